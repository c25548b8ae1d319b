"""Routers: which instance serves a request, decided from cache events and load only.

Every router sees the same :class:`FleetState`: one
:class:`~hybridkv.fleet.events.InstanceView` per instance (built from that instance's
events, never from its memory), an optional view of the shared store, and each
instance's :class:`InstanceLoad`. A request is its whole prompt's unit hashes, so the
whole prompt decides, never its first message.

* ``round-robin``; ``least-load``: fewest outstanding prompt tokens.
* ``prefix``: the behaviour of SGLang's ``cache_aware`` policy (sgl-router, before its
  2025-12-08 change of the miss rule) in our own code: an approximate per-instance tree of
  the prompts routed there. When the load is imbalanced (``max - min > balance_abs_threshold``
  and ``max > balance_rel_threshold * min``, requests in flight) the fewest requests in flight
  win (lowest index among equals); otherwise the longest match wins when its match ratio
  exceeds ``cache_threshold`` (strictly), ties among the instances holding that match broken
  by a pseudorandom order fixed per matched prefix (SGLang takes the first tenant of the
  matched tree node's hash map), and a poor match goes to the instance with the smallest
  tree (as SGLang did, whatever its queue; ties in one fixed pseudorandom order).
* ``prefix-smg`` (an extra, for comparison): the same policy as SGLang's successor SMG runs it
  now: misses and spills to the least loaded, a per-request spill gate instead of the
  fleet-wide imbalance test (:class:`SMGPrefixRouter`).
* ``kv-overlap``: Dynamo's KV-router cost at its defaults (``overlap_score_weight`` 1,
  ``router_temperature`` 0): ``w * prefill_blocks + decode_blocks``, with ``prefill_blocks`` the
  prompt tokens it would have to prefill (this request's, net of its page-aligned KV overlap,
  plus those of its requests without a first token) over the page size, and
  ``decode_blocks`` the unique KV pages its requests in flight hold plus this prompt's new
  ones; ties to the smallest tree (KV the instance holds), then at random (seeded).
* ``hybrid``: lowest ``T_queue + (1 + waiting) * (T_prefill + T_transfer + T_cold)`` in seconds,
  the seed's ``score = T_saved - T_queue - T_transfer - T_cold`` (DESIGN §7) with the work also
  charged to the requests that will wait behind it; hits are *joint* hits (KV contiguous plus a
  checkpoint at or below it).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import numbers
import random
from bisect import bisect_left
from collections.abc import Callable
from itertools import islice, repeat, takewhile
from operator import attrgetter, is_
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from hybridkv.cache.groups import joint_hit, joint_hits
from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.fleet.events import InstanceView
from hybridkv.fleet.store import StoreCost, paying_load


@dataclass(slots=True)
class InstanceLoad:
    """Load of one instance as routers see it; the fleet owns and updates it.

    Attributes:
        outstanding_tokens: prompt tokens of requests routed here without a first token yet.
        queued_seconds: predicted prefill seconds of those requests (the router's estimate
            when it routed them).
        in_flight: requests routed here and not finished.
        in_flight_tokens: prompt + output tokens of those (KV they hold or will hold).
        routed: requests ever routed here (the last tie-break, so idle instances share misses).
        waiting: requests routed here without a first token yet (queued or in prefill).
        decode_tokens: tokens still to generate after their first by requests routed here.
        prefill_tokens: prompt tokens still to compute of the requests routed here without a
            first token, each net of its page-aligned KV run on this instance when routed
            (Dynamo's active prefill tokens; :func:`kv_admission`).
        pages: whole prompt KV pages of the requests in flight here, each counted once, with
            the number of those requests holding it (Dynamo's unique active blocks).
        partial_pages: requests in flight here whose prompt ends inside a page (one page of
            their own each).
    """

    outstanding_tokens: int = 0
    queued_seconds: float = 0.0
    in_flight: int = 0
    in_flight_tokens: int = 0
    routed: int = 0
    waiting: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    pages: dict[bytes, int] = field(default_factory=dict, repr=False)
    partial_pages: int = 0

    @property
    def active_pages(self) -> int:
        """KV pages the requests in flight hold: unique whole pages plus one per partial page."""
        return len(self.pages) + self.partial_pages

    def hold(self, keys: list[bytes], partial: bool, prefill_tokens: int) -> None:
        """Count a routed request: its whole pages ``keys`` (:func:`page_keys`), whether its
        prompt ends in a partial page, and the tokens it has to prefill."""
        pages = self.pages
        for k in keys:
            pages[k] = pages.get(k, 0) + 1
        self.partial_pages += partial
        self.prefill_tokens += prefill_tokens

    def release(self, keys: list[bytes], partial: bool) -> None:
        """Forget a finished request's pages (its prefill tokens leave at its first token)."""
        pages = self.pages
        for k in keys:
            n = pages[k] - 1
            if n:
                pages[k] = n
            else:
                del pages[k]
        self.partial_pages -= partial

    def clear(self) -> None:
        """Zero every count but ``routed`` (the instance lost all its requests)."""
        self.outstanding_tokens = self.in_flight = self.in_flight_tokens = self.waiting = 0
        self.decode_tokens = self.prefill_tokens = self.partial_pages = 0
        self.queued_seconds = 0.0
        self.pages.clear()

    def key(self) -> tuple[int, int, int]:
        """Lighter first: outstanding prompt tokens, then requests in flight, then requests routed."""
        return self.outstanding_tokens, self.in_flight, self.routed


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router knows of a request.

    Attributes:
        hashes: chained hashes of every whole ``prefix_match_unit`` of the prompt.
        prompt_tokens: prompt length in tokens.
        limit: most tokens reusable (:func:`~hybridkv.cache.groups.reuse_cap`).
        output_tokens: tokens the request will generate (its KV too).
    """

    hashes: list[bytes] = field(repr=False)
    prompt_tokens: int
    limit: int
    output_tokens: int = 1


@dataclass(slots=True)
class FleetState:
    """The router's inputs: per-instance views and loads, the store's view (or ``None``), and
    ``live``: indices of the instances that are up, ascending (default all; the fleet removes a
    crashed instance until it is back, as service discovery would). Routers choose among ``live``."""

    views: list[InstanceView]
    loads: list[InstanceLoad]
    store: InstanceView | None = None
    live: list[int] | None = None

    def __post_init__(self) -> None:
        if self.live is None:
            self.live = list(range(len(self.loads)))


def page_keys(hashes: list[bytes], unit: int, block_size: int) -> list[bytes]:
    """Keys of a prompt's whole KV pages of ``block_size`` tokens: the chained unit hash
    (``unit`` tokens each) at the end of each page, which names the page and all before it.

    Raises:
        ValueError: ``block_size`` not a positive multiple of ``unit``.
    """
    if unit <= 0 or block_size <= 0 or block_size % unit:
        raise ValueError(f"block_size={block_size!r} must be a positive multiple of unit={unit!r}")
    r = block_size // unit
    return hashes[r - 1::r]


def kv_admission(view: InstanceView, hashes: list[bytes], prompt_tokens: int,
                 block_size: int) -> tuple[list[bytes], bool, int]:
    """What a request routed to the instance that ``view`` describes adds to Dynamo's load counts
    (:meth:`InstanceLoad.hold`): ``(page keys, ends in a partial page, prefill tokens)``, the
    prefill tokens being ``prompt_tokens - overlap * block_size`` with ``overlap`` the whole
    pages of its KV run there (the blocks Dynamo's indexer would match)."""
    keys = page_keys(hashes, view.unit, block_size)
    overlap = view.kv_run(hashes, len(hashes) * view.unit) // block_size
    return keys, prompt_tokens % block_size != 0, prompt_tokens - overlap * block_size


_LOAD_KEY = attrgetter("outstanding_tokens", "in_flight", "routed")   # InstanceLoad.key
_PLAIN_LOAD = {InstanceLoad}


def priced_prefill(cost: StepCostModel, store: StoreCost | None, prompt_tokens: int, kv_hit: int, hit: int,
                   store_hit: int, restore_s: float = 0.0, store_restore_s: float = 0.0) -> tuple[float, int]:
    """``(seconds, tokens reused)`` before a prompt of ``prompt_tokens`` on an instance whose own
    KV run is ``kv_hit`` and joint hit ``hit`` (tokens) has its prefill done: the prefill of
    ``[hit, T)`` (``cost.prefill_seconds``), or, when the shared store's joint hit ``store_hit``
    lies deeper (and ``store`` prices it) and loading pays, the prefill of ``[store_hit, T)`` plus
    the store load of ``[load_start(kv_hit, store_hit, alignment), store_hit)``: bytes over the
    bandwidth and the per-object latency (:meth:`~hybridkv.fleet.store.StoreCost.load_seconds`),
    the seed's ``T_transfer + T_lookup``. Loading pays when it takes less than computing
    ``[hit, store_hit)``, the rule a simulated instance applies before it loads (issue 9 item 3;
    :meth:`~hybridkv.fleet.instance.FleetInstance._fetch`). ``restore_s`` / ``store_restore_s``:
    seconds of rebuilding the boundary state at the local / the store's hit from its restart
    point (:data:`RestorePricer`; 0 when states are saved at the hit, as for Kimi Linear), added
    to each side. The hybrid router's work term, and the queued seconds the fleet books for a
    routed request."""
    load = paying_load(cost, store, kv_hit, hit, store_hit, restore_s, store_restore_s) if store is not None else None
    if load is None:
        return cost.prefill_seconds(hit, prompt_tokens) + restore_s, hit
    return cost.prefill_seconds(store_hit, prompt_tokens) + load[0] + load[1] + store_restore_s, store_hit


RestorePricer = Callable[[int, int], float]
"""``price(restart, hit) -> seconds`` of rebuilding a boundary state at ``hit`` (tokens) by
recomputing from ``restart`` (a saved state there, or the raw tokens of a recompute cone):
:func:`~hybridkv.fleet.costmodel.v4_restore_pricer` for DeepSeek-V4. A hit's value to a router is
the prefill it saves less this."""


def restore_seconds(restore: RestorePricer | None, restart: int, hit: int) -> float:
    """``restore(restart, hit)`` when ``restart < hit`` and a pricer is given, else 0 (seconds)."""
    return restore(restart, hit) if restore is not None and restart < hit else 0.0


def least_loaded(loads: list[InstanceLoad], among=None) -> int:
    """Index of the lightest :meth:`InstanceLoad.key` (then the lowest index) among ``among`` (default all)."""
    among = range(len(loads)) if among is None else list(among)
    chosen = list(map(loads.__getitem__, among))
    if {*map(type, chosen)} == _PLAIN_LOAD:     # InstanceLoad.key's tuple read in C (a router's ties)
        return min(zip(map(_LOAD_KEY, chosen), among))[1]
    return min(among, key=lambda j: (loads[j].key(), j))


NO_LIVE_INSTANCE = "no live instance to route to: every instance is down (FleetState.live is empty)"
"""The :meth:`Router.route` error when ``fleet.live`` is empty."""


def live_instances(fleet: FleetState) -> list[int]:
    """``fleet.live``, the instances a router may choose.

    Raises:
        ValueError: none is live (:data:`NO_LIVE_INSTANCE`).
    """
    live = fleet.live
    if not live:
        raise ValueError(NO_LIVE_INSTANCE)
    return live

_PLAIN_VIEW = {InstanceView}
_UNIT = attrgetter("unit")
_FAMILY = attrgetter("family")
_IN_FLIGHT = attrgetter("in_flight")
_ROUTED = attrgetter("routed")

HOLDER_MAP_ABOVE = 32
"""On a fleet of more instances than this, ``prefix`` and ``prefix-smg`` find the longest match
through a map from each unit key to the trees holding it (a walk down the prompt's units
intersecting holders) and the smallest tree through a heap, instead of a scan of every tree:
the same decisions, at a cost that grows with the prompt and its holders, not the fleet."""


def _one_family(views: list[InstanceView]) -> bool:
    """Every view follows one family's rule (a fleet's views share the family object: checked
    by identity in C first, by equality only when some view holds another object)."""
    fam = views[0].family
    if all(map(is_, repeat(fam), map(_FAMILY, views))):
        return True
    return all(v.family is fam or v.family == fam for v in views)


class _ViewsPresence:
    """:class:`~hybridkv.cache.groups.Presences` of several views (one per instance, of one family)
    for the units of one prompt (:meth:`HybridRouter.route`, every instance on every arrival): a
    group is held at a unit where the view's set of that group (``held``) has its key (``full``
    where a unit has KV, ``kda`` where it has a checkpoint, for Kimi Linear). Most views
    hold the same few units of a prompt (a shared first block), so the last run found is checked
    whole (in C, ``issuperset``) before a unit-by-unit walk; a view without the first unit has
    a run of 0 at once.

    Args:
        units: the prompt's unit hashes within its reuse cap.
        unit: ``prefix_match_unit`` in tokens.
        views: the views, in the order of the answers.
    """

    __slots__ = ("units", "unit", "views")

    def __init__(self, units: list[bytes], unit: int, views: list[InstanceView]) -> None:
        self.units, self.unit, self.views = units, unit, views

    def prefix_runs(self, group: str, limit: int) -> list[int]:
        units, g = self.units, self.unit
        n = min(len(units), limit // g)
        if n < len(units):                          # a shorter limit than the prompt's slice
            units = units[:n]
        if not n:
            return [0] * len(self.views)
        first, out = units[0], []
        append = out.append
        guess, head = 0, ()                         # the last run found (units) and its units
        for view in self.views:
            kv = view.held[group]
            if first not in kv:
                append(0)
            elif guess and kv.issuperset(head):
                if guess < n and units[guess] in kv:
                    append((guess + len(list(takewhile(kv.__contains__, islice(units, guess, None))))) * g)
                else:
                    append(guess * g)
            else:
                run = len(list(takewhile(kv.__contains__, units)))
                guess, head = run, units[:run]
                append(run * g)
        return out

    def deepest_states(self, group: str, at_most: list[int]) -> list[int]:
        units, g, out = self.units, self.unit, []
        append, n = out.append, len(self.units)
        for view, top in zip(self.views, at_most):
            if not top:
                append(0)
                continue
            k = top // g
            if k > n:
                k = n
            ck = view.held[group]
            while k and units[k - 1] not in ck:
                k -= 1
            append(k * g)
        return out


class _RoutedPresence:
    """:class:`~hybridkv.cache.groups.Presence` of a view together with the prompts a router sent
    its instance that have no first token yet (:meth:`RoutedPrompts.extend`): a prefix group held
    where the view's set of it (``view.held``) or the routed prompts' units (``kv``) have a unit,
    a boundary group where the view's set of it or the routed prompts' tail states (``ck``) have
    it (``full`` / ``kda`` for Kimi Linear). The view's own joint hit ``pair`` (``(kv_hit, hit,
    ...)``) is known already: the run continues from its ``kv_hit``, the scan stops at its hit."""

    __slots__ = ("units", "unit", "kv", "held", "ck", "pair")

    def __init__(self, units, unit, kv, held, ck, pair: tuple[int, ...]) -> None:
        self.units, self.unit, self.kv, self.held, self.ck, self.pair = units, unit, kv, held, ck, pair

    def prefix_run(self, group: str, limit: int) -> int:
        g, units, kv, vkv = self.unit, self.units, self.kv, self.held[group]
        n = min(len(units), limit // g)
        run = min(self.pair[0] // g, n)
        while run < n and units[run] in kv:
            more = len(list(takewhile(kv.__contains__, islice(units, run, n))))
            more += len(list(takewhile(vkv.__contains__, islice(units, run + more, n))))
            if not more:
                break
            run += more
        return run * g

    def deepest_state(self, group: str, at_most: int) -> int:
        g, units, ck, vck = self.unit, self.units, self.ck, self.held[group]
        deepest, floor = min(at_most // g, len(units)), self.pair[1] // g
        if deepest < floor:                         # below the view's own hit: nothing known there
            floor = 0
        while deepest > floor and units[deepest - 1] not in ck and units[deepest - 1] not in vck:
            deepest -= 1
        return deepest * g


class Router(ABC):
    """Picks an instance for each request; may keep state of its own decisions.

    ``uses_pages``: it reads :attr:`InstanceLoad.prefill_tokens` and the page counts, so the
    load's owner must keep them (:func:`kv_admission`); others leave them at zero."""

    name: str
    uses_pages: bool = False

    @abstractmethod
    def route(self, req: RouteRequest, fleet: FleetState) -> int:
        """Index of the instance that serves ``req``, one of ``fleet.live``.

        Raises:
            ValueError: ``fleet.live`` is empty (every instance down: the caller decides where a
                request waits then; the fleet sends it to the instance back first).
        """

    def expected_hit(self) -> int | None:
        """Tokens the last :meth:`route` expected the chosen instance to reuse, or ``None``
        when the router makes no such estimate (the fleet then prices the queued prefill
        from the view's joint hit)."""
        return None

    def expected_seconds(self) -> float | None:
        """Seconds of prefill (and store load) the last :meth:`route` priced on the chosen
        instance (:func:`priced_prefill`), or ``None`` when the router prices none (the fleet
        then prices it from the views)."""
        return None


class RoundRobin(Router):
    """Instances in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def route(self, req: RouteRequest, fleet: FleetState) -> int:
        n, live = len(fleet.loads), live_instances(fleet)
        if len(live) == n:
            return next(self._next) % n
        while (j := next(self._next) % n) not in live:    # skip the instances that are down
            pass
        return j


class LeastLoad(Router):
    """Fewest outstanding prompt tokens (ties: :func:`least_loaded`)."""

    name = "least-load"

    def route(self, req: RouteRequest, fleet: FleetState) -> int:
        return least_loaded(fleet.loads, live_instances(fleet))


@dataclass(frozen=True, slots=True)
class PrefixOptions:
    """SGLang ``cache_aware`` settings (sgl-router's launch defaults).

    Attributes:
        cache_threshold: a match ratio (matched / prompt tokens, 0..1) above which (strictly)
            the best-matching instance wins.
        balance_abs_threshold, balance_rel_threshold: the load (requests in flight) is
            imbalanced when ``max - min > abs`` and ``max > rel * min`` (both strict).
        seed: (0 or more) seeds the pseudorandom orders that stand for the Rust hash maps' iteration
            order (tie-breaks), so runs are reproducible.
        max_tree_tokens: tokens each instance's tree keeps (``None``: no bound, the replay's
            default). Past it the least recently used leaves go first, a ``prefix_match_unit``
            (one node) at a time, as SGLang's router evicts its trees past ``max_tree_size``.
    """

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    seed: int = 0
    max_tree_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tree_tokens is not None and (isinstance(self.max_tree_tokens, bool)
                                                 or not isinstance(self.max_tree_tokens, int)
                                                 or self.max_tree_tokens < 1):
            raise ValueError(f"max_tree_tokens={self.max_tree_tokens!r} must be a positive number of tokens "
                             "(or None: no bound)")


def _mix(seed: int, key: bytes, j: int) -> bytes:
    """A pseudorandom rank of instance ``j`` for ``key`` (8 bytes of BLAKE2b): one fixed order
    of the instances per key, independent across keys."""
    return hashlib.blake2b(key + j.to_bytes(4, "little"), digest_size=8,
                           key=seed.to_bytes(8, "little")).digest()


class PrefixRouter(Router):
    """SGLang's ``cache_aware``: longest prefix over a per-instance tree of routed prompts
    (approximate: built from its own decisions, no events).

    Per request, with ``flight`` the requests in flight on each live instance:

    1. ``max(flight) - min(flight) > balance_abs_threshold`` and ``max(flight) >
       balance_rel_threshold * min(flight)``: the fewest in flight wins (lowest index among
       equals: Rust's ``min_by_key`` keeps the first).
    2. Otherwise ``matched`` is the longest run of the prompt's units in any tree (tokens); if
       ``matched / prompt_tokens > cache_threshold`` an instance whose tree holds that run wins;
       among several, the first in a pseudorandom order fixed per matched prefix (SGLang's
       tree keeps each node's tenants in a hash map with its own random hasher and takes the
       first it iterates).
    3. Else the instance with the smallest tree (units held) wins; ties in one pseudorandom
       order fixed for the router (SGLang iterates one tenant-size map, first strict minimum).

    The chosen instance's tree then takes the whole prompt. With ``options.max_tree_tokens``
    a tree keeps at most that many tokens (``max_tree_tokens // unit`` nodes): a prompt's units
    are touched leaf first, so every node is more recent than its descendants, and past the
    bound the least recently used nodes (leaves) are evicted, as SGLang evicts a tenant's
    least recently used leaves past ``max_tree_size`` (2**26 characters per tenant at its
    launch default). Unbounded by default: the bundled trace does not reach SGLang's bound
    (docs/concepts/routing.md, "Emulations checked against their sources"); ``hybridkv
    router`` bounds them (``--max-tree-tokens``).

    Args:
        unit: ``prefix_match_unit`` in tokens.
        options: thresholds and seed.
    """

    name = "prefix"

    def __init__(self, unit: int, options: PrefixOptions = PrefixOptions()) -> None:
        self.options = options
        self.unit = unit
        self.trees: list[InstanceView] = []
        self._rank: list[bytes] = []        # the tenant-size map's fixed order (smallest-tree ties)
        cap = options.max_tree_tokens
        self._cap = None if cap is None else max(cap // unit, 1)      # nodes per tree
        self._recency: list[OrderedDict] = []                        # per tree: key -> None, oldest first
        # on a fleet of more than HOLDER_MAP_ABOVE instances: unit key -> the trees holding it (one
        # index, or a set of several), and a heap of (tree size, rank, index), stale entries skipped
        self._holders: dict[bytes, int | set[int]] | None = None
        self._sizes: list[tuple[int, bytes, int]] = []

    def _take(self, j: int, hashes: list[bytes]) -> None:
        """Instance ``j``'s tree takes a prompt's unit ``hashes``; past the bound its least
        recently used nodes go (the prompt's own leaf first touched, so a node outlives its
        descendants)."""
        tree = self.trees[j]
        tree.kv.update(hashes)
        holders = self._holders
        if holders is not None:
            get = holders.get
            for k in hashes:
                have = get(k)
                if have is None:
                    holders[k] = j
                elif have.__class__ is int:
                    if have != j:
                        holders[k] = {have, j}
                else:
                    have.add(j)
        if self._cap is not None:
            while len(self._recency) <= j:
                self._recency.append(OrderedDict())
            recency = self._recency[j]
            for k in reversed(hashes):
                recency[k] = None
                recency.move_to_end(k)
            while len(recency) > self._cap:
                k = recency.popitem(last=False)[0]
                tree.kv.discard(k)
                if holders is not None:
                    have = holders[k]
                    if have.__class__ is int:
                        del holders[k]
                    else:
                        have.discard(j)
                        if len(have) == 1:
                            holders[k] = next(iter(have))
        if holders is not None:
            self._push_size(j)

    def _push_size(self, j: int) -> None:
        sizes, n = self._sizes, len(self.trees)
        heapq.heappush(sizes, (len(self.trees[j].kv), self._rank[j], j))
        if len(sizes) > 4 * n + 64:                 # mostly stale: rebuild from the trees
            sizes[:] = [(len(t.kv), self._rank[i], i) for i, t in enumerate(self.trees)]
            heapq.heapify(sizes)

    def _prepare(self, n: int) -> None:
        """Trees (and ranks) for ``n`` instances; above :data:`HOLDER_MAP_ABOVE` instances the
        holder map and the size heap, built once from the trees as they are."""
        while len(self.trees) < n:
            self.trees.append(InstanceView(self.unit))
        while len(self._rank) < len(self.trees):
            self._rank.append(_mix(self.options.seed, b"tenant-size", len(self._rank)))
        if self._holders is None and n > HOLDER_MAP_ABOVE \
                and all(len(t.family.prefix_names) == 1 for t in self.trees):
            holders = self._holders = {}
            for j, t in enumerate(self.trees):
                for k in t.kv:
                    have = holders.get(k)
                    holders[k] = j if have is None else {have, j} if have.__class__ is int else have | {j}
            self._sizes = [(len(t.kv), self._rank[j], j) for j, t in enumerate(self.trees)]
            heapq.heapify(self._sizes)

    def _longest(self, hashes: list[bytes], live: list[int]) -> tuple[int, list[int]]:
        """``(top, holders)``: the longest run of ``hashes`` from the first unit in any live
        tree (tokens) and the live instances whose tree holds it (ascending; every live one when
        ``top`` is 0), as a scan of every tree's ``kv_run`` finds them."""
        holders = self._holders
        if holders is None:
            limit = len(hashes) * self.unit
            matched = {i: self.trees[i].kv_run(hashes, limit) for i in live}
            top = max(matched.values())
            return top, [i for i in live if matched[i] == top]
        have = holders.get(hashes[0]) if hashes else None
        if have is None:
            return 0, list(live)
        everyone = len(live) == len(self.trees)
        alive = None if everyone else set(live)
        if have.__class__ is int:
            at = {have} if everyone or have in alive else set()
        else:
            at = set(have) if everyone else have & alive
        if not at:
            return 0, list(live)
        depth, get = 1, holders.get
        for k in islice(hashes, 1, None):
            have = get(k)
            if have is None:
                break
            if have.__class__ is int:
                if have not in at:
                    break
                at = {have}
            else:
                deeper = at & have
                if not deeper:
                    break
                at = deeper
            depth += 1
        return depth * self.unit, sorted(at)

    def _smallest(self, live: list[int]) -> int:
        """The live instance with the smallest tree, ties in the fixed rank order."""
        if self._holders is None:
            return min(live, key=lambda i: (len(self.trees[i].kv), self._rank[i]))
        sizes, trees, alive = self._sizes, self.trees, None if len(live) == len(self.trees) else set(live)
        aside, j = [], None
        while sizes:
            entry = heapq.heappop(sizes)
            size, _, i = entry
            if size != len(trees[i].kv):
                continue                              # stale: a newer entry of i is in the heap
            aside.append(entry)
            if alive is None or i in alive:
                j = i
                break
        for entry in aside:
            heapq.heappush(sizes, entry)
        return j

    def route(self, req: RouteRequest, fleet: FleetState) -> int:
        n, o, live = len(fleet.loads), self.options, live_instances(fleet)
        self._prepare(n)
        loads = fleet.loads
        flight = list(map(_IN_FLIGHT, loads if len(live) == n else map(loads.__getitem__, live)))
        hi, lo = max(flight), min(flight)
        if hi - lo > o.balance_abs_threshold and hi > o.balance_rel_threshold * lo:
            j = live[flight.index(lo)]
        else:
            top, holders = self._longest(req.hashes, live)
            if req.prompt_tokens and top / req.prompt_tokens > o.cache_threshold:
                if len(holders) == 1:
                    j = holders[0]
                else:
                    node = req.hashes[top // self.unit - 1]
                    j = min(holders, key=lambda i: _mix(o.seed, node, i))
            else:
                j = self._smallest(live)
        self._take(j, req.hashes)
        return j


class SMGPrefixRouter(PrefixRouter):
    """SGLang's ``cache_aware`` as its successor SMG runs it at its launch defaults (text
    tree; its backend KV-usage triggers, overlap decay and selection temperature off), the
    same trees and thresholds as :class:`PrefixRouter`, with ``flight`` the requests in flight
    and ``mean`` their mean over the live instances:

    1. ``matched / prompt_tokens > cache_threshold``: of the instances holding the longest
       match, the fewest in flight, uniformly at random among equals (seeded); but if that
       one has ``flight > balance_rel_threshold * mean`` and ``flight > mean +
       balance_abs_threshold``, the least loaded instead (the spill gate, per request).
    2. Otherwise (a poor match) the least loaded: fewest in flight, then fewest routed, then
       the lowest index. There is no fleet-wide imbalance test.

    Args:
        unit: ``prefix_match_unit`` in tokens.
        options: thresholds and seed.
    """

    name = "prefix-smg"

    def __init__(self, unit: int, options: PrefixOptions = PrefixOptions()) -> None:
        super().__init__(unit, options)
        self._rng = random.Random(options.seed)

    def route(self, req: RouteRequest, fleet: FleetState) -> int:
        n, o, live, loads = len(fleet.loads), self.options, live_instances(fleet), fleet.loads
        self._prepare(n)
        mine = loads if len(live) == n else [loads[i] for i in live]
        flight = list(map(_IN_FLIGHT, mine))
        mean = sum(flight) / len(live)
        least = min(zip(flight, map(_ROUTED, mine), live))[2]
        top, holders = self._longest(req.hashes, live)
        if req.prompt_tokens and top / req.prompt_tokens > o.cache_threshold:
            fewest = min(loads[i].in_flight for i in holders)
            holders = [i for i in holders if loads[i].in_flight == fewest]
            j = holders[self._rng.randrange(len(holders))] if len(holders) > 1 else holders[0]
            if fewest > o.balance_rel_threshold * mean and fewest > mean + o.balance_abs_threshold:
                j = least
        else:
            j = least
        self._take(j, req.hashes)
        return j


class KVOverlapRouter(Router):
    """Dynamo's KV router (``DefaultWorkerSelector`` at its defaults): the lowest
    ``logit_j = w * prefill_blocks_j + decode_blocks_j`` wins (``router_temperature`` 0).

    * ``prefill_blocks_j = (prefill_tokens_j + T - overlap_j * B) / B`` (a float): the prompt
      tokens instance ``j`` would have to prefill with this request, its own net of its KV
      overlap (``overlap_j``: whole pages of the KV run its view shows, :func:`kv_admission`);
      ``prefill_tokens_j`` (:attr:`InstanceLoad.prefill_tokens`) drops a request's share at
      its first token.
    * ``decode_blocks_j``: the KV pages ``j``'s requests in flight hold, each whole page once
      (:attr:`InstanceLoad.active_pages`), plus this prompt's whole pages not among them and
      its partial last page. Output tokens are not counted (Dynamo's
      ``router_track_output_blocks`` defaults to off).
    * Equal logits: the smallest tree (units of KV the view holds), then uniformly at random
      (a seeded generator, so runs are reproducible).

    Only KV counts: a KV overlap without a checkpoint at or below it saves a hybrid model
    nothing, and this router does not know it.

    Args:
        block_size: KV page size in tokens (``B``, the block the cost counts).
        overlap_weight: ``w`` (Dynamo's ``overlap_score_weight``, default 1.0).
        seed: seeds the tie-break generator.
    """

    name = "kv-overlap"
    uses_pages = True

    def __init__(self, block_size: int, overlap_weight: float = 1.0, seed: int = 0) -> None:
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self._rng = random.Random(seed)

    def logits(self, req: RouteRequest, fleet: FleetState) -> dict[int, float]:
        """``logit_j`` of every live instance (blocks; lower is better)."""
        b, w, t = self.block_size, self.overlap_weight, req.prompt_tokens
        hashes, views, loads = req.hashes, fleet.views, fleet.loads
        partial = 1 if t % b else 0
        out = {}
        keys, unit = None, None
        for j in fleet.live:
            view, ld = views[j], loads[j]
            if keys is None or view.unit != unit:
                unit = view.unit
                keys = page_keys(hashes, unit, b)
            overlap = view.kv_run(hashes, len(hashes) * unit) // b
            pages = ld.pages
            # pages already held by requests in flight here: a prefix of ``keys`` (chained keys)
            shared = bisect_left(range(len(keys)), True, key=lambda k: keys[k] not in pages) if pages else 0
            out[j] = w * ((ld.prefill_tokens + t - overlap * b) / b) + (ld.active_pages + len(keys) - shared + partial)
        return out

    def route(self, req: RouteRequest, fleet: FleetState) -> int:
        live_instances(fleet)
        logits = self.logits(req, fleet)
        best = min(logits.values())
        tied = [j for j, v in logits.items() if v == best]
        if len(tied) == 1:
            return tied[0]
        views = fleet.views
        size = min(len(views[j].kv) for j in tied)
        tied = [j for j in tied if len(views[j].kv) == size]
        return tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]


@dataclass(frozen=True, slots=True)
class HybridOptions:
    """Guards against hot-spotting.

    Attributes:
        hot_relative, hot_absolute_s: an instance whose predicted wait exceeds
            ``hot_relative * mean + hot_absolute_s`` is not a candidate (unless none is below it).
        tie_relative: scores within this fraction of the request's full prefill seconds of
            the best count as equal, and the least loaded of them wins: a small hit (a shared
            system prompt every instance soon holds) must not pull all traffic to the few
            instances that hold it first while the rest stand idle.
        weigh_waiting: price the work a placement adds once for the request and once for each
            request that will wait behind it (``(1 + waiting_j)`` times, below); ``False``: the
            request's own predicted TTFT alone (the seed's score, kept for comparison).
        count_decode: ``T_queue`` includes the wait for a sequence slot held by decoding
            requests (:meth:`HybridRouter.queue_seconds`); ``False``: queued prefill seconds
            alone (the seed's, kept for comparison).
        count_routed: an instance's hit also counts the prompts this router sent it that have
            no first token yet (:class:`RoutedPrompts`): their entries are not published yet,
            but a request queued behind them finds them cached when it runs; ``False``: the
            events alone (kept for comparison).
        own_waiting: with ``weigh_waiting``, the share (0..1) of the instance's own waiting
            count ``n_j`` in the count that weighs its work; the rest is the mean over the live
            instances: ``n = own_waiting * n_j + (1 - own_waiting) * mean(n)``. ``0`` (the
            default): the fleet's mean, so an instance whose requests are few but long (a long
            conversation's turns) does not draw the shared-prefix traffic that would balance its
            queue, and an idle instance's extra prefill is priced as the queue it will soon have;
            ``1``: the instance's own count (the Little's-law estimate for that instance).
            Chosen on the development traces (docs/results/routing.md, "On other traces").
        price_restore: a hit whose restart point lies below it (DeepSeek-V4's ``periodic=P`` and
            ``recompute``) is worth the prefill it saves less the recompute that restores its
            state (:class:`HybridRouter`'s ``restore``); ``False``: the prefill it saves alone
            (kept for comparison, docs/results/v4.md).
        waiting_weight: with ``weigh_waiting``, each waiting request counts this many times in the
            weight on the work: ``1 + waiting_weight * n``. A second of work delays every request
            that starts on the instance before its queue next drains, not only those waiting now;
            under sustained load that is about ``n / (1 - rho)`` of them (``rho`` the instance's
            utilisation; the M/M/1 busy period), so the count of those waiting now understates it
            by a factor that grows as the fleet nears saturation. ``8`` (the default, ``rho``
            about 0.9) was chosen on the development traces among 1, 3, 5, 6, 8, 10, 12 and 16;
            it changes little while queues are short (``n`` near 0) and keeps shared prefixes
            on their holders under overload, where a spill's extra prefill slows the whole
            fleet. ``1``: the waiting count alone.
        tie_kv_run: among the instances tied on cost (``tie_relative``), prefer those with a free
            sequence slot (fewer than ``max_num_seqs`` requests in flight) whose KV run is the
            deepest and deeper than every tied joint hit; then the least loaded. A KV run beyond
            the joint hit saves nothing now (no checkpoint there), but the replay's ``branch``
            checkpoint policy creates one at that branching boundary when a request runs there,
            so the next request sharing the prefix (another conversation of a tenant, another
            question on a document) hits it; sent to the least loaded instead, every such
            request computes the prefix again. ``False``: the least loaded of the tied.

    Raises:
        ValueError: a guard, tie band or ``waiting_weight`` that is not a finite number >= 0,
            ``own_waiting`` not a number in 0..1, or a switch that is not a bool (each named with
            its value).
    """

    hot_relative: float = 2.0
    hot_absolute_s: float = 2.0
    tie_relative: float = 0.1
    weigh_waiting: bool = True
    count_decode: bool = True
    count_routed: bool = True
    own_waiting: float = 0.0
    price_restore: bool = True
    waiting_weight: float = 8.0
    tie_kv_run: bool = True

    def __post_init__(self) -> None:
        def number(v) -> bool:                   # a real number (numpy's too), not a bool
            return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))

        for name in ("hot_relative", "hot_absolute_s", "tie_relative", "waiting_weight"):
            v = getattr(self, name)
            if not (number(v) and math.isfinite(v) and v >= 0):
                raise ValueError(f"HybridOptions.{name}={v!r} must be a finite number >= 0")
        v = self.own_waiting
        if not (number(v) and 0 <= v <= 1):
            raise ValueError(f"HybridOptions.own_waiting={v!r} must be a number in 0..1")
        for name in ("weigh_waiting", "count_decode", "count_routed", "price_restore", "tie_kv_run"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"HybridOptions.{name}={v!r} must be True or False")

    def waiting_counts(self, loads: list[InstanceLoad], live: list[int]) -> list[float]:
        """``n`` for every instance (indexed as ``loads``): requests waiting for their first
        token, each counted :attr:`waiting_weight` times, blended with the mean over ``live`` by
        :attr:`own_waiting` (:meth:`waiting_among` of every instance)."""
        return self.waiting_among(loads, live, range(len(loads)))

    def waiting_among(self, loads: list[InstanceLoad], live: list[int], among) -> list[float]:
        """:meth:`waiting_counts` of the instances ``among`` only (indices, in that order), the
        same values: reads the loads of ``live`` (for the mean) and ``among``, not every
        instance's."""
        k, a = self.waiting_weight, self.own_waiting
        own = [loads[j].waiting * k for j in among]
        if a == 1:
            return own
        mean = sum([loads[j].waiting * k for j in live]) / len(live) if live else 0.0
        return [a * n + (1 - a) * mean for n in own]


class RoutedPrompts:
    """The prompts a router sent one instance that have no first token yet: what the instance
    will have cached when a request routed now runs, before any event says so.

    Under load a request waits seconds to minutes before its prefill, and only then do its
    entries reach the router's view (:class:`~hybridkv.fleet.events.InstanceView`); the next turn
    of its conversation, arriving meanwhile, would see no hit anywhere and go to the least
    loaded instance, which computes the conversation from zero. SGLang's cache_aware router
    avoids that by inserting each prompt into its per-worker tree when it routes it; this is the
    same record, kept only until the events catch up.

    ``kv`` maps each unit hash of those prompts (beyond what the view already held when routed)
    to the sequence number of the last prompt that brought it, ``checkpoints`` likewise for the
    boundary where each prompt's tail checkpoint will land (its last whole ``tail_tokens``
    block within the reuse cap: the replay's ``tail=B`` policy, :func:`~hybridkv.replay.runner.default_policy`).
    :meth:`trim` keeps the ``waiting`` newest prompts, and of those only the ones not yet served
    by the count of first tokens on the instance (first come, first served: a prompt that had
    ``ahead`` requests routed there before it has its first token once more than ``ahead`` of
    them have; the count is the instance's, so it holds whoever routed the others, as the HTTP
    router's several routers on the same workers do), and forgets everything once nothing waits
    or the view's :attr:`~hybridkv.fleet.events.InstanceView.generation` changes (a restart or
    crash lost what it had; a view's first event is no change, so prompts routed before the
    instance said anything are kept). Entries of prompts
    that got their first token stay until the instance next has nothing waiting, or until
    ``kv`` outgrows :data:`PRUNE_FACTOR` times the units of the waiting prompts, or
    ``checkpoints`` that many times their number (then those older than the oldest waiting
    prompt are dropped, from both tables or from ``checkpoints``); by then they are published, so the view
    holds them as well, unless evicted meanwhile.

    Args:
        unit: ``prefix_match_unit`` in tokens.
        tail_tokens: block where a prompt's tail checkpoint lands, tokens (a multiple of ``unit``).
    """

    PRUNE_FACTOR = 4

    __slots__ = ("unit", "tail_units", "_kv", "_checkpoints", "seqs", "generation", "_held", "_unfolded")

    def __init__(self, unit: int, tail_tokens: int) -> None:
        self.unit, self.tail_units = unit, max(1, tail_tokens // unit)
        self._kv: dict[bytes, int] = {}
        self._checkpoints: dict[bytes, int] = {}
        # (sequence number, units it added, requests routed to the instance before it), oldest first
        self.seqs: deque[tuple[int, int, int]] = deque()
        self.generation = -1                          # the view's generation the records were made in
        self._held = 0                                # units added by the prompts in seqs
        # prompts recorded but not yet folded into the tables, oldest first: (seq, new units,
        # tail unit or None); folded on the first query, so a prompt that gets its first token
        # before any query (an instance at low load) costs no table writes
        self._unfolded: deque[tuple[int, list[bytes], bytes | None]] = deque()

    @property
    def kv(self) -> dict[bytes, int]:
        """Unit hash -> sequence number of the last recorded prompt bringing it."""
        self._fold()
        return self._kv

    @property
    def checkpoints(self) -> dict[bytes, int]:
        """Tail-checkpoint unit hash -> sequence number of its prompt."""
        self._fold()
        return self._checkpoints

    def _fold(self) -> None:
        kv, ck, todo = self._kv, self._checkpoints, self._unfolded
        while todo:
            seq, new, tail = todo.popleft()
            kv.update(dict.fromkeys(new, seq))
            if tail is not None:
                ck[tail] = seq

    def trim(self, waiting: int, generation: int, started: int = 0) -> None:
        """Keep the ``waiting`` newest prompts, less those with fewer than ``started`` requests
        routed to the instance before them (``started``: requests routed there that have had
        their first token or ended, ``InstanceLoad.routed - InstanceLoad.waiting``; 0: not
        known, the ``waiting`` newest kept); all forgotten when none waits or ``generation``
        (the view's, :attr:`~hybridkv.fleet.events.InstanceView.generation`) is not the one
        they were routed under."""
        seqs = self.seqs
        if waiting <= 0 or generation != self.generation:
            if seqs or self._kv:
                seqs.clear()
                self._unfolded.clear()
                self._kv.clear()
                self._checkpoints.clear()
                self._held = 0
            self.generation = generation
            return
        todo = self._unfolded
        while seqs and (len(seqs) > waiting or seqs[0][2] < started):
            seq, n, _ = seqs.popleft()
            self._held -= n
            if todo and todo[0][0] == seq:            # never folded: nothing to forget
                todo.popleft()
        if not seqs:
            self.trim(0, generation)
            return
        floor = seqs[0][0]
        if len(self._kv) > self.PRUNE_FACTOR * max(self._held, 1):
            self._kv = {h: q for h, q in self._kv.items() if q >= floor}
            self._checkpoints = {h: q for h, q in self._checkpoints.items() if q >= floor}
        elif len(self._checkpoints) > self.PRUNE_FACTOR * len(seqs):
            # at most one a prompt: bounded on its own, as prompts the view held whole add no unit
            self._checkpoints = {h: q for h, q in self._checkpoints.items() if q >= floor}

    def add(self, seq: int, units: list[bytes], known: int, limit: int, generation: int, ahead: int = 0) -> None:
        """Record a prompt routed here: ``units`` its unit hashes within the reuse cap,
        ``known`` how many of them (from the start) the view already held, ``limit`` the cap
        (tokens), ``generation`` the view's (a record holding nothing starts in it), ``ahead`` the
        requests routed to the instance before it (``InstanceLoad.routed`` when it is routed;
        :meth:`trim`)."""
        if not self.seqs:
            self.generation = generation
        new = units[known:]
        tail = (limit // self.unit) // self.tail_units * self.tail_units
        self._unfolded.append((seq, new, units[tail - 1] if tail else None))
        self.seqs.append((seq, len(new), ahead))
        self._held += len(new)

    def extend(self, units: list[bytes], view, pair: tuple[int, int, int]) -> tuple[int, int, int]:
        """``(kv_hit, hit, restart)`` (tokens) over the view's entries and these prompts together,
        from the view's own ``(kv_hit, hit, restart)``: the view family's joint-hit rule
        (:func:`~hybridkv.cache.groups.joint_hit`) with the prefix groups' run continued through
        units either holds and boundary states in either (for Kimi Linear: the KV run, and the
        deepest boundary on it with a checkpoint)."""
        self._fold()
        g, kv = self.unit, self._kv
        run = pair[0] // g
        if (run >= len(units) or units[run] not in kv) and pair[0] == pair[1]:
            return pair             # most records: another conversation, and no KV past the checkpoint
        m = joint_hit(view.family, _RoutedPresence(units, g, kv, view.held, self._checkpoints, pair), len(units) * g)
        return m.kv_hit, m.hit, m.restart


class HybridRouter(Router):
    """Lowest marginal cost wins: ``cost_j = T_queue,j + (1 + K * n_j) * W_j`` (seconds), with
    ``W_j = T_prefill,j + T_transfer,j + T_cold,j`` the work the request adds to instance ``j``.

    * ``T_prefill,j``: prefill seconds of ``[h_j, T)``, ``h_j`` the joint hit on instance ``j``
      (its view, by the view's family's rule) or in the store, whichever is deeper (a KV run
      without a checkpoint at or below it saves nothing), plus, when the joint hit's restart
      point ``c_j`` lies below it, the seconds of rebuilding the boundary state from there
      (``restore``: DeepSeek-V4's ``periodic=P`` tail and ``recompute`` cone).
      ``T_saved,j = T_prefill(0) - T_prefill,j``.
    * ``T_queue``: the instance's queued prefill seconds (:attr:`InstanceLoad.queued_seconds`)
      plus, when all ``max_num_seqs`` sequence slots are taken, the wait for one
      (:meth:`queue_seconds`): with several hundred output tokens per request a slot is held
      for seconds of decode, ten times a typical prefill on the H200 model.
    * ``T_transfer``: store bytes of the KV the instance lacks up to ``h_store`` and the
      checkpoint there, over the store bandwidth, when the store's hit is deeper;
      ``T_cold``: the per-object latency of that load (the instance must fetch before it
      computes). Both 0 for a local hit or a miss (:class:`~hybridkv.fleet.store.StoreCost`).
    * ``n_j``: requests waiting on ``j`` for their first token (:attr:`InstanceLoad.waiting`;
      blended with the fleet's mean when ``options.own_waiting`` is below 1: by default the
      mean alone); ``K = options.waiting_weight`` (8 by default) counts each of them ``K`` times,
      as the requests that start before ``j``'s queue drains outnumber those waiting now.
      ``T_queue + W`` is the request's own predicted TTFT; every second of ``W`` also delays
      whatever is queued behind it on ``j`` when it runs. In a steady state as many requests
      join behind it while it waits as are waiting ahead of it now (arrivals match
      departures, Little's law), so ``n_j`` estimates that number and the cost is the
      total delay the placement causes. An idle fleet (``n_j = 0``) reduces to the seed's
      ``score_j = T_saved,j - T_queue,j - T_transfer,j - T_cold,j`` (DESIGN §7; ``score_j =
      T_prefill(0) - cost_j``); under overload the saving is multiplied by the queue it
      shortens, so reuse (less total work) wins over spreading the present queue.
    * ``h_j`` also counts the prompts this router sent ``j`` that have no first token yet
      (:class:`RoutedPrompts`, ``options.count_routed``): under load a conversation's next turn
      arrives before its first turn's entries are published, and would otherwise be a miss
      everywhere. Their checkpoints are assumed only at each prompt's tail block
      (``tail_tokens``), so a KV run alone still saves nothing.
    * Ties (costs within ``tie_relative`` of the full prefill; misses everywhere) go to the
      tied instance with a free sequence slot and the deepest KV run past every tied joint hit
      (``options.tie_kv_run``: a ``branch`` checkpoint will be made there), else to the least
      loaded.

    Args:
        cost: prices prefill (:meth:`StepCostModel.prefill_seconds`).
        store: store transfer cost, or ``None`` (no shared store).
        options: hot-spot guard, tie band, ``weigh_waiting``, ``count_decode``, ``count_routed``.
        max_num_seqs: sequence slots of each instance (prefill and decode together).
        tail_tokens: the block at whose last whole boundary within the reuse cap an instance
            places a prompt's tail checkpoint, tokens (:func:`make_router` passes the KV page
            size, the replay's ``tail=B`` block); ``None``: one ``prefix_match_unit``.
        restore: prices rebuilding a boundary state at a hit from its restart point
            (:data:`RestorePricer`), added to ``T_prefill,j`` for a joint hit whose restart lies
            below it (DeepSeek-V4's ``periodic=P`` and ``recompute``: the hit's value is the
            prefill it saves less that recompute); ``None``: restores cost nothing (Kimi Linear,
            whose checkpoints are saved at the hit).

    Raises:
        ValueError: ``max_num_seqs`` or ``tail_tokens`` below 1.
    """

    name = "hybrid"

    def __init__(self, cost: StepCostModel, store: StoreCost | None = None,
                 options: HybridOptions = HybridOptions(), max_num_seqs: int = 1,
                 tail_tokens: int | None = None, restore: RestorePricer | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs!r} must be at least 1")
        if tail_tokens is not None and tail_tokens < 1:
            raise ValueError(f"tail_tokens={tail_tokens!r} must be at least 1 (or None: one unit)")
        self.cost = cost
        self.store = store
        self.options = options
        self.max_num_seqs = max_num_seqs
        self.tail_tokens = tail_tokens
        self.restore = restore
        self.routed: list[RoutedPrompts] = []      # per instance, when options.count_routed
        self._seq = itertools.count()
        self._active: set[int] = set()              # instances whose RoutedPrompts hold any
        self._expected: int | None = None
        self._expected_s: float | None = None

    def expected_hit(self) -> int | None:
        """The hit (tokens) the last :meth:`route` priced on the instance it chose: its view's
        joint hit, the prompts routed there and waiting, or the store's, whichever is deepest."""
        return self._expected

    def expected_seconds(self) -> float | None:
        """The work (seconds: prefill, store transfer and latency) the last :meth:`route` priced
        on the instance it chose."""
        return self._expected_s

    def _routed(self, fleet: FleetState, unit: int) -> list[RoutedPrompts]:
        """The :class:`RoutedPrompts` of every instance, trimmed to what waits there now (only
        those holding any are visited: at low load most hold none)."""
        routed, loads, views, active = self.routed, fleet.loads, fleet.views, self._active
        while len(routed) < len(loads):
            routed.append(RoutedPrompts(unit, self.tail_tokens or unit))
        live = fleet.live
        for j in ([*active] if len(live) == len(loads) else active.intersection(live)):   # narrowed: those
            rp = routed[j]
            ld = loads[j]
            rp.trim(ld.waiting, views[j].generation, ld.routed - ld.waiting)
            if not rp.seqs:
                active.discard(j)
        return routed

    def queue_seconds(self, ld: InstanceLoad) -> float:
        """Predicted seconds before a request sent to an instance with load ``ld`` starts.

        Queued prefill seconds, plus, when the ``S = max_num_seqs`` slots are full
        (``m = in_flight >= S``), a fluid estimate of the wait for one:
        ``decode_tokens * t_token * (m - S + 1) / m``. ``decode_tokens * t_token`` drains
        every decode routed there at a full batch (``t_token``: the cost model's decode step
        of ``S`` sequences at the instance's mean context, over ``S``); a slot frees once
        ``m - S + 1`` of the ``m`` requests ahead are done, taken as that share of the work.
        """
        q = ld.queued_seconds
        s, m = self.max_num_seqs, ld.in_flight
        if not self.options.count_decode or m < s or ld.decode_tokens <= 0:
            return q
        context = ld.in_flight_tokens // m
        t_token = self.cost.step_seconds([], s, s * context) / s
        return q + ld.decode_tokens * t_token * (m - s + 1) / m

    def predicted_prefill(self, req: RouteRequest, hit: int) -> float:
        """Seconds to prefill ``[hit, T)`` of ``req``."""
        return self.cost.prefill_seconds(hit, req.prompt_tokens)

    def score(self, req: RouteRequest, fleet: FleetState, j: int, store_hit: int,
              store_restart: int | None = None) -> tuple[float, int]:
        """``(score in seconds, tokens reused)`` of sending ``req`` to instance ``j`` when the
        store's joint hit is ``store_hit`` (restart point ``store_restart``, default the hit); the
        score is ``T_prefill(0) - cost_j`` (higher is better; the seed's score when nothing waits)."""
        view = fleet.views[j]
        m = view.match(req.hashes, req.limit)
        pair = (m.kv_hit, m.hit, m.restart)
        if self.options.count_routed and isinstance(view, InstanceView) and req.limit >= 0:
            rp = self._routed(fleet, view.unit)[j]
            if rp.seqs:
                pair = rp.extend(req.hashes[:req.limit // view.unit], view, pair)
        work, hit = self._work(req, pair, (store_hit, store_hit if store_restart is None else store_restart))
        ld = fleet.loads[j]
        weight = 1 + self.options.waiting_among(fleet.loads, fleet.live, [j])[0] if self.options.weigh_waiting else 1
        return self.predicted_prefill(req, 0) - self.queue_seconds(ld) - weight * work, hit

    def _work(self, req: RouteRequest, local: tuple[int, int, int], store: tuple[int, int]) -> tuple[float, int]:
        """``(seconds of prefill, restore recompute, transfer and store latency, tokens reused)``
        for an instance whose own prefix run, joint hit and restart point are ``local`` (tokens),
        the store's joint hit and restart point ``store``."""
        kv_hit, hit, restart = local
        store_hit, store_restart = store
        restore = self.restore if self.options.price_restore else None
        return priced_prefill(self.cost, self.store, req.prompt_tokens, kv_hit, hit, store_hit,
                              restore_seconds(restore, restart, hit), restore_seconds(restore, store_restart, store_hit))

    def candidates(self, fleet: FleetState) -> list[int]:
        """Live instances not hot: predicted wait (:meth:`queue_seconds`) within the guard."""
        live = fleet.live
        return self._cool(live, [self.queue_seconds(fleet.loads[j]) for j in live])

    def _cool(self, live: list[int], q: list[float]) -> list[int]:
        """Of the instances ``live``, those whose waits ``q`` (seconds, one per live
        instance) lie within the hot-spot guard; all of them when none does."""
        bound = self.options.hot_relative * sum(q) / len(q) + self.options.hot_absolute_s
        cool = [j for j, s in zip(live, q) if s <= bound]
        return cool or list(live)

    def route(self, req: RouteRequest, fleet: FleetState) -> int:
        """The best :meth:`score` among :meth:`candidates`, ties (within ``tie_relative`` of
        ``T_prefill(0)``) to the least loaded. Computed as :meth:`score` is, with each
        instance's wait computed once and the prefill, transfer and latency seconds computed
        once per distinct ``(kv_hit, hit)`` (instances mostly share a few: the same system
        prompt, or nothing)."""
        live_instances(fleet)
        if fleet.store is not None:
            sm = fleet.store.match(req.hashes, req.limit)
            store = (sm.hit, sm.restart)
        else:
            store = (0, 0)
        loads, views, hashes, limit = fleet.loads, fleet.views, req.hashes, req.limit
        live = fleet.live
        # read only the live instances' loads (a large fleet's candidates: O(candidates), not O(fleet))
        some = loads if len(live) == len(loads) else [loads[j] for j in live]
        if type(self).queue_seconds is HybridRouter.queue_seconds and self.options.count_decode:
            # queue_seconds' first case inline (an instance with a free slot or nothing to decode
            # waits its queued prefill only); the others computed by it, the same values
            s, qs = self.max_num_seqs, self.queue_seconds
            q = [ld.queued_seconds if ld.in_flight < s or ld.decode_tokens <= 0 else qs(ld) for ld in some]
        else:
            q = [self.queue_seconds(ld) for ld in some]
        p0 = self.predicted_prefill(req, 0)
        cool = self._cool(live, q)                  # q: one wait per live instance (ascending)
        q = dict(zip(live, q))                      # instance -> its wait
        # the cool views of one kind and unit (a fleet's): the joint-hit rule over one slice of the
        # prompt's hashes shared by them, through one _ViewsPresence (only they are scored)
        cviews = [views[j] for j in cool]
        plain = (limit >= 0 and {*map(type, cviews)} == _PLAIN_VIEW and len({*map(_UNIT, cviews)}) == 1
                 and _one_family(cviews))
        g = cviews[0].unit if plain else 0
        units = hashes[:limit // g] if plain else hashes
        active = ()
        if self.options.count_routed and limit >= 0 and isinstance(views[live[0]], InstanceView):
            unit = views[live[0]].unit
            routed, active = self._routed(fleet, unit), self._active
            cunits = units if unit == g else hashes[:limit // unit]       # the views' slice when they share it
        if plain:       # the rule for every cool view at once (lists, in the order of ``cool``)
            view_pairs = list(zip(*joint_hits(cviews[0].family, _ViewsPresence(units, g, cviews), limit)))
        # per instance of ``cool``, in order (the mean read over ``live``)
        waiting = self.options.waiting_among(loads, live, cool) if self.options.weigh_waiting else None
        works: dict[tuple[int, int], tuple[float, int]] = {}     # (kv_hit, hit) -> (seconds, tokens reused)
        pairs, scores, own = [], [], {}                          # per instance of ``cool``, in order
        add_pair, add_score, priced_for, work = pairs.append, scores.append, works.get, self._work
        for k, j in enumerate(cool):
            if plain:
                pair = view_pairs[k]
            else:
                m = views[j].match(hashes, limit)
                pair = (m.kv_hit, m.hit, m.restart)
            if j in active:
                own[j] = pair                            # the view's own pair, before the records
                pair = routed[j].extend(cunits, views[j], pair)
            add_pair(pair)
            priced = priced_for(pair)
            if priced is None:
                priced = works[pair] = work(req, pair, store)
            add_score(p0 - q[j] - (1 + waiting[k] if waiting is not None else 1) * priced[0])
        floor = max(scores) - (self.options.tie_relative * p0 + 1e-9)
        tied = [k for k, sc in enumerate(scores) if sc >= floor]
        if self.options.tie_kv_run and len(tied) > 1:
            free = [k for k in tied if loads[cool[k]].in_flight < self.max_num_seqs]
            deepest = max([pairs[k][0] for k in free], default=0)
            if deepest > max([pairs[k][1] for k in tied]):
                tied = [k for k in free if pairs[k][0] == deepest]
        j = least_loaded(loads, [cool[k] for k in tied])
        k = cool.index(j)
        self._expected_s, self._expected = works[pairs[k]]
        if active is self._active:
            known = own.get(j, pairs[k])[0] // unit                  # the view's own run, before the records
            routed[j].add(next(self._seq), cunits, known, limit, views[j].generation, loads[j].routed)
            active.add(j)
        return j


ROUTER_NAMES = ("round-robin", "least-load", "prefix", "kv-overlap", "hybrid", "prefix-smg")
"""Names ``--router`` accepts (``prefix-smg``: :class:`SMGPrefixRouter`, an extra one for comparison)."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything a router may need, built once from the command line.

    Attributes:
        name: one of :data:`ROUTER_NAMES`.
        unit: ``prefix_match_unit`` (tokens).  block_size: KV page size (tokens).
        cost: the step cost model (prices prefill for ``hybrid``).
        store: store transfer cost or ``None``.
        prefix: ``prefix`` and ``prefix-smg`` thresholds.  hybrid: ``hybrid`` guard.
        max_num_seqs: sequence slots of each instance (``hybrid``'s wait for a slot).
        seed: seeds ``kv-overlap``'s random tie-break.
        restore: prices a restore's recompute for ``hybrid`` (:data:`RestorePricer`); ``None``: free.
    """

    name: str
    unit: int
    block_size: int
    cost: StepCostModel
    store: StoreCost | None = None
    prefix: PrefixOptions = PrefixOptions()
    hybrid: HybridOptions = HybridOptions()
    max_num_seqs: int = 1
    seed: int = 0
    restore: RestorePricer | None = None


def make_router(cfg: RouterConfig) -> Router:
    """A fresh router.

    Raises:
        ValueError: an unknown router name (named, with the choices).
    """
    if cfg.name == "round-robin":
        return RoundRobin()
    if cfg.name == "least-load":
        return LeastLoad()
    if cfg.name == "prefix":
        return PrefixRouter(cfg.unit, cfg.prefix)
    if cfg.name == "prefix-smg":
        return SMGPrefixRouter(cfg.unit, cfg.prefix)
    if cfg.name == "kv-overlap":
        return KVOverlapRouter(cfg.block_size, seed=cfg.seed)
    if cfg.name == "hybrid":
        return HybridRouter(cfg.cost, cfg.store, cfg.hybrid, cfg.max_num_seqs, cfg.block_size, cfg.restore)
    raise ValueError(f"unknown router {cfg.name!r}; choose one of {', '.join(ROUTER_NAMES)}")
