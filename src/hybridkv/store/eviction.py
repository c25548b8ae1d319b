"""Eviction orders: which cached, unreferenced item goes first (DESIGN §8).

One small interface, two policies, used by every capacity-bounded holder of
cached state: the device page and checkpoint pools (:mod:`hybridkv.cache.pools`),
the host tier (:mod:`hybridkv.tiers.host`) and the disk store's capacity
(:mod:`hybridkv.store.disk`). It lives in the lowest layer that needs it (the
byte store) and knows nothing of tokens or tensors: callers describe each item
with plain numbers (:meth:`EvictionOrder.describe`).

Membership. An item is *in* the order while it is cached and nobody holds it
(refcount 0): :meth:`~EvictionOrder.add` when it becomes evictable,
:meth:`~EvictionOrder.discard` when a request references it or it is freed.
Only members are ever returned by :meth:`~EvictionOrder.victim`, so a holder
that keeps referenced items out of the order never evicts what a running
request holds. Descriptions (bytes, cost, owner, hits) outlive membership and
are dropped by :meth:`~EvictionOrder.forget` when the item's content goes.

``lru`` (:class:`LRUOrder`): least recently added or hit first.

``value`` (:class:`ValueOrder`): the seed's value density
``V = p · C_saved / (M · T_residence)``, estimated as a cost-per-byte weighted,
exponentially decayed use count (the combined recency-frequency value of LRFU:
Lee et al., "LRFU: a spectrum of policies that subsumes the least recently used
and least frequently used policies", IEEE Trans. Computers 50(12), 2001, with
``F(x) = 2^(-x / h)``; the ``C / M`` weight is GreedyDual-Size's, Cao & Irani,
USENIX Symposium on Internet Technologies and Systems, 1997)::

    V(item, now) = C / M · w(now),   w(now) = sum over its uses u of 2^(-(now - t_u) / h)

* ``p / T_residence`` — the chance of another hit per unit of time held — is
  estimated by ``w``: every use adds 1 and the sum halves every ``h`` turnovers
  without one (``h = HALF_LIFE_TURNOVERS = 1``). An entry used often lately
  ranks high; one used often long ago forgets it. (Counts that never decay —
  GreedyDual-Size-Frequency, Cherkasova, HP Labs TR-98-69, 1998, this order's
  previous form — kept stale shared pages over a conversation's newest turn and
  lost to ``lru`` at 20% capacity. The decayed form wins there on each half of
  the bundled trace but still loses on the whole trace: docs/memory.md.) A newly cached entry — a
  conversation's newest turn, which its next turn continues — starts at
  ``w = 1`` now: it outranks every entry whose decayed weight fell below one,
  e.g. any entry used once more than a turnover ago.
  Uses: the one that cached it; each lookup that matched it
  (:meth:`EvictionOrder.hit`: a lookup touches every page of its matched path
  and the checkpoint of its joint hit). A request waiting for admission looks
  its prompt up again every engine step; those repeats are one use
  (``count=False``: refreshed, not counted — the coordinator recognises them),
  so a queued request is not credited once per step it waits.
  The time a request holds an item is use, not idleness: when it becomes
  evictable again (:meth:`~EvictionOrder.add`) its last use is now.
* Time is counted in *turnovers*: each eviction advances the clock by the
  victim's bytes over the bytes the order describes (at capacity: the tier's
  capacity), so ``h`` means the same in a 1% and a 20% pool, the host tier and
  the disk store, with no constant tuned to a pool size, and is deterministic
  (no seconds). ``h = 1``: uses are forgotten at the rate the tier replaces its
  content. Measured alternatives (``h`` = 0.5, 2) are in docs/memory.md.
* ``C`` — prefill saved by a hit — is the ``cost`` the holder gives, in
  tokens: a checkpoint's boundary depth (a hit on ``C(P_t)`` skips ``t``
  tokens of prefill); a KV page's own tokens (``block_size``); a disk object
  1 (a byte store cannot see depths, so it ranks by decayed hits per byte).
* ``M`` — bytes the item holds (``nbytes``).

Ranking by ``V(now)`` is the same at every later time as ranking by the fixed key
``log2(C · w_last / M) + t_last / h`` (the decay factor is common to all items),
so the members sit in a heap with O(log n) updates and no rescoring.

Ties (equal key) evict the deeper item first (``depth``), so under equal value
a descendant goes before the ancestor it depends on. Lookups touch the whole
matched path and a request releases its pages together, so an ancestor page's
weight is not below its descendants' unless it was cached before them and not
used since; evicting a page removes the index subtree below it (prefix-closed
KV) in any case.

Owners. Every item may name an ``owner`` (a tenant's namespace); the order
counts each owner's bytes (members and held items alike) and
:meth:`~EvictionOrder.victim` with ``owner=`` picks that owner's lowest item,
which is how a tenant over its quota evicts its own entries first.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

EVICTION_POLICIES = ("lru", "value")
HALF_LIFE_TURNOVERS = 1.0       # value order: an unused item's weight halves per turnover (docs/memory.md)


@dataclass(slots=True)
class ItemInfo:
    """What the order knows of one item.

    Attributes:
        nbytes: bytes held (M), > 0.
        cost: prefill saved by a hit (C), in tokens (or 1 where unknown).
        depth: tie-break; deeper items go first at equal value (tokens).
        owner: owner key for quotas (``None``: unowned).
        hits: lookups that counted as uses since cached.
        weight: the value order's decayed use count ``w`` at ``last`` (1 when cached).
        last: the value order's clock (turnovers) at the item's last use.
    """

    nbytes: int = 1
    cost: float = 1.0
    depth: int = 0
    owner: Hashable | None = None
    hits: int = 0
    weight: float = 1.0
    last: float = 0.0


class EvictionOrder(ABC):
    """Members (cached, unreferenced items) in eviction order, plus per-owner byte counts."""

    name = ""

    def __init__(self) -> None:
        self.info: dict[Hashable, ItemInfo] = {}          # owner: this order (describe/forget)
        self.owner_bytes: dict[Hashable, int] = {}        # invariant: sum of info.nbytes per owner
        self.total_bytes = 0                               # invariant: sum of info.nbytes

    # -- descriptions ----------------------------------------------------
    def describe(self, item: Hashable, nbytes: int = 1, cost: float = 1.0, depth: int = 0,
                 owner: Hashable | None = None) -> None:
        """Set what ``item`` holds (a new content: hits restart at 0).

        Raises:
            ValueError: ``nbytes`` is not positive or ``cost`` is negative.
        """
        if nbytes <= 0:
            raise ValueError(f"eviction item nbytes={nbytes} must be positive")
        if cost < 0:
            raise ValueError(f"eviction item cost={cost} must be >= 0")
        if item in self.info:              # a member always has a description (``_info``)
            self.forget(item)
        self.info[item] = ItemInfo(nbytes, float(cost), depth, owner)
        self.total_bytes += nbytes
        if owner is not None:
            self.owner_bytes[owner] = self.owner_bytes.get(owner, 0) + nbytes

    def forget(self, item: Hashable) -> None:
        """The item's content is gone: drop it from the order and its description."""
        self.discard(item)
        info = self.info.pop(item, None)
        if info is not None:
            self.total_bytes -= info.nbytes
        if info is not None and info.owner is not None:
            left = self.owner_bytes[info.owner] - info.nbytes
            if left:
                self.owner_bytes[info.owner] = left
            else:
                del self.owner_bytes[info.owner]

    def _info(self, item: Hashable) -> ItemInfo:
        info = self.info.get(item)
        if info is None:
            info = self.info[item] = ItemInfo()
            self.total_bytes += info.nbytes
        return info

    # -- membership ------------------------------------------------------
    @abstractmethod
    def add(self, item: Hashable) -> None:
        """``item`` became evictable (cached, unreferenced); re-adding refreshes it."""

    @abstractmethod
    def discard(self, item: Hashable) -> None:
        """``item`` is no longer evictable (referenced, freed); absent items are ignored."""

    @abstractmethod
    def hit(self, item: Hashable, count: bool = True) -> None:
        """A lookup used ``item`` (member or held); ``count=False``: the same use again (a
        request waiting for admission looking up again), a refresh that adds no use."""

    @abstractmethod
    def victim(self, owner: Hashable | None = None) -> Hashable | None:
        """The member to evict next (of ``owner`` only, when given), or ``None``; not removed."""

    @abstractmethod
    def __contains__(self, item: Hashable) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self):
        """Members, first victim first."""

    def pop(self, owner: Hashable | None = None) -> Hashable | None:
        """Remove and return :meth:`victim` (``None`` when there is none)."""
        item = self.victim(owner)
        if item is not None:
            self.evicted(item)
            self.discard(item)
        return item

    def evicted(self, item: Hashable) -> None:
        """``item`` is being evicted (the value order advances its clock)."""


