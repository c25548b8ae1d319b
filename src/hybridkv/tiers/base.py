"""What every lower tier shares (DESIGN §4, §5): miss reasons, statistics, the per-group
remote match and the :class:`Tier` base class (keys, alignment, lookup through the one
joint-hit rule of :mod:`hybridkv.cache.groups`, one existence query, one miss counter)
that :class:`~hybridkv.tiers.store_tier.StoreTier` and :class:`~hybridkv.tiers.host.HostTier`
build on.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from hybridkv.cache.groups import (KIMI_LINEAR, BoundaryList, EntryPresence, Family, RecomputeCone, joint_hit,
                                   nbytes)
from hybridkv.tiers.layout import entry_key

if TYPE_CHECKING:                       # annotations only: a simulated run imports no torch
    import torch

MISS_REASONS = ("absent", "evicted", "checksum", "incomplete", "unreachable", "expired")

Entry = tuple[bytes, bytes | None, str, int, dict[str, "torch.Tensor"]]
"""An entry to save: ``(chain_hash, parent_hash, group, boundary, tensors)``."""


@dataclass(frozen=True, slots=True)
class TierPurge:
    """What one tier's :meth:`Tier.purge` (or :meth:`Tier.purge_chains`) did.

    Attributes:
        entries: entries removed now (``-1``: the tier's store was unreachable, nothing removed).
        nbytes: payload bytes (components) of those entries; ``None``: not known (a store purged by
            key prefix removes without reading manifests, or the store was unreachable).
        hidden_before: Unix seconds: the purge raised an expiry horizon (a purge by age of a store
            that cannot list its keys), so every selected entry created before it is an ``expired``
            miss for every reader from now on and is removed when read; ``None``: none raised.
        horizons: expiry-horizon scopes raised (one per (model, owner) pair of the selector; 0 with none).
    """

    entries: int = 0
    nbytes: int | None = 0
    hidden_before: float | None = None
    horizons: int = 0

    @property
    def hidden(self) -> bool:
        """Whether this purge hid entries behind an expiry horizon instead of removing them all now."""
        return self.hidden_before is not None


#: A purge of a tier whose store was unreachable.
PURGE_UNREACHABLE = TierPurge(entries=-1, nbytes=None)


@dataclass(slots=True)
class TierStats:
    """Counters of one tier (tokens and bytes); ``evictions`` / ``bytes_evicted``: entries this
    tier dropped for capacity (a store tier's backend evicts silently: see its own counters);
    ``loads_taken`` / ``loads_declined``: installs from this tier attempted, and skipped because
    recomputing was predicted faster; ``bytes_peak``: most payload bytes held at once (a tier
    that tracks its size: the host tier)."""

    hit_tokens: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    loads_taken: int = 0
    loads_declined: int = 0
    bytes_peak: int = 0
    misses: Counter = field(default_factory=lambda: Counter({r: 0 for r in MISS_REASONS}))

    def as_dict(self) -> dict:
        """``{hit_tokens, bytes_loaded, bytes_saved, evictions, bytes_evicted, loads_taken,
        loads_declined, bytes_peak}`` for the JSON report (``loads_*``: installs attempted from this
        tier, and ones skipped because recomputing was predicted faster; see ``TierConnector``)."""
        return {"hit_tokens": self.hit_tokens, "bytes_loaded": self.bytes_loaded, "bytes_saved": self.bytes_saved,
                "evictions": self.evictions, "bytes_evicted": self.bytes_evicted,
                "loads_taken": self.loads_taken, "loads_declined": self.loads_declined,
                "bytes_peak": self.bytes_peak}


@dataclass(frozen=True, slots=True)
class RemoteMatch:
    """Per-group result of a remote lookup (tokens).

    Attributes:
        kv_length: contiguous KV from 0 (aligned; the device's KV counts).
        checkpoint_boundaries: aligned boundaries ``<= kv_length`` with a checkpoint entry.
        best_joint: the joint hit: deepest of those (0 = none).
        missing_branching_boundary: ``kv_length`` when it exceeds ``best_joint``, else ``None``.
    """

    kv_length: int
    checkpoint_boundaries: tuple[int, ...]
    best_joint: int
    missing_branching_boundary: int | None
    candidates: tuple[tuple[int, int], ...] = ()
    """``(hit, state boundary)`` installs to try, best first: the joint hit at each limit (the
    tier's boundaries below the previous one) and the boundary of the saved state its restore
    strategy needs (0: none, the state is rebuilt from token 0 or by the recompute cone)."""


class TierObserver(Protocol):
    """Hears what a tier commits and removes, by ``(chained hash, group)`` (keys identify
    prefixes, never carry token ids, and must not be logged). ``hybridkv serve`` publishes a
    shared store's changes as cache events with ``medium: store`` through it
    (:class:`~hybridkv.serve.cache_events.EventFeed`). Called on whatever thread touched the tier."""

    def entries_saved(self, tier: str, entries: list[tuple[bytes, str]]) -> None:
        """Entries now visible in tier ``tier`` (manifest committed)."""

    def entries_removed(self, tier: str, entries: list[tuple[bytes, str]]) -> None:
        """Entries removed from tier ``tier``."""

    def entries_purged(self, tier: str) -> None:
        """A purge removed entries of tier ``tier`` that are not named (a view should forget them all)."""


class Tier(ABC):
    """What every lower tier shares: keys, alignment, lookup, existence and miss counting.

    Subclasses implement :meth:`exists`, :meth:`load_many`, :meth:`save_entries`
    and :meth:`invalidate`.

    Args:
        namespace: namespace digest.
        unit: ``prefix_match_unit`` (tokens per chained hash).
        alignment: A (tokens) of this tier's entries; a multiple of ``unit``.
        shapes: this model's entry shapes, entry kind -> component -> ``(dtype, shape)``, the
            page entry first, then the state entry
            (:func:`hybridkv.cache.groups.tier_entry_shapes` with segment ``alignment``).
        family: the model's groups and restore strategies (the joint-hit rule of :meth:`lookup`;
            default Kimi Linear); its prefix groups are stored as the page entry, its boundary
            group as the state entry.
        name: tier name in reports (``host`` or ``store``).
        write_through: entries are saved as soon as they are computed.
        write_back: entries are saved when the device evicts them; default
            ``not write_through``. A host tier may do both.

    Raises:
        ValueError: ``alignment`` is not a positive multiple of ``unit``, or
            the tier would never be written (neither write-through nor write-back).
    """

    def __init__(self, namespace: bytes, unit: int, alignment: int, shapes: dict[str, dict],
                 name: str = "store", write_through: bool = True, write_back: bool | None = None,
                 family: Family = KIMI_LINEAR) -> None:
        if alignment <= 0 or alignment % unit:
            raise ValueError(f"store_alignment={alignment} must be a positive multiple of prefix_match_unit={unit}")
        if len(shapes) != 2:
            raise ValueError(f"tier entry shapes name {list(shapes)}: a page entry and a state entry expected")
        #: The entry kinds: prefix groups of a segment (``full``, ``csa-hca``), boundary state (``kda``, ``swa``).
        self.page_group, self.state_group = tuple(shapes)
        self.family = family
        #: Whether the family's restore strategy reads saved states (a recompute cone reads none).
        self.saves_state = any(not isinstance(how, RecomputeCone) for _, how in family.boundary)
        self._flags = {**{g: "has_kv" for g in family.prefix_names}, self.state_group: "has_checkpoint"}
        self.namespace = namespace
        self.unit = unit
        self.alignment = alignment
        self.shapes = shapes
        self.name = name
        self.write_through = write_through
        self.write_back = (not write_through) if write_back is None else write_back
        if not (self.write_through or self.write_back):
            raise ValueError(f"{name} tier: neither write-through nor write-back, so it would never be written")
        self.stats = TierStats()
        self._lock = threading.RLock()            # guards store calls and statistics
        self.observer: TierObserver | None = None  # told of committed saves and removals
        #: Purges applied to this tier so far (:meth:`purge`, :meth:`purge_chains`): a prefetch
        #: read before one is not installed after it (``TierConnector``).
        self.purges = 0

    def _observe(self, what: str, entries: list[tuple[bytes, str]]) -> None:
        """Tell the observer (if any) that ``entries`` (``(chained hash, group)``) were ``what``:
        ``saved``, ``removed`` or ``purged`` (entries unknown: empty)."""
        obs = self.observer
        if obs is None:
            return
        if what == "saved":
            obs.entries_saved(self.name, entries)
        elif what == "removed":
            obs.entries_removed(self.name, entries)
        else:
            obs.entries_purged(self.name)

    payload = True
    """Entries carry their tensors. ``False`` (a host tier in simulate mode): entries are byte
    accounting only, loads hand out components whose values are ``None``."""

    def holds(self, group: str) -> bool:
        """Whether this tier keeps ``group`` entries at all (every group unless a subclass narrows it)."""
        return True

    def writes_through(self, group: str) -> bool:
        """Whether ``group`` entries are saved here as they are computed (write-through tiers: every
        group they hold, unless a subclass narrows it)."""
        return self.write_through and self.holds(group)

    # -- what subclasses implement ----------------------------------------
    # ``owner`` everywhere: the request namespace digest the entries are cached under (part of a
    # store key, cache ABI v4); ``None`` is this tier's own ``namespace`` (a request that named none).
    @abstractmethod
    def exists(self, wanted: list[tuple[bytes, str]], owner: bytes | None = None) -> list[bool] | None:
        """Whether each ``(chained hash, group)`` entry of ``owner`` exists, in one query (``None``:
        unreachable, counted as an ``unreachable`` miss)."""

    @abstractmethod
    def load_many(self, hashes: list[bytes], wanted: list[tuple[int, str]],
                  owner: bytes | None = None) -> list[dict | None]:
        """Per ``(boundary, group)``: component name -> tensor, or ``None`` (a counted miss)."""

    @abstractmethod
    def save_entries(self, entries: list[Entry], owner: bytes | None = None,
                     speculative: Collection[bytes] = ()) -> list[bool]:
        """Commit entries (see :data:`Entry`) cached under the request namespace ``owner``;
        per entry, whether it is visible now. ``speculative``: chained hashes of entries no
        device holds and no request has used yet (host-only checkpoints), which a tier may
        give up first (the host tier's probation); a tier may ignore it."""

    @abstractmethod
    def purge(self, selector, chains: list[tuple[bytes, int, bytes | None]] = ()) -> TierPurge:
        """Remove the entries a :class:`~hybridkv.cache.purge.PurgeSelector` selects (manifest
        first); ``chains`` (``(chained hash, boundary, owner)``, the device's) name entries to
        remove where the tier cannot enumerate its own. Returns what it removed and hid
        (:data:`PURGE_UNREACHABLE` when the store is unreachable)."""

    @abstractmethod
    def invalidate_chain(self, chain_hash: bytes, group: str, owner: bytes | None = None) -> None:
        """Remove the ``group`` entry of ``owner`` of the prefix whose chained hash is ``chain_hash``
        (manifest first)."""

    def invalidate(self, hashes: list[bytes], boundary: int, group: str, owner: bytes | None = None) -> None:
        """Remove one entry (its manifest first)."""
        self.invalidate_chain(self.chain_hash(hashes, boundary), group, owner)

    def purge_chains(self, chains: list[tuple[bytes, int, bytes | None]]) -> TierPurge:
        """Remove the entries of ``(chained hash, boundary, owner)`` triples at this tier's alignment,
        both groups; returns the entries that existed and their payload bytes
        (:data:`PURGE_UNREACHABLE`: unreachable)."""
        self.purges += 1
        by_owner: dict[bytes | None, list[tuple[bytes, str]]] = {}
        for h, b, owner in chains:
            if b % self.alignment == 0:
                by_owner.setdefault(owner, []).extend((h, grp) for grp in (self.page_group, self.state_group))
        total = total_bytes = 0
        for owner, wanted in by_owner.items():
            found = self.exists(wanted, owner)
            if found is None:
                return PURGE_UNREACHABLE
            for (h, grp), ok in zip(wanted, found):
                if ok:
                    self.invalidate_chain(h, grp, owner)
                    total += 1
                    total_bytes += self.entry_nbytes(grp)
        return TierPurge(total, total_bytes)

    # -- shared ---------------------------------------------------------------
    def entry_nbytes(self, group: str) -> int:
        """Payload bytes of one ``group`` entry of this model (components only)."""
        return sum(nbytes(dtype, shape) for dtype, shape in self.shapes[group].values())

    def count_miss(self, reason: str) -> None:
        """Count one miss with ``reason`` (one of :data:`MISS_REASONS`); every miss goes through here."""
        with self._lock:
            self.stats.misses[reason] += 1

    def add_hit_tokens(self, tokens: int) -> None:
        """Credit ``tokens`` of hit to this tier."""
        with self._lock:
            self.stats.hit_tokens += tokens

    def chain_hash(self, hashes: list[bytes], boundary: int) -> bytes:
        """Chained hash of ``[0, boundary)`` of a prompt whose unit hashes are ``hashes``."""
        return hashes[boundary // self.unit - 1]

    def _key(self, hashes, boundary, group, component="manifest", owner: bytes | None = None) -> str:
        """Object key of ``component`` of the entry of ``owner`` at ``boundary``."""
        return entry_key(self.namespace, self.chain_hash(hashes, boundary), group, component, owner=owner)

    def lookup(self, hashes: list[bytes], cap: int, local_kv: int = 0,
               owner: bytes | None = None) -> RemoteMatch | None:
        """Per-group result for a prompt whose unit hashes are ``hashes``, reuse capped at ``cap``.

        ``local_kv`` tokens of KV are already on the device; KV contiguity is
        counted from there, so only the missing segments must be in this tier.
        One existence query (entries of ``owner``, the request namespace the hashes were made
        under); the joint hit follows :func:`hybridkv.cache.groups.joint_hit`.
        ``None`` when the tier is unreachable (counted as an ``unreachable`` miss).
        """
        a = self.alignment
        bounds = list(range(a, min(cap, len(hashes) * self.unit) + 1, a))
        if not bounds:
            return RemoteMatch(0, (), 0, None)
        local = local_kv // a * a
        kv_bounds = [b for b in bounds if b > local]
        state_bounds = bounds if self.saves_state else []
        found = self.exists([(self.chain_hash(hashes, b), self.page_group) for b in kv_bounds]
                            + [(self.chain_hash(hashes, b), self.state_group) for b in state_bounds], owner)
        if found is None:
            return None
        has_kv = [True] * (len(bounds) - len(kv_bounds)) + found[: len(kv_bounds)]
        has_state = found[len(kv_bounds):] if self.saves_state else [False] * len(bounds)
        presence = BoundaryList([EntryPresence(b, kv, ck) for b, kv, ck in zip(bounds, has_kv, has_state)],
                                self._flags)
        joint = joint_hit(self.family, presence, cap)
        ckpts = tuple(p.end for p in presence.boundaries if p.has_checkpoint and p.end <= joint.kv_hit)
        if self.family.saved_pair is not None:    # saved at the hit: each saved state inside the run, deepest first
            return RemoteMatch(joint.kv_hit, ckpts, joint.hit, joint.branching_boundary,
                               tuple((b, b) for b in reversed(ckpts)))
        candidates, j = [], joint
        while j.hit > 0:                          # the joint hit at each shorter limit: next best on a miss
            state = presence.deepest_state(self.state_group, j.hit) if self.saves_state else 0
            candidates.append((j.hit, state))
            j = joint_hit(self.family, presence, j.hit - a)
        return RemoteMatch(joint.kv_hit, ckpts, joint.hit, joint.branching_boundary, tuple(candidates))

    def entry(self, hashes: list[bytes], boundary: int, group: str, tensors: dict) -> Entry:
        """An entry for :meth:`save_entries` at an aligned ``boundary`` of a prompt.

        Raises:
            ValueError: ``boundary`` is not a positive multiple of the alignment.
        """
        if boundary <= 0 or boundary % self.alignment:
            raise ValueError(f"boundary {boundary} is not a positive multiple of store_alignment={self.alignment}")
        parent = self.chain_hash(hashes, boundary - self.alignment) if boundary > self.alignment else None
        return (self.chain_hash(hashes, boundary), parent, group, boundary, tensors)
