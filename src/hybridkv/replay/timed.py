"""``hybridkv replay --timed``: the trace on the clock, through a router, onto a fleet of
instances (:mod:`hybridkv.fleet.simulator`).

Every instance runs in this process on its own virtual clock. With the real model each
step's measured wall time advances its instance's clock, so instances that would run in
parallel on separate machines are timed as if they did, even though this process runs
their steps one after another; an idle instance's clock jumps to its next arrival. With
``--simulate`` the step times come from a cost model
(:mod:`hybridkv.fleet.costmodel`) and the rest of each decode is modelled. Arrivals are
the trace's ``timestamp`` (ms) times ``time_scale`` (> 1 slows them down).

Several instances share a store: real engines their store tier (the replay's store, a
fresh disk store by default), simulated ones a modelled store
(:mod:`hybridkv.fleet.store`) at ``store_gbps`` and ``store_latency_s``. Either way the
router's view of the store comes from the instances' events and its transfer estimate
from those two figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv._torch import torch
from hybridkv.cache.config import CacheConfig
from hybridkv.cache.groups import FullAttentionSpec, KDASpec
from hybridkv.engine.build import build_engine, load_model, model_config
from hybridkv.engine.request import Request
from hybridkv.fleet.costmodel import StepCostModel, cost_model, v4_restore_pricer
from hybridkv.fleet.candidates import DEFAULT_ROUTE_CANDIDATES, NARROWED_ROUTERS, CandidateIndex
from hybridkv.fleet.instance import FleetInstance, FleetRequest, SimulatedStore
from hybridkv.fleet.operating import HOT_PREFIX_PAGES
from hybridkv.fleet.routers import HybridOptions, HybridRouter, RouterConfig, make_router
from hybridkv.fleet.simulator import Fleet, timing_summary
from hybridkv.fleet.steplog import StepRecord
from hybridkv.model.v4.config import V4Config
from hybridkv.fleet.store import (
    DEFAULT_STORE_GIB,
    MOONCAKE_GET_LATENCY_S,
    MOONCAKE_LOAD_BYTES_PER_S,
    StoreCost,
    StoreView,
)
from hybridkv.replay.instance import InstanceResult, collect_result
from hybridkv.replay.trace import TraceRequest, TraceUnits
from hybridkv.replay.unit_hashes import UnitHasher

DEFAULT_SIMULATED_COST_MODEL = "h200-kimi-linear-48b"
"""Cost model of ``--simulate --timed`` unless ``--cost-model`` names another (Kimi Linear)."""
DEFAULT_SIMULATED_V4_COST_MODEL = "h200-deepseek-v4-flash"
"""Cost model of ``--simulate --timed`` for a DeepSeek-V4 model unless ``--cost-model`` names another."""

DEFAULT_COLD_START_S = 30.0
"""Seconds a crashed instance takes to serve again unless ``--cold-start`` says otherwise: an
assumption, not a measurement (a fresh process loading the Kimi-Linear-48B weights, about 98 GB
in bf16, from a local NVMe drive at a few GB/s, then warming up)."""

CPU_ESTIMATE = StepCostModel(name="flat 4000 prefill tokens/s (uncalibrated CPU estimate)", overhead_s=0.0,
                             linear_s_per_token=1 / 4000, attention_s_per_pair=0.0,
                             source="SimulatedBackend's default rate for the small preset on 2 cores")
"""What a real timed run's router prices prefill with when no ``--cost-model`` is given."""