class LRUOrder(EvictionOrder):
    """Least recently added or hit member first."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._q: OrderedDict[Hashable, None] = OrderedDict()
        self._by_owner: dict[Hashable, OrderedDict[Hashable, None]] = {}

    def add(self, item: Hashable) -> None:
        """Make ``item`` the most recent member."""
        q = self._q
        if item in q:
            q.move_to_end(item)
        else:
            q[item] = None
        owner = self._info(item).owner
        if owner is not None:
            oq = self._by_owner.get(owner)
            if oq is None:
                oq = self._by_owner[owner] = OrderedDict()
            if item in oq:
                oq.move_to_end(item)
            else:
                oq[item] = None

    def discard(self, item: Hashable) -> None:
        """Drop ``item`` from the order (absent: no-op)."""
        if self._q.pop(item, 0) is None:
            info = self.info.get(item)
            if info is not None and info.owner is not None:
                q = self._by_owner[info.owner]
                del q[item]
                if not q:
                    del self._by_owner[info.owner]

    def hit(self, item: Hashable, count: bool = True) -> None:
        """Move a member to the most recent end (held items: no-op)."""
        self._info(item).hits += count
        if item in self._q:
            self.add(item)

    def victim(self, owner: Hashable | None = None) -> Hashable | None:
        """Least recent member (of ``owner``)."""
        q = self._q if owner is None else self._by_owner.get(owner, ())
        return next(iter(q), None)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._q

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(list(self._q))


class ValueOrder(EvictionOrder):
    """Lowest value density ``(C / M) · w`` first, ``w`` a hit weight that halves every
    ``half_life`` turnovers without a use (see module docstring).

    Time is counted in *turnovers*: each eviction advances :attr:`clock` by the victim's
    bytes over the bytes the order describes (members and held items: at capacity, the
    tier's capacity), so one turnover is the eviction of one tier's worth of bytes. Ranking
    by ``(C / M) · w · 2^(-(clock - last) / half_life)`` is the same at every later time as
    ranking by the fixed key ``log2(C · w / M) + last / half_life`` (the decay factor is
    common to all items), so the members sit in heaps with O(log n) updates: each change
    pushes a fresh ``(key, -depth, seq, item)`` record; stale records (superseded ``seq``)
    are skipped when met and the heaps are rebuilt once they hold over four times the
    members.

    Args:
        half_life: turnovers after which an unused item's weight halves (> 0).

    Raises:
        ValueError: ``half_life`` is not positive.
    """

    name = "value"

    def __init__(self, half_life: float = HALF_LIFE_TURNOVERS) -> None:
        if not half_life > 0:
            raise ValueError(f"value eviction half_life={half_life} must be positive (turnovers)")
        super().__init__()
        self.half_life = float(half_life)
        self.clock = 0.0                                   # turnovers elapsed (evicted bytes / described bytes)
        self._live: dict[Hashable, tuple] = {}             # member -> its current heap record
        self._heap: list[tuple] = []
        self._owner_heaps: dict[Hashable, list[tuple]] = {}
        self._seq = 0

    def describe(self, item: Hashable, nbytes: int = 1, cost: float = 1.0, depth: int = 0,
                 owner: Hashable | None = None) -> None:
        """Set what ``item`` holds; its weight starts at 1 (the use that cached it), now."""
        super().describe(item, nbytes, cost, depth, owner)
        self.info[item].last = self.clock

    def weight(self, item: Hashable) -> float:
        """``w`` of ``item`` now: its weight at its last use, halved per ``half_life`` turnovers since."""
        info = self._info(item)
        return info.weight * 2.0 ** (-(self.clock - info.last) / self.half_life)

    def priority(self, item: Hashable) -> float:
        """The fixed heap key ``log2(C · w / M) + last / half_life`` (``-inf`` for ``C = 0``)."""
        info = self._info(item)
        density = info.cost * info.weight / info.nbytes
        return (math.log2(density) if density > 0 else -math.inf) + info.last / self.half_life

    def add(self, item: Hashable) -> None:
        """Insert ``item`` (or re-score it), its last use now: time a request held it is use, not idleness."""
        info = self._info(item)
        info.last = self.clock
        self._push(item, info)

    def _push(self, item: Hashable, info: ItemInfo) -> None:
        self._seq += 1
        rec = (self.priority(item), -info.depth, self._seq, item)
        self._live[item] = rec
        heapq.heappush(self._heap, rec)
        if info.owner is not None:
            heapq.heappush(self._owner_heaps.setdefault(info.owner, []), rec)
        if len(self._heap) > 4 * len(self._live) + 64:
            self._rebuild()

    def discard(self, item: Hashable) -> None:
        """Drop ``item`` (its heap records become stale)."""
        self._live.pop(item, None)

    def hit(self, item: Hashable, count: bool = True) -> None:
        """A use (``count``): ``w := w · 2^(-(clock - last) / half_life) + 1``; a repeated use
        (``not count``): ``w`` kept. Either way its last use is now; a member is re-scored."""
        info = self._info(item)
        if count:
            info.hits += 1
            info.weight = self.weight(item) + 1.0
        info.last = self.clock
        if item in self._live:
            self._push(item, info)

    def victim(self, owner: Hashable | None = None) -> Hashable | None:
        """Member with the lowest value density now (of ``owner``)."""
        heap = self._heap if owner is None else self._owner_heaps.get(owner)
        while heap:
            rec = heap[0]
            if self._live.get(rec[3]) is rec:
                return rec[3]
            heapq.heappop(heap)
        return None

    def evicted(self, item: Hashable) -> None:
        """Advance the clock by the victim's share of the described bytes (a fraction of a turnover)."""
        info = self.info.get(item)
        if info is not None and self.total_bytes > 0:
            self.clock += info.nbytes / self.total_bytes

    def _rebuild(self) -> None:
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)
        self._owner_heaps = {}
        for rec in self._heap:
            owner = self.info[rec[3]].owner
            if owner is not None:
                self._owner_heaps.setdefault(owner, []).append(rec)
        for h in self._owner_heaps.values():
            heapq.heapify(h)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self):
        return iter([rec[3] for rec in sorted(self._live.values())])


def make_order(policy: str) -> EvictionOrder:
    """A fresh order for ``policy`` (``"lru"`` or ``"value"``).

    Raises:
        ValueError: ``policy`` is neither.
    """
    if policy == "lru":
        return LRUOrder()
    if policy == "value":
        return ValueOrder()
    raise ValueError(f"eviction policy {policy!r} must be one of {list(EVICTION_POLICIES)}")
