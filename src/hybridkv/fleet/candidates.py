"""Bounded routing on a large fleet: the few instances a router weighs for one request.

A router that scores every instance costs ``O(instances)`` a decision, which at 1,024 instances
and a million requests is most of a simulation. Above :data:`DEFAULT_ROUTE_CANDIDATES` instances
the fleet instead hands the router a short list of candidates as its ``live`` instances
(:class:`~hybridkv.fleet.routers.FleetState`):

* the ``k`` instances with the smallest predicted wait (the router's :meth:`load key
  <CandidateIndex>`, the hybrid router's queued seconds), and the ``k`` lightest by the
  least-load key (outstanding prompt tokens, requests in flight, requests routed), ``k =
  limit // 2``; per key the ``k`` lightest are held apart in order and the rest in a heap, both
  updated when an instance's load changes (lazy: a stale entry is skipped when popped; the heap
  is rebuilt when stale entries outnumber the live ones three to one), so a decision with every
  instance up reads ``k`` entries, and one with some down ``O(k log n)``;
* the prompt's *holders*: the instances this fleet last sent a prompt that shares a prefix with
  it. Every routed prompt is remembered by the chained hash of the unit ending its last whole KV
  page (one entry a request, the oldest forgotten past ``history`` entries); a new prompt's page
  ends are looked up deepest first, and the first :data:`MAX_HOLDERS` distinct instances found
  join the list.
  A conversation's next turn re-sends its history, so it finds where its last turn went.

The router then scores only those, with the same views and loads as always, so its joint hits
stay exact for every candidate; what it gives up is an instance outside the list that would
score better (one holding the prefix of a prompt it was never sent, through a shared system
prompt, say, and lightly loaded without being among the ``k`` lightest). At or below the limit
every live instance is a candidate and decisions are those of a full scan.
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections import OrderedDict
from collections.abc import Callable
from operator import attrgetter

DEFAULT_ROUTE_CANDIDATES = 32
"""Instances a router weighs per decision on a fleet larger than this (``--route-candidates``):
half by the router's load key, half by the least-load key, plus the prompt's holders. At or
below it every instance is weighed (8 and 32 instances route exactly as a full scan)."""

MAX_HOLDERS = 8
"""Most instances a prompt's holders add to the candidates (deepest shared prefix first)."""

DEFAULT_HISTORY = 1 << 20
"""Routed prompts remembered for holder lookups (one entry, about 150 bytes, a prompt)."""


