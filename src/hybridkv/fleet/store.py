"""The shared store as the fleet sees it: which entries it holds (a view fed by every
instance's events) and what loading from it costs.

The store holds what instances write through to it, by the store tier's entry layout
(``CacheConfig.store_boundary``; :func:`~hybridkv.cache.groups.tier_entry_shapes`): a *page
entry* per segment of ``alignment`` tokens (every prefix group of the family: ``full`` KV for
Kimi Linear, ``csa`` + ``hca`` compressed entries for DeepSeek-V4) and a *state entry* (the
boundary group: a ``kda`` checkpoint, a V4 ``swa`` state) at those boundaries. It outlives
instance restarts, so removals and epochs do not touch it. With a capacity it evicts least
recently used entries (stored or loaded) until what it holds fits; without one it keeps
everything. Loading ``[start, end)`` costs one object round trip per page entry plus one for
the state entry (none when the family's strategy saves no state: V4's ``recompute``), each
with its manifest (two objects an entry), and the bytes over the store's bandwidth. The
defaults are this project's Mooncake measurements (docs/results/store.md):
1.1 GB/s loads at the Kimi-48B entry sizes through the storage process, 194 µs a
``get_into``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat

from hybridkv.cache.groups import KIMI_LINEAR, Family, KeySetPresence
from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView

MOONCAKE_LOAD_BYTES_PER_S = 1.1e9
"""Measured Mooncake load bandwidth at Kimi-48B entry sizes (docs/results/store.md), bytes/s."""
MOONCAKE_GET_LATENCY_S = 194e-6
"""Measured Mooncake ``get_into`` time of a small object (docs/results/store.md), seconds."""
DEFAULT_STORE_GIB = 1024.0
"""Capacity of the simulated shared store unless ``--store-gib`` says otherwise, GiB: an
assumption (a Mooncake pool of 8 hosts lending 128 GiB of DRAM each), not a measurement."""


@dataclass(frozen=True, slots=True)
class StoreCost:
    """Cost of loading from the shared store.

    Attributes:
        bytes_per_s: load bandwidth, bytes/s.
        latency_s: seconds per object fetched.
        alignment: tokens per page entry (store entries exist at multiples of it).
        kv_bytes_per_token: page-entry bytes of one token (every prefix group: Kimi Linear's
            MLA KV over all MLA layers; DeepSeek-V4's compressed entries per token).
        checkpoint_bytes: bytes of one state entry (a KDA checkpoint; a V4 ``swa`` state).
        loads_state: a load reads a state entry besides the page entries (``False``: the
            family's strategy saves none, DeepSeek-V4's ``recompute``).
    """

    bytes_per_s: float
    latency_s: float
    alignment: int
    kv_bytes_per_token: int
    checkpoint_bytes: int
    loads_state: bool = True

    def load_bytes(self, start: int, end: int) -> int:
        """Bytes of the page entries of ``[start, end)`` and the state entry (when loaded)."""
        return (end - start) * self.kv_bytes_per_token + (self.checkpoint_bytes if self.loads_state else 0)

    def transfer_seconds(self, start: int, end: int) -> float:
        """Seconds the bytes of :meth:`load_bytes` take at the bandwidth."""
        return self.load_bytes(start, end) / self.bytes_per_s

    def latency_seconds(self, start: int, end: int) -> float:
        """Per-object seconds: one entry per page segment plus the state entry (when loaded),
        each with a manifest."""
        return 2 * ((end - start) // self.alignment + self.loads_state) * self.latency_s

    def load_seconds(self, start: int, end: int) -> float:
        """Seconds to load ``[start, end)`` and the state entry (when loaded)."""
        return self.transfer_seconds(start, end) + self.latency_seconds(start, end)


def load_start(kv_hit: int, store_hit: int, granularity: int) -> int:
    """Where a load from the store begins (tokens): the local KV run rounded down to
    ``granularity`` (whole pages or entries), at most ``store_hit``."""
    return min(kv_hit // granularity * granularity, store_hit)


def paying_load(cost, store: StoreCost, kv_hit: int, hit: int, store_hit: int, restore_s: float = 0.0,
                store_restore_s: float = 0.0) -> tuple[float, float, int] | None:
    """``(transfer seconds, latency seconds, read start in tokens)`` of loading ``[start,
    store_hit)`` from the store (``start``: the local KV run ``kv_hit`` rounded down to whole
    entries, :func:`load_start`) when that, plus ``store_restore_s`` (seconds of rebuilding the
    boundary state at the store's hit from its restart point), takes less than computing
    ``[hit, store_hit)`` with ``cost`` (a :class:`~hybridkv.fleet.costmodel.StepCostModel`) plus
    ``restore_s`` (rebuilding the state at the local hit); ``None`` when it does not pay or the
    store's hit is not deeper than ``hit``. The restore seconds are 0 for a family whose states
    are saved at the hit (Kimi Linear). The one rule that the router
    (``routers.priced_prefill``) and a simulated instance (``FleetInstance._fetch``) both apply."""
    if store_hit <= hit:
        return None
    start = load_start(kv_hit, store_hit, store.alignment)
    transfer, latency = store.transfer_seconds(start, store_hit), store.latency_seconds(start, store_hit)
    if transfer + latency + store_restore_s < cost.prefill_seconds(hit, store_hit) + restore_s:
        return transfer, latency, start
    return None


class StoreView(InstanceView):
    """Entries of the shared store, from every instance's stored events; a hit only at
    ``alignment`` boundaries, by the joint-hit rule of the instances' family.

    ``kv`` holds the keys of page entries (every prefix group of the family reads it: the store
    tier writes a segment's prefix groups as one entry), ``checkpoints`` those of state entries
    (the family's boundary group). "KV" and "checkpoint" below stand for them.

    The store holds what the store tier writes through: whole KV entries (the ``alignment``
    tokens ending at each aligned boundary, keyed by the unit hash ending there) and
    checkpoints at those boundaries. ``kv`` holds the entry keys: of a ``BLOCKS_STORED``
    event's units, those ending on a multiple of ``alignment`` (its ``first_unit`` says where
    they lie; an event without it, from an emitter that does not say, is taken whole: each key
    held and charged as an entry), so the KV of units past a prompt's last whole entry is
    neither held nor charged, as the store tier does not write it. Only checkpoints on entry
    boundaries are held and charged, for the same reason; the events' ``boundaries`` say where
    each lies (an event without them is taken whole likewise).

    With ``capacity_bytes`` the store holds at most that many bytes: each KV entry
    (``alignment * kv_bytes_per_token``) and each checkpoint (``checkpoint_bytes``) is charged
    when stored, and the least recently used is evicted first (an entry takes its checkpoint
    with it; a load touches what it read, :meth:`touch`). An entry whose predecessor was
    evicted stays until it ages out, unreachable (lookups stop at the first missing entry), as
    in a key-value store without a tree.

    Args:
        unit: ``prefix_match_unit`` in tokens.
        alignment: tokens per store entry (a multiple of ``unit``).
        capacity_bytes: the most bytes held; ``None``: unlimited.
        kv_bytes_per_token: KV bytes of one token over all MLA layers (needed with a capacity).
        checkpoint_bytes: bytes of one KDA checkpoint (likewise). With both sizes the view
            counts ``bytes_held``, ``bytes_peak`` and ``evicted_bytes`` even without a capacity.
        family: the instances' cache groups (default Kimi Linear); at most one boundary group
            (the store tier's entry kinds: one page entry, one state entry).

    Raises:
        ValueError: ``alignment`` not a positive multiple of ``unit``; a capacity not positive,
            or given without positive entry sizes; a family of several boundary groups.
    """

    def __init__(self, unit: int, alignment: int, capacity_bytes: int | None = None,
                 kv_bytes_per_token: int = 0, checkpoint_bytes: int = 0, family: Family = KIMI_LINEAR) -> None:
        if alignment <= 0 or alignment % unit:
            raise ValueError(f"store alignment {alignment} is not a positive multiple of the unit {unit}")
        if capacity_bytes is not None:
            if capacity_bytes <= 0:
                raise ValueError(f"store capacity_bytes={capacity_bytes!r} must be positive (None: unlimited)")
            if kv_bytes_per_token <= 0 or checkpoint_bytes <= 0:
                raise ValueError(f"a store capacity needs positive entry sizes: kv_bytes_per_token="
                                 f"{kv_bytes_per_token!r}, checkpoint_bytes={checkpoint_bytes!r}")
        if len(family.boundary) > 1:
            raise ValueError(f"family {family.name!r}: a store holds one state entry per boundary, this family "
                             f"has boundary groups {[b for b, _ in family.boundary]}")
        super().__init__(unit, family)
        self.alignment = alignment
        self.capacity_bytes = capacity_bytes
        self._step = alignment // unit                # units an entry
        self._entry_bytes = alignment * kv_bytes_per_token   # bytes an entry (held per entry key)
        self._ckpt_bytes = checkpoint_bytes
        self._track = kv_bytes_per_token > 0 and checkpoint_bytes > 0          # bytes counted (and evicted)
        # Least recently used order, lazily: ``kv`` (a dict here, not the set of an InstanceView)
        # maps each held entry key to the stamp of its last use and ``_ck_last`` each held checkpoint
        # to its own, and ``_uses`` holds every use in order as ``(stamp, entries)``, one per
        # stored event or load, sharing the event's key tuple (a checkpoint appears there as
        # ``(True, key)``). An entry's place in the order is its occurrence in the use whose stamp
        # it holds (later occurrences supersede earlier ones, which are skipped when reached):
        # the order an OrderedDict moved to the end on each use would have, at one dict store per
        # entry and use (the entries' key set and their stamps are one dict: the view's largest
        # table is written once a stored entry, not twice). ``_head`` is how far the oldest use has been
        # consumed.
        self.kv: dict[bytes, int] = {}
        # every prefix group reads the page entries, the boundary group the state entries
        self.held = {**dict.fromkeys(family.prefix_names, self.kv),
                     **{b: self.checkpoints for b, _ in family.boundary}}
        self._ck_last: dict[bytes, int] = {}
        self._uses: deque[tuple[int, tuple]] = deque()
        self._head = 0
        self._stamp = 0
        self.bytes_held = 0
        self.bytes_peak = 0
        self.evicted_bytes = 0

    def _evict_to_fit(self) -> None:
        uses, kv, ck, ck_last = self._uses, self.kv, self.checkpoints, self._ck_last
        held, evicted, cap = self.bytes_held, self.evicted_bytes, self.capacity_bytes
        entry_b, ck_b = self._entry_bytes, self._ckpt_bytes
        i = self._head
        while held > cap and (kv or ck_last):
            stamp, entries = uses[0]
            n = len(entries)
            while i < n and held > cap:
                key = entries[i]
                i += 1
                if type(key) is tuple:                     # a checkpoint alone
                    key = key[1]
                    if ck_last.get(key) != stamp:          # used again later: not its place
                        continue
                    del ck_last[key]
                    held -= ck_b
                    evicted += ck_b
                    ck.discard(key)
                    continue
                if kv.get(key) != stamp:                   # used again later: not its place
                    continue
                del kv[key]
                held -= entry_b
                evicted += entry_b
                if key in ck:                              # an entry takes its checkpoint with it
                    ck.discard(key)
                    if ck_last.pop(key, None) is not None:
                        held -= ck_b
                        evicted += ck_b
            if i >= n:
                uses.popleft()
                i = 0
        self._head = i
        self.bytes_held, self.evicted_bytes = held, evicted

    def apply(self, event: CacheEvent) -> None:
        """Add what was stored (evicting the least recently used beyond the capacity);
        removals, clears and epochs do not reach the store.

        Raises:
            ValueError: a stored event naming a group its kind cannot concern in the family.
        """
        kind = event.kind
        if ((kind is EventKind.BLOCKS_STORED or kind is EventKind.CHECKPOINTS_STORED)
                and (kind is EventKind.BLOCKS_STORED, event.group) not in self._targets):
            self.group_sets(kind, event.group)             # a group of the family, checked (then cached)
        if kind is EventKind.BLOCKS_STORED:
            keys, kv, step = event.keys, self.kv, self._step
            if event.first_unit is not None and step > 1:     # the keys ending an entry
                keys = keys[-(event.first_unit + 1) % step::step]
                if not keys:
                    return
            before = len(kv)
            self._stamp += 1
            kv.update(zip(keys, repeat(self._stamp)))      # the keys of one event are distinct (one chain)
            if self._track:
                self.bytes_held += (len(kv) - before) * self._entry_bytes
            if self.capacity_bytes is not None:           # without a capacity nothing is evicted
                self._uses.append((self._stamp, keys))
        elif kind is EventKind.CHECKPOINTS_STORED:
            kv = self.kv
            if event.boundaries:                           # the store tier writes entry boundaries only
                a = self.alignment
                new = [k for k, b in zip(event.keys, event.boundaries) if b % a == 0 and k in kv]
            else:
                new = [k for k in event.keys if k in kv]
            self.checkpoints.update(new)
            if self._track and new:
                last = self._ck_last
                before = len(last)
                self._stamp += 1
                last.update(zip(new, repeat(self._stamp)))
                self.bytes_held += (len(last) - before) * self._ckpt_bytes
                if self.capacity_bytes is not None:
                    self._uses.append((self._stamp, tuple(zip(repeat(True), new))))
        else:
            return
        if self.capacity_bytes is not None and self.bytes_held > self.capacity_bytes:
            self._evict_to_fit()
        self.bytes_peak = max(self.bytes_peak, self.bytes_held)

    def touch(self, hashes: list[bytes], end: int, state_at: int | None = None) -> None:
        """A load read the page entries of ``[0, end)`` and the state entry at ``state_at``
        (tokens; default ``end``; 0: none): most recently used."""
        if not self._track:
            return
        kv, ck_last = self.kv, self._ck_last
        used = [k for k in hashes[: end // self.unit] if k in kv]      # entry keys (any key of an event taken whole)
        state_at = end if state_at is None else state_at
        top = hashes[state_at // self.unit - 1] if state_at else None
        if top is not None and top in ck_last:
            used.append((True, top))
        if not used:
            return
        self._stamp += 1
        stamp = self._stamp
        for k in used:
            if type(k) is tuple:
                ck_last[k[1]] = stamp
            else:
                kv[k] = stamp
        if self.capacity_bytes is not None:
            self._uses.append((stamp, tuple(used)))

    def presence(self, hashes: list[bytes]) -> KeySetPresence:
        """The :class:`~hybridkv.cache.groups.Presence` of the store for a prompt's unit hashes:
        boundaries at whole entries (multiples of ``alignment``), each prefix group held where
        the page entry is (``full`` for Kimi Linear), the boundary group where the state entry is
        (``kda``); :meth:`match` (inherited) applies the family's joint-hit rule over it."""
        return KeySetPresence(hashes, self.unit, self.held, self._step)