@dataclass(frozen=True, slots=True)
class TimedSetup:
    """What a timed run needs beyond the cache config.

    Attributes:
        model: preset name or model directory.  seed: weight / token seed.
        simulate: cost model instead of the real model.
        instances: fleet size.  router: router name.  time_scale: arrival multiplier.
        hybrid: the ``hybrid`` router's options (:class:`~hybridkv.fleet.routers.HybridOptions`).
        cost_model: built-in name or JSON path; ``None``: the default for the mode.
        store_url, host_bytes, host_write_through: lower tiers of real instances.
        store_gbps: store load bandwidth (GB/s) of the simulated store and of the router's
            estimate; 0: no shared store in simulation.
        store_latency_s: seconds per store object, likewise.
        record_steps: keep every instance's step records (:mod:`hybridkv.fleet.steplog`).
        step_clock: ``wall`` or ``cpu``: how real steps are timed
            (:class:`~hybridkv.fleet.instance.FleetInstance`).
        threads: torch threads of the real model during the run (``--threads``; calibration
            times the model with the same number).
        store_gib: capacity of the simulated store in GiB (least recently used evicted); 0: unlimited.
        restarts: ``(instance, seconds)``: restart that instance (empty cache, new epoch) at the
            first moment it is idle at or after that time on the fleet's clock
            (:meth:`~hybridkv.fleet.simulator.Fleet.schedule_restart`).
        crashes: ``(instance, seconds)``: crash that instance then (requests in flight lost and
            routed again; :meth:`~hybridkv.fleet.simulator.Fleet.schedule_crash`).
        cold_start_s: seconds a crashed instance takes to be back.
        swa_recovery: DeepSeek-V4 models: ``window``, ``periodic=P`` or ``recompute``.
        route_candidates: on a fleet of more instances than this, the ``hybrid``, ``least-load`` and
            ``kv-overlap`` routers weigh this many candidates plus the prompt's holders
            (:mod:`hybridkv.fleet.candidates`); 0: every instance always.
        slo: service-level targets (:func:`~hybridkv.fleet.operating.parse_slo`, seconds) the
            report's ``goodput`` is counted against; ``None``: no goodput.
        simulated_host: a simulation builds every instance's host tier of ``host_bytes`` (payload-free:
            keys, capacity, eviction, demotion and promotion; a host load takes no time on the clock).
    """

    model: str
    seed: int
    simulate: bool
    instances: int
    router: str
    time_scale: float
    cost_model: str | None
    store_url: str = "none"
    host_bytes: int = 0
    host_write_through: bool = False
    store_gbps: float = MOONCAKE_LOAD_BYTES_PER_S / 1e9
    store_latency_s: float = MOONCAKE_GET_LATENCY_S
    record_steps: bool = False
    threads: int = 1
    step_clock: str = "wall"
    store_gib: float = DEFAULT_STORE_GIB
    restarts: tuple[tuple[int, float], ...] = ()
    crashes: tuple[tuple[int, float], ...] = ()
    cold_start_s: float = DEFAULT_COLD_START_S
    hybrid: HybridOptions = HybridOptions()
    swa_recovery: str | None = None
    slo: dict[str, float] | None = None
    route_candidates: int = DEFAULT_ROUTE_CANDIDATES
    simulated_host: bool = False


@dataclass(slots=True)
class TimedRun:
    """Per-instance counters (merged like an untimed replay's) and the timing figures
    (:func:`~hybridkv.fleet.simulator.timing_summary`, plus ``router``, ``time_scale``, ``cost_model``);
    ``steps``: every instance's step records in order of start (empty unless ``record_steps``)."""

    results: list[InstanceResult]
    timing: dict
    steps: list[StepRecord] = field(default_factory=list)


def _simulated_v4(setup: TimedSetup, cfg: CacheConfig):
    """A simulated DeepSeek-V4 backend of the run's shapes (its group specs, family and entry
    sizes), or ``None`` for a Kimi Linear model or a real run."""
    mcfg = model_config(setup.model)
    if not setup.simulate or not isinstance(mcfg, V4Config):
        return None
    from hybridkv.engine.v4backend import SimulatedV4Backend
    return SimulatedV4Backend(mcfg, cfg.block_size, cfg.prefix_match_unit, setup.swa_recovery)


def _store_cost(setup: TimedSetup, cfg: CacheConfig) -> StoreCost | None:
    """The shared store's cost, or ``None`` when the instances share no store. Its entry sizes
    follow the model's groups: Kimi Linear's MLA KV per token and KDA checkpoint; a simulated
    DeepSeek-V4 model's compressed entries per token (``csa`` + ``hca``, bf16) and ``swa`` state,
    read only when the strategy saves states (not under ``recompute``)."""
    shared = setup.instances > 1 if setup.simulate else setup.store_url not in ("none", "")
    if not shared or setup.store_gbps <= 0:
        return None
    mcfg = model_config(setup.model)
    if isinstance(mcfg, V4Config):
        v4 = _simulated_v4(setup, cfg)
        if v4 is None:                 # a real V4 fleet is not timed (check_v4_replay)
            return None
        from hybridkv.cache.swa import saves_state
        return StoreCost(bytes_per_s=setup.store_gbps * 1e9, latency_s=setup.store_latency_s,
                         alignment=cfg.store_boundary, kv_bytes_per_token=v4.kv_bytes_per_token,
                         checkpoint_bytes=v4.checkpoint_bytes, loads_state=saves_state(v4.family))
    return StoreCost(bytes_per_s=setup.store_gbps * 1e9, latency_s=setup.store_latency_s,
                     alignment=cfg.store_boundary,
                     kv_bytes_per_token=FullAttentionSpec.for_model(mcfg, cfg.block_size).bytes_per_token,
                     checkpoint_bytes=KDASpec.for_model(mcfg).page_size_bytes)


