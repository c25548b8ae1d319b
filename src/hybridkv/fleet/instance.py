"""One engine instance on a virtual clock: its queue, its engine, its modelled decode, its load.

Time is virtual (seconds). Each step advances the instance's clock by the step's
duration: the measured wall time of the real engine's step, or the cost model's
price of the simulated engine's step (:class:`~hybridkv.fleet.costmodel.StepCostModel`).
With a cost model the engine runs each request to its first token (prefill, the real
cache code deciding every hit) and the instance models the rest of the decode as one
token per step for each decoding sequence; decoding sequences take part in the price
of every step and count against ``max_num_seqs``. As in the real engine, a request's
pages for ``prompt + output - 1`` tokens are reserved at admission and held until its
last token (the engine's :meth:`~hybridkv.engine.engine.Engine.detach` hands the decode
to the instance with the pages); generated tokens are never published (the real engine
caches prompt units only), so decode presses on the page pool without adding reuse.

With a simulated shared store (:class:`SimulatedStore`), a request whose joint hit in
the store is deeper than the instance's own is loaded before it enters the engine: the
missing KV pages and the checkpoint are installed through the coordinator's install
seams (as the store tier does) unless the cost model predicts that computing the
missing tokens is faster, and the load's seconds
(:meth:`~hybridkv.fleet.store.StoreCost.load_seconds`) pass on the instance's clock
before its next step, not overlapped with compute.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv.cache.groups import reuse_cap
from hybridkv.engine.build import EngineHandle
from hybridkv.engine.request import Request, Status
from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.fleet.events import EventPublisher
from hybridkv.fleet.routers import InstanceLoad
from hybridkv.fleet.steplog import RecordingBackend, StepRecord
from hybridkv.fleet.store import StoreCost, StoreView, load_start, paying_load

STEP_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""How a real engine step is timed (``FleetInstance(step_clock=...)``)."""

BuildEngine = Callable[[EventPublisher, Callable | None], EngineHandle]
"""``build(listener, step_cost) -> EngineHandle``: a fresh engine whose cache reports to
``listener``; ``step_cost`` is ``None`` for a real model (timed by the clock)."""


@dataclass(slots=True, eq=False)
class FleetRequest:
    """One request's journey; times are seconds on the fleet's clock (``None``: not yet).

    Attributes:
        index: trace index.
        request: the engine request (prompt, status, match).
        arrival: when it reaches the router (scaled trace timestamp).
        output_tokens: tokens it generates in all.
        instance: where the router sent it.
        admitted: when its engine admitted it (looked up, got its pages).
        first_token: end of the step that produced its first token.
        finished: end of the step that produced its last token (or rejected it).
        rejected: the engine refused it.
        predicted_s: prefill seconds the fleet predicted for it when routed.
        decode_left: tokens still to generate after the first (counted in the instance's
            :attr:`~hybridkv.fleet.routers.InstanceLoad.decode_tokens` until generated).
        hashes: chained unit hashes of the prompt (set when routed).
        pages: what it adds to its instance's page counts (:func:`~hybridkv.fleet.routers.kv_admission`:
            page keys, partial last page, prefill tokens net of the KV overlap; set when routed).
        requeues: times a crash of its instance sent it back to the router (:meth:`requeue`).
        earlier_first_token: the first token of an attempt lost in a crash (the user saw it, so
            its TTFT counts from it); ``None``: no attempt that got one was lost.
    """

    index: int
    request: Request
    arrival: float
    output_tokens: int
    instance: int | None = None
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    rejected: bool = False
    predicted_s: float = 0.0
    decode_left: int = 0
    hashes: list[bytes] = field(default_factory=list, repr=False)
    pages: tuple[list[bytes], bool, int] = field(default=((), False, 0), repr=False)
    requeues: int = 0
    earlier_first_token: float | None = None

    def requeue(self) -> None:
        """Start over after its instance crashed: a fresh engine request (same id, prompt, output
        length, namespace and hashes), no admission, first token or finish of the lost attempt
        (a first token already streamed is kept in :attr:`earlier_first_token`)."""
        old = self.request
        self.request = Request(old.request_id, old.prompt, old.max_output_tokens, old.hints, old.record_logits,
                               namespace=old.namespace, sampler=old.sampler, hashes=old.hashes)
        if self.earlier_first_token is None and self.first_token is not None:
            self.earlier_first_token = self.first_token
        self.instance = self.admitted = self.first_token = self.finished = None
        self.decode_left = 0
        self.requeues += 1

    @property
    def ttft_end(self) -> float | None:
        """When the user saw the first token (:attr:`earlier_first_token` if a crash lost the
        attempt that made it, else :attr:`first_token`)."""
        return self.first_token if self.earlier_first_token is None else self.earlier_first_token