class CandidateIndex:
    """The candidates of each routing decision on a fleet of ``n`` instances (module docstring).

    Args:
        loads: each instance's :class:`~hybridkv.fleet.routers.InstanceLoad` (read, never written).
        limit: candidates by load (``k = limit // 2`` per key); at least 2.
        wait_key: the router's load key of one load (smaller is lighter), e.g. the hybrid router's
            :meth:`~hybridkv.fleet.routers.HybridRouter.queue_seconds`; ``None``: the least-load key only.
        history: routed prompts remembered for holder lookups.
        stride: units per KV page: prompts are remembered, and looked up, by the unit ending their
            last whole page (a page's units are cached together), so a lookup probes one unit a page.

    Raises:
        ValueError: ``limit`` below 2, ``history`` or ``stride`` below 1.
    """

    def __init__(self, loads: list, limit: int = DEFAULT_ROUTE_CANDIDATES,
                 wait_key: Callable | None = None, history: int = DEFAULT_HISTORY, stride: int = 1) -> None:
        if limit < 2:
            raise ValueError(f"route candidates {limit!r} must be at least 2")
        if history < 1:
            raise ValueError(f"history={history!r} must be at least 1")
        if stride < 1:
            raise ValueError(f"stride={stride!r} must be at least 1")
        self.stride = stride
        self.loads = loads
        self.k = limit // 2
        self.keys: list[Callable] = [_least_load_key] + ([wait_key] if wait_key is not None else [])
        n = len(loads)
        self._version = [0] * n
        # entries (key, instance, version): equal keys pop lowest index first, as least_loaded breaks ties.
        # Per key, the k lightest current entries are held apart, ascending (``_tops``, with
        # ``_in_top`` mapping each of their instances to its entry), and the rest in a heap
        # (``_heaps``, stale entries skipped when popped): every entry of a top is lighter than
        # every current entry of its heap, so a decision on a fleet with every instance live reads
        # the top alone, and a load change moves at most a few entries between the two.
        self._heaps: list[list] = [[(key(ld), j, 0) for j, ld in enumerate(loads)] for key in self.keys]
        self._pushed: list[list] = [[e[0] for e in h] for h in self._heaps]    # last key pushed, per instance
        self._tops: list[list] = [[] for _ in self.keys]
        self._in_top: list[dict] = [{} for _ in self.keys]
        for i, h in enumerate(self._heaps):
            heapq.heapify(h)
            self._refill(i)
        self._placed: OrderedDict[bytes, int] = OrderedDict()
        self._history = history
        self.decisions = 0
        self.weighed = 0          # candidates over all decisions (the mean is the per-decision cost)

    def _refill(self, i: int) -> None:
        """Move the lightest current entries of heap ``i`` to its top until it holds ``k``."""
        top, in_top, h, version, k = self._tops[i], self._in_top[i], self._heaps[i], self._version, self.k
        pop = heapq.heappop
        while len(top) < k and h:
            entry = pop(h)
            j = entry[1]
            if entry[2] == version[j]:           # else stale: a newer entry of j is in the heap or top
                top.append(entry)                # no lighter than any entry of the top
                in_top[j] = entry

    def changed(self, j: int) -> None:
        """Instance ``j``'s load changed (a step, a routed request, a crash or restart)."""
        ld, fs, pushed = self.loads[j], self.keys, self._pushed
        k0 = fs[0](ld)
        if len(fs) == 1:                            # one or two keys (__init__)
            if k0 == pushed[0][j]:
                return                              # e.g. a decode step with a free slot: nothing to re-rank
            keys = (k0,)
        else:
            k1 = fs[1](ld)
            if k0 == pushed[0][j] and k1 == pushed[1][j]:
                return
            keys = (k0, k1)
        v = self._version[j] = self._version[j] + 1
        n, k = len(self.loads), self.k
        for i, key in enumerate(keys):             # every key: all entries share one version
            pushed[i][j] = key
            entry, h, top, in_top = (key, j, v), self._heaps[i], self._tops[i], self._in_top[i]
            old = in_top.pop(j, None)
            if old is not None:
                top.remove(old)
            if top and entry < top[-1]:             # among the k lightest: into the top, its last out
                insort(top, entry)
                in_top[j] = entry
                if len(top) > k:
                    last = top.pop()
                    del in_top[last[1]]
                    heapq.heappush(h, last)
            else:
                heapq.heappush(h, entry)
            if len(top) < k:
                self._refill(i)
            if len(h) > 4 * n + 64:                 # mostly stale: rebuild from the current loads
                h[:] = [(pushed[i][x], x, self._version[x]) for x in range(n) if x not in in_top]
                heapq.heapify(h)

    def _lightest(self, i: int, live: set[int] | None, out: set[int]) -> None:
        """Add the ``k`` lightest live instances by key ``i`` to ``out`` (``live`` ``None``: all are)."""
        top = self._tops[i]
        if live is None:                            # the top is the k lightest
            out.update([e[1] for e in top])
            return
        k, got = self.k, 0
        for e in top:                               # the top, then the heap, lightest first
            if e[1] in live:
                out.add(e[1])
                got += 1
                if got >= k:
                    return
        h, version, taken = self._heaps[i], self._version, []
        pop, keep = heapq.heappop, taken.append
        while h:
            entry = pop(h)
            j = entry[1]
            if entry[2] != version[j]:
                continue                              # stale: a newer entry of j is in the heap or top
            keep(entry)
            if j in live:
                out.add(j)
                got += 1
                if got >= k:
                    break
        push = heapq.heappush
        for entry in taken:
            push(h, entry)

    def candidates(self, hashes: list[bytes], limit_units: int, live: list[int]) -> list[int]:
        """The candidates (ascending indices, a subset of ``live``) for a prompt with unit hashes
        ``hashes`` of which ``limit_units`` may be reused."""
        live_set = None if len(live) == len(self.loads) else set(live)    # None: every instance is live
        out: set[int] = set()
        for i in range(len(self._heaps)):
            self._lightest(i, live_set, out)
        placed, found, r = self._placed, 0, self.stride
        for i in range(min(limit_units, len(hashes)) // r * r - 1, -1, -r):
            j = placed.get(hashes[i])
            if j is not None and (live_set is None or j in live_set) and j not in out:
                out.add(j)
                found += 1
                if found == MAX_HOLDERS:
                    break
        self.decisions += 1
        self.weighed += len(out)
        return sorted(out)

    def placed(self, hashes: list[bytes], limit_units: int, j: int) -> None:
        """Remember that the prompt with these unit hashes went to instance ``j`` (by the unit ending
        its last whole page within ``limit_units``; the oldest remembered prompt forgotten past
        ``history``; a prompt shorter than a page is not remembered)."""
        n = min(limit_units, len(hashes)) // self.stride * self.stride
        if not n:
            return
        key = hashes[n - 1]
        placed = self._placed
        placed[key] = j
        placed.move_to_end(key)
        if len(placed) > self._history:
            placed.popitem(last=False)


_least_load_key = attrgetter("outstanding_tokens", "in_flight", "routed")
"""The least-load key of a load: ``(outstanding_tokens, in_flight, routed)`` (read in C)."""


NARROWED_ROUTERS = ("hybrid", "least-load", "kv-overlap")
"""Routers a large fleet narrows to candidates. ``least-load`` loses nothing (the lightest instance
is always among them); ``round-robin`` needs no scan; ``prefix`` and ``prefix-smg`` keep every
instance, since their fleet-wide balance tests (SGLang's) read every instance's load (one pass in
C over the loads), and find their longest match through a map from unit keys to the trees holding
them above :data:`~hybridkv.fleet.routers.HOLDER_MAP_ABOVE` instances, never a scan of every tree."""
