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
  without one. An entry used often lately ranks high; one used often long ago
  forgets it. A newly cached entry — a conversation's newest turn, which its next
  turn continues — starts at ``w = 1`` now. Uses: the one that cached it; each
  lookup that matched it (:meth:`EvictionOrder.hit`: a lookup touches every page of
  its matched path and the checkpoint of its joint hit). A request waiting for
  admission looks its prompt up again every engine step; those repeats are one use
  (``count=False``: refreshed, not counted — the coordinator recognises them). The
  time a request holds an item is use, not idleness: when it becomes evictable again
  (:meth:`~EvictionOrder.add`) its last use is now.
* Time is counted in *turnovers of written content* (the write clock): each newly
  described item advances the clock by its bytes over the most bytes the order has
  described (once the tier has filled: its capacity), so ``h`` means the same in a 1%
  and a 20% pool, the host tier and the disk store, and is deterministic (no
  seconds). Evictions do not move it: entries freed with an evicted page's subtree or
  superseded would otherwise leave the clock frozen (docs/concepts/eviction.md, "value").
* ``h`` — how long uses are remembered — is chosen online where the holder gives each
  item's content key (the device page and checkpoint pools) by *miniature simulations*
  (Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations",
  USENIX ATC 2017): five shadow caches, metadata only, each this order with a fixed
  ``h`` from :data:`HALF_LIFE_GRID` = {1/64, 1/16, 1/4, 1, 4} turnovers (factor-4 steps
  from 1/64, which ranks as ``lru`` does, past 1, to 4, close to LFU), fed the same
  stream: every counted hit and every described item (a miss here, perhaps a hit
  there), so each sees the whole prompt stream and recognises content across
  evictions by its key. Keys are spatially sampled as in SHARDS (Waldspurger et al.,
  "Efficient MRC Construction with SHARDS", FAST 2015): a key is sampled when its low
  24 bits are below ``T``, rate ``R = T / 2^24 = min(1, SHADOW_ITEMS / most items
  described)`` (fixed-size sampling: at most about 4,096 keys a shadow; rate 1, a full
  simulation, for smaller tiers), only ever lowered, and a shadow holds ``R`` times the
  most bytes described. Each shadow sums the tokens (``C``) its hits save in a window
  halving per turnover, restarted at the tier's first eviction (before it every shadow
  hits alike); every 1/16 turnover the order adopts the best shadow's ``h`` when it
  beats the current ``h``'s shadow by more than 1/64 (hysteresis) and re-keys its heap.
  It starts at ``h = HALF_LIFE_TURNOVERS = 1`` (a tier that is never told content keys
  — the host tier, the disk store — keeps it). The shadows evict keys independently (no
  prefix closure, nothing pinned); a lookup touches its whole path, so an ancestor's
  weight is not below its descendants' and prefix closure holds approximately in them
  as in the real order. Measured (docs/results/memory.md, "Capacity sweep: the device alone"): within 0.3 point of
  ``lru`` at 20% of the bundled trace, ahead of it at 1-10% and on the synthetic trace
  except at 5% (−0.12); a fixed ``h`` cannot do both.
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
HALF_LIFE_TURNOVERS = 1.0       # value order: an unused item's weight halves per turnover (docs/concepts/eviction.md)
HALF_LIFE_GRID = (1 / 64, 1 / 16, 1 / 4, 1.0, 4.0)   # value order: the shadows' half-lives (turnovers)
SHADOW_ITEMS = 4096             # value order: most sampled keys one shadow tracks (fixed-size sampling)
SCORE_WINDOW_TURNOVERS = 1.0    # value order: half-life of a shadow's hit-value window (turnovers)
SWITCH_MARGIN = 1 / 64          # value order: a shadow must beat the current h's by this share to switch
CHOOSE_EVERY_TURNOVERS = 1 / 16 # value order: turnovers between choices of h
_SAMPLE_SPACE = 1 << 24         # sample values of content keys: 0 .. 2^24 - 1


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
                 owner: Hashable | None = None, key: bytes | None = None) -> None:
        """Set what ``item`` holds (a new content: hits restart at 0). ``key``: the content it
        holds (a chained hash), which outlives the item id across evictions; the value order's
        shadow caches follow content by it (``None``: no content key, e.g. the byte store).

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
        """``item`` is being evicted (the value order: the tier's fill is over)."""


class RecencyOrder(EvictionOrder):
    """The ``lru`` ranking without descriptions: least recently added or hit member first,
    exactly as :class:`LRUOrder` ranks (the same members, victims and iteration after any
    sequence of calls), keeping no :class:`ItemInfo`: no byte or owner counts
    (``owner_bytes``, ``total_bytes`` and ``info`` stay empty), no hit counts, no victims by
    owner. ``make_order("lru", described=False)``.

    For a holder that serves no quotas and reads no descriptions: the device page pool of a
    cache without ``tenant_quota``, where describing every page published and looking up its
    owner on every release is most of an ``lru`` order's upkeep (about 1.45 M pages described
    on a whole-trace simulated replay).
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._q: OrderedDict[Hashable, None] = OrderedDict()

    def describe(self, item: Hashable, nbytes: int = 1, cost: float = 1.0, depth: int = 0,
                 owner: Hashable | None = None, key: bytes | None = None) -> None:
        """A new content: a member leaves the order (as :meth:`LRUOrder.describe` forgets it);
        nothing is kept of the description."""
        self._q.pop(item, None)

    def forget(self, item: Hashable) -> None:
        self._q.pop(item, None)

    def add(self, item: Hashable) -> None:
        """Make ``item`` the most recent member."""
        q = self._q
        if item in q:
            q.move_to_end(item)
        else:
            q[item] = None

    def discard(self, item: Hashable) -> None:
        self._q.pop(item, None)

    def hit(self, item: Hashable, count: bool = True) -> None:
        """Move a member to the most recent end (held items: no-op)."""
        if item in self._q:
            self._q.move_to_end(item)

    def victim(self, owner: Hashable | None = None) -> Hashable | None:
        """Least recent member.

        Raises:
            ValueError: ``owner`` given (this order knows no owners; a holder with quotas needs
                :class:`LRUOrder`).
        """
        if owner is not None:
            raise ValueError("a RecencyOrder keeps no owners: a holder with quotas needs a described order")
        return next(iter(self._q), None)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._q

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(list(self._q))


class LRUOrder(RecencyOrder):
    """Least recently added or hit member first, with descriptions (hit counts, owner bytes)
    and victims by owner."""

    name = "lru"
    describe = EvictionOrder.describe
    forget = EvictionOrder.forget

    def __init__(self) -> None:
        super().__init__()
        # members of each owner in the same order: the subsequence of ``_q`` with that owner (an
        # item's owner is fixed while it is a member: ``describe`` takes it out first). Built on
        # the first ``victim(owner)`` (a tenant over its quota) and kept from then on; ``None``
        # until then, so a cache without quotas keeps one queue, not two.
        self._by_owner: dict[Hashable, OrderedDict[Hashable, None]] | None = None

    def add(self, item: Hashable) -> None:
        """Make ``item`` the most recent member."""
        RecencyOrder.add(self, item)
        info = self.info.get(item)           # :meth:`_info` inline: a page always has one here
        if info is None:
            info = self._info(item)
        owner = info.owner
        if owner is not None and self._by_owner is not None:
            oq = self._by_owner.get(owner)
            if oq is None:
                oq = self._by_owner[owner] = OrderedDict()
            if item in oq:
                oq.move_to_end(item)
            else:
                oq[item] = None

    def discard(self, item: Hashable) -> None:
        """Drop ``item`` from the order (absent: no-op)."""
        if self._q.pop(item, 0) is None and self._by_owner is not None:
            info = self.info.get(item)
            if info is not None and info.owner is not None:
                q = self._by_owner[info.owner]
                del q[item]
                if not q:
                    del self._by_owner[info.owner]

    def hit(self, item: Hashable, count: bool = True) -> None:
        """Move a member to the most recent end (held items: no-op)."""
        info = self.info.get(item)
        if info is None:
            info = self._info(item)
        info.hits += count
        if item in self._q:
            self.add(item)

    def victim(self, owner: Hashable | None = None) -> Hashable | None:
        """Least recent member (of ``owner``)."""
        if owner is None:
            return next(iter(self._q), None)
        if self._by_owner is None:
            by: dict[Hashable, OrderedDict[Hashable, None]] = {}
            info = self.info
            for item in self._q:
                o = info[item].owner
                if o is not None:
                    oq = by.get(o)
                    if oq is None:
                        oq = by[o] = OrderedDict()
                    oq[item] = None
            self._by_owner = by
        return next(iter(self._by_owner.get(owner, ())), None)


class _Shadow:
    """One miniature simulation: a metadata-only value cache of fixed half-life ``h`` over the
    sampled content keys, of the sampled share of the real tier's bytes.

    It ranks as :class:`ValueOrder` does (fixed key ``log2(C · w / M) + last / h``, lazy heap,
    write clock: each inserted key advances its clock by its bytes over its capacity), holds
    no references (nothing is pinned) and evicts keys independently (no prefix closure).
    ``pending`` accumulates the tokens (``C``) its hits would have saved since the owner last
    folded them into ``score``.
    """

    __slots__ = ("h", "clock", "nbytes", "items", "heap", "seq", "score", "pending")

    def __init__(self, h: float) -> None:
        self.h = h
        self.clock = 0.0
        self.nbytes = 0
        self.items: dict[bytes, list] = {}      # key -> [weight, last, cost, nbytes, seq, sample]
        self.heap: list[tuple] = []
        self.seq = 0
        self.score = 0.0
        self.pending = 0.0

    def access(self, key: bytes, cost: float, nbytes: int, sample: int, cap: float) -> None:
        """``key`` was used (a hit of the real tier or content it wrote): a hit here adds
        ``cost`` to ``pending`` and one use to the key's weight; a miss inserts it (``w = 1``)
        and evicts the lowest keys while the shadow holds over ``cap`` bytes."""
        ent = self.items.get(key)
        self.seq += 1
        if ent is not None:
            self.pending += cost
            ent[0] = ent[0] * 2.0 ** ((ent[1] - self.clock) / self.h) + 1.0
            ent[1] = self.clock
        else:
            ent = self.items[key] = [1.0, self.clock, cost, nbytes, 0, sample]
            self.nbytes += nbytes
            self.clock += nbytes / cap
        ent[4] = self.seq
        d = ent[2] * ent[0] / ent[3]
        heapq.heappush(self.heap, ((math.log2(d) if d > 0 else -math.inf) + ent[1] / self.h, self.seq, key))
        if self.nbytes > cap:
            self._trim(cap)
        if len(self.heap) > 4 * len(self.items) + 64:
            self.heap = [r for r in self.heap if self.items.get(r[2], (0,) * 5)[4] == r[1]]
            heapq.heapify(self.heap)

    def _trim(self, cap: float) -> None:
        heap, items = self.heap, self.items
        while self.nbytes > cap and heap:
            _, seq, key = heapq.heappop(heap)
            ent = items.get(key)
            if ent is not None and ent[4] == seq:
                del items[key]
                self.nbytes -= ent[3]

    def resample(self, threshold: int) -> None:
        """Drop the keys whose sample value is no longer below ``threshold`` (a lower rate)."""
        for key in [k for k, e in self.items.items() if e[5] >= threshold]:
            self.nbytes -= self.items.pop(key)[3]


class ValueOrder(EvictionOrder):
    """Lowest value density ``(C / M) · w`` first, ``w`` a hit weight that halves every
    ``half_life`` turnovers without a use (see module docstring); ``half_life`` chosen online
    from :data:`HALF_LIFE_GRID` by miniature simulations when the holder gives content keys.

    Time is counted in *turnovers* of written content: each newly described item advances
    :attr:`clock` by its bytes over the most bytes the order has described (at capacity, the
    tier's capacity), so one turnover is the writing of one tier's worth of bytes. Ranking
    by ``(C / M) · w · 2^(-(clock - last) / half_life)`` is the same at every later time as
    ranking by the fixed key ``log2(C · w / M) + last / half_life`` (the decay factor is
    common to all items), so the members sit in heaps with O(log n) updates: each change
    pushes a fresh ``(key, -depth, seq, item)`` record; stale records (superseded ``seq``)
    are skipped when met and the heaps are rebuilt once they hold over four times the
    members. A change of ``half_life`` re-keys every member (O(n)).

    Args:
        half_life: turnovers after which an unused item's weight halves (> 0); ``None``
            (default): adaptive, starting at :data:`HALF_LIFE_TURNOVERS`.
        grid: the half-lives the shadows simulate (adaptive only; each > 0).
        shadow_items: most sampled keys a shadow tracks (fixed-size sampling, >= 1).

    Raises:
        ValueError: ``half_life`` or a grid entry is not positive, or ``shadow_items < 1``.
    """

    name = "value"

    def __init__(self, half_life: float | None = None, grid: tuple[float, ...] | None = None,
                 shadow_items: int | None = None) -> None:
        adaptive = half_life is None
        h = HALF_LIFE_TURNOVERS if adaptive else half_life
        if not h > 0:
            raise ValueError(f"value eviction half_life={half_life} must be positive (turnovers)")
        grid = tuple(HALF_LIFE_GRID if grid is None else grid)
        if adaptive and not (grid and all(g > 0 for g in grid)):
            raise ValueError(f"value eviction grid={grid} must be non-empty half-lives > 0 (turnovers)")
        shadow_items = SHADOW_ITEMS if shadow_items is None else shadow_items
        if shadow_items < 1:
            raise ValueError(f"value eviction shadow_items={shadow_items} must be >= 1")
        super().__init__()
        self.half_life = float(h)
        self.clock = 0.0                                   # turnovers written (described bytes / most described)
        self.max_bytes = 0                                 # most bytes described at once (the tier's size, once full)
        self._max_items = 0
        self._live: dict[Hashable, tuple] = {}             # member -> its current heap record
        self._heap: list[tuple] = []
        self._owner_heaps: dict[Hashable, list[tuple]] = {}
        self._seq = 0
        self.shadows = [_Shadow(float(g)) for g in grid] if adaptive else []
        self._shadow_items = shadow_items
        self._keys: dict[Hashable, tuple[bytes, int]] = {}   # described item -> (content key, sample value)
        self.threshold = _SAMPLE_SPACE                      # sampled iff sample value < threshold (rate 1)
        self._folded = 0.0                                  # clock when the shadows' scores were last folded
        self.switches = 0                                   # half-life changes made
        self._evicting = False                              # the tier has evicted (its fill is over)
        self._full = False                                  # the shadows' windows restarted after the fill

    def describe(self, item: Hashable, nbytes: int = 1, cost: float = 1.0, depth: int = 0,
                 owner: Hashable | None = None, key: bytes | None = None) -> None:
        """Set what ``item`` holds; its weight starts at 1 (the use that cached it), now; the
        clock advances by its bytes over the most bytes described. With a ``key`` (adaptive
        order) the write is an access of the shadows (a miss here, maybe a hit there)."""
        super().describe(item, nbytes, cost, depth, owner)
        if self.total_bytes > self.max_bytes:
            self.max_bytes = self.total_bytes
        self.clock += nbytes / self.max_bytes
        self.info[item].last = self.clock
        if key is not None and self.shadows:
            n = len(self.info)
            if n > self._max_items:
                self._max_items = n
                if n > self._shadow_items:
                    self._resample()
            sample = int.from_bytes(key[:4], "little") & (_SAMPLE_SPACE - 1) if isinstance(key, bytes) \
                else hash(key) & (_SAMPLE_SPACE - 1)
            self._keys[item] = (key, sample)
            if sample < self.threshold:
                self._shadow_access(key, float(cost), nbytes, sample)
            if self.clock - self._folded >= CHOOSE_EVERY_TURNOVERS:
                self._choose()

    def forget(self, item: Hashable) -> None:
        """The item's content is gone (its content key stays in the shadows)."""
        if self._keys:
            self._keys.pop(item, None)
        super().forget(item)

    def _resample(self) -> None:
        """Fixed-size sampling (SHARDS): lower the rate so a shadow tracks about ``shadow_items``
        keys of a tier holding ``_max_items``; only ever lowered, in steps of at least 1/16."""
        want = int(_SAMPLE_SPACE * self._shadow_items / self._max_items)
        if want < self.threshold * 15 // 16:
            self.threshold = want
            for sh in self.shadows:
                sh.resample(want)

    def _shadow_access(self, key: bytes, cost: float, nbytes: int, sample: int) -> None:
        cap = self.max_bytes * self.threshold / _SAMPLE_SPACE
        for sh in self.shadows:
            sh.access(key, cost, nbytes, sample, cap)

    def _choose(self) -> None:
        """Fold each shadow's hit value into its decayed window (half-life
        :data:`SCORE_WINDOW_TURNOVERS`; emptied once, at the first eviction: the fill's hits
        are every shadow's alike and would only dilute their differences) and adopt the best
        shadow's ``h`` when it beats the shadow of the current ``h`` by more than
        :data:`SWITCH_MARGIN` (hysteresis)."""
        if self._evicting and not self._full:
            self._full = True                              # the fill's hits, equal in every shadow, go
            for sh in self.shadows:
                sh.score = sh.pending = 0.0
        decay = 2.0 ** (-(self.clock - self._folded) / SCORE_WINDOW_TURNOVERS)
        self._folded = self.clock
        cur = best = None
        for sh in self.shadows:
            sh.score = sh.score * decay + sh.pending
            sh.pending = 0.0
            if best is None or sh.score > best.score:
                best = sh
            if sh.h == self.half_life:
                cur = sh
        if best is not None and best.h != self.half_life and \
                (cur is None or best.score > cur.score * (1.0 + SWITCH_MARGIN)):
            self.set_half_life(best.h)

    def evicted(self, item: Hashable) -> None:
        """The first eviction ends the fill (the shadows' windows restart then)."""
        self._evicting = True

    def set_half_life(self, h: float) -> None:
        """Use half-life ``h`` (> 0) from now on: every member is re-keyed (weights and last
        uses kept; later decay at ``h``).

        Raises:
            ValueError: ``h`` is not positive.
        """
        if not h > 0:
            raise ValueError(f"value eviction half_life={h} must be positive (turnovers)")
        if h == self.half_life:
            return
        self.half_life = float(h)
        self.switches += 1
        for it, rec in self._live.items():
            self._live[it] = (self.priority(it), rec[1], rec[2], it)
        self._rebuild()

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
        (``not count``): ``w`` kept. Either way its last use is now; a member is re-scored.
        A counted use of an item with a sampled content key is an access of the shadows."""
        info = self._info(item)
        if count:
            info.hits += 1
            info.weight = self.weight(item) + 1.0
            if self._keys:
                ks = self._keys.get(item)
                if ks is not None and ks[1] < self.threshold:
                    self._shadow_access(ks[0], info.cost, info.nbytes, ks[1])
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


class ProbationOrder(LRUOrder):
    """:class:`LRUOrder` with a probation segment for speculative members (2Q's A1in / Am split,
    applied to one pool): a member :meth:`mark`-ed before it is added (a checkpoint placed on
    speculation, e.g. by ``interval``, that no request has used yet) waits on probation until its
    first counted hit promotes it. The victim is the least recent probation member while probation
    holds at least ``share`` of ``capacity`` members (or nothing else is evictable), otherwise the
    least recent of the others; so speculative members take at most about ``share`` of the pool
    from members a request used or that the policy placed where traffic is known to return, and
    any room those leave. Victims by owner (quotas) follow :class:`LRUOrder`, both segments
    together.

    Args:
        capacity: members the pool can hold at most (its slots), >= 1.
        share: fraction in [0, 1] of ``capacity`` that probation may hold while others need room.

    Raises:
        ValueError: ``capacity`` below 1 or ``share`` outside [0, 1].
    """

    name = "lru"

    def __init__(self, capacity: int, share: float) -> None:
        if capacity < 1:
            raise ValueError(f"probation capacity={capacity} must be >= 1")
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"probation share={share} must be a fraction in [0, 1]")
        super().__init__()
        self.limit = share * capacity
        self._marked: set[Hashable] = set()          # speculative, not yet used (member or held)
        self._spec: OrderedDict[Hashable, None] = OrderedDict()   # members on probation, lru first
        self._rest: OrderedDict[Hashable, None] = OrderedDict()   # the other members, lru first

    def mark(self, item: Hashable) -> None:
        """``item`` (not yet added) holds a speculative entry: it starts on probation."""
        self._marked.add(item)

    def on_probation(self, item: Hashable) -> bool:
        """Whether member ``item`` is on probation."""
        return item in self._spec

    def describe(self, item: Hashable, nbytes: int = 1, cost: float = 1.0, depth: int = 0,
                 owner: Hashable | None = None, key: bytes | None = None) -> None:
        """As :meth:`EvictionOrder.describe`, keeping a :meth:`mark` made for this content."""
        marked = item in self._marked
        EvictionOrder.describe(self, item, nbytes, cost, depth, owner, key)
        if marked:
            self._marked.add(item)

    def forget(self, item: Hashable) -> None:
        """The item's content is gone (its mark too)."""
        self._marked.discard(item)
        EvictionOrder.forget(self, item)

    def add(self, item: Hashable) -> None:
        """Make ``item`` the most recent member of its segment."""
        LRUOrder.add(self, item)
        q, other = (self._spec, self._rest) if item in self._marked else (self._rest, self._spec)
        other.pop(item, None)
        if item in q:
            q.move_to_end(item)
        else:
            q[item] = None

    def discard(self, item: Hashable) -> None:
        """Drop ``item`` from the order (absent: no-op)."""
        LRUOrder.discard(self, item)
        self._spec.pop(item, None)
        self._rest.pop(item, None)

    def hit(self, item: Hashable, count: bool = True) -> None:
        """A use: a counted one promotes a probation item (member or held) to the others."""
        if count and item in self._marked:
            self._marked.discard(item)
            if self._spec.pop(item, 0) is None:
                self._rest[item] = None
        LRUOrder.hit(self, item, count)

    def victim(self, owner: Hashable | None = None) -> Hashable | None:
        """Least recent probation member while probation is at its share (or alone), else the
        least recent other member; by ``owner``: as :class:`LRUOrder`."""
        if owner is not None:
            return LRUOrder.victim(self, owner)
        if self._spec and (len(self._spec) >= self.limit or not self._rest):
            return next(iter(self._spec))
        return next(iter(self._rest), None)


def make_order(policy: str, described: bool = True) -> EvictionOrder:
    """A fresh order for ``policy`` (``"lru"`` or ``"value"``). ``described=False``: the holder
    reads no descriptions (no quotas), so ``lru`` is a :class:`RecencyOrder` (the same ranking,
    no descriptions kept); ``value`` ranks by its descriptions and keeps them either way.

    Raises:
        ValueError: ``policy`` is neither.
    """
    if policy == "lru":
        return LRUOrder() if described else RecencyOrder()
    if policy == "value":
        return ValueOrder()
    raise ValueError(f"eviction policy {policy!r} must be one of {list(EVICTION_POLICIES)}")