def _builder(setup: TimedSetup, cfg: CacheConfig):
    """``build(listener, step_cost)`` for every instance (one model object shared read-only)."""
    if setup.simulate:
        mcfg = model_config(setup.model)
        v4 = {"swa_recovery": setup.swa_recovery,
              "restore_cost": v4_restore_pricer(mcfg, setup.swa_recovery)} if isinstance(mcfg, V4Config) else {}
        host = setup.host_bytes if setup.simulated_host else 0
        return lambda listener, step_cost: build_engine(mcfg, cfg, model_name=setup.model, listener=listener,
                                                        step_cost=step_cost, host_bytes=host, **v4)
    model = load_model(setup.model, setup.seed)
    return lambda listener, step_cost: build_engine(
        model, cfg, model_name=setup.model, store_url=setup.store_url, host_bytes=setup.host_bytes,
        host_write_through=setup.host_write_through and setup.host_bytes > 0, listener=listener)


def run_timed(setup: TimedSetup, cfg: CacheConfig, reqs: list[TraceRequest], prompts, output_lengths: list[int],
              verify: set[int], progress=None, units: TraceUnits | None = None) -> TimedRun:
    """Route and serve the requests on the clock.

    Args:
        setup: fleet, router and timing options.
        cfg: validated cache config of every instance.
        reqs: trace requests (their ``timestamp_ms`` give arrivals).
        prompts: ``int64[T]`` prompt of each request.
        output_lengths: tokens each request generates (the engine generates the first one
            only when simulating; the instance models the rest).
        verify: trace indices whose logits are checked against a cache-free run (real model).
        progress: ``progress(n)`` as requests end.
        units: key the caches by these unit payloads of ``reqs`` instead of hashing ``prompts``
            (simulation with placeholder prompts; :class:`~hybridkv.replay.trace.TraceUnits`).

    Raises:
        ValueError: unknown router name, ``time_scale`` not positive, ``store_gib`` negative, a
            restart or crash of an instance the fleet does not have, a negative cold start (named).
        CostModelError: unknown cost model or a bad cost-model file.
    """
    if not setup.time_scale > 0:
        raise ValueError(f"time_scale={setup.time_scale!r} must be positive")
    default = DEFAULT_SIMULATED_V4_COST_MODEL if isinstance(model_config(setup.model), V4Config) \
        else DEFAULT_SIMULATED_COST_MODEL
    name = setup.cost_model or (default if setup.simulate else None)
    estimate = cost_model(name) if name else CPU_ESTIMATE
    store_cost = _store_cost(setup, cfg)
    # a hit's value to the router is the prefill it saves less the recompute that restores its state
    # (DeepSeek-V4's periodic tail and recompute cone), priced as the simulated engine prices it
    v4cfg = model_config(setup.model)
    restore = v4_restore_pricer(v4cfg, setup.swa_recovery) if setup.simulate and isinstance(v4cfg, V4Config) else None
    router = make_router(RouterConfig(name=setup.router, unit=cfg.prefix_match_unit, block_size=cfg.block_size,
                                      cost=estimate, store=store_cost, hybrid=setup.hybrid,
                                      max_num_seqs=cfg.max_num_seqs, restore=restore))
    if setup.store_gib < 0:
        raise ValueError(f"store_gib={setup.store_gib!r} must be 0 (unlimited) or more")
    view = None
    if store_cost is not None:
        capacity = int(setup.store_gib * 2**30) if setup.simulate and setup.store_gib > 0 else None
        v4 = _simulated_v4(setup, cfg)
        view = StoreView(cfg.prefix_match_unit, cfg.store_boundary, capacity, store_cost.kv_bytes_per_token,
                         store_cost.checkpoint_bytes, **({"family": v4.family} if v4 is not None else {}))
    sim_store = SimulatedStore(view, store_cost) if view is not None and setup.simulate else None
    build = _builder(setup, cfg)
    instances = [FleetInstance(k, build, estimate if setup.simulate else None, cfg.max_num_seqs, sim_store,
                               step_clock=setup.step_clock)
                 for k in range(setup.instances)]
    if setup.record_steps:
        for inst in instances:
            inst.record_steps()
    frs = [FleetRequest(r.index, Request(f"r{r.index}", p, o, record_logits=r.index in verify),
                        arrival=r.timestamp_ms / 1000.0 * setup.time_scale, output_tokens=o)
           for r, p, o in zip(reqs, prompts, output_lengths)]
    frs.sort(key=lambda fr: fr.arrival)
    fleet = Fleet(instances, router, cfg.prefix_match_unit, estimate, view, store_cost, restore)
    if units is not None:      # hashed when routed, dropped when finished; every instance binds the same namespace
        hasher, by_index = UnitHasher(units, instances[0].handle.engine.cache), {r.index: r for r in reqs}
        fleet.hash_request = lambda fr: hasher(by_index[fr.index])
        fleet.keep_hash_at = max(1, HOT_PREFIX_PAGES * cfg.block_size // cfg.prefix_match_unit)
    if setup.route_candidates == 1:
        raise ValueError("route_candidates=1 (--route-candidates) must be 0 (every instance) or at least 2")
    if setup.route_candidates and setup.instances > setup.route_candidates and router.name in NARROWED_ROUTERS:
        fleet.candidates = CandidateIndex(fleet.state.loads, setup.route_candidates,
                                          router.queue_seconds if isinstance(router, HybridRouter) else None,
                                          stride=max(1, cfg.block_size // cfg.prefix_match_unit))
    threads = None if setup.simulate else torch.get_num_threads()    # a simulation runs no torch
    if threads is not None:
        torch.set_num_threads(setup.threads)
    for j, at in setup.restarts:
        fleet.schedule_restart(j, at)
    for j, at in setup.crashes:
        fleet.schedule_crash(j, at, setup.cold_start_s)
    try:
        fleet.run(frs, progress)
    finally:
        for inst in instances:
            inst.handle.close()
    results = []
    served: dict[int | None, list[FleetRequest]] = {}  # each instance's requests, in arrival order
    for fr in frs:
        served.setdefault(fr.instance, []).append(fr)
    try:                                               # verification (in collect_result) on the same threads
        for inst in instances:
            mine = served.get(inst.index, [])
            results.append(collect_result(inst.handle, [fr.index for fr in mine], [fr.request for fr in mine],
                                          inst.stats.busy_seconds))
    finally:
        if threads is not None:
            torch.set_num_threads(threads)
    for res, inst in zip(results, instances):
        if sim_store is not None:                      # loads the fleet made, not a store tier; the one
            first = inst.index == 0                    # shared store's writes and peak are counted once:
            res.tiers["store"] = {"hit_tokens": inst.stats.store_hit_tokens,     # every byte written is
                                  "bytes_loaded": inst.stats.store_bytes_loaded,  # held or was evicted
                                  "bytes_saved": view.bytes_held + view.evicted_bytes if first else 0,
                                  "loads_taken": inst.stats.store_loads,
                                  "loads_declined": inst.stats.store_declined,
                                  "bytes_peak": view.bytes_peak if first else 0}
            res.tiers["device"]["hit_tokens"] -= inst.stats.store_hit_tokens
    # engines replaced by restarts: their counters (requests, tokens, reuse) count too; the
    # requests themselves were reported with the current engine above (each once)
    results.extend(collect_result(old, [], [], 0.0) for inst in instances for old in inst.retired)
    timing = timing_summary(frs, instances)
    timing.update(router=router.name, time_scale=setup.time_scale, cost_model=estimate.name,
                  restarts=fleet.restarts_done, crashes=fleet.crashes_done)
    if not setup.simulate:
        timing["step_clock"] = setup.step_clock
    if sim_store is not None:
        timing["store"].update(capacity_bytes=view.capacity_bytes, bytes_peak=view.bytes_peak,
                               evicted_bytes=view.evicted_bytes)
    from hybridkv.replay.operating import timed_operating_figures
    timing.update(timed_operating_figures(setup, cfg, frs, instances, results, view))
    steps = sorted((r for inst in instances for r in inst.step_log or ()), key=lambda r: (r.start, r.instance))
    return TimedRun(results, timing, steps)
