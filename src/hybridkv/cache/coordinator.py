"""Joint matching and the request-facing cache API (DESIGN §2-4, §8).

The coordinator owns the index and both device pools. It answers lookups with
a :class:`MatchResult` (joint hit, per-group hits, branching boundary; the rule
is :func:`hybridkv.cache.groups.joint_hit` over the matched path, :class:`PathPresence`), gives a request its pages and
working state (:meth:`acquire`), publishes what the request computed in one call
(:meth:`publish`, which also retires superseded tail checkpoints) and takes
everything back (:meth:`release`). It never reports a joint hit that lacks a
part: the joint hit is a node on the matched path that has both its page chain
and its checkpoint. Lower tiers hear of evictions through the ``on_evict``
callback given at construction and read device state through
:meth:`read_checkpoint` / :meth:`checkpoint_at`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from operator import attrgetter

from hybridkv.cache.config import CacheConfig
from hybridkv.cache.groups import KIMI_LINEAR, Family, joint_hit, reuse_cap
from hybridkv.cache.index import BlockNode, PrefixIndex
from hybridkv.cache.namespace import (
    bind_namespace,
    chain_payloads,
    PeriodicMemo,
    chain_periodic,
    chained_block_hashes,
)
from hybridkv.cache.pools import SHADOWED, SHARED_TAIL_HITS, CheckpointPool, PagePool, UtilityOrder
from hybridkv.store.eviction import ProbationOrder

if TYPE_CHECKING:                      # the model's state type, named in annotations only
    from hybridkv.model.state import KDACheckpoint

_page_of = attrgetter("page")      # a node's page, read in C over a path (lookup, acquire)

CopyPage = Callable[[int, int, int], None]
"""``copy_page(src_page, dst_page, num_tokens)`` copies KV latents of the first tokens."""

TAIL = "tail"
"""Label of tail checkpoints (the policy term), the ones ``supersede`` retires."""
BRANCH = "branch"
"""Label of branch checkpoints (the policy term), and of a shared tail kept past ``supersede``
under the ``utility`` order without a lower tier (:meth:`HybridCacheCoordinator.publish`)."""
LEAD = "lead"
"""Label of a lead checkpoint: one block past where a request's new content begins (its KV hit),
placed under the ``utility`` order without a lower tier (:attr:`MatchResult.lead`)."""
INSTALLED = "installed"
"""Label of a checkpoint installed from a lower tier (a promotion), for the ``utility`` order."""
PROBATION_LABELS = frozenset({"interval"})
"""Policy terms whose checkpoints start on probation under ``CacheConfig.checkpoint_probation``:
placed on speculation (a boundary no request has reached twice), unlike ``branch`` (where traffic
already branched), ``tail`` (where a conversation's next turn resumes) and ``hint`` (named by the
caller)."""


class PathPresence:
    """:class:`~hybridkv.cache.groups.Presence` over a matched index path (the device's entries of a
    prompt): every prefix group of the family is held on every node of the path (they share one
    page per block, and a walk stops at the first unit without one), every boundary group where a
    node holds a checkpoint slot (one slot per boundary: the family's one boundary group's state).

    Args:
        path: index nodes of units ``1 .. len(path)`` from the root.
        unit: ``prefix_match_unit`` in tokens.
        family: the model family (default Kimi Linear: ``full`` paged, ``kda`` checkpoints).
    """

    __slots__ = ("path", "unit", "family")

    def __init__(self, path: list[BlockNode], unit: int, family: Family = KIMI_LINEAR) -> None:
        self.path, self.unit, self.family = path, unit, family

    def prefix_run(self, group: str, limit: int) -> int:
        if group not in self.family.prefix_names:
            raise KeyError(f"the device index holds no prefix group {group!r}")
        return min(len(self.path), limit // self.unit) * self.unit

    def deepest_state(self, group: str, at_most: int) -> int:
        if group not in self.family.names or self.family.spec(group).prefix_closed:
            raise KeyError(f"the device index holds no boundary group {group!r}")
        path = self.path
        k = min(len(path), at_most // self.unit)
        while k and path[k - 1].checkpoint is None:
            k -= 1
        return k * self.unit


@dataclass(frozen=True, slots=True)
class EvictedEntry:
    """Device state about to be evicted, as the ``on_evict`` callback sees it.

    Attributes:
        key: chained hash of ``[0, end)``.
        parent_key: chained hash of ``[0, end - block_size)``; ``None`` when
            ``end <= block_size``.
        end: boundary in tokens.
        page: the page whose KV goes (``None``: only the checkpoint goes).
        checkpoint: slot of ``C(P_end)`` that goes with it, or ``None``; readable
            through :meth:`HybridCacheCoordinator.read_checkpoint` during the callback.
        owner: request namespace digest it was cached under (``None``: unknown).
    """

    key: bytes
    parent_key: bytes | None
    end: int
    page: int | None
    checkpoint: int | None
    owner: bytes | None = None


EvictCallback = Callable[[list[EvictedEntry]], None]


@dataclass(slots=True)
class PublishResult:
    """What one :meth:`HybridCacheCoordinator.publish` call did.

    Attributes:
        created: ``(boundary, label)`` of each checkpoint published now.
        skipped: boundaries (tokens) whose checkpoint was not published: one
            existed there already, or no slot could be freed.
        superseded: older tail checkpoints retired by a new one (``supersede`` policy).
        retired: boundaries (tokens) of those retired checkpoints, one per ``superseded``.
    """

    created: list[tuple[int, str]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    superseded: int = 0
    retired: list[int] = field(default_factory=list)


@dataclass(slots=True)
class MatchResult:
    """Result of one lookup (all lengths in tokens).

    Attributes:
        hit: joint hit — tokens whose KV *and* checkpoint are reusable.
        kv_hit: contiguous full-attention hit (capped at ``T - 1`` aligned).
        checkpoint_hit: deepest checkpoint boundary ``<= kv_hit`` (0 = none).
        branching_boundary: ``kv_hit`` when it exceeds ``checkpoint_hit``, else ``None``.
        per_group: group name -> its own hit.
        hashes: chained hashes of every whole unit of the prompt.
        path: matched index nodes, one per unit, up to ``kv_hit``.
        namespace: the request's namespace digest (the engine's when it gave none), before
            binding: the owner of what the request publishes, for quotas and purges.
        restart: where computation resumes (``<= hit``; ``None`` given: ``hit``): ``[restart, hit)``
            is recomputed to rebuild the boundary state at ``hit`` (its prefix groups' entries are
            cached), from the state saved at ``restart`` (or the zero state at 0, or, when no
            state is saved there, the raw tokens: a recompute cone).
        lead: boundary (tokens) for a lead checkpoint, the first ``block_size`` boundary past
            ``kv_hit`` (where the request's own content begins), or ``None``: set by the
            ``utility`` order without a lower tier (:meth:`HybridCacheCoordinator.lookup`);
            :func:`~hybridkv.engine.scheduler.plan_captures` places it (label :data:`LEAD`).
    """

    hit: int
    kv_hit: int
    checkpoint_hit: int
    branching_boundary: int | None
    per_group: dict[str, int]
    hashes: list[bytes]
    path: list[BlockNode]
    namespace: bytes | None = None
    restart: int | None = None
    lead: int | None = None

    def __post_init__(self) -> None:
        if self.restart is None:
            self.restart = self.hit


@dataclass(slots=True)
class Allocation:
    """What a running request holds. Each page in ``block_table`` carries one reference.

    Attributes:
        block_table: page ids; entry ``k`` holds positions ``[k*B, (k+1)*B)``.
        state: private working KDA state at ``start`` (``None``: zeros / simulation).
        start: tokens already present (the joint hit).
        nodes: index nodes published (or matched) for this request's units, in order.
        owner: namespace digest its new entries are cached under (``MatchResult.namespace``).
    """

    block_table: list[int]
    state: KDACheckpoint | None
    start: int
    nodes: list[BlockNode] = field(default_factory=list)
    owner: bytes | None = None


class HybridCacheCoordinator:
    """Index + page pool + checkpoint pool + group agreement.

    Args:
        config: validated cache config.
        namespace: namespace digest; every hash is salted with it.
        checkpoints: the checkpoint pool (tensor-backed or bookkeeping-only).
        page_bytes: bytes of one KV page (metrics).
        copy_page: KV copy hook for partial-page copy-on-write (``None`` in simulation).
        on_evict: called with the :class:`EvictedEntry` list of state about to be
            evicted (LRU), before anything is freed; lower tiers use it for
            write-back. ``None``: nobody listens.
        binding: what the compute backend's state depends on (its
            ``cache_binding()``: weights digest and state layout); every
            namespace, the engine's and per-request ones, is bound to it before
            hashing (:func:`~hybridkv.cache.namespace.bind_namespace`).
        clock: seconds (default ``time.time``); stamps index nodes for purges by age.
        family: the model family whose joint-hit rule lookups follow
            (:func:`~hybridkv.cache.groups.joint_hit`; its groups are ``full`` and ``kda``).

    :attr:`lower_tiers` (``False`` until the engine sets it): a lower tier takes this cache's
    evicted checkpoints (write-back).

    Eviction follows ``config.eviction`` (both pools; the checkpoint pool is built with the
    same policy by the backend); without ``config.tenant_quota`` an ``lru`` page pool keeps no
    page descriptions (:class:`~hybridkv.store.eviction.RecencyOrder`, the same victims).
    With ``config.tenant_quota`` a namespace whose cached bytes in a pool exceed that fraction
    of the pool evicts its own entries first.
    """

    def __init__(self, config: CacheConfig, namespace: bytes, checkpoints: CheckpointPool,
                 page_bytes: int = 0, copy_page: CopyPage | None = None,
                 on_evict: EvictCallback | None = None, binding: bytes = b"",
                 clock: Callable[[], float] = time.time, family: Family = KIMI_LINEAR) -> None:
        self.config = config
        self.family = family
        self.namespace = namespace
        self.clock = clock
        # pages described only where quotas read them: an lru pool without quotas ranks by recency alone
        self.pages = PagePool(config.num_kv_pages, config.eviction, page_bytes, config.block_size,
                              described=config.tenant_quota is not None)
        self.checkpoints = checkpoints
        self._probation = None
        if config.checkpoint_probation is not None:       # speculative (interval) checkpoints on probation
            if len(checkpoints.order):
                raise ValueError("checkpoint_probation needs an empty checkpoint pool")
            self._probation = checkpoints.order = ProbationOrder(checkpoints.num_slots, config.checkpoint_probation)
        self._utility: UtilityOrder | None = None
        if config.checkpoint_eviction == "utility":       # expected saving: uses x tokens over the one below
            if len(checkpoints.order):
                raise ValueError("checkpoint_eviction needs an empty checkpoint pool")
            self._utility = checkpoints.order = UtilityOrder(ghosts=checkpoints.num_slots)
        self._below: dict[int, int] = {}      # slot -> boundary of the checkpoint below it when placed (utility)
        self.index = PrefixIndex(config.prefix_match_unit, self.pages, checkpoints)
        self.page_bytes = page_bytes
        self.copy_page = copy_page
        self.kv_pages_peak = 0
        self.checkpoints_peak = 0
        self.evicted_pages = 0
        self.evicted_checkpoints = 0
        self.labels: dict[int, str] = {}      # slot -> policy that created it (valid while published)
        self._on_evict = on_evict
        # set by the engine: a lower tier takes this cache's evicted checkpoints (write-back)
        self.lower_tiers = False
        self.binding = binding
        self._bound: dict[bytes, bytes] = {}   # namespace -> bound namespace
        self._last_lookup: tuple | None = None  # (namespace, length, last unit hash) of the last touching lookup

    # -- lookup ----------------------------------------------------------
    def hash_prompt(self, token_ids, namespace: bytes | None = None) -> list[bytes]:
        """Chained hashes of every whole ``prefix_match_unit`` of ``token_ids``.

        ``namespace`` overrides the engine's namespace digest (per-request
        tenant or adapter); different namespaces never share a hash.
        """
        ns = namespace or self.namespace
        bound = self._bound.get(ns)
        if bound is None:
            bound = self._bound[ns] = bind_namespace(ns, self.binding)
        return chained_block_hashes(bound, token_ids, self.config.prefix_match_unit)

    def chain_units(self, payloads: list[bytes], namespace: bytes | None = None) -> list[bytes]:
        """Chained hashes ``h_i = SHA256(h_{i-1} || namespace || payloads[i])`` (the rule of
        :meth:`hash_prompt`) over caller-made unit payloads instead of token bytes.

        For prompts whose tokens are a known function of a shorter description (a trace's
        synthetic blocks: :func:`hybridkv.replay.trace.unit_payloads`): each payload must fix
        its unit's token ids exactly, so equal payload chains mean equal prefixes. Payload
        lengths are never a multiple of 8, so no payload equals a unit's token bytes
        (``int64``, 8 bytes a token).

        Raises:
            ValueError: a payload whose length is a multiple of 8 (naming its index and length).
        """
        ns = namespace or self.namespace
        bound = self._bound.get(ns)
        if bound is None:
            bound = self._bound[ns] = bind_namespace(ns, self.binding)
        return chain_payloads(bound, payloads)

    def chain_periodic_units(self, heads: list[bytes], tails: list[bytes], n: int,
                             namespace: bytes | None = None, memo: PeriodicMemo | None = None) -> list[bytes]:
        """:meth:`chain_units` over the ``n`` payloads ``heads[i % len(heads)] + tails[i // len(heads)]``
        without making them (:func:`~hybridkv.cache.namespace.chain_periodic`): the same hashes,
        through ``memo`` (from :meth:`periodic_memo` with the same heads and namespace) when given.

        Raises:
            ValueError: as :func:`~hybridkv.cache.namespace.chain_periodic`.
        """
        ns = namespace or self.namespace
        bound = self._bound.get(ns)
        if bound is None:
            bound = self._bound[ns] = bind_namespace(ns, self.binding)
        return chain_periodic(bound, heads, tails, n, memo)

    def periodic_memo(self, heads: list[bytes], namespace: bytes | None = None) -> PeriodicMemo:
        """An empty :class:`~hybridkv.cache.namespace.PeriodicMemo` for :meth:`chain_periodic_units`
        with these ``heads`` under ``namespace`` (default this cache's)."""
        ns = namespace or self.namespace
        bound = self._bound.get(ns)
        if bound is None:
            bound = self._bound[ns] = bind_namespace(ns, self.binding)
        return PeriodicMemo(bound, heads)

    def lookup(self, token_ids, namespace: bytes | None = None, touch: bool = True,
               hashes: list[bytes] | None = None) -> MatchResult:
        """Joint hit for a prompt of ``T = len(token_ids)`` tokens.

        At most ``T - 1`` tokens are reused, rounded down to a unit boundary,
        so the last prompt position is always computed. ``touch=False`` leaves
        the LRU order as it is (a peek, e.g. for a prefetch). A lookup repeating the last
        touching one (same namespace and prompt) with no :meth:`acquire` between is the same
        request waiting for admission: it refreshes the matched entries without counting
        another use (:meth:`hybridkv.store.eviction.EvictionOrder.hit`). ``hashes``: the prompt's
        chained unit hashes when the caller has them already (from :meth:`hash_prompt` or
        :meth:`chain_units` with the same ``namespace``, one per whole unit of the prompt);
        ``None``: hashed here.

        Raises:
            ValueError: ``hashes`` is not one hash per whole unit of the prompt (naming both counts).
        """
        g = self.config.prefix_match_unit
        if hashes is None:
            hashes = self.hash_prompt(token_ids, namespace)
        elif len(hashes) != len(token_ids) // g:
            raise ValueError(f"{len(hashes)} unit hashes given for a prompt of {len(token_ids)} tokens "
                             f"({len(token_ids) // g} whole units of {g})")
        limit = reuse_cap(len(token_ids), g)
        path = self.index.walk(hashes[: limit // g])
        joint = joint_hit(self.family, PathPresence(path, g, self.family), limit)
        kv_hit, hit, restart = joint.kv_hit, joint.hit, joint.restart
        if touch:   # the same prompt looked up again before any admission: the same request waiting, one use
            key = (namespace or self.namespace, len(token_ids), hashes[-1] if hashes else b"")
            count, self._last_lookup = key != self._last_lookup, key
            # each page once, deepest first: the root end is the most recent
            self.pages.touch_many(dict.fromkeys(map(_page_of, reversed(path))), count)
            slot = self._state_slot(path, restart)            # the state a hit resumes from
            if slot is not None:
                self.checkpoints.touch(slot, count)
        lead = None
        if self._utility is not None and not self.lower_tiers:   # one block past where its own content begins
            b = self.config.block_size
            lead = (kv_hit // b + 1) * b
        return MatchResult(hit=hit, kv_hit=kv_hit, checkpoint_hit=hit,
                           branching_boundary=joint.branching_boundary,
                           per_group=joint.per_group, hashes=hashes, path=path,
                           namespace=namespace or self.namespace, restart=restart, lead=lead)

    def _state_slot(self, path: list[BlockNode], boundary: int) -> int | None:
        """The checkpoint slot saved at ``boundary`` on ``path`` (``None``: none there, at 0, or a
        boundary off the unit grid, e.g. a recompute cone's restart point)."""
        g = self.config.prefix_match_unit
        if boundary <= 0 or boundary % g or boundary // g > len(path):
            return None
        return path[boundary // g - 1].checkpoint

    def shorter_hits(self, match: MatchResult) -> list[MatchResult]:
        """Matches that reuse less than ``match``, deepest first: each checkpointed boundary of
        its path below the joint hit, then no hit at all. An admission that cannot place the
        full hit (its partial page must be copied while the pool is full) tries these before
        refusing. ``kv_hit`` is kept, so the branching boundary still gets its checkpoint."""
        g = self.config.prefix_match_unit
        out = []
        presence, hit = PathPresence(match.path, g, self.family), match.hit
        while hit:                          # the joint hit under a limit one unit below the last one
            joint = joint_hit(self.family, presence, hit - g)
            hit = joint.hit
            out.append(MatchResult(hit=hit, kv_hit=match.kv_hit, checkpoint_hit=hit,
                                   branching_boundary=match.kv_hit if match.kv_hit > hit else None,
                                   per_group={**match.per_group, **{b: hit for b, _ in self.family.boundary}},
                                   hashes=match.hashes, path=match.path, namespace=match.namespace,
                                   restart=joint.restart, lead=match.lead))
        return out

    def could_fit(self, match: MatchResult, num_tokens: int) -> bool:
        """Whether ``num_tokens`` positions could get their pages now, counting free pages,
        evictable ones and pages of the hit that other requests hold (shared, not taken).

        Installs from lower tiers add no pages, so a request that does not fit now will not
        fit after loading either: the engine waits instead of loading what would be evicted
        before it runs. The partial-page copy of a hit is not counted (a ``True`` may still
        fail in :meth:`acquire`, never the other way round).
        """
        g = self.config.prefix_match_unit
        rc = self.pages.refcount                    # the hit's distinct pages first (read in C), then their counts
        held = [p for p in dict.fromkeys(map(_page_of, match.path[: match.hit // g])) if rc[p] > 0]
        need = -(-num_tokens // self.config.block_size)
        return need <= self.pages.num_free + self.pages.num_evictable + len(held)

    # -- allocation ------------------------------------------------------
    def acquire(self, match: MatchResult, num_tokens: int) -> Allocation | None:
        """Pages for ``num_tokens`` positions and the working state at ``match.hit``.

        Full pages of the hit are shared read-only (a reference each); a partial
        last page is copied into a private page (copy-on-write); the checkpoint
        is copied into a private working state. Evicts unreferenced entries
        (LRU) when the pool is short.

        Returns:
            The allocation, or ``None`` when the pool cannot hold the request
            (every reference taken here is released again).
        """
        b, g = self.config.block_size, self.config.prefix_match_unit
        self._last_lookup = None                            # admitted: the next lookup is another request's
        hit = match.hit
        path = match.path[: hit // g]
        held = list(dict.fromkeys(map(_page_of, path)))     # every page on the hit path, before any eviction
        self.pages.ref_many(held)
        state, restart = None, match.restart
        slot = self._state_slot(path, restart)
        if slot is not None:                                 # copy the checkpoint out while it is held
            self.checkpoints.ref(slot)
            state = self.checkpoints.read(slot, restart)
            self.checkpoints.unref(slot)
        shared = [path[((k + 1) * b) // g - 1].page for k in range(hit // b)]
        cow_src = path[-1].page if hit % b else None
        try:                                                 # an on_evict failure must not leak `held`
            fresh = self._take_pages(-(-num_tokens // b) - len(shared), match.namespace)
            if fresh is not None and cow_src is not None and self.copy_page is not None:
                self.copy_page(cow_src, fresh[0], hit % b)
            if fresh is not None:
                self.pages.ref_many(shared)                  # the block table's own references
        finally:
            self.pages.unref_many(held)
        if fresh is None:
            return None
        self._note_peaks()
        return Allocation(block_table=shared + fresh, state=state, start=hit, nodes=list(path),
                          owner=match.namespace)

    def _take_pages(self, n: int, owner: bytes | None = None) -> list[int] | None:
        while self.pages.num_free < n:
            victim = self._victim(self.pages, owner)
            if victim is None:
                return None
            self._evict_page(victim)
        return [self.pages.pop_free() for _ in range(n)]

    def _victim(self, pool, owner: bytes | None) -> int | None:
        """The next victim of ``pool``: ``owner``'s own first while it is over its quota."""
        if owner is not None and self.over_quota(pool, owner):
            own = pool.next_victim(owner)
            if own is not None:
                return own
        return pool.next_victim()

    def over_quota(self, pool, owner: bytes) -> bool:
        """Whether ``owner``'s cached bytes in ``pool`` (``self.pages`` or ``self.checkpoints``)
        exceed ``config.tenant_quota`` of the pool's bytes (never, without a quota)."""
        q = self.config.tenant_quota
        if q is None:
            return False
        size = (pool.num_pages * pool.page_bytes if pool is self.pages
                else pool.num_slots * (pool.slot_bytes or 1))
        return pool.order.owner_bytes.get(owner, 0) > q * size

    def enforce_quota(self, owner: bytes | None) -> int:
        """Evict ``owner``'s unreferenced entries (lowest first) until its bytes in each pool fit
        its quota, or nothing of it is evictable; returns entries evicted."""
        n = 0
        if owner is None or self.config.tenant_quota is None:
            return n
        while self.over_quota(self.pages, owner) and (v := self.pages.next_victim(owner)) is not None:
            self._evict_page(v)
            n += 1
        while (self.over_quota(self.checkpoints, owner)
               and (v := self.checkpoints.next_victim(owner)) is not None):
            self._evict_checkpoint(v)
            n += 1
        return n

    def _evict_page(self, victim: int) -> int:
        """Evict ``victim`` and the subtree depending on it; returns index nodes removed."""
        if self._on_evict is not None:
            self._on_evict([self._evicted(n, kv=True) for n in self.index.subtree_nodes(victim)])
        self.pages.order.evicted(victim)
        self.evicted_pages += 1
        return self.index.evict_page(victim)

    def release(self, alloc: Allocation) -> None:
        """Drop every page reference the request holds (finish, cancel, failure).

        Pages are released tail first, so the prefix end of the request's pages
        is the most recently used and an LRU eviction takes leaves before roots.
        """
        self.pages.unref_many(reversed(alloc.block_table))
        self.enforce_quota(alloc.owner)
        alloc.block_table = []
        alloc.nodes = []
        alloc.state = None

    # -- publication -----------------------------------------------------
    def publish(self, alloc: Allocation, hashes: list[bytes], computed: int,
                checkpoints: dict[int, tuple[KDACheckpoint | None, str]]) -> PublishResult:
        """Publish what a request computed: its whole units of ``[0, computed)`` and its checkpoints.

        Each checkpoint goes into a cache-owned slot (which keeps the captured tensors,
        :meth:`_publish_checkpoint`) and is attached at its boundary. With the ``supersede``
        policy, a new ``tail`` checkpoint retires the tail checkpoint the request started from
        (``alloc.start``) if no request holds it.

        Args:
            alloc: the request's allocation.
            hashes: the prompt's chained unit hashes.
            computed: tokens whose KV the request has written.
            checkpoints: boundary (tokens, a multiple of ``prefix_match_unit``,
                ``<= computed``) -> ``(C(P_boundary), label)``; the label is the
                policy that planned it.

        Raises:
            ValueError: a boundary that is not a positive multiple of
                ``prefix_match_unit`` or lies beyond ``computed``.
        """
        g = self.config.prefix_match_unit
        for b in checkpoints:                       # check every boundary before anything changes
            if b <= 0 or b % g:
                raise ValueError(f"checkpoint boundary {b} is not a positive multiple of prefix_match_unit={g}")
            if b > computed:
                raise ValueError(f"checkpoint boundary {b} lies beyond the {computed} computed tokens")
            if b > len(hashes) * g:
                raise ValueError(f"checkpoint boundary {b} lies beyond the prompt's {len(hashes)} whole units")
        self.publish_units(alloc, hashes, computed)
        result = PublishResult()
        below, group, start = 0, None, None
        if self._utility is not None:              # the node it resumed from, found once for the rules below
            start = self._start_node(alloc)
            below, group = self._below_start(alloc, start, checkpoints), self._tail_group(start)
        placed = alloc.start            # the last boundary this request placed a checkpoint at (or its start)
        kept = False                    # the start was a shared tail kept past ``supersede``
        for b in sorted(checkpoints):
            ckpt, label = checkpoints[b]
            # a lead saves over the boundary just below it; the other checkpoints' savings skip leads,
            # which the order evicts first unless a request resumes from one
            ok = self._publish_checkpoint(alloc, hashes, ckpt, b, label, placed if label == LEAD else below,
                                          group if label == TAIL else None)
            placed = b
            if label != LEAD:
                below = b
            if not ok:
                result.skipped.append(b)
                continue
            result.created.append((b, label))
            if label == TAIL and self.config.policy.supersede and not kept:
                kept = self._keep_shared_tail(start)
                if not kept and self.retire_checkpoint(alloc, alloc.start, TAIL):
                    result.superseded += 1
                    result.retired.append(alloc.start)
        if self._utility is not None and result.created:
            firsts = [b for b, label in result.created if label != LEAD]
            if firsts and not kept:         # a kept shared tail: other requests went elsewhere from it
                self._shadow_start(alloc, start, min(firsts))
        if self._utility is not None and self._utility.ghosts:
            self._went_past(alloc, computed)
        return result

    def _keep_shared_tail(self, node: BlockNode | None) -> bool:
        """Under the ``utility`` order without a lower tier (:attr:`lower_tiers`): the tail the
        request resumed from (``alloc.start``), about to be retired by ``supersede``, is shared —
        :data:`~hybridkv.cache.pools.SHARED_TAIL_HITS` hits or more, so other requests resumed
        from it too (a first turn's tail that ended on a tenant's system prompt or a shared
        document) — and is kept: relabelled ``branch``, its hits back to 0, out of its tail group
        (:meth:`UtilityOrder.relabel`). The request's new tail still saves over the boundary below
        it (:meth:`_below_start`). Returns whether it was kept (then nothing is retired)."""
        if node is None or self._utility is None or self.lower_tiers:
            return False
        slot = node.checkpoint
        if (slot is None or node.parent is None or self.labels.get(slot) != TAIL
                or self.checkpoints.refcount[slot] or self._hits(slot) < SHARED_TAIL_HITS):
            return False
        self._utility.relabel(slot, BRANCH)
        self.labels[slot] = BRANCH
        return True

    def _tail_group(self, node: BlockNode | None) -> bytes | None:
        """Under the ``utility`` order: the group of the tail the request places, for tail
        expiry (:class:`UtilityOrder`): the group of the tail it resumed from, or, resuming from
        another checkpoint (a tenant's system prompt, a document), that checkpoint's content key;
        ``None`` (no expiry) when it resumed from nothing or from a tail without a group. Only
        without a lower tier (:attr:`lower_tiers`): with the host tier it measured lower at the
        host cells of the many-tenant trace (docs/results/memory.md)."""
        if node is None or self.lower_tiers:
            return None
        slot = node.checkpoint
        if slot is None or node.parent is None:
            return None
        if self.labels.get(slot) == TAIL:
            return self._utility.group_of(slot)
        return node.key

    def _went_past(self, alloc: Allocation, computed: int) -> None:
        """Under the ``utility`` order: tell it the content keys of the tail boundaries (multiples
        of the tail alignment) the request went past above its start, so an evicted tail a
        conversation came back to still teaches its group's return gap
        (:meth:`UtilityOrder.resumed`)."""
        g = self.config.prefix_match_unit
        a = self.config.policy.tail_alignment or g
        nodes, order = alloc.nodes, self._utility
        ghosts = order.ghosts
        for b in range((alloc.start // a + 1) * a, min(computed, len(nodes) * g) + 1, a):
            key = nodes[b // g - 1].key
            if key in ghosts:
                order.resumed(key)

    def _hits(self, slot: int) -> int:
        """Hits the ``utility`` order has counted on the checkpoint in ``slot``."""
        info = self._utility.info.get(slot)
        return info.hits if info is not None else 0

    def _shadow_start(self, alloc: Allocation, node: BlockNode | None, first: int) -> None:
        """Under the ``utility`` order: the request resumed from a checkpoint other than a tail at
        ``alloc.start`` and placed its lowest new checkpoint at ``first`` (tokens); when no branch
        lies between the two (every node from the start's up to the one below ``first`` has one
        child), every request that has reached the start so far went on to ``first``, so the new
        checkpoint takes over the start's uses (:meth:`UtilityOrder.shadow`): the start ranks as
        unused again and the new one saves the start's saving more. A request that branches
        between them later hits the start, which ranks by its hits again. Only without a lower
        tier (:attr:`lower_tiers`): with the host tier it measured lower on the bundled trace's
        host cells (docs/results/memory.md)."""
        start, g = alloc.start, self.config.prefix_match_unit
        nodes = alloc.nodes
        if node is None or self.lower_tiers or first <= start or len(nodes) < first // g:
            return
        slot, new = node.checkpoint, nodes[first // g - 1].checkpoint
        if (slot is None or new is None or node.parent is None or self.checkpoints.refcount[slot]
                or self.labels.get(slot) == TAIL):
            return
        for k in range(start // g - 1, first // g - 1):
            if nodes[k].many is not None:
                return
        self._utility.shadow(slot, new)
        self.labels[slot] = SHADOWED

    def _start_node(self, alloc: Allocation) -> BlockNode | None:
        """The request's index node at its start (the boundary it resumed from), or ``None`` at
        0 or past its published units."""
        start, g = alloc.start, self.config.prefix_match_unit
        if start <= 0 or len(alloc.nodes) < start // g:
            return None
        return alloc.nodes[start // g - 1]

    def _below_start(self, alloc: Allocation, node: BlockNode | None, checkpoints: dict) -> int:
        """The boundary (tokens) of the checkpoint below the request's new ones, for the ``utility``
        order's saving: its start (the checkpoint it resumed from), or, when that is a tail and the
        request places a tail under ``supersede`` (which retires the start unless another request
        holds it), the boundary that was below the start when it was placed."""
        start = alloc.start
        if start <= 0 or not self.config.policy.supersede:
            return start
        slot = node.checkpoint if node is not None else None
        if slot is None or self.labels.get(slot) != TAIL or not any(lb == TAIL for _, lb in checkpoints.values()):
            return start
        return self._below.get(slot, 0)

    def publish_units(self, alloc: Allocation, hashes: list[bytes], computed: int) -> None:
        """Publish every whole unit of ``[0, computed)`` whose KV the request has written.

        Existing nodes are reused (content set once); nodes evicted meanwhile
        are re-created from the request's own pages.
        """
        g, b = self.config.prefix_match_unit, self.config.block_size
        n = min(len(hashes), computed // g)
        nodes = alloc.nodes
        if nodes and nodes[-1].parent is None:       # evicted since: rebuild from the root
            nodes.clear()
        k = len(nodes)
        if k >= n:
            return
        parent = nodes[-1] if nodes else self.index.root
        table, per_page = alloc.block_table, b // g     # b is a multiple of g (CacheConfig)
        self.index.extend_table(parent, hashes[k:n], table, k, per_page, alloc.owner, self.clock(), out=nodes)

    def _publish_checkpoint(self, alloc: Allocation, hashes: list[bytes], ckpt: KDACheckpoint | None,
                            boundary: int, label: str = "", below: int = 0, group: bytes | None = None) -> bool:
        """Publish ``C(P_boundary)`` at the request's node for ``boundary`` (units already published).

        ``ckpt`` is a checkpoint the request's forward captured: the slot keeps its tensors
        (:meth:`CheckpointPool.write` with ``own=True``; the forward returns every capture in
        storage of its own and never writes a state in place, so the request's working state
        may be the same tensors and is only read from then on). The slot is written before it
        is attached.

        Returns:
            ``True`` if a new checkpoint was published; ``False`` if one already
            existed there or no slot could be freed.
        """
        g = self.config.prefix_match_unit
        if len(alloc.nodes) < boundary // g:
            raise ValueError(f"checkpoint boundary {boundary} lies beyond the published units")
        return self._attach_new(alloc.nodes[boundary // g - 1], ckpt, label, below, group, own=True)

    def retire_checkpoint(self, alloc: Allocation, boundary: int, label: str) -> bool:
        """Detach the request's checkpoint at ``boundary`` if it was published under ``label``."""
        g = self.config.prefix_match_unit
        if boundary <= 0 or len(alloc.nodes) < boundary // g:
            return False
        node = alloc.nodes[boundary // g - 1]
        slot = node.checkpoint
        if node.parent is None or slot is None or self.labels.get(slot) != label or self.checkpoints.refcount[slot]:
            return False
        self.index.detach_checkpoint(node)
        return True

    def _attach_new(self, node: BlockNode, ckpt: KDACheckpoint | None, label: str = "", below: int = 0,
                    group: bytes | None = None, own: bool = False) -> bool:
        if node.checkpoint is not None:
            return False
        held = self.checkpoints.prepare(ckpt, own)     # a state refused here evicts nothing for it
        slot = self.checkpoints.take_free()
        while slot is None:
            victim = self._victim(self.checkpoints, node.owner)
            if victim is None:
                return False
            self._evict_checkpoint(victim)
            slot = self.checkpoints.take_free()
        self.checkpoints.put(slot, held)
        if self._probation is not None and label in PROBATION_LABELS:
            self._probation.mark(slot)
        if self._utility is not None:      # saving: tokens over the checkpoint below (``below``) when placed
            self._utility.mark(slot, label, node.end - below, group)
            self._below[slot] = below
        self.index.attach_checkpoint(node, slot)
        self.labels[slot] = label
        used = self.checkpoints.num_slots - self.checkpoints.num_free   # only checkpoints changed here
        if used > self.checkpoints_peak:
            self.checkpoints_peak = used
        return True

    # -- installs from lower tiers --------------------------------------
    def install_kv(self, hashes: list[bytes], start: int, end: int, write_pages, owner: bytes | None = None) -> bool:
        """Install verified KV of ``[start, end)`` (whole pages) as cached, unreferenced entries.

        ``write_pages(pages)`` copies the latents into the freshly taken pages
        before any node points at them. The path ``[0, start)`` must be indexed.
        ``owner``: the request namespace the entries were cached under (the new nodes'
        owner, for quotas, purges and the owner segment of a write-back's store keys;
        ``None``: inherited from the path).

        Returns:
            ``False`` when the path is missing or no pages can be freed.
        """
        b, g = self.config.block_size, self.config.prefix_match_unit
        if start % b or end % b or end <= start:
            raise ValueError(f"install range [{start}, {end}) is not whole pages of {b}")
        path = self.index.walk(hashes[: start // g])
        if len(path) * g < start:
            return False
        held = list({n.page for n in path})
        for p in held:
            self.pages.ref(p)
        try:
            pages = self._take_pages((end - start) // b)
            if pages is not None:
                held += pages                               # freed again below unless indexed
                write_pages(pages)
                per_page = b // g
                self.index.extend(path[-1] if path else self.index.root, hashes[start // g: end // g],
                                  [pages[i // per_page] for i in range(end // g - start // g)], owner,
                                  now=self.clock())
        finally:
            for p in held:
                self.pages.unref(p)
        self._note_peaks()
        return pages is not None

    def install_checkpoint(self, hashes: list[bytes], ckpt: KDACheckpoint | None, boundary: int) -> bool:
        """Attach a verified checkpoint at ``boundary`` of an indexed path (no-op if one exists)."""
        g = self.config.prefix_match_unit
        path = self.index.walk(hashes[: boundary // g])
        if len(path) * g < boundary:
            return False
        node = path[-1]
        if node.checkpoint is not None:
            return True
        below = 0
        if self._utility is not None:          # its saving: tokens over the deepest checkpoint below it
            k = len(path) - 1
            while k and path[k - 1].checkpoint is None:
                k -= 1
            below = k * g
        return self._attach_new(node, ckpt, INSTALLED, below)

    def _evict_checkpoint(self, slot: int) -> None:
        if self._on_evict is not None:
            self._on_evict([self._evicted(self.index.slot_node[slot], kv=False)])
        if self._utility is None or self.labels.get(slot) != LEAD or self._hits(slot):
            self.checkpoints.order.evicted(slot)     # a lead never hit leaves the order's floor as it is
        self.index.detach_checkpoint(self.index.slot_node[slot])
        self.evicted_checkpoints += 1

    def _evicted(self, node: BlockNode, kv: bool) -> EvictedEntry:
        parent = node
        for _ in range(self.config.block_size // self.config.prefix_match_unit):
            parent = parent.parent if parent is not None else None
        parent_key = parent.key if parent is not None and parent.end else None
        return EvictedEntry(node.key, parent_key, node.end, node.page if kv else None, node.checkpoint, node.owner)

    # -- reads for lower tiers ------------------------------------------
    def read_checkpoint(self, slot: int, boundary: int) -> KDACheckpoint | None:
        """A copy of the checkpoint in ``slot`` (``None`` in simulation), e.g. an
        :attr:`EvictedEntry.checkpoint` during the ``on_evict`` callback."""
        return self.checkpoints.read(slot, boundary)

    def checkpoint_at(self, alloc: Allocation, boundary: int) -> KDACheckpoint | None:
        """A copy of the published checkpoint at ``boundary`` on the request's own path, or ``None``
        when there is none (never published there, or evicted since)."""
        g = self.config.prefix_match_unit
        if boundary <= 0 or boundary % g or len(alloc.nodes) < boundary // g:
            return None
        node = alloc.nodes[boundary // g - 1]
        if node.parent is None or node.checkpoint is None:
            return None
        return self.checkpoints.read(node.checkpoint, boundary)

    def clear(self) -> int:
        """Evict every unreferenced entry (explicit purge); returns pages evicted."""
        n = 0
        while (victim := self.pages.next_victim()) is not None:
            self.index.evict_page(victim)
            n += 1
        while (slot := self.checkpoints.next_victim()) is not None:
            self._evict_checkpoint(slot)
        return n

    def remove_prefix(self, first_hash: bytes) -> int:
        """Purge the cached prefix whose first unit's chained hash is ``first_hash`` and every
        entry cached below it (KV nodes and their checkpoints; no write-back to lower tiers).
        A first hash is namespace-bound, so this removes one namespace's tree of that prefix.

        Returns:
            Index nodes removed (0 when nothing is cached under ``first_hash``).

        Raises:
            RuntimeError: a request still holds references (purge only while none runs).
        """
        if any(self.pages.refcount) or any(self.checkpoints.refcount):
            raise RuntimeError("remove_prefix while requests hold references; release them first")
        node = self.index.root.child(first_hash)
        return self.purge_subtree(node) if node is not None else 0

    def purge_subtree(self, node: BlockNode) -> int:
        """Remove ``node`` and its descendants for a purge (:meth:`remove_prefix`,
        :func:`~hybridkv.cache.purge.purge_device`): as :meth:`PrefixIndex.remove_subtree`, and
        under the ``utility`` order no removed tail is remembered as evicted (a ghost) and no tail
        group keyed by a removed node survives (:meth:`UtilityOrder.purging`).

        Returns:
            Index nodes removed.
        """
        if self._utility is None:
            return self.index.remove_subtree(node)
        keys, stack = [], [node]
        while stack:
            n = stack.pop()
            keys.append(n.key)
            stack.extend(n.children.values())
        with self._utility.purging(keys):
            return self.index.remove_subtree(node)

    # -- metrics and checks ---------------------------------------------
    def _note_peaks(self) -> None:
        self.kv_pages_peak = max(self.kv_pages_peak, self.pages.num_pages - self.pages.num_free)
        self.checkpoints_peak = max(self.checkpoints_peak, self.checkpoints.num_slots - self.checkpoints.num_free)

    @property
    def kv_bytes_peak(self) -> int:
        """Peak bytes of KV pages in use or cached."""
        return self.kv_pages_peak * self.page_bytes

    @property
    def checkpoint_bytes_peak(self) -> int:
        """Peak bytes of checkpoint slots in use."""
        return self.checkpoints_peak * self.checkpoints.slot_bytes

    def check_invariants(self) -> None:
        """Index and pool consistency; ``AssertionError`` on the first violation."""
        self.pages.check_invariants()
        self.checkpoints.check_invariants()
        self.index.check_invariants()