@dataclass(frozen=True, slots=True)
class Coast:
    """Decode-only steps an instance will take (:meth:`FleetInstance.coast_plan`), one entry a step.

    Attributes:
        starts: each step's start on the instance's clock (seconds, ascending).
        taken: tokens each decoder has generated in these steps by the end of each step.
        busy: the instance's ``busy_seconds`` at the end of each step.
        end: the clock after the last step (seconds): when the next step, which ends a decoder,
            starts.
    """

    starts: list[float]
    taken: list[int]
    busy: list[float]
    end: float


@dataclass(frozen=True, slots=True)
class SimulatedStore:
    """The shared store of a simulated fleet: what it holds and what a load costs."""

    view: StoreView
    cost: StoreCost


@dataclass(slots=True)
class InstanceStats:
    """Per-instance figures of a timed run (tokens, seconds, requests); ``store_*`` count
    loads from a simulated store (tokens of joint hit gained, bytes, seconds, and loads
    declined because computing ``[local hit, store hit)`` was predicted faster)."""

    requests: int = 0
    busy_seconds: float = 0.0
    reused_tokens: int = 0
    queue_peak: int = 0
    store_hit_tokens: int = 0
    store_bytes_loaded: int = 0
    store_seconds: float = 0.0
    store_declined: int = 0
    store_loads: int = 0

    def as_dict(self) -> dict:
        """``{requests, busy_seconds, reused_tokens, queue_peak}``."""
        return {"requests": self.requests, "busy_seconds": round(self.busy_seconds, 6),
                "reused_tokens": self.reused_tokens, "queue_peak": self.queue_peak}


