"""``hybridkv replay``: run a Mooncake-format trace through the engine (the main job).

Real mode runs the model on every scheduled token and, with ``verify``,
re-runs sampled requests without any cache and compares logits at every
position the cached run computed. Simulate mode drives the same index,
matcher, policy and scheduler through :class:`SimulatedBackend` (no tensors).
With ``instances > 1`` the requests are dealt round-robin to engine instances
in their own processes, sharing one store. With ``timed`` the trace's arrival
times are honoured and a router places each request on one of the instances,
all in this process on virtual clocks (:mod:`hybridkv.replay.timed`).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import resource
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, replace
from multiprocessing.managers import SyncManager

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from hybridkv.cache.config import HOST_PROBATION, CacheConfig, CheckpointPolicy
from hybridkv.cache.swa import CSA, HCA, SwaRecovery, check_block_size
from hybridkv.model.v4.config import V4_SIMULATE_ONLY, V4Config
from hybridkv.fleet.costmodel import cost_model
from hybridkv.engine.build import check_pool_memory, model_config
from hybridkv.fleet.candidates import DEFAULT_ROUTE_CANDIDATES
from hybridkv.fleet.routers import HybridOptions
from hybridkv.fleet.steplog import write_step_log
from hybridkv.fleet.store import (
    DEFAULT_STORE_GIB,
    MOONCAKE_GET_LATENCY_S,
    MOONCAKE_LOAD_BYTES_PER_S,
)
from hybridkv.replay.instance import (
    TURN_FAILED,
    InstanceResult,
    InstanceSpec,
    run_instance,
)
from hybridkv.replay.oracle import oracle_from_trace
from hybridkv.replay.report import (
    OPERATING_KEYS,
    TIMED_KEYS,
    ReplayReport,
    VerifyReport,
    ratio,
    reuse_histogram,
)
from hybridkv.replay.timed import (
    CPU_ESTIMATE,
    DEFAULT_COLD_START_S,
    DEFAULT_SIMULATED_COST_MODEL,
    DEFAULT_SIMULATED_V4_COST_MODEL,
    TimedSetup,
    run_timed,
)
from hybridkv.replay.trace import (
    TraceUnits,
    load_trace,
    placeholder_prompts,
    request_token_array,
    scaled_input_length,
    scaled_output_length,
)
from hybridkv.replay.workload import workload_notes
from hybridkv.tiers.base import MISS_REASONS


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """Options of one replay (lengths in tokens). ``None`` pool sizes mean "sized so nothing is evicted";
    ``max_output_tokens=None`` means 4 with the model and no cap in timed simulation. ``host_bytes``:
    host tier capacity (bytes; 0: none; payload-free when simulating), ``host_groups`` the groups it
    holds, ``host_interval`` (tokens) the host-only checkpoint spacing (``CacheConfig.host_interval``;
    ``None``: :func:`default_host_interval`, 0: off); ``checkpoint_probation``: the device checkpoint
    pool's probation share for interval checkpoints (``CacheConfig.checkpoint_probation``; ``None``:
    off); ``host_protected_share``: the host tier's protected segment for checkpoints loaded from it
    before (``CacheConfig.host_protected_share``; ``None``: off); ``checkpoint_eviction``: ``"utility"`` for the device checkpoint pool's expected-saving
    order (``CacheConfig.checkpoint_eviction``; ``None``: ``eviction``'s); ``store_gib=None`` means
    :data:`~hybridkv.fleet.store.DEFAULT_STORE_GIB` (0: unlimited); ``restarts`` are
    ``(instance, seconds)`` pairs of a timed run (:class:`~hybridkv.replay.timed.TimedSetup`), and so
    are ``crashes`` (each instance back after ``cold_start_s``); ``hybrid``: the ``hybrid``
    router's options (:class:`~hybridkv.fleet.routers.HybridOptions`); ``slo``: timed only,
    service-level targets in seconds (:func:`~hybridkv.fleet.operating.parse_slo`) the report's
    ``goodput`` counts against; ``defaulted_limit``: ``limit`` was chosen by the mode, not given (the
    report's ``workload_notes`` then name it); ``route_candidates``: a larger timed fleet narrows the
    routers that scan every instance to this many candidates (:mod:`hybridkv.fleet.candidates`);
    ``simulated_host``: a timed simulation builds the host tier of ``host_bytes`` too (payload-free,
    its loads not priced; off: a timed simulation has no host tier; ``hybridkv plan`` turns it on)."""

    trace: str | None = None
    limit: int | None = 40
    model: str = "small"
    block_tokens: int | None = None
    block_size: int | None = None
    prefix_match_unit: int = 64
    policy: str | None = None
    mechanism: str = "extract"
    max_output_tokens: int | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 4
    num_kv_pages: int | None = None
    num_checkpoint_slots: int | None = None
    verify: int = 0
    simulate: bool = False
    skip_bad: bool = False
    seed: int = 0
    progress: bool = True
    instances: int = 1
    store: str = "none"
    store_alignment: int | None = None
    host_bytes: int = 256 << 20
    host_write_through: bool = False
    host_groups: tuple[str, ...] = ("full", "kda")
    host_interval: int | None = None
    threads: int = 1
    eviction: str = "lru"
    host_eviction: str = "lru"
    host_probation: float = HOST_PROBATION
    host_protected_share: float | None = None
    checkpoint_probation: float | None = None
    checkpoint_eviction: str | None = None
    timed: bool = False
    time_scale: float = 1.0
    router: str | None = None
    hybrid: HybridOptions = HybridOptions()
    cost_model: str | None = None
    store_gbps: float = MOONCAKE_LOAD_BYTES_PER_S / 1e9
    store_latency_s: float = MOONCAKE_GET_LATENCY_S
    step_log: str | None = None
    step_clock: str = "wall"
    store_gib: float | None = None
    restarts: tuple[tuple[int, float], ...] = ()
    crashes: tuple[tuple[int, float], ...] = ()
    cold_start_s: float = DEFAULT_COLD_START_S
    swa_recovery: str | None = None
    slo: dict[str, float] | None = None
    defaulted_limit: bool = False
    route_candidates: int = DEFAULT_ROUTE_CANDIDATES
    simulated_host: bool = False


def default_policy(block_tokens: int, prefix_match_unit: int) -> str:
    """``branch+tail=B+interval=14B+supersede`` with ``B = block_tokens`` (512 unscaled).

    * ``tail=B``: the trace shares whole 512-token blocks (scaled: ``B``), so the
      next turn of a conversation can only hit a tail on a block boundary; a
      unit-aligned tail inside the last partial block is never hit.
    * ``branch``: a request whose KV hit passes its checkpoint hit creates the
      checkpoint there once, for every later request branching at that point.
    * ``interval=14B``: a request branching inside a long shared prefix can
      reuse only up to the checkpoint behind the branch; sparse dense tracking
      bounds that recompute.
    * ``supersede``: a conversation's older tail retires when its next turn
      publishes a newer one.

    On the whole trace (simulate) this reaches 98.1% of the every-block oracle (98.06% of
    the every-unit oracle the replay reports)
    with 9.9% of its checkpoint bytes (docs/results/policies.md).
    """
    if block_tokens % prefix_match_unit == 0:
        return f"branch+tail={block_tokens}+interval={14 * block_tokens}+supersede"
    return "branch+tail+supersede"


HOST_INTERVAL_BLOCKS = 4
"""Default host-only checkpoint spacing, in pages (:func:`default_host_interval`)."""


def default_host_interval(block_size: int, host_bytes: int, host_groups=("full", "kda"),
                          lower_tiers_built: bool = True) -> int | None:
    """``4 * block_size`` tokens when a host tier holding checkpoints is built, else ``None``.

    With it the prefill writes a checkpoint every 4 pages through to the host (besides the
    device policy's, and the device's evictions written back): about a quarter of what a
    checkpoint at every block costs, so a host of 25% of the every-block bytes holds nearly
    all of them for any trace, while the device keeps its sparse policy. Measured:
    docs/results/memory.md.
    """
    if not host_bytes or "kda" not in host_groups or not lower_tiers_built:
        return None
    return HOST_INTERVAL_BLOCKS * block_size


def _default_slots(opts: ReplayOptions, prompts, policy: CheckpointPolicy, v4: bool = False) -> int:
    """Slots so that nothing is evicted. Simulating (no tensors), or a DeepSeek-V4 run (``v4``:
    its ``periodic=P`` policy saves a state every ``P`` tokens): the most the policy can create,
    per request two branch (the device's and a lower tier's), one tail and one per ``interval``
    (one per unit without an interval: a bound that holds whatever the policy); a V4 policy that
    saves nothing (``recompute``): 16; else 4 per request."""
    if v4 and not (policy.branch or policy.tail or policy.interval or policy.hint):
        return 16
    if opts.simulate or v4:
        g = opts.prefix_match_unit
        if policy.interval and not policy.hint:
            return 16 + sum(3 + len(p) // policy.interval for p in prompts)
        return 16 + sum(len(p) // g for p in prompts)
    return max(16, 4 * len(prompts))


def run_replay(opts: ReplayOptions, console: Console | None = None) -> ReplayReport:
    """Replay the trace and return the report.

    Raises:
        TraceError: a bad trace line (unless ``skip_bad``), naming file and line.
        ConfigError: an invalid cache option, naming the value.
        ValueError: an unknown model preset or bad model directory; ``instances`` below 1 or above
            the number of requests; a ``memory://`` store with ``instances`` > 1 (each engine's
            memory store is its own: they would share nothing); a DeepSeek-V4 rule broken
            (:func:`check_v4_replay`).
    """
    check_v4_replay(opts.model, opts.swa_recovery, opts.simulate, opts.host_bytes, opts.timed)
    with _fewer_collections(opts.simulate):      # from the trace load to the report
        return _replay(opts, console)


def check_v4_replay(model: str, swa_recovery: str | None, simulate: bool, host_bytes: int, timed: bool) -> None:
    """The model-family rules of a replay, in one place for ``hybridkv replay`` and :func:`run_replay`:
    ``swa_recovery`` only with a DeepSeek-V4 model; a simulate-only V4 preset only with ``simulate``;
    a real V4 fleet is not ``timed``. ``host_bytes`` (bytes) is accepted for every V4 replay (a
    simulated one's host tier is payload-free, as a simulated Kimi Linear model's is).

    Raises:
        ValueError: naming the option (as ``hybridkv replay`` spells it), its value and the model.
    """
    from hybridkv.engine.build import is_v4
    v4 = is_v4(model)
    if swa_recovery is not None and not v4:
        raise ValueError(f"--swa-recovery {swa_recovery}: applies to DeepSeek-V4 models (v4-tiny, v4-small, or a "
                         f"deepseek_v4 directory); --model {model} is Kimi Linear, whose KDA checkpoints are restored "
                         "at the hit")
    if not v4:
        return
    if model in V4_SIMULATE_ONLY and not simulate:
        raise ValueError(f"--model {model} is a simulate-only preset (published shapes, no weights): add --simulate, "
                         "or replay v4-tiny / v4-small with the model")
    if timed and not simulate:
        raise ValueError(f"--timed with --model {model}: a real DeepSeek-V4 fleet is not timed; add --simulate "
                         "(the V4-Flash cost model) or replay it untimed")


def resolved_block_tokens(opts: ReplayOptions) -> int:
    """Tokens per trace hash id of a replay: ``opts.block_tokens``, or when it is ``None`` 512 (the
    trace's own block, Mooncake FAST'25 release) when simulating and 64 (lengths scaled 1/8 so the
    CPU models can run them) otherwise."""
    if opts.block_tokens is not None:
        return opts.block_tokens
    return 512 if opts.simulate else 64


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its children reaped so far
    (``getrusage``: an untimed replay with ``--instances > 1`` runs each instance in a child)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process so far, bytes (``getrusage`` ``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _priced_by(opts: ReplayOptions, mcfg) -> str | None:
    """Name of what prices a timed run: a simulation's steps (``opts.cost_model`` or the mode's
    default), a real run's router (``opts.cost_model`` or :data:`~hybridkv.replay.timed.CPU_ESTIMATE`);
    ``None`` untimed."""
    if not opts.timed:
        return None
    if opts.cost_model is not None:
        return opts.cost_model
    if not opts.simulate:
        return CPU_ESTIMATE.name
    return DEFAULT_SIMULATED_V4_COST_MODEL if isinstance(mcfg, V4Config) else DEFAULT_SIMULATED_COST_MODEL


def _replay(opts: ReplayOptions, console: Console | None) -> ReplayReport:
    """:func:`run_replay`'s work."""
    console = console or Console(stderr=True)
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    load = load_trace(opts.trace, limit=opts.limit, skip_bad=opts.skip_bad)
    reqs = load.requests
    given = opts                                  # as given: the notes name the defaults the mode chose
    opts = replace(opts, block_tokens=resolved_block_tokens(opts))
    if opts.max_output_tokens is None and not opts.simulate:
        opts = replace(opts, max_output_tokens=4)
    if opts.block_size is None:       # pages follow the trace's sharing granularity
        g = opts.prefix_match_unit
        opts = replace(opts, block_size=-(-opts.block_tokens // g) * g)
    policy = CheckpointPolicy.parse(opts.policy if opts.policy is not None
                                    else default_policy(opts.block_tokens, opts.prefix_match_unit))
    mcfg = model_config(opts.model)
    recovery = None
    if isinstance(mcfg, V4Config):   # the strategy places the saved boundary states (build_engine applies it too)
        recovery = SwaRecovery.parse(opts.swa_recovery)
        recovery.check(opts.prefix_match_unit)
        policy = recovery.policy(policy)
    units = TraceUnits(opts.block_tokens, opts.prefix_match_unit, mcfg.vocab_size, opts.seed) if opts.simulate else None
    if units is not None:      # no tensors: the cache is keyed by unit payloads, no token is synthesised
        prompts = placeholder_prompts([scaled_input_length(r, opts.block_tokens) for r in reqs])
    else:
        prompts = [request_token_array(r, opts.block_tokens, mcfg.vocab_size, seed=opts.seed) for r in reqs]
    out_lens = [_output_length(opts, r) for r in reqs]
    pages_needed = sum(-(-(len(p) + o) // opts.block_size) for p, o in zip(prompts, out_lens))
    cfg = CacheConfig(
        block_size=opts.block_size, prefix_match_unit=opts.prefix_match_unit,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        num_kv_pages=opts.num_kv_pages or pages_needed + opts.max_num_seqs,
        num_checkpoint_slots=opts.num_checkpoint_slots or _default_slots(opts, prompts, policy, recovery is not None),
        policy=policy, mechanism=opts.mechanism, max_num_seqs=opts.max_num_seqs,
        store_alignment=opts.store_alignment, eviction=opts.eviction, host_eviction=opts.host_eviction,
        host_probation=opts.host_probation, checkpoint_probation=opts.checkpoint_probation,
        checkpoint_eviction=opts.checkpoint_eviction, host_protected_share=opts.host_protected_share,
        host_interval=(default_host_interval(opts.block_size, opts.host_bytes, opts.host_groups,
                                             not (opts.timed and opts.simulate) or opts.simulated_host)
                       if opts.host_interval is None else opts.host_interval or None))
    if recovery is not None:
        check_block_size(cfg.block_size, {CSA: mcfg.csa_rate, HCA: mcfg.hca_rate})
    if not opts.simulate:
        hint = "" if opts.num_kv_pages else " (sized for every prompt: lower --block-tokens or give --kv-pages)"
        sizes = mcfg
        if recovery is not None:        # DeepSeek-V4: its pages and slots, from the group specs
            from hybridkv.engine.v4backend import pool_sizes
            sizes = pool_sizes(mcfg, cfg.block_size, cfg.prefix_match_unit)
        check_pool_memory(cfg, sizes, opts.instances, hint, host_bytes=opts.host_bytes)
    if opts.instances < 1:
        raise ValueError(f"instances={opts.instances} must be >= 1")
    if opts.instances > len(reqs):
        raise ValueError(f"instances={opts.instances} is more than the {len(reqs)} requests to replay: each instance "
                         "is a process that loads the model, and those beyond the requests would replay nothing")
    if opts.instances > 1 and opts.store.startswith("memory:"):
        raise ValueError(f"store {opts.store!r} with instances={opts.instances}: memory:// is private to one engine "
                         "(a dict in its process), so the instances would share nothing; use disk:///PATH or "
                         "mooncake://HOST:PORT, or no store (the instances then share a fresh disk store)")
    if opts.timed and opts.cost_model is not None:
        cost_model(opts.cost_model)           # a bad cost-model file is refused before any note is printed
    _warn_if_lower_tiers_idle(opts, cfg, prompts, console)
    notes = workload_notes(given, len(reqs), cfg.num_checkpoint_slots, _priced_by(opts, mcfg))
    for note in notes:                        # before the run: what this mode changes in the work
        console.print(f"[yellow]note:[/yellow] {note.line()}", markup=True, highlight=False)
    store_url, scratch = opts.store, None
    if opts.instances > 1 and store_url == "none":
        scratch = tempfile.mkdtemp(prefix="hybridkv-store-")
        store_url = f"disk://{scratch}"
    oracle = oracle_from_trace(reqs, opts.block_tokens, cfg.prefix_match_unit)   # the unit the engine matches on
    verify_ids = _pick_verify(oracle.per_request, opts.verify) if not opts.simulate else set()
    n = opts.instances
    specs = [InstanceSpec(instance_id=k, model=opts.model, seed=opts.seed, config=cfg,
                          prompts=prompts[k::n], indices=list(range(k, len(reqs), n)), output_lengths=out_lens[k::n],
                          verify={i for i in verify_ids if i % n == k}, store_url=store_url,
                          host_bytes=opts.host_bytes, host_write_through=opts.host_write_through,
                          host_groups=tuple(opts.host_groups), simulate=opts.simulate,
                          trace=reqs[k::n] if units is not None else [], units=units,
                          swa_recovery=None if recovery is None else str(recovery))
             for k in range(n)]
    with Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not opts.progress, transient=False) as bar:
        task = bar.add_task("requests", total=len(reqs))
        timed = None
        try:
            if opts.timed:                   # no progress bar: no call a step (tens of thousands a run)
                timed = run_timed(_timed_setup(opts, store_url), cfg, reqs, prompts, out_lens, verify_ids,
                                  (lambda k: bar.advance(task, k)) if opts.progress else None, units)
                results = timed.results
            elif n == 1:
                results = [run_instance(specs[0], lambda k: bar.advance(task, k), threads=opts.threads)]
            else:
                results = _run_processes(specs, lambda k: bar.advance(task, k), opts.threads)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        bar.update(task, completed=len(reqs))
    report = _merge(opts, cfg, policy, load, oracle, results, verify_ids, store_url, time.perf_counter() - t0)
    if recovery is not None:          # DeepSeek-V4 only: the strategy and what restoring hits recomputed
        report.config["swa_recovery"] = str(recovery)
        report.config["restore_recompute_tokens"] = sum(r.stats.get("restore_recompute_tokens", 0) for r in results)
        from hybridkv.replay.v4report import restore_summary
        report.config["swa_restore"] = restore_summary(results, mcfg, recovery, opts.simulate,
                                                       results[0].kv_bytes_per_token, report.kv_bytes_peak,
                                                       report.checkpoint_bytes_peak)
    report.workload_notes = [note.as_dict() for note in notes]
    report.peak_rss_bytes = _peak_rss_bytes()
    report.cpu_seconds = round(_cpu_seconds() - cpu0, 3)
    for key, seconds in (("requests_per_second", report.wall_seconds), ("requests_per_cpu_second", report.cpu_seconds)):
        rate = ratio(report.requests, seconds)
        setattr(report, key, None if rate is None else round(rate, 1))
    if timed is not None:
        for key in TIMED_KEYS:
            setattr(report, key, timed.timing[key])
        for key in OPERATING_KEYS:
            setattr(report, key, timed.timing.get(key))
        if opts.step_log is not None:
            try:                # checked writable before the run; failing now still keeps the report
                write_step_log(opts.step_log, timed.steps,
                               {"mode": "simulate" if opts.simulate else "model", "model": opts.model,
                                "instances": opts.instances, "time_scale": opts.time_scale,
                                "cost_model": timed.timing["cost_model"], "requests": len(reqs),
                                "step_clock": None if opts.simulate else opts.step_clock})
            except OSError as exc:
                console.print(f"[yellow]warning:[/yellow] --step-log {opts.step_log}: {exc.strerror or exc}; "
                              "the step log is not written, the report is", markup=True, highlight=False)
    return report


@contextmanager
def _fewer_collections(on: bool):
    """No cyclic garbage collection inside the block when ``on`` (a simulated replay); the
    collector's previous state after.

    The simulated cache allocates millions of long-lived index nodes, and every collection
    of the young generations traverses them once or twice while finding nothing: with the
    thresholds raised to ``(100_000, 50, 1000)`` (the previous setting) collections still took
    about 2 of the 17 CPU seconds of a whole-trace timed run at 32 instances (docs/results/replay.md,
    "Simulator speed"). Reference counting still frees everything acyclic at once, and index
    nodes break their own cycles when removed, so memory does not wait on the collector: the
    whole-trace run peaked at 2,019 MiB with the collector off against 2,021 MiB with it on.

    On the way out every object tracked by the collector is moved to the oldest generation
    (``gc.freeze`` then ``gc.unfreeze``, which splice lists and traverse nothing) before the
    collector is enabled again: else its first young collection would traverse everything
    allocated during the run (1.8 s for the whole trace). What the run leaves (its fleet, a
    cyclic structure) then waits for a full collection, as it did with the raised thresholds.
    """
    if not on:
        yield
        return
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if was:
            gc.enable()


def _output_length(opts: ReplayOptions, r) -> int:
    """Tokens request ``r`` generates: 1 in untimed simulation; else the trace's (scaled) length,
    capped at ``max_output_tokens`` when set (timed simulation models the decode)."""
    if opts.simulate and not opts.timed:
        return 1
    n = scaled_output_length(r, opts.block_tokens)
    return n if opts.max_output_tokens is None else min(opts.max_output_tokens, n)


def _router_name(opts: ReplayOptions) -> str:
    """The timed replay's router: ``opts.router``, else ``hybrid`` for a fleet and ``round-robin``
    for one instance."""
    return opts.router or ("hybrid" if opts.instances > 1 else "round-robin")


def _timed_setup(opts: ReplayOptions, store_url: str) -> TimedSetup:
    router = _router_name(opts)
    return TimedSetup(model=opts.model, seed=opts.seed, simulate=opts.simulate, instances=opts.instances,
                      router=router, hybrid=opts.hybrid, time_scale=opts.time_scale, cost_model=opts.cost_model,
                      store_url=store_url, host_bytes=opts.host_bytes, host_write_through=opts.host_write_through,
                      store_gbps=opts.store_gbps, store_latency_s=opts.store_latency_s,
                      record_steps=opts.step_log is not None, threads=opts.threads,
                      step_clock=opts.step_clock,
                      store_gib=DEFAULT_STORE_GIB if opts.store_gib is None else opts.store_gib,
                      restarts=opts.restarts, crashes=opts.crashes, cold_start_s=opts.cold_start_s,
                      swa_recovery=opts.swa_recovery, slo=opts.slo, route_candidates=opts.route_candidates,
                      simulated_host=opts.simulated_host)


def _warn_if_lower_tiers_idle(opts: ReplayOptions, cfg: CacheConfig, prompts, console: Console) -> None:
    """Say once when most prompts are shorter than the lower tiers' entry size: host and store
    entries exist only at whole multiples of it, so those tiers would hold (almost) nothing."""
    tiers = [(name, size) for name, size, on in (
        ("host tier", cfg.block_size, opts.host_bytes),
        ("store", cfg.store_boundary, (opts.store != "none" or opts.instances > 1) and not opts.simulate)) if on]
    for name, size in tiers:
        short = sum(len(p) <= size for p in prompts)
        if prompts and short * 2 > len(prompts):
            console.print(f"[yellow]warning:[/yellow] {short} of {len(prompts)} prompts are not longer than the "
                          f"{name}'s entry size ({size} tokens): it will hold little; lower --block-size or "
                          f"--store-alignment", markup=True, highlight=False)


def _run_processes(specs: list[InstanceSpec], progress, threads: int) -> list[InstanceResult]:
    """One worker process per instance (spawned: no state is inherited), progress via a queue.

    Requests run one at a time in trace order across instances (see :func:`run_instance`).
    Ctrl-C reaches every process of the group: the workers and the manager ignore it, and
    here it only sets a flag (whatever this process is doing then: spawning, waiting), on
    which the shared ``stop`` event is set: each instance stops before its next request
    and returns what it measured (``interrupted``).
    """
    ctx = mp.get_context("spawn")
    ignore_sigint = (signal.signal, (signal.SIGINT, signal.SIG_IGN))
    ctrl_c = threading.Event()
    previous = _on_sigint(ctrl_c.set)
    manager = SyncManager(ctx=ctx)
    try:
        manager.start(*ignore_sigint)
        queue, turn, stop = manager.Queue(), manager.Value("i", 0), manager.Event()
        with ProcessPoolExecutor(max_workers=len(specs), mp_context=ctx, initializer=ignore_sigint[0],
                                 initargs=ignore_sigint[1]) as pool:
            futures = [pool.submit(_worker, spec, queue, turn, threads, stop) for spec in specs]
            while not all(f.done() for f in futures):
                if ctrl_c.is_set():
                    if not stop.is_set():
                        stop.set()                    # each instance stops before its next request
                    wait(futures, timeout=0.2)
                    continue
                if any(f.done() and f.exception() is not None for f in futures):
                    turn.value = TURN_FAILED          # a worker died before it could say so
                try:
                    progress(queue.get(timeout=0.2))
                except Exception:  # noqa: BLE001, S110 - queue.Empty from a manager proxy
                    pass
            results = [f.result() for f in futures]
            if ctrl_c.is_set():
                for r in results:
                    r.interrupted = True
            return results
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        manager.shutdown()


def _on_sigint(action):
    """Make SIGINT (Ctrl-C) call ``action()`` instead of raising ``KeyboardInterrupt``; returns the
    handler to restore, or ``None`` off the main thread (where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, lambda signum, frame: action())


def _worker(spec: InstanceSpec, queue, turn, threads: int, stop) -> InstanceResult:
    return run_instance(spec, queue.put, turn, threads, stop)


def _merge(opts, cfg, policy, load, oracle, results, verify_ids, store_url, wall) -> ReplayReport:
    stats = Counter()
    created = Counter()
    for r in results:
        for k, v in r.stats.items():
            if k == "checkpoints_created":
                created.update(v)
            else:
                stats[k] += v
    kv_tok, ck = results[0].kv_bytes_per_token, results[0].checkpoint_bytes
    # Reuse beyond what this run's earlier requests could supply came from a store filled before
    # the run (a warm start): the oracle fraction counts only the reuse within the oracle's reach.
    reused = {i: n for r in results for i, n in r.reused.items()}
    within = sum(min(n, oracle.per_request[i]) for i, n in reused.items())
    warm = sum(reused.values()) - within
    # the oracle over the requests served: a refused (or, after Ctrl-C, never admitted) request
    # counts in no figure, the oracle's included (each served request's oracle reuse still
    # assumes every earlier request cached: an upper bound for it)
    oracle_served = sum(oracle.per_request[i] for i in reused)
    total_bytes = stats["prompt_tokens"] * kv_tok + stats["requests"] * ck
    reused_bytes = stats["reused_tokens"] * kv_tok + stats["requests_with_hit"] * ck
    compute = max(r.compute_seconds for r in results)
    tiers = {name: {k: sum(r.tiers[name].get(k, 0) for r in results)
                    for k in ("hit_tokens", "bytes_loaded", "bytes_saved", "loads_taken", "loads_declined",
                              "bytes_peak")}
             for name in ("device", "host", "store")}
    page_bytes = kv_tok * cfg.block_size
    evictions = {"device": {"kv_pages": sum(r.evicted_pages for r in results),
                            "kv_bytes": sum(r.evicted_pages for r in results) * page_bytes,
                            "checkpoints": sum(r.evicted_checkpoints for r in results),
                            "checkpoint_bytes": sum(r.evicted_checkpoints for r in results) * ck},
                 "host": {"entries": sum(r.tiers["host"].get("evictions", 0) for r in results),
                          "bytes": sum(r.tiers["host"].get("bytes_evicted", 0) for r in results)}}
    misses = Counter({reason: 0 for reason in MISS_REASONS})
    for r in results:
        misses.update(r.store_misses)
    verify = None
    if not opts.simulate:
        verify = VerifyReport(requests=sum(r.verify_requests for r in results),
                              max_abs_logit_diff=max(r.max_abs_logit_diff for r in results),
                              greedy_mismatches=sum(r.greedy_mismatches for r in results))
    report = ReplayReport(
        requests=stats["requests"], prompt_tokens=stats["prompt_tokens"],
        computed_prompt_tokens=stats["computed_prompt_tokens"], reused_tokens=stats["reused_tokens"],
        token_hit_rate=ratio(stats["reused_tokens"], stats["prompt_tokens"]),
        request_hit_rate=ratio(stats["requests_with_hit"], stats["requests"]),
        byte_weighted_hit_rate=ratio(reused_bytes, total_bytes),
        oracle_reused_tokens=oracle_served, oracle_fraction=ratio(within, oracle_served),
        checkpoints_created={**{name: created.get(name, 0) for name in policy.names()},
                             **{k: v for k, v in created.items() if k not in policy.names()}},
        branch_recompute_tokens=stats["branch_recompute_tokens"],
        checkpoint_bytes_peak=sum(r.checkpoint_bytes_peak for r in results),
        kv_bytes_peak=sum(r.kv_bytes_peak for r in results),
        verify=verify, wall_seconds=round(wall, 3),
        prefill_tokens_per_second=ratio(stats["computed_prompt_tokens"], compute),
        mode="simulate" if opts.simulate else "model",
        config={"model": opts.model, "weight_digest": next((r.weight_digest for r in results if r.weight_digest), None),
                "block_tokens": opts.block_tokens, "block_size": cfg.block_size,
                "prefix_match_unit": cfg.prefix_match_unit, "policy": str(policy), "mechanism": cfg.mechanism.value,
                "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
                "num_kv_pages": cfg.num_kv_pages, "num_checkpoint_slots": cfg.num_checkpoint_slots,
                "max_output_tokens": opts.max_output_tokens, "instances": opts.instances, "store": store_url,
                "store_alignment": cfg.store_boundary, "rejected": stats["rejected"], "eviction": cfg.eviction,
                **{k: getattr(opts.hybrid, k) if opts.timed and _router_name(opts) == "hybrid" else None
                   for k in ("own_waiting", "waiting_weight", "tie_kv_run", "price_restore")},
                "host_eviction": cfg.host_eviction, "host_probation": cfg.host_probation,
                "host_protected_share": cfg.host_protected_share,
                "checkpoint_eviction": cfg.checkpoint_eviction, "host_bytes": opts.host_bytes, "host_write_through": opts.host_write_through,
                "host_groups": "+".join(opts.host_groups), "host_interval": cfg.host_interval,
                "evicted_pages": sum(r.evicted_pages for r in results),
                "evicted_checkpoints": sum(r.evicted_checkpoints for r in results)},
        skipped_lines=load.skipped)
    report.tiers = tiers
    report.store_misses = dict(misses)
    reasons, examples = Counter(), {}
    for r in results:
        reasons.update(r.reject_reasons)
        for kind, example in r.reject_examples.items():     # the largest refused request of every instance
            examples[kind] = max(examples.get(kind, example), example, key=lambda e: e[0])
    report.rejected = {"requests": stats["rejected"], "reasons": dict(reasons),
                       "examples": {kind: reason for kind, (_, reason) in examples.items()}}
    report.warm_start_reused_tokens = warm
    report.interrupted = True if any(r.interrupted for r in results) else None
    report.evictions = evictions
    report.reused_histogram = reuse_histogram(reused.values())
    return report


def _pick_verify(oracle_per_request, n: int) -> set[int]:
    """``n`` request indices spread over the trace, preferring requests that share a prefix."""
    if n <= 0:
        return set()
    sharing = [i for i, reused in enumerate(oracle_per_request) if reused > 0]
    pool = sharing if len(sharing) >= n else list(range(len(oracle_per_request)))
    picks = np.linspace(0, len(pool) - 1, num=min(n, len(pool))).round().astype(int)
    return {pool[i] for i in picks}
