"""Device pools: full-attention pages and KDA checkpoint slots (DESIGN §3, §8).

Both pools keep bookkeeping only in Python; tensors live at the device edge
(:class:`hybridkv.model.kv_pool.PagedKVPool` for pages, the optional tensors of
:class:`CheckpointPool` for checkpoints). The simulator uses the same pools
without tensors.

Page states (each page is in exactly one):
  * free      — ``refcount == 0`` and no index node points at it (in ``_free``);
  * cached    — ``refcount == 0`` and ``>= 1`` node points at it (a member of ``order``);
  * in use    — ``refcount > 0`` (held by running requests; may also be cached).
A page's content is immutable while any node points at it ("hash set once").

Checkpoint slot states: free (in ``_free``), published (attached to exactly one
index node; a member of ``order`` when unreferenced), or referenced (a request is
copying it into its working state).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from hybridkv._torch import torch
from hybridkv.cache.groups import GroupSpec
from hybridkv.store.eviction import EvictionOrder, make_order


class _FreeQueue:
    """The free ids of a pool of ``n``, in the order they are handed out: the ids never
    taken yet (``next .. n - 1``, ascending), then the ids freed since, in the order they were
    freed. That is the order of ``deque(range(n))`` taken from the left and freed onto the
    right, without making an ``int`` for every id up front (a simulated replay sizes 32
    instances' pools for the whole trace and uses a few percent of each).

    Supports what the pools use of a deque: ``popleft`` (``IndexError`` when empty),
    ``append``, ``len``, truth, iteration (hand-out order) and ``in``.
    """

    __slots__ = ("_next", "_n", "_freed")

    def __init__(self, n: int) -> None:
        self._next = 0                      # ids below this were handed out at least once
        self._n = n
        self._freed: deque[int] = deque()

    def __len__(self) -> int:
        return self._n - self._next + len(self._freed)

    def __bool__(self) -> bool:
        return self._next < self._n or bool(self._freed)

    def popleft(self) -> int:
        i = self._next
        if i < self._n:
            self._next = i + 1
            return i
        return self._freed.popleft()

    def append(self, i: int) -> None:
        self._freed.append(i)

    def __iter__(self):
        yield from range(self._next, self._n)
        yield from self._freed

    def __contains__(self, i) -> bool:
        return i in range(self._next, self._n) or i in self._freed


class _RefcountedCache:
    """Shared bookkeeping: per-item refcounts, a free queue and an eviction order of cached,
    unreferenced items (:mod:`hybridkv.store.eviction`: ``lru`` or ``value``).

    Subclasses say what "cached" means (:meth:`_cached`); an item is free when it
    is neither referenced nor cached, evictable when cached and unreferenced.
    Referenced items are never members of ``order``, so they are never evicted.
    """

    def __init__(self, n: int, eviction: str = "lru", described: bool = True) -> None:
        self.refcount = [0] * n                # owner: requests via ref/unref
        self._free = _FreeQueue(n)             # never-taken ids first, then freed ones (FIFO)
        # members: cached, unreferenced items; owner: this pool
        self.order = make_order(eviction, described)

    def _cached(self, i: int) -> bool:
        raise NotImplementedError

    def next_victim(self, owner=None) -> int | None:
        """The cached, unreferenced item the eviction order gives up first (of ``owner`` when
        given: a tenant over its quota), or ``None``."""
        return self.order.victim(owner)

    def touch(self, i: int, count: bool = True) -> None:
        """A lookup used item ``i``: under ``lru`` a cached, unreferenced item becomes most
        recently used; under ``value`` its weight grows by one use (``count``) or, for a
        repeated lookup of a waiting request, is refreshed (:meth:`EvictionOrder.hit`)."""
        if self._cached(i) or self.refcount[i]:
            self.order.hit(i, count)

    def touch_many(self, items, count: bool = True) -> None:
        """:meth:`touch` each of ``items`` in order (one call for a lookup's pages)."""
        rc, cached, hit = self.refcount, self._cached, self.order.hit
        for i in items:
            if cached(i) or rc[i]:
                hit(i, count)

    def _freed(self, i: int) -> None:
        self.order.forget(i)
        self._free.append(i)

    def ref(self, i: int) -> None:
        """Add a reference to a cached (or already referenced) item."""
        if self.refcount[i] == 0:
            if not self._cached(i):
                raise RuntimeError(f"{type(self).__name__} item {i} is not cached; it cannot be referenced")
            self.order.discard(i)
        self.refcount[i] += 1

    def ref_many(self, items) -> None:
        """:meth:`ref` each of ``items`` in order (one call for a request's pages); raises as
        :meth:`ref` does at the first bad item, the items before it referenced."""
        rc, cached, discard = self.refcount, self._cached, self.order.discard
        for i in items:
            if rc[i] == 0:
                if not cached(i):
                    raise RuntimeError(f"{type(self).__name__} item {i} is not cached; it cannot be referenced")
                discard(i)
            rc[i] += 1

    def unref_many(self, items) -> None:
        """:meth:`unref` each of ``items`` in order (one call for a request's pages); raises as
        :meth:`unref` does at the first bad item, the items before it released."""
        rc, cached, add, freed = self.refcount, self._cached, self.order.add, self._freed
        for i in items:
            left = rc[i] - 1
            if left < 0:
                raise RuntimeError(f"{type(self).__name__} item {i} refcount would go below zero")
            rc[i] = left
            if left == 0:
                if cached(i):
                    add(i)
                else:
                    freed(i)

    def unref(self, i: int) -> None:
        """Drop a reference; an unreferenced item becomes MRU evictable if cached, else free."""
        rc = self.refcount
        left = rc[i] - 1
        if left < 0:
            raise RuntimeError(f"{type(self).__name__} item {i} refcount would go below zero")
        rc[i] = left
        if left == 0:
            if self._cached(i):
                self.order.add(i)
            else:
                self._freed(i)


class PagePool(_RefcountedCache):
    """Refcounted page ids with an LRU queue of cached, unreferenced pages.

    Args:
        num_pages: pool size in pages.
        eviction: ``lru`` or ``value`` (:func:`hybridkv.store.eviction.make_order`).
        page_bytes: bytes of one page (M of the value score; 1 when unknown).
        block_size: tokens of one page (C of the value score: a page's hit saves its tokens).
        described: the order keeps each page's description (bytes, owner, hits; needed for
            quotas); ``False`` with ``lru``: a :class:`~hybridkv.store.eviction.RecencyOrder`,
            the same victims without them.
    """

    def __init__(self, num_pages: int, eviction: str = "lru", page_bytes: int = 0, block_size: int = 1,
                 described: bool = True) -> None:
        super().__init__(num_pages, eviction, described)
        self.page_bytes = page_bytes or 1
        self.block_size = block_size
        self.num_pages = num_pages
        self.node_count = [0] * num_pages      # owner: the index via add_node/remove_node

    def _cached(self, page: int) -> bool:
        return self.node_count[page] > 0

    # -- queries ---------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages neither referenced nor cached."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached pages with no request reference."""
        return len(self.order)

    # -- transitions -----------------------------------------------------
    def pop_free(self) -> int | None:
        """Take a free page (refcount becomes 1) or return ``None`` when none is free."""
        if not self._free:
            return None
        page = self._free.popleft()
        self.refcount[page] = 1
        return page

    def add_node(self, page: int, end: int = 0, owner=None, key: bytes | None = None) -> None:
        """An index node now points at ``page`` (its content is published).

        The first node describes the page to the eviction order: ``end`` (tokens, its
        depth), ``owner`` (the namespace whose quota it counts against) and ``key`` (the
        chained hash of its first unit: its content, which the value order's shadows follow)."""
        if self.refcount[page] == 0 and self.node_count[page] == 0:
            raise RuntimeError(f"page {page} is free; publish it while a request holds it")
        if self.node_count[page] == 0:
            self.order.describe(page, self.page_bytes, self.block_size, end, owner, key)
        self.node_count[page] += 1

    def add_nodes(self, page: int, end: int = 0, owner=None, count: int = 1, key: bytes | None = None) -> None:
        """:meth:`add_node` ``count`` times for ``count`` nodes at ``page`` (``end``: the first's,
        the shallowest; ``key``: the first's hash), checked once; ``count`` must be >= 1."""
        nc = self.node_count
        if nc[page] == 0:
            if self.refcount[page] == 0:
                raise RuntimeError(f"page {page} is free; publish it while a request holds it")
            self.order.describe(page, self.page_bytes, self.block_size, end, owner, key)
        nc[page] += count

    def remove_node(self, page: int) -> None:
        """An index node pointing at ``page`` was removed."""
        if self.node_count[page] <= 0:
            raise RuntimeError(f"page {page} has no node to remove")
        self.node_count[page] -= 1
        if self.node_count[page] == 0 and self.refcount[page] == 0:
            self._freed(page)

    def check_invariants(self) -> None:
        """Every page is in exactly one state; raise ``AssertionError`` otherwise."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate page in free queue"
        for p in range(self.num_pages):
            rc, nc = self.refcount[p], self.node_count[p]
            assert rc >= 0 and nc >= 0, f"page {p}: negative count"
            assert (p in free) == (rc == 0 and nc == 0), f"page {p}: free-queue membership wrong"
            assert (p in self.order) == (rc == 0 and nc > 0), f"page {p}: evictable membership wrong"


@dataclass(frozen=True, slots=True)
class StateCodec:
    """How a boundary group's state object (the model's, e.g. a KDA checkpoint) maps to the
    components of its :class:`~hybridkv.cache.groups.GroupSpec` and back; the cache never
    imports the model, the backend that owns the model hands this in.

    Attributes:
        encode: ``state -> {component: tensor}`` (views allowed; the pool copies them).
        decode: ``({component: tensor}, boundary in tokens) -> state``: the tensors are the
            pool's own (a slot's), so the state it returns must own copies of what it keeps
            (the reader may write its state; the slot is shared by every reader).
    """

    encode: Callable[[Any], dict]
    decode: Callable[[dict, int], Any]


class CheckpointPool(_RefcountedCache):
    """Fixed number of published boundary-state slots (checkpoints), with optional tensor storage.

    Args:
        num_slots: slots.
        spec: the boundary group's spec; its components (dtype, shape) are the storage of a
            tensor-backed pool. ``None``: a bookkeeping-only pool (simulation).
        codec: converts the model's state objects to and from the components (``None``: states
            are ``{component: tensor}`` dicts).
        slot_bytes: bytes of one checkpoint (used for metrics when tensor-less; a tensor-backed
            pool takes its spec's ``bytes_per_entry``).
        device: torch device of the storage.
        eviction: ``lru`` or ``value`` (:func:`hybridkv.store.eviction.make_order`).

    Storage: a tensor-backed slot holds one tensor per spec component, ``dtype[*shape]`` on
    ``device``, from its write until the slot is freed; the pool's bytes are at most
    ``num_slots * slot_bytes``. A write copies the state, or, for a state the caller hands over
    (``own=True``: the engine's freshly captured checkpoints, which nothing writes again), keeps
    its tensors: a capture is then never copied a second time.

    Raises:
        ValueError: a ``spec`` of a prefix-closed group (naming it).
    """

    def __init__(self, num_slots: int, *, spec: GroupSpec | None = None, codec: StateCodec | None = None,
                 slot_bytes: int = 0, device="cpu", eviction: str = "lru") -> None:
        super().__init__(num_slots, eviction)
        self.num_slots = num_slots
        self.published = [False] * num_slots   # owner: the index (attach/detach)
        self.spec, self.codec = spec, codec
        # tensor-backed: per slot, its components (None: free or never written)
        self._held: list[dict[str, torch.Tensor] | None] | None = None
        if spec is not None:
            if spec.prefix_closed:
                raise ValueError(f"a checkpoint pool holds a boundary group's state, not prefix group {spec.name!r}")
            self.device = torch.device(device)
            if self.device.type != "cpu" and self.device.index is None:   # "cuda" -> the current index, as tensors name it
                self.device = torch.empty(0, device=self.device).device
            self._layout = tuple((comp, getattr(torch, dtype), torch.Size(shape))
                                 for comp, dtype, shape in spec.components)
            self._held = [None] * num_slots
            slot_bytes = spec.bytes_per_entry
        self.slot_bytes = slot_bytes

    @property
    def num_free(self) -> int:
        """Unused slots."""
        return len(self._free)

    def take_free(self) -> int | None:
        """Reserve a free slot for writing (not yet published); ``None`` if none."""
        return self._free.popleft() if self._free else None

    @property
    def tensor_backed(self) -> bool:
        """Whether slots hold tensors (a pool built from a spec); else bookkeeping only."""
        return self._held is not None

    def write(self, slot: int, ckpt, own: bool = False) -> None:
        """Store the state ``ckpt`` (the codec's state object, or a component dict) in ``slot``
        (the slot becomes cache-owned bytes): each spec component ``dtype[*shape]`` on the pool's
        device, a copy unless ``own``.

        ``own=True``: the caller hands the state over: nothing writes its tensors again (the
        engine's checkpoints captured in a forward, which returns every capture in storage of its
        own and never modifies a state in place). Components already of the spec's dtype and on
        the pool's device are then kept as they are; the others are converted (a copy).

        Raises:
            ValueError: a tensor-backed pool given no state, or a state missing a spec component
                or holding one of another shape (naming the component and both shapes).
        """
        if self._held is not None:
            self.put(slot, self.prepare(ckpt, own))

    def prepare(self, ckpt, own: bool = False) -> dict[str, torch.Tensor] | None:
        """The components :meth:`write` would store for ``ckpt`` (``None`` for a bookkeeping-only
        pool), checked against the spec before any slot is touched: a caller validates a state
        with it before evicting anything to make room (then :meth:`put`).

        Raises:
            ValueError: as :meth:`write`.
        """
        if self._held is None:
            return None
        if ckpt is None:
            raise ValueError("a tensor-backed checkpoint pool needs checkpoint tensors")
        parts = self.codec.encode(ckpt) if self.codec is not None else ckpt
        held, device = {}, self.device
        for comp, dtype, shape in self._layout:
            t = parts.get(comp)
            if t is None:
                raise ValueError(f"checkpoint state has no component {comp!r} (the spec's: "
                                 f"{[c for c, _, _ in self._layout]})")
            if t.shape != shape:
                raise ValueError(f"checkpoint component {comp!r} has shape {tuple(t.shape)}, "
                                 f"the spec's is {tuple(shape)}")
            if not own or t.dtype != dtype or t.device != device:
                t = t.to(device=device, dtype=dtype, copy=True)
            held[comp] = t
        return held

    def put(self, slot: int, held: dict[str, torch.Tensor] | None) -> None:
        """Store components from :meth:`prepare` in ``slot`` (a slot from :meth:`take_free`)."""
        if self._held is not None:
            self._held[slot] = held

    def held(self, slot: int) -> dict[str, torch.Tensor] | None:
        """The components ``slot`` holds (the pool's own tensors: read only), or ``None`` for a
        free slot or a bookkeeping-only pool."""
        return self._held[slot] if self._held is not None else None

    def _freed(self, i: int) -> None:
        if self._held is not None:
            self._held[i] = None                # the slot's bytes go with it
        super()._freed(i)

    def publish(self, slot: int, boundary: int = 0, owner=None, key: bytes | None = None) -> None:
        """Mark a written slot published (attached to an index node); it becomes evictable.

        ``boundary`` (tokens) is the prefill a hit on it saves (C of the value score) and
        its depth; ``owner`` the namespace whose quota it counts against; ``key`` the chained
        hash of the unit ending at ``boundary`` (its content, for the value order's shadows)."""
        self.published[slot] = True
        self.order.describe(slot, self.slot_bytes or 1, boundary, boundary, owner, key)
        self.order.add(slot)

    def read(self, slot: int, boundary: int):
        """A private copy of the state in ``slot`` at ``boundary`` (tokens): the codec's state
        object, or a component dict without a codec; ``None`` when tensor-less.

        Raises:
            RuntimeError: a tensor-backed slot that holds no state (free, or never written).
        """
        if self._held is None:
            return None
        held = self._held[slot]
        if held is None:
            raise RuntimeError(f"checkpoint slot {slot} holds no state")
        if self.codec is not None:                  # the codec copies what it keeps (StateCodec)
            return self.codec.decode(dict(held), boundary)
        return {comp: t.clone() for comp, t in held.items()}

    def _cached(self, slot: int) -> bool:
        return self.published[slot]

    def unpublish(self, slot: int) -> None:
        """Detach a slot from the index; it is freed once unreferenced."""
        self.published[slot] = False
        if self.refcount[slot] == 0:
            self._freed(slot)

    def check_invariants(self) -> None:
        """Every slot is free, evictable or referenced; raise ``AssertionError`` otherwise."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate slot in free queue"
        for s in range(self.num_slots):
            rc, pub = self.refcount[s], self.published[s]
            assert rc >= 0, f"slot {s}: negative refcount"
            assert (s in self.order) == (pub and rc == 0), f"slot {s}: evictable membership wrong"
            if s in free:
                assert not pub and rc == 0, f"slot {s}: free but in use"


_UNDESCRIBED = ("", 1.0)
"""``(label, saving)`` the :class:`UtilityOrder` ranks an item by that was never described."""

SHADOWED = "shadowed"
"""Label of a checkpoint the :class:`UtilityOrder` ranks as unused again: a request resumed from
it and placed a checkpoint above it, with no branch between the two (:meth:`UtilityOrder.shadow`)."""

EXPIRED = "expired"
"""Label of a conversation tail the :class:`UtilityOrder` ranks as past its return: never hit, and
older, in its group's tails, than every return its group has had (:meth:`UtilityOrder.mark`)."""

SHARED_TAIL_HITS = 2
"""Hits after which a conversation tail counts as shared: without a host tier, the ``utility`` order
keeps such a tail when the conversation's next turn would retire it (``supersede``), ranked as a
``branch`` (:meth:`UtilityOrder.relabel`): a first turn's tail that ended on a tenant's system
prompt or a shared document, which other conversations resume from too."""

EXPIRY_MIN_RETURNS = 19
"""Returns a tail group must have had before its own largest return gap expires its tails (until
then the largest gap of any group does): after ``n`` returns, the chance that the next one comes
later than all of them is ``1 / (n + 1)``, at most 5% from 19 on."""


class UtilityOrder(EvictionOrder):
    """Eviction order of the device checkpoint pool by expected saving (``checkpoint_eviction="utility"``).

    GreedyDual-Size-Frequency (Cherkasova, 1998) with the two inputs a checkpoint cache knows:
    the *saving* of a checkpoint, the tokens a hit on it saves over the next checkpoint below it
    on its path when it was placed (Marconi's FLOPs saved, Pan et al. 2025, linear in tokens here),
    and its expected uses: the hits it has had, or, before its first hit, the share of checkpoints
    placed under the same label (``tail``, ``branch``, ``interval``, ...) that have been hit at
    least once, ``(used + 1) / (placed + 2)``, learned online. A member's priority is
    ``floor + uses * saving``; the victim is the member of lowest priority; ``floor`` rises to
    each victim's priority, so an entry not used for a while falls below newer ones (recency).
    All checkpoints are the same size, so bytes do not enter the priority.

    What it learns per label replaces a fixed probation for speculative checkpoints: where
    ``interval`` checkpoints are seldom used (a conversation trace) they go first, where later
    requests do resume from them (a hot set of long contexts) they stay.

    Conversation tails marked with a *group* (the checkpoint their conversation's first turn
    resumed from, inherited by its later tails: a tenant's system prompt, a shared document)
    expire: each group counts the tails placed in it (its clock) and learns, from the tails that
    were hit (or, once evicted, that a request went past, :meth:`resumed`), the largest *return
    gap*: tails placed in the group between a tail and the request that came back to it. A
    never-hit tail older than that, in its group's clock, is relabelled :data:`EXPIRED` and ranks
    by that label's learned use share from then on (its priority never rises by it). The gap is
    its group's own once the group has had :data:`EXPIRY_MIN_RETURNS` returns, before that the
    largest of any group (once all groups together have had that many). A group's clock runs at its own traffic's pace, so a tenant with many
    conversations expires its abandoned ones after as many of its own turns as a quiet tenant.
    Evicted never-hit tails are remembered by content key (*ghosts*, as many as the pool has
    slots, the oldest dropped first), so a return after an eviction still teaches the gap and
    counts as a use of :data:`EXPIRED` where the tail had expired.

    :meth:`mark` tells the order a slot's label and saving before the pool describes it
    (:meth:`CheckpointPool.publish`); unmarked items count as label ``""`` with the described
    ``cost`` (tokens) as their saving. Victims by owner (quotas) scan the members: O(members).
    """

    name = "utility"

    def __init__(self, ghosts: int = 0) -> None:
        """``ghosts``: how many evicted never-hit tails to remember (the pool's slots); the order
        keeps the records of at most ``2 * ghosts`` tail groups when ``ghosts`` > 0 (see
        :meth:`_place`; 0: no ghosts and no bound, for an order used outside a pool)."""
        super().__init__()
        self.floor = 0.0                                     # priority of the last victim (GDS's L)
        self._prio: dict[Hashable, float] = {}               # member -> priority
        self._heap: list[tuple[float, int, Hashable]] = []   # (priority, seq, item); stale entries skipped
        self._seq = 0
        self._pending: dict[Hashable, tuple] = {}           # item -> (label, saving, group) before describe
        self._what: dict[Hashable, tuple[str, float]] = {}       # described item -> (label, saving)
        self.placed: dict[str, int] = {}                     # label -> checkpoints described
        self.used: dict[str, int] = {}                       # label -> of those, hit at least once
        # tail expiry: group -> its record [clock (tails placed), returns, largest return gap,
        # deque of (tick, item), not purged]; tails and ghosts point at the record itself
        self._groups: dict[Hashable, list] = {}
        self._born: dict[Hashable, tuple[list, int, bytes | None]] = {}   # unhit grouped tail -> (record, tick, key)
        self._group: dict[Hashable, Hashable] = {}           # described grouped tail -> its group
        self.max_gap = -1                                    # largest return gap of any group (-1: none yet)
        self.returns = 0                                     # returns of every group
        self.ghosts: dict[bytes, tuple[list, int, bool]] = {}   # content key -> (group record, tick, expired)
        self._ghost_cap = ghosts
        self._group_cap = 2 * ghosts if ghosts > 0 else None   # tail groups kept (least recently placed into go)
        self._purging = False                                # forget() inside purging(): no ghost

    def mark(self, item: Hashable, label: str, saving: float, group: Hashable | None = None) -> None:
        """The next :meth:`describe` of ``item`` is a checkpoint placed by ``label`` saving
        ``saving`` tokens over the checkpoint below it; ``group``: a conversation tail's group
        (its tails expire, see the class notes; ``None``: never expires)."""
        self._pending[item] = (label, float(saving), group)

    def group_of(self, item: Hashable) -> Hashable | None:
        """The group tail ``item`` was placed in (``None``: none)."""
        return self._group.get(item)

    def _place(self, item: Hashable, group: Hashable, key: bytes | None) -> None:
        """A tail placed in ``group``: tick its clock, then expire its tails past the gap.

        The groups are kept in the order they were last placed into, at most ``2 * ghosts`` of
        them (a pool of ``ghosts`` slots holds tails of at most that many groups, and as many
        ghosts): past that the least recently placed into is forgotten (its tails still in the
        pool no longer expire, a return to one still counts in :attr:`returns` and
        :attr:`max_gap`; a later tail of the group starts a new record), so the order's memory
        stays bounded by the pool's size over a run of any length."""
        groups = self._groups
        st = groups.pop(group, None)
        if st is None:
            st = [0, 0, -1, deque(), True]
            if self._group_cap is not None and len(groups) >= self._group_cap:
                del groups[next(iter(groups))]
        groups[group] = st
        st[0] += 1
        tick, born, q = st[0], self._born, st[3]
        born[item] = (st, tick, key)
        self._group[item] = group
        q.append((tick, item))
        gap = (st[2] if st[1] >= EXPIRY_MIN_RETURNS
               else self.max_gap if self.returns >= EXPIRY_MIN_RETURNS else -1)
        while q:
            t0, it = q[0]
            b = born.get(it)
            if b is not None and b[1] == t0 and b[0] is st:
                if gap < 0 or tick - t0 <= gap:
                    break
                self._expire(it)
            q.popleft()

    def _expire(self, item: Hashable) -> None:
        """``item`` (a never-hit tail) is past every return of its group: it ranks by
        :data:`EXPIRED`'s share from now on, never above its priority before."""
        label, saving = self._what[item]
        self._what[item] = (EXPIRED, saving)
        self.placed[EXPIRED] = self.placed.get(EXPIRED, 0) + 1
        old = self._prio.get(item)
        if old is not None:
            p = min(old, self.floor + self.use_share(EXPIRED) * saving)
            self._prio[item] = p
            self._seq += 1
            heapq.heappush(self._heap, (p, self._seq, item))

    def _returned(self, st: list, tick: int) -> None:
        """A tail placed at ``tick`` of the clock of the group whose record is ``st`` was come
        back to (nothing is learned from a purged group)."""
        if not st[4]:
            return
        gap = st[0] - tick
        st[1] += 1
        self.returns += 1
        if gap > st[2]:
            st[2] = gap
        if gap > self.max_gap:
            self.max_gap = gap

    def resumed(self, key: bytes) -> None:
        """A request went past the boundary of content ``key``: if it was an evicted never-hit
        tail (a ghost), its group learns the return (and an expired one counts as a use of
        :data:`EXPIRED`)."""
        g = self.ghosts.pop(key, None)
        if g is not None:
            self._returned(g[0], g[1])
            if g[2]:
                self.used[EXPIRED] = self.used.get(EXPIRED, 0) + 1

    def shadow(self, item: Hashable, above: Hashable) -> None:
        """``above``, a checkpoint just placed over ``item`` with no branch between them, now takes
        every use ``item`` had: ``item`` counts as a checkpoint placed by label ``shadowed`` that
        has not been hit (its hits restart at 0; it ranks by that label's learned share), and
        ``above`` saves ``item``'s saving more (a hit on ``above`` saves what a hit on ``item``
        would, plus its own). Items not described are left as they are."""
        what, up = self._what.get(item), self._what.get(above)
        if what is None or up is None:
            return
        self._unused_as(item, SHADOWED, what[1])
        self._what[above] = (up[0], up[1] + what[1])
        for i in (item, above):
            if i in self._prio:
                self._push(i)

    def relabel(self, item: Hashable, label: str) -> None:
        """``item`` is kept from now on as a checkpoint placed by ``label`` that has not been hit
        (a shared conversation tail kept past ``supersede``, :data:`SHARED_TAIL_HITS`): its hits
        restart at 0, it ranks by ``label``'s learned share, and it leaves its tail group (it no
        longer expires). Its saving is unchanged. Items not described are left as they are."""
        what = self._what.get(item)
        if what is None:
            return
        self._unused_as(item, label, what[1])
        if item in self._prio:
            self._push(item)

    def _unused_as(self, item: Hashable, label: str, saving: float) -> None:
        """``item`` counts from now on as a checkpoint placed by ``label`` saving ``saving``
        tokens that has not been hit (its hits back to 0), out of its tail group."""
        self._what[item] = (label, saving)
        self._born.pop(item, None)
        self._group.pop(item, None)
        self.placed[label] = self.placed.get(label, 0) + 1
        info = self.info.get(item)
        if info is not None:
            info.hits = 0

    def use_share(self, label: str) -> float:
        """Share of ``label``'s checkpoints hit at least once, ``(used + 1) / (placed + 2)``."""
        return (self.used.get(label, 0) + 1) / (self.placed.get(label, 0) + 2)

    def describe(self, item: Hashable, nbytes: int = 1, cost: float = 1.0, depth: int = 0,
                 owner: Hashable | None = None, key: bytes | None = None) -> None:
        """As :meth:`EvictionOrder.describe`; takes the label and saving :meth:`mark` gave."""
        EvictionOrder.describe(self, item, nbytes, cost, depth, owner, key)
        pending = self._pending.pop(item, None)
        label, saving, group = pending if pending is not None else ("", float(cost), None)
        self._what[item] = (label, saving)
        placed = self.placed
        placed[label] = placed.get(label, 0) + 1
        if group is not None:
            self._place(item, group, key)

    def forget(self, item: Hashable) -> None:
        """The item's content is gone."""
        EvictionOrder.forget(self, item)
        what = self._what.pop(item, None)
        self._pending.pop(item, None)
        self._group.pop(item, None)
        b = self._born.pop(item, None)
        if b is not None and b[2] is not None and self._ghost_cap and not self._purging:
            ghosts = self.ghosts
            ghosts.pop(b[2], None)
            ghosts[b[2]] = (b[0], b[1], what is not None and what[0] == EXPIRED)
            if len(ghosts) > self._ghost_cap:
                del ghosts[next(iter(ghosts))]

    @contextmanager
    def purging(self, keys: Iterable[bytes]) -> Iterator[None]:
        """A purge (not an eviction) removes entries inside the block: an item forgotten there
        becomes no ghost, and afterwards the ghosts and groups keyed by ``keys`` (the content keys
        of the removed index nodes) are dropped, so the order keeps nothing of what was purged and
        the same prompt sent again teaches no return."""
        self._purging = True
        try:
            yield
        finally:
            self._purging = False
            ghosts, groups = self.ghosts, self._groups
            for k in keys:
                ghosts.pop(k, None)
                st = groups.pop(k, None)
                if st is not None:
                    st[4] = False

    def priority(self, item: Hashable) -> float:
        """``floor + uses * saving`` for ``item`` now (uses: its hits, or its label's use share)."""
        info = self.info.get(item)
        return self._priority(item, info.hits if info is not None else 0)

    def _priority(self, item: Hashable, hits: int) -> float:
        """:meth:`priority` of ``item`` with ``hits`` counted hits."""
        label, saving = self._what.get(item, _UNDESCRIBED)
        if hits:
            return self.floor + hits * saving
        return self.floor + self.use_share(label) * saving

    def _push(self, item: Hashable, hits: int | None = None) -> None:
        """Take ``item``'s priority now (``hits``: its counted hits, when the caller has them)."""
        if hits is None:
            info = self.info.get(item)
            hits = info.hits if info is not None else 0
        p = self._priority(item, hits)
        prio = self._prio
        prio[item] = p
        self._seq += 1
        heapq.heappush(self._heap, (p, self._seq, item))
        if len(self._heap) > 4 * len(prio) + 1024:           # rebuild without the stale entries
            self._heap = [e for e in self._heap if prio.get(e[2]) == e[0]]
            latest: dict[Hashable, tuple] = {}
            for e in self._heap:                             # equal priorities: keep the latest push
                if e[2] not in latest or e[1] > latest[e[2]][1]:
                    latest[e[2]] = e
            self._heap = list(latest.values())
            heapq.heapify(self._heap)

    def add(self, item: Hashable) -> None:
        """``item`` became evictable; its priority is taken now (a refresh when re-added)."""
        info = self.info.get(item)
        if info is None:
            info = self._info(item)
        self._push(item, info.hits)

    def discard(self, item: Hashable) -> None:
        self._prio.pop(item, None)

    def hit(self, item: Hashable, count: bool = True) -> None:
        """A use: counted ones add a hit (the first counts its label as used); a member's
        priority is taken again."""
        info = self._info(item)
        if count:
            if not info.hits:
                label = self._what.get(item, ("", 0.0))[0]
                self.used[label] = self.used.get(label, 0) + 1
                b = self._born.pop(item, None)
                if b is not None:
                    self._returned(b[0], b[1])
            info.hits += 1
        if item in self._prio:
            self._push(item, info.hits)

    def victim(self, owner: Hashable | None = None) -> Hashable | None:
        """The member of lowest priority (of ``owner`` when given), or ``None``."""
        if owner is not None:
            own = [(p, i) for i, p in self._prio.items() if self.info[i].owner == owner]
            return min(own, key=lambda e: e[0])[1] if own else None
        heap, prio = self._heap, self._prio
        while heap:
            p, _, item = heap[0]
            if prio.get(item) == p:
                return item
            heapq.heappop(heap)
        return None

    def evicted(self, item: Hashable) -> None:
        """``item`` is evicted: the floor rises to its priority."""
        p = self._prio.get(item)
        if p is not None and p > self.floor:
            self.floor = p

    def __contains__(self, item: Hashable) -> bool:
        return item in self._prio

    def __len__(self) -> int:
        return len(self._prio)

    def __iter__(self):
        return iter(sorted(self._prio, key=self._prio.__getitem__))
