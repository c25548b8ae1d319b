"""The fleet: a discrete-event loop over instances on virtual clocks, a router, and the
event stream between them.

Arrivals are taken in time order. Before a request is routed, every instance whose
clock is earlier steps first (the instance with the earliest clock always goes next),
so a routing decision at time ``t`` sees each instance as of its last step ending by
``t`` (a step that started before ``t`` and ends after it is seen whole: the instance
state is sampled at step granularity). Cache events an instance emits in a step
reach the router's views when that step ends. The same loop drives real engines (step
durations measured) and simulated ones (durations from a cost model).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybridkv.cache.groups import reuse_cap
from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView
from hybridkv.fleet.candidates import CandidateIndex
from hybridkv.fleet.instance import Coast, FleetInstance, FleetRequest
from hybridkv.fleet.routers import (FleetState, RestorePricer, Router, RouteRequest, kv_admission, priced_prefill,
                                    restore_seconds)
from hybridkv.fleet.store import StoreCost, StoreView


_STORED, _CK_STORED = EventKind.BLOCKS_STORED, EventKind.CHECKPOINTS_STORED


@dataclass(slots=True)
class _EventQueue:
    """Events waiting for their delivery time (seconds), in order: one heap entry a batch
    (the events of one step, in their order), batches due at the same time in push order."""

    heap: list = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)

    def push(self, at: float, events: list[CacheEvent]) -> None:
        if events:
            heapq.heappush(self.heap, (at, next(self.seq), events))

    def due(self, now: float) -> bool:
        """Some event is due by ``now``."""
        return bool(self.heap) and self.heap[0][0] <= now

    def pop_until(self, now: float):
        heap = self.heap
        while heap and heap[0][0] <= now:
            yield from heapq.heappop(heap)[2]


class Fleet:
    """Instances, a router and the router's event-fed views.

    Args:
        instances: the instances (indices ``0..N-1`` in order).
        router: decides where each request goes.
        unit: ``prefix_match_unit`` in tokens.
        estimate: prices the prefill a routed request will need (its queued-seconds load).
        store: the shared store's view (fed by every instance's events), or ``None``.
        store_cost: prices a load from the store in that queued-seconds load when the router
            makes no estimate of its own (:func:`~hybridkv.fleet.routers.priced_prefill`);
            ``None``: a store hit's queued prefill is priced without the load.
        restore: prices rebuilding a boundary state below a hit in that estimate likewise
            (:data:`~hybridkv.fleet.routers.RestorePricer`); ``None``: restores cost nothing.

    The router's views follow the instances' cache groups (their engines' backend ``family``).
    """

    coast = True
    """An instance with modelled decoders and nothing else to do takes its decode steps as one
    plan, applied when the fleet next needs it (:meth:`FleetInstance.coast_plan
    <hybridkv.fleet.instance.FleetInstance.coast_plan>`), instead of one loop turn a step: the
    same steps, the same results; ``False``: every step through the loop."""

    def __init__(self, instances: list[FleetInstance], router: Router, unit: int, estimate: StepCostModel,
                 store: StoreView | None = None, store_cost: StoreCost | None = None,
                 restore: RestorePricer | None = None) -> None:
        if not instances:
            raise ValueError("a fleet needs at least one instance")
        self.instances = instances
        self.router = router
        self.unit = unit
        self.estimate = estimate
        self.store_cost = store_cost
        self.restore = restore
        self.family = instances[0].handle.backend.family
        self.state = FleetState(views=[InstanceView(unit, self.family) for _ in instances],
                                loads=[i.load for i in instances], store=store)
        self._events = _EventQueue()
        self._hash = instances[0].handle.engine.cache.hash_prompt
        self._block_size = instances[0].handle.engine.cache.config.block_size
        self._busy: list[tuple[float, int]] = []
        self._restarts: list[tuple[float, int]] = []      # (not before, instance), not yet done
        self.restarts_done: list[dict] = []
        self.candidates: CandidateIndex | None = None     # set: routers weigh candidates (large fleets)
        self.hash_request: Callable[[FleetRequest], list[bytes]] | None = None   # set: hashed when routed,
        self.keep_hash_at = 1      # and when finished only the prefix key at this unit kept (the report's phases)
        self._faults: list[tuple[float, int, int, float, float]] = []   # heap: (at, 0 back / 1 crash, instance,
        #                                                                  cold-start s, time asked for)
        self.crashes_done: list[dict] = []
        self.coasted = 0           # decode-only steps planned by coasting (not taken one loop turn each)
        self._coasting: dict[int, Coast] = {}             # instance -> its plan, in _busy at plan.end
        self._stale: Counter[tuple[float, int]] = Counter()   # _busy entries of plans applied early
        self._arrivals: list[float] = []
        self._coast_below = getattr(router, "max_num_seqs", None)

    def deliver(self, now: float) -> None:
        """Apply every event due by ``now`` (seconds) to the router's views."""
        heap = self._events.heap
        if not heap or heap[0][0] > now:
            return
        views, store = self.state.views, self.state.store
        # a StoreView takes in what was stored only (removals and clears do not reach the store)
        stored_only = store is not None and type(store).apply is StoreView.apply
        pop = heapq.heappop
        while heap and heap[0][0] <= now:       # _EventQueue.pop_until, batch by batch
            for ev in pop(heap)[2]:
                views[ev.instance].apply(ev)
                if store is not None and (not stored_only or ev.kind is _STORED or ev.kind is _CK_STORED):
                    store.apply(ev)

    def route(self, fr: FleetRequest, now: float | None = None) -> int:
        """Route one request at ``now`` (default its arrival; later for one requeued after a
        crash) and queue it on the chosen instance. Its queued seconds are the router's own
        price (:meth:`~hybridkv.fleet.routers.Router.expected_seconds`: prefill past the hit,
        plus the store load when the hit is the store's), else priced the same way from the
        chosen instance's view and the store's. With every instance down it goes to the
        one back first, its queued prefill (and ``kv-overlap``'s page counts) priced on the empty
        cache it comes back with: the whole prompt."""
        now = fr.arrival if now is None else now
        self.deliver(now)
        r = fr.request
        if r.hashes is None:                     # hashed once: the router, the store and the engine share them
            r.hashes = self._hash(r.prompt, r.namespace) if self.hash_request is None else self.hash_request(fr)
        hashes = fr.hashes = r.hashes
        rr = RouteRequest(hashes=hashes, prompt_tokens=r.prompt_len, limit=reuse_cap(r.prompt_len, self.unit),
                          output_tokens=fr.output_tokens)
        if self.state.live:
            j = self.router.route(rr, self._narrowed(rr))
        else:
            j = min(range(len(self.instances)), key=lambda k: (self.instances[k].clock, k))
        if not 0 <= j < len(self.instances):
            raise RuntimeError(f"router {self.router.name} chose instance {j} of {len(self.instances)}")
        seconds = None
        if self.state.live:
            view = self.state.views[j]
            seconds = self.router.expected_seconds()     # the router's own price, else the views'
            if seconds is None:
                seconds = self._priced(view, hashes, rr.limit, r.prompt_len)
        else:
            # every instance is down: ``j`` comes back with an empty cache, while its view still
            # shows the lost one until the return (``all_cleared`` is heard then); priced from zero
            view = InstanceView(self.unit, self.family)
            seconds = self.estimate.prefill_seconds(0, r.prompt_len)
        inst = self.instances[j]
        if self.router.uses_pages:
            fr.pages = kv_admission(view, hashes, r.prompt_len, self._block_size)
        if j in self._coasting:                  # its steps that start before now, then it steps again
            self._wake(j, now)
        idle = not inst.has_work
        inst.enqueue(fr, now, seconds)
        if self.candidates is not None:
            self.candidates.placed(hashes, rr.limit // self.unit, j)
            self.candidates.changed(j)
        if idle:
            heapq.heappush(self._busy, (inst.clock, j))
        return j

    def _narrowed(self, rr: RouteRequest) -> FleetState:
        """The state the router decides on: :attr:`state`, or with :attr:`candidates` set and more
        live instances than its limit, the same views and loads with ``live`` narrowed to the
        request's candidates (:meth:`~hybridkv.fleet.candidates.CandidateIndex.candidates`)."""
        c, state = self.candidates, self.state
        if c is None or len(state.live) <= 2 * c.k:
            return state
        live = c.candidates(rr.hashes, rr.limit // self.unit, state.live)
        return FleetState(views=state.views, loads=state.loads, store=state.store, live=live)

    def _priced(self, view: InstanceView, hashes: list[bytes], limit: int, prompt_len: int) -> float:
        """Queued seconds of a prompt routed to the instance of ``view`` by a router that prices
        none: :func:`~hybridkv.fleet.routers.priced_prefill` over the view's hits and the store's,
        with each one's restore recompute (:attr:`restore`)."""
        m = view.match(hashes, limit)
        store = self.state.store
        sm = store.match(hashes, limit) if store is not None and self.store_cost is not None else None
        store_hit, store_restart = (sm.hit, sm.restart) if sm is not None else (0, 0)
        return priced_prefill(self.estimate, self.store_cost, prompt_len, m.kv_hit, m.hit, store_hit,
                              restore_seconds(self.restore, m.restart, m.hit),
                              restore_seconds(self.restore, store_restart, store_hit))[0]

    def _wake(self, j: int, now: float) -> None:
        """Apply instance ``j``'s coasting plan up to ``now`` (its steps that start before it,
        as the loop would have stepped it by then); it is then stepped as any busy instance."""
        plan, inst = self._coasting.pop(j), self.instances[j]
        inst.coast_to(plan, now)
        if inst.clock != plan.end:               # its entry at plan.end is void; one at its clock
            self._stale[(plan.end, j)] += 1
            heapq.heappush(self._busy, (inst.clock, j))

    def _coasts(self, inst: FleetInstance) -> bool:
        """``inst`` may coast: modelled decoders only, its load as the router reads it unchanged
        by their steps (fewer requests in flight than the router's sequence slots, whose
        ``queue_seconds`` counts the decode only when they are full), no fault pending."""
        return (self.coast and inst.decoding and not inst.queue and not inst.in_engine
                and inst.step_log is None and inst.cost is not None and not inst.handle.engine.has_work
                and not self._faults and not self._restarts
                and (self._coast_below is None or inst.load.in_flight < self._coast_below))

    def _step_next(self, horizon: float) -> int:
        entry = heapq.heappop(self._busy)
        j = entry[1]
        if self._stale and self._stale.get(entry):
            self._stale[entry] -= 1
            if not self._stale[entry]:
                del self._stale[entry]
            return 0
        inst = self.instances[j]
        plan = self._coasting.pop(j, None)
        if plan is not None:
            inst.coast_to(plan)
        self.deliver(inst.clock)                 # the store holds what was written before this step
        done = inst.step(horizon)
        if self.candidates is not None:
            self.candidates.changed(j)
        if self.hash_request is not None:        # hashed lazily: a finished request keeps one prefix key
            k = self.keep_hash_at
            for fr in done:
                hs = fr.hashes
                fr.hashes = [hs[min(k, len(hs)) - 1]] if hs else []
                fr.request.hashes = None
                m = fr.request.match                # its lookup's copy of the hashes and the index
                if m is not None:                   # nodes it matched (kept alive past eviction)
                    m.hashes, m.path = [], []
        self._events.push(inst.clock, inst.publisher.drain())
        if inst.has_work:
            plan = self._coasts(inst) and inst.coast_plan(self._arrivals)
            if plan:
                self._coasting[j] = plan
                self.coasted += len(plan.starts)
            heapq.heappush(self._busy, (plan.end if plan else inst.clock, j))
        return len(done)

    def run(self, requests: list[FleetRequest], progress: Callable[[int], None] | None = None) -> None:
        """Serve ``requests`` (sorted by arrival) until every one is finished or rejected;
        ``progress(n)`` hears of requests as they end.

        Raises:
            ValueError: ``requests`` not sorted by arrival (naming the first out of order).
        """
        for a, b in itertools.pairwise(requests):
            if b.arrival < a.arrival:
                raise ValueError(f"requests must be sorted by arrival: trace index {b.index} arrives "
                                 f"at {b.arrival} s, before {a.arrival} s")
        arrivals = self._arrivals = [fr.arrival for fr in requests]
        i, n, busy, inf = 0, len(requests), self._busy, math.inf
        while i < n or busy:
            nxt = arrivals[i] if i < n else inf
            fault = self._faults[0][0] if self._faults else inf
            until = nxt if nxt <= fault else fault          # min(nxt, fault)
            if busy and busy[0][0] < until:
                ended = self._step_next(until)
                if ended and progress is not None:
                    progress(ended)
            elif fault <= nxt and self._faults:
                self._fault_due()
            else:
                if self._restarts:
                    self._restart_due(nxt)
                self.route(requests[i])
                i += 1
        self.deliver(math.inf)

    def restart(self, j: int) -> None:
        """Restart instance ``j`` (idle) with an empty cache in a new epoch; the router hears
        ``all_cleared`` at the instance's clock."""
        inst = self.instances[j]
        inst.restart()
        if self.candidates is not None:
            self.candidates.changed(j)
        self._events.push(inst.clock, inst.publisher.drain())


    def schedule_restart(self, j: int, at: float) -> None:
        """Restart instance ``j`` at the first moment it is idle at or after ``at`` (seconds on
        the fleet's clock), checked as requests arrive: a graceful restart that lets the requests
        it holds finish. One that never finds it idle before the last arrival does not happen;
        :attr:`restarts_done` lists those that did (``{instance, requested, at}``).

        Raises:
            ValueError: ``j`` not an instance of the fleet, or ``at`` negative or not finite.
        """
        if not 0 <= j < len(self.instances):
            raise ValueError(f"restart of instance {j}: the fleet has instances 0..{len(self.instances) - 1}")
        if not (at >= 0 and math.isfinite(at)):
            raise ValueError(f"restart of instance {j} at {at!r} s: the time must be finite and >= 0")
        self._restarts.append((at, j))
        self._restarts.sort()

    def schedule_crash(self, j: int, at: float, cold_start_s: float) -> None:
        """Crash instance ``j`` at ``at`` (seconds on the fleet's clock; a step under way then
        completes first: instances are sampled at step granularity). It loses its cache and the
        requests it holds; the router stops sending it traffic at once (as service discovery
        would on a lost lease) and routes the lost requests again at the crash (their TTFT still
        counts from their arrival). The instance is back ``cold_start_s`` later with an empty
        cache in a new epoch whose sequence numbers start at 0 (``all_cleared`` reaches the
        views then: what the router knew of its old cache stops attracting traffic). A crash
        after the fleet has no work left does not happen; :attr:`crashes_done` lists those that
        did (``{instance, requested, at, back_at, requeued}``).

        Raises:
            ValueError: ``j`` not an instance of the fleet; ``at`` or ``cold_start_s`` negative
                or not finite.
        """
        if not 0 <= j < len(self.instances):
            raise ValueError(f"crash of instance {j}: the fleet has instances 0..{len(self.instances) - 1}")
        if not (at >= 0 and math.isfinite(at)):
            raise ValueError(f"crash of instance {j} at {at!r} s: the time must be finite and >= 0")
        if not (cold_start_s >= 0 and math.isfinite(cold_start_s)):
            raise ValueError(f"cold start of {cold_start_s!r} s: must be finite and >= 0")
        heapq.heappush(self._faults, (at, 1, j, cold_start_s, at))

    def _fault_due(self) -> None:
        """The earliest crash or return: every busy instance's clock has reached it."""
        at, kind, j, cold_s, requested = heapq.heappop(self._faults)
        inst = self.instances[j]
        if kind == 0:                                         # back from a crash
            self.state.live.append(j)
            self.state.live.sort()
            return
        if j not in self.state.live:                          # down already: nothing more to lose (work
            return                                            # queued on it meanwhile is not lost again)
        if inst.has_work and inst.clock > at:                 # its step under way ends first
            heapq.heappush(self._faults, (inst.clock, 1, j, cold_s, requested))
            return
        if inst.has_work:
            self._busy[:] = [e for e in self._busy if e[1] != j]     # in place: run() holds the list
            heapq.heapify(self._busy)
        now = max(at, inst.clock)
        lost = inst.crash(now, cold_s)
        if self.candidates is not None:
            self.candidates.changed(j)
        self._events.push(inst.clock, inst.publisher.drain())    # the new epoch, heard when it is back
        self.state.live.remove(j)
        heapq.heappush(self._faults, (inst.clock, 0, j, 0.0, requested))
        self.crashes_done.append({"instance": j, "requested": requested, "at": round(now, 6),
                                  "back_at": round(inst.clock, 6), "requeued": len(lost)})
        for fr in lost:
            self.route(fr, now)

    def _restart_due(self, now: float) -> None:
        """Do the scheduled restarts due by ``now`` whose instance is idle."""
        still = []
        for at, j in self._restarts:
            inst = self.instances[j]
            if at > now or inst.has_work:
                still.append((at, j))
                continue
            inst.clock = max(inst.clock, at)
            self.restart(j)
            self.restarts_done.append({"instance": j, "requested": at, "at": round(inst.clock, 6)})
        self._restarts = still


def latency_summary(values: list[float]) -> dict[str, float | None]:
    """``{mean, p50, p90, p99}`` of ``values`` in seconds (``None`` each when empty);
    percentiles by linear interpolation (numpy's default)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()), 6), "p50": round(float(p50), 6), "p90": round(float(p90), 6),
            "p99": round(float(p99), 6)}


CDF_PERCENTILES = (1, 5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 99, 99.9)
"""Percentiles of ``ttft_cdf_seconds``."""


def timing_summary(requests: list[FleetRequest], instances: list[FleetInstance]) -> dict:
    """The timed report's figures: ``ttft_seconds``, ``queue_seconds``, ``e2e_seconds``
    (each :func:`latency_summary` over served requests, from arrival), ``rejected`` (count),
    ``instances`` (per instance ``{requests, busy_seconds, reused_tokens, queue_peak}``),
    ``store`` (``{hit_tokens, bytes_loaded, seconds, loads, declined}`` of loads from a simulated store:
    tokens, bytes, seconds, loads taken, loads declined as slower than recomputing),
    ``requeued`` (``{requests, times, ttft_seconds}``: requests a crash sent back to the router,
    how often, and their TTFT from the original arrival),
    ``load_skew`` (max / mean busy seconds; ``None`` when nothing was busy) and
    ``makespan_seconds`` (last finish on the fleet's clock) and ``ttft_cdf_seconds``
    (``[percentile, seconds]`` at :data:`CDF_PERCENTILES`, for plots)."""
    served = [fr for fr in requests if not fr.rejected and fr.first_token is not None]
    busy = [i.stats.busy_seconds for i in instances]
    mean_busy = sum(busy) / len(busy)
    ttft = [fr.ttft_end - fr.arrival for fr in served]
    requeued = [fr for fr in served if fr.requeues]
    cdf = np.percentile(ttft, CDF_PERCENTILES).tolist() if ttft else []
    return {
        "ttft_seconds": latency_summary(ttft),
        "ttft_cdf_seconds": [[p, round(x, 6)] for p, x in zip(CDF_PERCENTILES, cdf)],
        "queue_seconds": latency_summary([fr.admitted - fr.arrival for fr in served]),
        "e2e_seconds": latency_summary([fr.finished - fr.arrival for fr in served]),
        "rejected": sum(fr.rejected for fr in requests),
        "requeued": {"requests": sum(fr.requeues > 0 for fr in requests), "times": sum(fr.requeues for fr in requests),
                     "ttft_seconds": latency_summary([fr.ttft_end - fr.arrival for fr in requeued])},
        "instances": [i.stats.as_dict() for i in instances],
        "store": {"hit_tokens": sum(i.stats.store_hit_tokens for i in instances),
                  "bytes_loaded": sum(i.stats.store_bytes_loaded for i in instances),
                  "seconds": round(sum(i.stats.store_seconds for i in instances), 6),
                  "loads": sum(i.stats.store_loads for i in instances),
                  "declined": sum(i.stats.store_declined for i in instances)},
        "load_skew": round(max(busy) / mean_busy, 6) if mean_busy > 0 else None,
        "makespan_seconds": round(max((fr.finished or 0.0) for fr in requests), 6) if requests else 0.0,
    }
