"""Host-memory tier: whole entries kept as tensors in this process (DESIGN §4, §5).

Unlike a :class:`~hybridkv.tiers.store_tier.StoreTier`, nothing here crosses a process
or disk boundary, so entries are kept as tensors: no serialization and no
checksum. A save copies each component once into host memory the tier owns; a
load hands those tensors out without a copy (the device install copies them into
its pools: ``write_pages`` / ``CheckpointPool.write``).

On CUDA (``pin_memory=True``) the host copies are pinned and asynchronous: each
entry records a CUDA event after its device-to-host copies, and the event is
waited before the entry is read (load) or its memory is dropped (eviction). On
CPU the same code runs with plain tensors and no events.

Capacity is in bytes of component payload; the eviction order's first entries
(:mod:`hybridkv.store.eviction`: ``lru``, or ``value`` with ``C`` = the tokens a
hit on the entry saves: a checkpoint's boundary, a KV segment's ``alignment``)
are dropped to make room (an entry larger than the whole capacity is refused).
Entries are never referenced across calls (a load hands out the tensors, which
the device install copies), so every held entry is evictable.

Speculative entries. Checkpoints written through for the host alone (``host_interval``:
no device holds them, no request has used them yet) are saved on *probation*: a FIFO
that may hold at most ``probation_share`` of the capacity while the main order (entries
the device evicted or holds, and probation entries that were hit) has a use for the
room. Over that share, the oldest probation entry is the victim; under it, the main
order's. A hit moves a probation entry into the main order. This is the A1in / Am split
of 2Q (T. Johnson and D. Shasha, "2Q: A Low Overhead High Performance Buffer Management
Replacement Algorithm", VLDB 1994, whose recommended A1in share is 25%): a flood of
speculative checkpoints cannot push out the demoted entries that requests come back for,
and still fills whatever room the main order leaves.

Retention (``retention``). Checkpoints written through as the device publishes them are copies
of entries the device still holds; when the device evicts one, the write-back finds it held and
saves nothing. ``inclusive`` leaves such an entry where it was, so the host's order is by
creation time and it spends its room on copies of what the device holds. ``demote`` makes a
device eviction of a held entry a use: it becomes the most recent (and leaves probation).
``exclusive`` also marks the copies (``save_entries(..., on_device=...)``, and entries handed
out by a load, which the device installs) and evicts them before anything else; a copy takes
only free room or another copy's, since the write-back saves it again when the device lets it go.
The host then holds, in recency order, what the device gave up: a victim cache of the device.

Payload-free (``payload=False``, what ``replay --simulate`` builds: simulation has no
tensors): the same keys, capacity, eviction order, demotion and promotion, with each
entry's bytes taken from this model's entry shapes and no tensors held; a load hands out
``{component: None}``. ``groups`` narrows what the tier holds (e.g. checkpoints only,
``("kda",)``, when device KV is not short): saves of another group are refused and
lookups find none, so a hit needs the device's own KV.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from hybridkv._torch import torch
from hybridkv.cache.config import HOST_PROBATION
from hybridkv.cache.groups import KIMI_LINEAR, Family
from hybridkv.store.eviction import make_order
from hybridkv.tiers.base import Entry, Tier, TierPurge
from hybridkv.tiers.layout import torch_dtype

HOST_RETENTION = ("inclusive", "demote", "exclusive")
"""How a host tier treats entries the device also holds (:class:`HostTier`'s ``retention``)."""

DEFAULT_HOST_RETENTION = "exclusive"
"""The ``retention`` a host tier gets unless told otherwise."""


@dataclass(slots=True)
class _HostEntry:
    tensors: dict[str, torch.Tensor]
    nbytes: int
    ready: object = None          # torch.cuda.Event after async copies, else None
    owner: bytes | None = None    # request namespace digest it was cached under
    created: float = 0.0          # Unix seconds when this tier got it

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


class HostTier(Tier):
    """Entries of one namespace in host memory: written back when the device evicts them, and
    also as they are computed with ``write_through=True``.

    Args:
        capacity_bytes: payload bytes this tier may hold (> 0).
        namespace, unit, alignment, shapes, name, write_through: see :class:`Tier`.
        pin_memory: pinned host buffers and async copies; default: when CUDA
            is available (without ``payload``: off unless given).
        eviction: ``lru`` or ``value``.
        quota_bytes: payload bytes one request namespace (``owner`` of a save) may hold;
            a save over it evicts that owner's own entries first. ``None``: no quota.
        payload: hold tensors (default); ``False``: byte accounting only (simulation; the
            ``tensors`` of a save are ignored and may be ``None``).
        groups: the entry kinds held (default both: the page entry and the state entry of
            ``shapes``, e.g. ``("full", "kda")``).
        family: see :class:`Tier`.
        through_groups: with ``write_through``, the groups written through (default: every group
            held); the others are only written back. ``("kda",)``: checkpoints as they are
            computed, KV pages when the device evicts them.
        probation_share: fraction in ``[0, 1]`` of ``capacity_bytes`` that speculative entries
            (``save_entries(..., speculative=...)``) may hold before they, not the main order,
            give up room (default :data:`~hybridkv.cache.config.HOST_PROBATION`; ``0``: the
            main order's entries always win; ``1``: speculative entries win until they alone
            fill the tier).
        protected_share: ``None`` (default): one main order. A fraction in ``(0, 1]``: a protected
            segment (segmented LRU) for entries whose content was loaded from this tier before
            (a ghost of recently loaded keys remembers them across evictions): the other main
            entries are evicted first while the protected ones hold at most this share of
            ``capacity_bytes``; a protected entry past the share goes back to the main order as
            its most recent entry (never evicted for it). Only with ``eviction="lru"``.
        retention: how the tier treats entries the device also holds (one of
            :data:`HOST_RETENTION`; module docstring, "Retention"): ``inclusive`` (a demotion of
            an entry already held changes nothing), ``demote`` (it makes the entry the most
            recent and takes it off probation) or ``exclusive`` (``demote``, and entries the
            device holds a copy of are evicted first).

    Raises:
        ValueError: ``capacity_bytes`` is not a positive integer, ``alignment``
            does not fit ``unit``, ``eviction`` is unknown, ``groups`` is empty or
            names an unknown group, ``probation_share`` is outside ``[0, 1]``,
            ``retention`` is not one of :data:`HOST_RETENTION`, or ``protected_share`` is not
            ``None`` or a fraction in ``(0, 1]`` with ``eviction="lru"``.
    """

    def __init__(self, capacity_bytes: int, namespace: bytes, unit: int, alignment: int, shapes: dict[str, dict],
                 name: str = "host", write_through: bool = False, pin_memory: bool | None = None,
                 eviction: str = "lru", quota_bytes: int | None = None, payload: bool = True,
                 groups: tuple[str, ...] | None = None, through_groups: tuple[str, ...] | None = None,
                 probation_share: float = HOST_PROBATION, family: Family = KIMI_LINEAR,
                 retention: str = DEFAULT_HOST_RETENTION, protected_share: float | None = None) -> None:
        super().__init__(namespace, unit, alignment, shapes, name, write_through, write_back=True, family=family)
        kinds = (self.page_group, self.state_group)
        groups = kinds if groups is None else tuple(groups)
        if not groups or any(g not in kinds for g in groups):
            raise ValueError(f"host tier groups={groups!r} must be a non-empty subset of {kinds}")
        self.groups = groups
        self.through_groups = groups if through_groups is None else tuple(through_groups)
        if any(g not in groups for g in self.through_groups):
            raise ValueError(f"host tier through_groups={self.through_groups!r} must be among groups={groups!r}")
        self.payload = bool(payload)
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
            raise ValueError(f"host tier capacity_bytes={capacity_bytes!r} must be a positive integer")
        self.capacity_bytes = capacity_bytes
        if quota_bytes is not None and (not isinstance(quota_bytes, int) or quota_bytes <= 0):
            raise ValueError(f"host tier quota_bytes={quota_bytes!r} must be a positive integer or None")
        self.quota_bytes = quota_bytes
        self._entries: dict[tuple[bytes, str], _HostEntry] = {}
        self._order = make_order(eviction)        # members: the keys of _entries not on probation
        if self.payload:                          # what an entry's tensors must be
            self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
            self._expected = {grp: {n: (torch_dtype(d), torch.Size(shape)) for n, (d, shape) in comps.items()}
                              for grp, comps in shapes.items()}
        else:                                     # bytes only: no tensor is checked or copied (no torch)
            self.pin_memory = bool(pin_memory)
            self._expected = {}
        self._bytes = 0
        share = probation_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"host tier probation_share={probation_share!r} must be a fraction in [0, 1]")
        self.probation_share = float(share)
        self._probation: dict[tuple[bytes, str], int] = {}     # speculative keys, oldest first -> bytes
        self._probation_bytes = 0
        if retention not in HOST_RETENTION:
            raise ValueError(f"host tier retention={retention!r} must be one of {', '.join(HOST_RETENTION)}")
        self.retention = retention
        self.demotions_held = 0                   # device evictions of entries already held here
        # exclusive: main-order keys the device also holds a copy of, oldest first (evicted first)
        self._on_device: dict[tuple[bytes, str], None] = {}
        ps = protected_share
        if ps is not None and (isinstance(ps, bool) or not isinstance(ps, (int, float)) or not 0.0 < ps <= 1.0
                               or eviction != "lru"):
            raise ValueError(f"host tier protected_share={protected_share!r} must be None or a fraction in (0, 1] "
                             f"with eviction='lru' (eviction={eviction!r})")
        self.protected_share = None if ps is None else float(ps)
        self._protected: OrderedDict[tuple[bytes, str], int] = OrderedDict()   # least recent first -> bytes
        self._protected_bytes = 0
        self._loaded: OrderedDict[tuple[bytes, str], None] = OrderedDict()     # ghost: keys loaded lately

    def holds(self, group: str) -> bool:
        """Whether ``group`` is one of :attr:`groups`."""
        return group in self.groups

    def writes_through(self, group: str) -> bool:
        """Whether ``group`` entries are saved as they are computed (``write_through`` and in
        :attr:`through_groups`)."""
        return self.write_through and group in self.through_groups

    @property
    def used_bytes(self) -> int:
        """Payload bytes held now."""
        return self._bytes

    def exists(self, wanted: list[tuple[bytes, str]], owner: bytes | None = None) -> list[bool]:
        """Whether each ``(chained hash, group)`` entry is held (never unreachable). ``owner`` is not
        needed here: chained hashes are already bound to the request namespace, and host entries
        are keyed by them alone."""
        with self._lock:
            return [k in self._entries for k in wanted]

    def load_many(self, hashes: list[bytes], wanted: list[tuple[int, str]],
                  owner: bytes | None = None) -> list[dict | None]:
        """The held tensors of each ``(boundary, group)`` (read-only by contract: callers copy).

        An entry not held (never saved, or evicted) is an ``absent`` miss.
        """
        out = []
        with self._lock:
            for b, grp in wanted:
                key = (self.chain_hash(hashes, b), grp)
                e = self._entries.get(key)
                if e is None:
                    self.count_miss("absent")
                    out.append(None)
                    continue
                self._order.hit(key)
                self._confirm(key)                      # used: out of probation
                if self.protected_share is not None:
                    self._remember_load(key)
                if self.retention == "exclusive":       # installed into the device (a promotion)
                    self._unprotect(key)
                    self._on_device[key] = None
                elif self.protected_share is not None:
                    self._protect(key)
                e.wait()
                self.stats.bytes_loaded += e.nbytes
                out.append(dict(e.tensors) if self.payload else dict.fromkeys(self.shapes[grp]))
        return out

    def save_entries(self, entries: list[Entry], owner: bytes | None = None,
                     speculative: Collection[bytes] = (), on_device: Collection[bytes] = ()) -> list[bool]:
        """Copy each ``(chain_hash, parent_hash, group, boundary, tensors)`` entry, cached under the
        request namespace ``owner``, into host memory (stamped with the wall time, for purges).

        An entry already held is left as it is (idempotent; saved again without being
        speculative, it leaves probation). Components must match this model's shapes
        (payload-free: not read; the entry's bytes are the shapes'). Entries whose chained
        hash is in ``speculative`` are saved on probation (module docstring); those whose chained
        hash is in ``on_device`` are copies of entries the device holds (written through as they
        are computed), the first victims under ``retention="exclusive"``.

        Returns:
            Per entry, whether it is held now (``False``: larger than the capacity or the quota,
            or a group this tier does not hold).

        Raises:
            ValueError: a component's name, dtype or shape differs from ``shapes``.
        """
        out = []
        with self._lock:
            for chain_hash, _parent, group, boundary, tensors in entries:
                key = (chain_hash, group)
                if key in self._entries:
                    self._order.hit(key)
                    if chain_hash not in speculative:
                        self._confirm(key)
                    out.append(True)
                    continue
                on_dev = self.retention == "exclusive" and chain_hash in on_device
                if group not in self.groups:
                    out.append(False)
                    continue
                if self.payload:
                    self._check(group, tensors)
                    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                else:
                    nbytes = self.entry_nbytes(group)
                if nbytes > self.capacity_bytes:
                    out.append(False)
                    continue
                quota = self.quota_bytes
                if owner is not None and quota is not None:
                    if nbytes > quota:
                        out.append(False)
                        continue
                    while self._order.owner_bytes.get(owner, 0) + nbytes > quota:
                        self._evict(self._owner_victim(owner))      # over its quota: its own go first
                on_probation = chain_hash in speculative
                if on_dev:                              # a device copy takes free room or another copy's
                    while self._bytes + nbytes > self.capacity_bytes and self._on_device:
                        self._evict(self._victim(0))
                    if self._bytes + nbytes > self.capacity_bytes:
                        out.append(False)
                        continue
                while self._bytes + nbytes > self.capacity_bytes:
                    self._evict(self._victim(nbytes if on_probation else 0))
                self._entries[key] = e = self._copy(tensors, nbytes) if self.payload else _HostEntry({}, nbytes)
                e.owner, e.created = owner, time.time()
                self._order.describe(key, nbytes, boundary if group == self.state_group else self.alignment, boundary, owner)
                if on_probation:                        # described (quota bytes) but not in the main order
                    self._probation[key] = nbytes
                    self._probation_bytes += nbytes
                else:
                    self._order.add(key)
                    if on_dev:
                        self._on_device[key] = None
                self._bytes += nbytes
                if not on_probation and not on_dev and self.protected_share is not None:
                    self._protect(key)
                self.stats.bytes_peak = max(self.stats.bytes_peak, self._bytes)
                self.stats.bytes_saved += nbytes
                out.append(True)
        return out

    def demoted(self, keys: list[tuple[bytes, str]]) -> None:
        """The device evicted these ``(chain_hash, group)`` entries, which this tier already holds
        (the write-back found them: written through, or promoted earlier). Under ``retention``
        ``demote`` or ``exclusive`` each becomes the main order's most recent entry (off probation,
        no longer a device copy); under ``inclusive`` nothing changes. Keys not held are ignored."""
        with self._lock:
            for key in keys:
                if key not in self._entries:
                    continue
                self.demotions_held += 1
                if self.retention == "inclusive":
                    continue
                self._on_device.pop(key, None)
                if key in self._probation:
                    self._confirm(key)
                elif key in self._protected:
                    self._protected.move_to_end(key)
                else:
                    self._order.add(key)
                if self.protected_share is not None:
                    self._protect(key)

    def invalidate_chain(self, chain_hash: bytes, group: str, owner: bytes | None = None) -> None:
        """Drop one entry if held (``owner`` not needed: see :meth:`exists`)."""
        with self._lock:
            if (chain_hash, group) in self._entries:
                self._drop((chain_hash, group))

    def purge(self, selector, chains: list[tuple[bytes, int, bytes | None]] = ()) -> TierPurge:
        """Remove every held entry ``selector`` selects (by this tier's namespace, the entry's owner
        and the time this tier got it); ``chains`` are not needed (the tier enumerates itself).
        Loads already handed out stay valid (the tensors are the caller's now).

        Returns:
            Entries removed and their payload bytes (nothing is ever hidden here).
        """
        self.purges += 1
        with self._lock:
            doomed = [k for k, e in self._entries.items() if selector.matches(self.namespace, e.owner, e.created)]
            freed = sum(self._drop(k).nbytes for k in doomed)
        return TierPurge(len(doomed), freed)

    def _victim(self, incoming: int) -> tuple[bytes, str]:
        """The next entry to evict for a save of ``incoming`` probation bytes (0: a main entry):
        the oldest probation entry while probation would hold more than its share or the main
        order is empty, else the main order's next victim (removed from the order). Under
        ``retention="exclusive"`` the oldest entry the device also holds goes before any of these."""
        if self._on_device:
            key = next(iter(self._on_device))
            self._order.evicted(key)
            return key
        if self._probation and (self._probation_bytes + incoming > self.probation_share * self.capacity_bytes
                                or not (len(self._order) or self._protected)):
            return next(iter(self._probation))
        if self._protected and not len(self._order):     # the segment is within its share (_protect)
            return next(iter(self._protected))
        return self._order.pop()

    def _owner_victim(self, owner: bytes) -> tuple[bytes, str] | None:
        """The next entry of ``owner`` to evict for its quota: its oldest probation entry, else
        the main order's next of its own (removed from the order), else ``None``."""
        for key in self._probation:
            if self._entries[key].owner == owner:
                return key
        key = self._order.pop(owner)
        if key is None:
            key = next((k for k in self._protected if self._entries[k].owner == owner), None)
        return key

    def _remember_load(self, key: tuple[bytes, str]) -> None:
        """Note a load of ``key`` in the ghost (bounded to 4 keys per held entry, oldest dropped)."""
        loaded = self._loaded
        loaded[key] = None
        loaded.move_to_end(key)
        while len(loaded) > 4 * max(1, len(self._entries)):
            loaded.popitem(last=False)

    def _protect(self, key: tuple[bytes, str]) -> None:
        """Move a main-order entry whose content was loaded before into the protected segment
        (most recent there)."""
        if key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._loaded and key in self._order:
            self._order.discard(key)                # still described: its bytes count for quotas
            nbytes = self._protected[key] = self._entries[key].nbytes
            self._protected_bytes += nbytes
        self._demote_protected()

    def _demote_protected(self) -> None:
        """While the protected segment holds more than ``protected_share`` of ``capacity_bytes``,
        move its least recent entry back into the main order as the most recent one (segmented
        LRU: a protected entry pushed out of its segment gets a second life in the probationary
        one rather than being evicted; Karedla, Love and Wherry, IEEE Computer 27(3), 1994)."""
        limit = self.protected_share * self.capacity_bytes
        while self._protected and self._protected_bytes > limit:
            self._unprotect(next(iter(self._protected)))

    def _unprotect(self, key: tuple[bytes, str]) -> None:
        """Move a protected entry back into the main order (most recent)."""
        nbytes = self._protected.pop(key, None)
        if nbytes is not None:
            self._protected_bytes -= nbytes
            self._order.add(key)

    def _confirm(self, key: tuple[bytes, str]) -> None:
        """Take ``key`` off probation into the main order (used, or saved again as a main entry)."""
        nbytes = self._probation.pop(key, None)
        if nbytes is not None:
            self._probation_bytes -= nbytes
            self._order.add(key)

    def _evict(self, key: tuple[bytes, str]) -> None:
        self.stats.bytes_evicted += self._drop(key).nbytes
        self.stats.evictions += 1

    def _drop(self, key: tuple[bytes, str]) -> _HostEntry:
        """Remove a held entry (its async copy is waited first); returns it."""
        e = self._entries.pop(key)
        self._on_device.pop(key, None)
        pbytes = self._protected.pop(key, None)
        if pbytes is not None:
            self._protected_bytes -= pbytes
        nbytes = self._probation.pop(key, None)
        if nbytes is not None:
            self._probation_bytes -= nbytes
        self._order.forget(key)
        e.wait()                                   # its async copy must finish before the memory goes
        self._bytes -= e.nbytes
        return e

    def _check(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        expected = self._expected[group]
        if len(tensors) != len(expected) or any(
                (t.dtype, t.shape) != expected.get(n, (None, None)) for n, t in tensors.items()):
            got = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}
            raise ValueError(f"{self.name} tier: {group} entry components {got} differ from "
                             f"{self.shapes[group]}")

    def _copy(self, tensors: dict[str, torch.Tensor], nbytes: int) -> _HostEntry:
        held, on_device = {}, False
        for n, t in tensors.items():
            t = t.detach()
            if self.pin_memory:
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                dst.copy_(t, non_blocking=t.is_cuda)
            else:
                dst = t.to("cpu", copy=True, memory_format=torch.contiguous_format)
            on_device |= t.is_cuda
            held[n] = dst
        ready = None
        if on_device and self.pin_memory:
            ready = torch.cuda.Event()
            ready.record()
        return _HostEntry(held, nbytes, ready)