class FleetInstance:
    """An engine with a queue in front and a virtual clock.

    Args:
        index: 0-based instance index.
        build: makes the engine (:data:`BuildEngine`); called again on :meth:`restart`.
        cost: prices simulated steps and models decode; ``None``: a real engine whose
            steps are timed by ``step_clock``.
        max_num_seqs: sequences in prefill or decode at once.
        store: the simulated shared store, or ``None`` (none, or a real engine's own store tier).
        step_clock: how a real step is timed: ``wall`` (``time.perf_counter``: includes whatever
            else the machine runs) or ``cpu`` (``time.process_time``: this process's CPU seconds,
            what the step would take on a core of its own; time blocked on I/O is not counted).

    Raises:
        ValueError: ``step_clock`` not ``wall`` or ``cpu``.
    """

    def __init__(self, index: int, build: BuildEngine, cost: StepCostModel | None, max_num_seqs: int,
                 store: SimulatedStore | None = None, step_clock: str = "wall") -> None:
        if step_clock not in STEP_CLOCKS:
            raise ValueError(f"step_clock={step_clock!r}: expected one of {', '.join(STEP_CLOCKS)}")
        self._clock = STEP_CLOCKS[step_clock]
        self.index = index
        self.store = store
        self._load_s = 0.0                             # store loads waiting to pass on the clock
        self.cost = cost
        self.max_num_seqs = max_num_seqs
        self._build = build
        self.publisher = EventPublisher(index, merge_removals=True)   # views apply a step's events at once
        self.handle = build(self.publisher, self._price if cost is not None else None)
        self.publisher.family = self.handle.backend.family      # its events name the engine's cache groups
        self.retired: list[EngineHandle] = []         # engines replaced by restarts (their counters stay)
        self.clock = 0.0
        self.queue: deque[FleetRequest] = deque()
        self.in_engine: list[FleetRequest] = []
        self.decoding: list[FleetRequest] = []
        self.load = InstanceLoad()
        self.stats = InstanceStats()
        self._priced = False
        self.step_log: list[StepRecord] | None = None   # see record_steps()
        self._shape: tuple[list[list[int]], int, int, float | None] = ([], 0, 0, None)
        self._times: tuple[float | None, float | None] = (None, None)   # a real step's wall and CPU seconds

    def record_steps(self) -> None:
        """Keep a :class:`~hybridkv.fleet.steplog.StepRecord` of every step from now on in
        :attr:`step_log` (a real engine's backend is wrapped to time its forward)."""
        if self.step_log is None:
            self.step_log = []
            self._wrap_backend()

    def _wrap_backend(self) -> None:
        engine = self.handle.engine
        if self.step_log is not None and self.cost is None and not isinstance(engine.backend, RecordingBackend):
            engine.backend = RecordingBackend(engine.backend, self._clock)

    @property
    def has_work(self) -> bool:
        """Requests are queued, in the engine or decoding."""
        return bool(self.queue or self.in_engine or self.decoding)

    def enqueue(self, fr: FleetRequest, now: float, predicted_s: float) -> None:
        """Accept a routed request at time ``now`` (an idle instance's clock jumps to it); a
        simulated instance sets the engine request's ``max_output_tokens`` to ``fr.output_tokens``
        (pages for the whole output are reserved at admission, as the real engine does)."""
        if not self.has_work:
            self.clock = max(self.clock, now)
        fr.instance, fr.predicted_s = self.index, predicted_s
        if self.cost is not None:                     # the engine reserves pages for the whole output
            fr.request.max_output_tokens = max(fr.output_tokens, 1)
        self.queue.append(fr)
        ld = self.load
        ld.outstanding_tokens += fr.request.prompt_len
        ld.waiting += 1
        fr.decode_left = max(fr.output_tokens - 1, 0)
        ld.decode_tokens += fr.decode_left
        ld.queued_seconds += predicted_s
        ld.in_flight += 1
        ld.in_flight_tokens += fr.request.prompt_len + fr.output_tokens
        ld.routed += 1
        ld.hold(*fr.pages)
        self.stats.queue_peak = max(self.stats.queue_peak, len(self.queue))

    def restart(self) -> None:
        """Replace the engine by a fresh one (empty cache) in a new event epoch.

        Raises:
            RuntimeError: the instance still has requests.
        """
        if self.has_work:
            raise RuntimeError(f"instance {self.index}: cannot restart with requests in flight")
        self.retired.append(self.handle)
        self.handle.close()
        self.publisher.restart()
        self.handle = self._build(self.publisher, self._price if self.cost is not None else None)
        self._wrap_backend()

    def crash(self, now: float, cold_start_s: float) -> list[FleetRequest]:
        """Lose the engine at ``now`` (seconds): its device (and host) cache and every request it
        holds (queued, in the engine, decoding) are gone. A fresh engine in a new event epoch
        (sequence numbers from 0, ``all_cleared`` buffered for :meth:`publisher`'s next drain)
        is up ``cold_start_s`` later (the clock jumps there); the load is zeroed (``routed``
        stays).

        Returns:
            The lost requests, :meth:`FleetRequest.requeue` d, oldest arrival first.

        Raises:
            ValueError: ``cold_start_s`` negative or not finite.
        """
        if not (cold_start_s >= 0 and math.isfinite(cold_start_s)):
            raise ValueError(f"cold_start_s={cold_start_s!r} must be a finite number >= 0")
        lost = sorted([*self.queue, *self.in_engine, *self.decoding], key=lambda fr: (fr.arrival, fr.index))
        for fr in lost:
            self._forget_admission(fr)
        self.queue.clear()
        self.in_engine, self.decoding, self._load_s = [], [], 0.0
        self.retired.append(self.handle)
        self.handle.close()
        self.publisher.restart()
        self.handle = self._build(self.publisher, self._price if self.cost is not None else None)
        self._wrap_backend()
        self.load.clear()
        self.clock = max(self.clock, now) + cold_start_s
        for fr in lost:
            fr.requeue()
        return lost

    def _forget_admission(self, fr: FleetRequest) -> None:
        """Take a lost attempt's admission out of the counters (this instance's and its engine's:
        requests, prompt / reused / computed / kv-hit tokens), so a requeued request counts once,
        where it ends. The seconds it took stay in ``busy_seconds`` (the work was done)."""
        r, match = fr.request, fr.request.match
        if match is None or r.status is Status.REJECTED:
            return                                          # never admitted: nothing was counted
        if fr.admitted is not None:
            self.stats.requests -= 1
            self.stats.reused_tokens -= r.reused
        s = self.handle.engine.stats
        s.requests -= 1
        s.prompt_tokens -= r.prompt_len
        s.reused_tokens -= match.hit
        s.computed_prompt_tokens -= r.prompt_len - match.hit
        s.kv_hit_tokens -= match.kv_hit
        s.requests_with_hit -= match.hit > 0
        s.branch_recompute_tokens -= match.kv_hit - match.hit

    # -- stepping --------------------------------------------------------
    def _decode_context(self) -> int:
        return sum(fr.request.prompt_len + fr.output_tokens - fr.decode_left for fr in self.decoding)

    def _price(self, items) -> float:
        """The simulated backend's ``step_cost``: prefill items plus this instance's decoders."""
        self._priced = True
        chunks = [(it.start, int(it.token_ids.shape[0])) for it in items]
        if self.step_log is not None:
            self._shape = ([list(c) for c in chunks], len(self.decoding), self._decode_context(), None)
        return self.cost.step_seconds(chunks, len(self.decoding), self._decode_context())

    def _feed(self) -> None:
        engine = self.handle.engine
        while self.queue and len(engine.waiting) + len(engine.running) + len(self.decoding) < self.max_num_seqs:
            fr = self.queue.popleft()
            if self.store is not None:
                self._load_s += self._fetch(fr)
            engine.add_request(fr.request)
            self.in_engine.append(fr)

    def _fetch(self, fr: FleetRequest) -> float:
        """Install the store's deeper joint hit for ``fr`` (page entries, and the state entry the
        hit restores from: at the hit for a state saved there, the deepest saved one at or below
        it for ``periodic``, none for ``recompute``); its seconds."""
        cache, r = self.handle.engine.cache, fr.request
        sm = self.store.view.match(fr.hashes, reuse_cap(r.prompt_len, cache.config.prefix_match_unit))
        got = sm.hit
        if not got:
            return 0.0
        local = cache.lookup(r.prompt, r.namespace, touch=False, hashes=fr.hashes)
        if got <= local.hit:
            return 0.0
        # the store is read in whole entries, from the entry boundary at or below the local KV run,
        # and only when that pays (each side with its restore recompute, priced by the backend):
        # the router's rule (store.paying_load); pages installed from the page boundary, at or
        # above where the read starts
        price = getattr(self.handle.backend, "recovery_seconds", None)
        restore = price(local.restart, local.hit) if price is not None and local.restart < local.hit else 0.0
        store_restore = price(sm.restart, got) if price is not None and sm.restart < got else 0.0
        load = paying_load(self.cost, self.store.cost, local.kv_hit, local.hit, got, restore, store_restore)
        if load is None:
            self.stats.store_declined += 1                # recomputing is faster than loading
            return 0.0
        transfer, latency, read = load
        seconds = transfer + latency
        start = load_start(local.kv_hit, got, cache.config.block_size)     # the pages installed
        # the state entry: where the store's hit restarts, unless the device holds one as deep
        state = sm.restart if self.store.cost.loads_state and sm.restart > local.restart else 0
        # owned by the request's namespace (the engine's when it gave none), as the store tier's
        # installs are (TierConnector passes MatchResult.namespace): quotas and purges by owner reach them
        if start < got and not cache.install_kv(fr.hashes, start, got, _no_tensors, local.namespace):
            return 0.0
        if state and not cache.install_checkpoint(fr.hashes, None, state):
            return 0.0
        g = cache.config.prefix_match_unit
        self.publisher.stored(fr.hashes[start // g: got // g], [fr.hashes[state // g - 1]] if state else [], [],
                              [state] if state else [], start // g)
        self.store.view.touch(fr.hashes, got, state)
        st = self.stats
        st.store_hit_tokens += got - local.hit
        c = self.store.cost
        st.store_bytes_loaded += (got - read) * c.kv_bytes_per_token + (c.checkpoint_bytes if state else 0)
        st.store_seconds += seconds
        st.store_loads += 1
        return seconds

    def _engine_step(self) -> float:
        """One engine step; its duration in seconds (modelled or measured)."""
        engine = self.handle.engine
        if self.cost is None:
            if self.step_log is not None:
                return self._recorded_real_step()
            t0 = self._clock()
            engine.step()
            return self._clock() - t0
        if self.step_log is not None:                 # replaced by _price when the engine runs items
            self._shape = ([], len(self.decoding), self._decode_context(), None)
        before, self._priced = self.handle.backend.modelled_seconds, False
        engine.step()
        dt = self.handle.backend.modelled_seconds - before
        if not self._priced and self.decoding:        # nothing scheduled: the decoders still step
            dt = self.cost.step_seconds([], len(self.decoding), self._decode_context())
        return dt

    def _recorded_real_step(self) -> float:
        """A real engine step with its shape and forward time kept for the step log."""
        engine, backend = self.handle.engine, self.handle.engine.backend
        decoders = [r.position for r in engine.running if r.status is Status.DECODE]
        backend.last_items, backend.last_seconds = [], 0.0
        w0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        self._times = (time.perf_counter() - w0, time.process_time() - c0)
        ran = backend.last_items
        d = len(decoders) if ran else 0                  # the scheduler puts decoders first
        self._shape = (ran[d:], d, sum(decoders) if ran else 0, backend.last_seconds)
        return self._times[0] if self._clock is time.perf_counter else self._times[1]

    def coast_plan(self, arrivals: list[float]) -> Coast | None:
        """The decode-only steps this instance will take from its clock, each exactly as
        :meth:`step` would take it, until the first step that would end a decoder (not taken).

        Only for an instance with modelled decoders and nothing else (no queue, nothing in the
        engine, no step log): its steps then depend on nothing but the horizon each one is given,
        which the fleet's loop makes the first arrival later than the step's start (``arrivals``:
        every arrival in seconds, ascending; no crash or restart pending). The fleet applies the
        plan (:meth:`coast_to`) when it next needs the instance, instead of stepping it.

        Returns:
            The plan, or ``None`` when its first step would already end a decoder.
        """
        dec, cost = self.decoding, self.cost
        b, ctx = len(dec), self._decode_context()
        step = _decode_pricer(cost, b, ctx)
        left = min(fr.decode_left for fr in dec)
        c, busy, n = self.clock, self.stats.busy_seconds, len(arrivals)
        starts, taken, busys, total = [], [], [], 0
        add_start, add_taken, add_busy = starts.append, taken.append, busys.append
        terms = getattr(step, "terms", None)     # the pricer's formula, inlined below for one step
        if terms is not None:
            lin, att, seq, w, kv, st, over = terms
        p = 0
        while True:
            p = bisect_right(arrivals, c, p)     # the clock only advances: search from the last horizon
            if p >= n:                           # no horizon: the step runs to a decoder's end
                break
            if terms is not None:                # step(ctx), the same arithmetic in the same order
                compute = lin + att * ctx + seq
                memory = w + kv * ctx + st
                one = over + (compute if compute >= memory else memory)
            else:
                one = step(ctx)
            if not one > 0:
                break
            k = int((arrivals[p] - c) / one)     # max(1, min(left, ...)), without the calls
            if k >= left:                        # it ends a decoder: step() takes it
                break
            if k <= 1:
                if left <= 1:
                    break
                k, dt = 1, one                   # step(ctx + 0) * 1: the same price
            else:
                dt = step(ctx + b * (k - 1) // 2) * k
            add_start(c)
            c = c + dt
            busy += 0.0 + dt                     # step(): busy_seconds += load + dt, with no store load
            ctx += b * k
            left -= k
            total += k
            add_taken(total)
            add_busy(busy)
        return Coast(starts, taken, busys, c) if starts else None

    def coast_to(self, plan: Coast, before: float = math.inf) -> None:
        """Take the steps of ``plan`` (:meth:`coast_plan`) that start before ``before`` (seconds;
        default all of them): the clock, busy seconds, decoders' tokens left and the load's
        decode tokens are then as :meth:`step` would have left them."""
        m = bisect_left(plan.starts, before) if before != math.inf else len(plan.starts)
        if not m:
            return
        self.clock = plan.starts[m] if m < len(plan.starts) else plan.end
        self.stats.busy_seconds = plan.busy[m - 1]
        k = plan.taken[m - 1]
        for fr in self.decoding:
            fr.decode_left -= k
        self.load.decode_tokens -= k * len(self.decoding)

    def _decode_steps(self, horizon: float) -> tuple[int, float]:
        """Decode-only steps to run at once (until a decoder ends or ``horizon``), and their seconds."""
        b, context = len(self.decoding), self._decode_context()
        one = self.cost.step_seconds([], b, context)
        k = min(fr.decode_left for fr in self.decoding)
        if math.isfinite(horizon) and one > 0:
            k = max(1, min(k, int((horizon - self.clock) / one)))
        return k, self.cost.step_seconds([], b, context + b * (k - 1) // 2) * k

    def step(self, horizon: float = math.inf) -> list[FleetRequest]:
        """Advance by one engine step (or, with only modelled decoders, by as many decode steps
        as end before ``horizon``, the next arrival, or the next decoder's end).

        Returns:
            Requests that finished or were rejected in it.
        """
        self._feed()
        start, load, self._load_s = self.clock + self._load_s, self._load_s, 0.0
        if self.handle.engine.has_work:
            k, dt = 1, self._engine_step()
        elif self.decoding:
            k, dt = self._decode_steps(horizon)
            if self.step_log is not None:
                self._shape = ([], len(self.decoding), self._decode_context(), None)
        else:
            return []
        end = self.clock = start + dt
        if self.step_log is not None:
            self._log_steps(start, dt, k, load)
        self.stats.busy_seconds += load + dt
        done = self._advance_decoders(k, end)
        done += self._collect(start, end)
        return done

    def _log_steps(self, start: float, dt: float, k: int, load: float) -> None:
        """Append the step (``k`` > 1: ``k`` equal decode-only steps run at once) to the step log."""
        chunks, decoders, context, backend_s = self._shape
        wall, cpu = self._times
        self._times = (None, None)
        for i in range(k):
            self.step_log.append(StepRecord(self.index, round(start + i * dt / k, 6), round(dt / k, 6), chunks,
                                            decoders, context + i * decoders, backend_s,
                                            round(load, 6) if i == 0 else 0.0, wall, cpu))

    def _advance_decoders(self, k: int, end: float) -> list[FleetRequest]:
        done, still = [], []
        self.load.decode_tokens -= k * len(self.decoding)
        for fr in self.decoding:
            fr.decode_left -= k
            (still if fr.decode_left > 0 else done).append(fr)
        self.decoding = still
        for fr in done:
            self.handle.engine.finish_detached(fr.request)
            self._finish(fr, end)
        return done

    def _collect(self, start: float, end: float) -> list[FleetRequest]:
        """Record admissions, first tokens and ends of the requests in the engine."""
        done, still = [], []
        for fr in self.in_engine:
            r = fr.request
            if fr.admitted is None and r.status is not Status.WAITING:
                fr.admitted = start
                if r.status is not Status.REJECTED:
                    self.stats.requests += 1
                    self.stats.reused_tokens += r.reused
            if r.status is Status.REJECTED:
                fr.rejected = True
                self._first_token(fr, end)
                self._finish(fr, end)
                done.append(fr)
                continue
            if fr.first_token is None and r.output:
                self._first_token(fr, end)
            if self.cost is not None and r.status is Status.DECODE:
                self.handle.engine.detach(r)          # the decode is modelled; its pages stay held
                fr.decode_left = fr.output_tokens - len(r.output)
                self.decoding.append(fr)
            elif not r.done:
                still.append(fr)
            else:
                self._finish(fr, end)
                done.append(fr)
        self.in_engine = still
        return done

    def _first_token(self, fr: FleetRequest, end: float) -> None:
        if not fr.rejected:
            fr.first_token = end
        self.load.outstanding_tokens -= fr.request.prompt_len
        self.load.waiting -= 1
        self.load.queued_seconds = max(0.0, self.load.queued_seconds - fr.predicted_s)
        self.load.prefill_tokens -= fr.pages[2]

    def _finish(self, fr: FleetRequest, end: float) -> None:
        fr.finished = end
        self.load.decode_tokens -= fr.decode_left          # tokens it will not generate after all (or 0)
        fr.decode_left = 0
        self.load.in_flight -= 1
        self.load.in_flight_tokens -= fr.request.prompt_len + fr.output_tokens
        self.load.release(fr.pages[0], fr.pages[1])


def _decode_pricer(cost: StepCostModel, b: int, ctx: int) -> Callable[[int], float]:
    """``price(context)``: ``cost.step_seconds([], b, context)`` (seconds of a decode-only step of
    ``b`` sequences attending ``context`` tokens), with the terms that depend on ``b`` alone
    taken once; the same arithmetic in the same order, checked against ``step_seconds`` at
    ``ctx`` (any other cost model, or a mismatch: ``step_seconds`` itself)."""
    exact = cost.step_seconds([], b, ctx)
    if type(cost) is not StepCostModel or b <= 0:
        return lambda context: cost.step_seconds([], b, context)
    lin, att, kv = cost.linear_s_per_token * b, cost.attention_s_per_pair, cost.kv_read_s_per_token
    seq, w, st, over = cost.seq_s * b, cost.weights_seconds(b), cost.state_s_per_seq * b, cost.overhead_s

    def price(context: int) -> float:
        compute = lin + att * context + seq
        memory = w + kv * context + st
        return over + (compute if compute >= memory else memory)

    if price(ctx) != exact:                      # the formula changed: no shortcut
        return lambda context: cost.step_seconds([], b, context)
    price.terms = (lin, att, seq, w, kv, st, over)   # for a caller that inlines price's arithmetic
    return price


def _no_tensors(pages) -> None:
    """``write_pages`` of a simulated install: there are no latents to copy."""
