"""Capacity planning: from a trace and service-level targets to the cheapest fleet that meets them.

The planner searches fleet configurations (:class:`FleetConfig`) on the timed fleet simulator
(``hybridkv replay --simulate --timed``, :func:`hybridkv.replay.runner.run_replay`) and prices
each (:class:`Prices`). It is a search, not a grid:

1. **Lower bound** (:func:`prefill_bound`): per request, the fastest its first token can come on
   an idle instance that reuses every token an earlier request makes reusable (the trace's
   oracle); a TTFT target below this bound's statistic is infeasible at once.
2. **Instances by bisection.** With the baseline configuration (the first candidate), the fewest
   instances that meet every target on a short prefix of the trace: doubling until the targets
   are met, then bisection (more instances are assumed never to make a target worse: monotone).
3. **Successive halving** at that count (:data:`HEADROOM`), on trace prefixes (the shortest,
   then :data:`GROWTH` times longer, up to half the trace), keeping the best :data:`KEEP` share
   on each. Candidates are grouped by their *structure*: what they pay for besides GPUs (store
   size and bandwidth, host tier size). Candidates of one structure cost the same at every
   instance count and compete on latency alone (ranked by the worst target's value over the
   target, then mean TTFT); every structure keeps its best two, whatever the others do.
   To keep this cheap, the device and routing choices (cache share, checkpoint policy, router)
   are first screened in two structures (the baseline's and the dearest) and the best
   :data:`SCREEN_KEEP` of each are tried in every structure.
4. **Branch and bound on the whole trace.** The cheapest structure's survivor gets the fewest
   instances that meet every target (bisection); every other structure's survivor is simulated
   at the most instances that still cost less than the cheapest plan so far: if it misses, no
   fewer instances meet (monotone) and the structure is done in one simulation; if it meets,
   its own bisection gives a cheaper plan. A structure's second survivor is tried the same way
   when its best met (was bisected) or missed by at most :data:`NEAR`.

Every simulation is cached by its configuration, prefix, seed and targets (in memory and, with a
cache file, across runs). The device memory of an instance is split between checkpoint slots and
KV pages (:class:`DeviceBudget`); the page pool holds both running requests' KV and cached pages,
so the cache share (the slots' part) is what the cache takes from decode KV.
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import math
import multiprocessing
import os
import random
import tempfile
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from hybridkv.fleet.operating import parse_slo

HOURS_PER_MONTH = 730.0
"""Hours in a billing month (365 x 24 / 12)."""

DEFAULT_GPU_HOUR_USD = 3.50
"""Price of one H200-hour (USD), an assumption: 2026 on-demand list prices for one H200 run from
about 2.25 USD at smaller GPU clouds to about 10 USD and more at the large public clouds; give your own
with ``--gpu-hour-usd``."""
DEFAULT_HOST_GB_MONTH_USD = 2.60
"""Price of one GiB-month of host DRAM (USD), derived from AWS us-east-1 on-demand list prices: an
r7i.large (16 GiB) at 0.1323 USD/h against a c7i.large (4 GiB) at 0.08925 USD/h, the same 2 vCPUs,
is 0.0036 USD per GiB-hour, times :data:`HOURS_PER_MONTH`."""
DEFAULT_STORE_GB_MONTH_USD = 2.60
"""Price of one GiB-month of the shared store (USD): the store keeps entries in DRAM (Mooncake), so
the host DRAM price (:data:`DEFAULT_HOST_GB_MONTH_USD`)."""
DEFAULT_STORE_GBPS_MONTH_USD = 100.0
"""Price of one GB/s of store load bandwidth for a month (USD), an assumption: the network ports and
store servers that serve it; give your own with ``--store-gbps-month-usd``."""

H200_HBM_BYTES = 141e9
"""HBM of one NVIDIA H200 in bytes (141 GB, NVIDIA H200 datasheet)."""
GPU_MEMORY_UTILIZATION = 0.9
"""Share of device memory for weights and pools (vLLM's ``gpu_memory_utilization`` default; the
rest is activations and workspace)."""
KIMI_LINEAR_48B_WEIGHT_BYTES = 48e9 * 2
"""Weights of Kimi-Linear-48B-A3B in bf16 (48B parameters, model card)."""

SHARES = (0.2, 0.05, 0.5)
"""Device cache shares searched (checkpoint slots' part of the pools; the first is the baseline's)."""
STORES = ((0.0, 0.0), (256.0, 1.1), (1024.0, 1.1), (1024.0, 10.0))
"""Shared stores searched, ``(GiB, GB/s)``; ``(0, 0)``: none. 1.1 GB/s is the Mooncake store's
measured load bandwidth (docs/results/store.md)."""
HOSTS = (0.0, 64.0, 256.0)
"""Host tier sizes searched, GiB of DRAM per instance (0: none); 256 GiB is an eighth of the 2 TiB
of host memory of a typical 8-GPU H200 server."""
ROUTERS = ("hybrid", "prefix-smg", "least-load")
"""Routers searched."""
KEEP = 0.25
"""Share of candidates a rung of successive halving keeps (at least 2)."""
GROWTH = 4
"""Each rung's trace prefix is this many times the previous one's."""
FIRST_FRACTION = 1 / 16
"""The first rung's share of the trace."""
MAX_INSTANCES = 64
"""Most instances the planner tries unless told otherwise."""
SCREEN_KEEP = 2
"""Device and routing choices (cache share, policy, router) each screening structure passes on
to every structure."""
HEADROOM = 1
"""The halving runs at this many times the instances the baseline needs on the first prefix: near the
count where a plan is decided, so the ranking shows what the cache, store, policy and router do
there (with many more instances every candidate's tail sits on the prefill bound and they tie)."""
RELAX = 0.25
"""A TTFT target below the prefill bound is planned for at the bound plus this share instead
(rounded up to 10 ms), and said so: the nearest target a fleet can reach."""


class PlanError(ValueError):
    """A planner input that cannot be used (the offending option and value are named)."""


@dataclass(frozen=True, slots=True)
class Prices:
    """Prices in USD: ``gpu_hour`` per GPU-hour, ``host_gb_month`` / ``store_gb_month`` per GiB-month,
    ``store_gbps_month`` per GB/s of store bandwidth and month.

    Raises:
        PlanError: a price negative or not finite (named by its option).
    """

    gpu_hour: float = DEFAULT_GPU_HOUR_USD
    host_gb_month: float = DEFAULT_HOST_GB_MONTH_USD
    store_gb_month: float = DEFAULT_STORE_GB_MONTH_USD
    store_gbps_month: float = DEFAULT_STORE_GBPS_MONTH_USD

    def __post_init__(self) -> None:
        for name in ("gpu_hour", "host_gb_month", "store_gb_month", "store_gbps_month"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise PlanError(f"--{name.replace('_', '-')}-usd {v!r}: a price must be a finite number >= 0")


@dataclass(frozen=True, slots=True, order=True)
class FleetConfig:
    """One fleet: ``instances`` (one GPU each), ``cache_share`` (checkpoint slots' share of each
    instance's device pools, 0..1), ``host_gib`` (host tier per instance, GiB), ``store_gib`` and
    ``store_gbps`` (the shared store's capacity in GiB and load bandwidth in GB/s; 0 GB/s: no store),
    ``policy`` (checkpoint policy text), ``router`` (router name)."""

    instances: int
    cache_share: float
    store_gib: float
    store_gbps: float
    policy: str
    router: str
    host_gib: float = 0.0

    def cost_per_hour(self, prices: Prices) -> float:
        """USD per hour: GPUs, host memory per instance, store capacity and bandwidth."""
        month = (self.instances * self.host_gib * prices.host_gb_month
                 + (self.store_gib * prices.store_gb_month + self.store_gbps * prices.store_gbps_month
                    if self.store_gbps > 0 else 0.0))
        return self.instances * prices.gpu_hour + month / HOURS_PER_MONTH

    @property
    def structure(self) -> tuple[float, float, float]:
        """What the fleet pays for besides GPUs: ``(store_gib, store_gbps, host_gib)`` (no store:
        ``(0, 0, host_gib)``). Configurations of one structure cost the same at every instance count."""
        return (self.store_gib, self.store_gbps, self.host_gib) if self.store_gbps > 0 else (0.0, 0.0, self.host_gib)

    def label(self) -> str:
        store = "no store" if self.store_gbps <= 0 else f"store {self.store_gib:g} GiB @ {self.store_gbps:g} GB/s"
        host = "no host tier" if self.host_gib <= 0 else f"host {self.host_gib:g} GiB"
        return (f"{self.instances} x H200, cache share {self.cache_share:g}, {host}, {store}, policy {self.policy}, "
                f"router {self.router}")


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    """Device memory of one instance for its cache pools (bytes): ``hbm_bytes`` times
    ``utilization`` less ``weight_bytes`` and the running sequences' KDA states
    (``max_num_seqs * checkpoint_bytes``). Pages hold ``block_size`` tokens of MLA latents at
    ``kv_bytes_per_token`` (bf16 on the GPU, as the H200 cost model assumes); a checkpoint slot
    holds ``checkpoint_bytes`` (the fp32 KDA state)."""

    hbm_bytes: float
    utilization: float
    weight_bytes: float
    kv_bytes_per_token: int
    checkpoint_bytes: int
    block_size: int
    max_num_seqs: int

    @property
    def pool_bytes(self) -> float:
        return (self.hbm_bytes * self.utilization - self.weight_bytes
                - self.max_num_seqs * self.checkpoint_bytes)

    def pools(self, cache_share: float) -> tuple[int, int]:
        """``(kv_pages, checkpoint_slots)`` for ``cache_share`` of :attr:`pool_bytes` in slots.

        Raises:
            PlanError: no room for pools (the weights fill the device).
        """
        if self.pool_bytes <= 0:
            raise PlanError(f"the weights ({self.weight_bytes / 1e9:g} GB) leave no device memory for the "
                            f"cache pools ({self.hbm_bytes / 1e9:g} GB at {self.utilization:g})")
        slots = max(1, int(cache_share * self.pool_bytes // self.checkpoint_bytes))
        pages = int((self.pool_bytes - slots * self.checkpoint_bytes) // (self.kv_bytes_per_token * self.block_size))
        return max(pages, 1), slots


def h200_budget(model: str, max_num_seqs: int, block_size: int = 512) -> DeviceBudget:
    """:class:`DeviceBudget` of ``model`` on one H200.

    Raises:
        PlanError: a model whose weights the planner does not know (only Kimi-Linear-48B-A3B).
    """
    from hybridkv.engine.build import model_config
    from hybridkv.model.config import HybridConfig
    if model != "kimi-linear-48b-a3b":
        raise PlanError(f"--model {model!r}: the planner prices the H200 cost model of kimi-linear-48b-a3b; "
                        "plan that model")
    mcfg = model_config(model)
    assert isinstance(mcfg, HybridConfig)
    return DeviceBudget(hbm_bytes=H200_HBM_BYTES, utilization=GPU_MEMORY_UTILIZATION,
                        weight_bytes=KIMI_LINEAR_48B_WEIGHT_BYTES,
                        kv_bytes_per_token=mcfg.kv_bytes_per_token // 2, checkpoint_bytes=mcfg.checkpoint_bytes,
                        block_size=block_size, max_num_seqs=max_num_seqs)


@dataclass(slots=True)
class Outcome:
    """One simulation's figures (seconds; ``ratio`` is the worst target's value over the target,
    infinite when a request was refused or none served)."""

    config: FleetConfig
    requests: int
    seed: int
    stats: dict
    goodput: float | None
    goodput_fraction: float | None
    rejected: int
    ratio: float
    meets: bool
    misses: list[str]
    cost_per_hour: float
    wall_seconds: float
    token_hit_rate: float | None
    cached: bool = False

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "config"}
        d["config"] = asdict(self.config)
        d["ratio"] = None if math.isinf(self.ratio) else round(self.ratio, 6)
        return d


def _stat(values: np.ndarray, stat: str) -> float:
    return float(values.mean()) if stat == "mean" else float(np.percentile(values, float(stat[1:])))


class Evaluator:
    """Runs and caches simulations of one trace against one SLO.

    Args:
        trace: trace path (``None``: the bundled one).
        model: model preset.
        slo: targets (:func:`~hybridkv.fleet.operating.parse_slo`).
        prices: :class:`Prices`.
        budget: :class:`DeviceBudget`.
        max_num_seqs, time_scale: as ``replay``'s.
        cache_file: JSON file of earlier results to read and extend (``None``: memory only).
        log: called with one line per simulation (progress).
        limit: plan on the first ``limit`` requests (``None``: all).
        jobs: simulations run at once (forked processes, one core each; 1: in this process).
    """

    def __init__(self, trace: str | None, model: str, slo: dict[str, float], prices: Prices, budget: DeviceBudget,
                 max_num_seqs: int = 4, time_scale: float = 1.0, cache_file: str | None = None,
                 log: Callable[[str], None] | None = None, limit: int | None = None, jobs: int = 1) -> None:
        from hybridkv.replay.trace import load_trace
        self.trace, self.model, self.slo, self.prices, self.budget = trace, model, slo, prices, budget
        self.max_num_seqs, self.time_scale = max_num_seqs, time_scale
        self.load = load_trace(trace, limit=limit)
        self.total = len(self.load.requests)
        self.scope = "whole trace" if limit is None else f"all {self.total:,} requests"
        """How the progress lines name the run on every request planned on (``--limit``: not the
        whole trace)."""
        if self.total == 0:
            raise PlanError(f"--trace {trace}: no requests")
        raw = Path(trace).read_bytes() if trace else None
        self._trace_id = hashlib.sha256(raw).hexdigest()[:16] if raw is not None else "bundled"
        self.cache: dict[str, dict] = {}
        self.cache_file = cache_file
        if cache_file:
            self.cache = read_cache(cache_file)
        self.log = log or (lambda line: None)
        self.runs = self.hits = 0
        self.jobs = max(1, int(jobs))
        self.stage = ""
        self.outcomes: list[Outcome] = []
        self._jittered: dict[int, str] = {}
        self._bound: np.ndarray | None = None

    def key(self, cfg: FleetConfig, requests: int, seed: int) -> str:
        return json.dumps([self._trace_id, self.total, self.model, self.slo, self.max_num_seqs, self.time_scale,
                           asdict(self.budget), asdict(cfg), requests, seed], sort_keys=True)

    def _trace_for(self, seed: int) -> str | None:
        """The trace, or (``seed`` > 0) a copy whose arrivals are each moved later by a uniform whole
        number of milliseconds in ``[0, gap)``, ``gap`` the trace's smallest positive gap between
        arrival times (the bundled trace's arrivals are bucketed about 3 s apart: the copy spreads
        each bucket over its 3 s and keeps the buckets in order)."""
        if seed == 0:
            return self.trace
        if seed not in self._jittered:
            ts = sorted({r.timestamp_ms for r in self.load.requests})
            gaps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
            gap = min(gaps) if gaps else 1.0
            rng = random.Random(seed)
            fd, path = tempfile.mkstemp(prefix=f"hybridkv-plan-seed{seed}-", suffix=".jsonl")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for r in self.load.requests:
                    f.write(json.dumps({"timestamp": int(r.timestamp_ms) + rng.randrange(max(int(gap), 1)),
                                        "input_length": r.input_length, "output_length": r.output_length,
                                        "hash_ids": list(r.hash_ids)}) + "\n")
            self._jittered[seed] = path
        return self._jittered[seed]

    def close(self) -> None:
        """Remove the jittered trace copies."""
        for path in self._jittered.values():
            Path(path).unlink(missing_ok=True)
        self._jittered.clear()

    def evaluate(self, cfg: FleetConfig, requests: int | None = None, seed: int = 0) -> Outcome:
        """Simulate ``cfg`` on the first ``requests`` requests (``None``: all) with arrival seed ``seed``."""
        return self.evaluate_many([(cfg, requests, seed)])[0]

    def _requests(self, cfg: FleetConfig, requests: int | None) -> int:
        return self.total if requests is None else max(min(requests, self.total), cfg.instances)

    def evaluate_many(self, jobs: list[tuple[FleetConfig, int | None, int]]) -> list[Outcome]:
        """:meth:`evaluate` of every ``(config, requests, seed)``, in order; those the cache lacks run
        :attr:`jobs` at a time in forked processes (each line of progress as one finishes)."""
        keys = [self.key(c, self._requests(c, r), s) for c, r, s in jobs]
        todo: dict[str, tuple[FleetConfig, int, int]] = {}
        for (c, r, s), k in zip(jobs, keys):
            if k not in self.cache and k not in todo:
                todo[k] = (c, self._requests(c, r), s)
        fresh: set[str] = set()
        total, done = len(todo), 0

        def finished(k: str, data: dict) -> None:
            nonlocal done
            done += 1
            self.cache[k] = data
            self.runs += 1
            fresh.add(k)
            self._save()
            c, n, s = todo[k]
            self._log(c, n, s, data, f"{done}/{total} ")

        if self.jobs > 1 and len(todo) > 1:
            global _WORKER
            for _, _, s in todo.values():
                self._trace_for(s)                  # made here, so that every worker reads the same copy
            _WORKER = self
            ctx = multiprocessing.get_context("fork")
            items = list(todo.items())
            try:     # a fresh process per simulation: each leaves nothing behind for the next
                # SIGINT blocked while the pool starts: its threads (which fork the later workers)
                # and its workers inherit the mask, so a Ctrl-C between a fork and the worker's
                # initializer waits and is then ignored there, instead of raising in the worker
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    pool = ctx.Pool(min(self.jobs, len(todo)), maxtasksperchild=1, initializer=_ignore_sigint)
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                with pool:
                    for i, data in pool.imap_unordered(_simulate_job, list(enumerate(j for _, j in items))):
                        finished(items[i][0], data)
            finally:
                _WORKER = None
        else:
            for k, (c, n, s) in todo.items():
                finished(k, self._simulate(c, n, s))
        outs = []
        for (c, r, s), k in zip(jobs, keys):
            cached = k not in fresh
            if cached:
                self.hits += 1
                self._log(c, self._requests(c, r), s, self.cache[k], "cached ")
            fresh.discard(k)                      # a job asked twice in one call: the second is a hit
            out = self._outcome(c, self._requests(c, r), s, self.cache[k], cached)
            self.outcomes.append(out)
            outs.append(out)
        return outs

    def _log(self, cfg: FleetConfig, n: int, seed: int, data: dict, head: str) -> None:
        out = self._outcome(cfg, n, seed, data, True)
        verdict = "meets" if out.meets else "misses " + ", ".join(out.misses)
        stage = f"[{self.stage}] " if self.stage else ""
        self.log(f"{stage}{head}{n:,} requests, seed {seed}: {cfg.label()}: "
                 f"TTFT p99 {out.stats['ttft_p99']:.3f} s, {out.cost_per_hour:.2f} USD/h, {verdict}"
                 + ("" if head == "cached " else f" ({data['wall_seconds']:.1f} s)"))

    def _save(self) -> None:
        if not self.cache_file:
            return
        tmp = Path(f"{self.cache_file}.{os.getpid()}.tmp")       # one writer's file: replaced whole
        try:
            tmp.write_text(json.dumps(self.cache), encoding="utf-8")
            tmp.replace(self.cache_file)
        except BaseException:                   # a failed or interrupted write: the old file stays whole
            tmp.unlink(missing_ok=True)
            raise

    def _simulate(self, cfg: FleetConfig, n: int, seed: int) -> dict:
        import time

        from rich.console import Console

        from hybridkv.replay.runner import ReplayOptions, run_replay
        pages, slots = self.budget.pools(cfg.cache_share)
        opts = ReplayOptions(trace=self._trace_for(seed), limit=n, model=self.model, simulate=True, timed=True,
                             instances=cfg.instances, router=cfg.router, policy=cfg.policy,
                             num_kv_pages=pages, num_checkpoint_slots=slots, max_num_seqs=self.max_num_seqs,
                             host_bytes=int(cfg.host_gib * 2**30), simulated_host=True,
                             store_gib=cfg.store_gib if cfg.store_gbps > 0 else None, store_gbps=cfg.store_gbps,
                             time_scale=self.time_scale, progress=False, slo=self.slo)
        t0 = time.perf_counter()
        report = run_replay(opts, Console(file=io.StringIO()))
        stats = {f"{m}_{s}": report_stat for m, key in (("ttft", "ttft_seconds"), ("e2e", "e2e_seconds"),
                                                       ("queue", "queue_seconds"))
                 for s, report_stat in getattr(report, key).items()}
        g = report.goodput or {}
        gc.collect()              # the run's fleet is cyclic garbage (the replay leaves it to a full collection)
        return {"stats": stats, "goodput": g.get("per_second"), "goodput_fraction": g.get("fraction"),
                "rejected": (report.rejected or {}).get("requests", 0), "token_hit_rate": report.token_hit_rate,
                "wall_seconds": round(time.perf_counter() - t0, 3)}

    def bound_times(self) -> np.ndarray:
        """Each request's own prefill seconds with the oracle's reuse on an idle instance
        (:func:`prefill_bound`), in trace order (computed once)."""
        if self._bound is None:
            self._bound = _prefill_times(self.load.requests)
        return self._bound

    def targets(self, n: int) -> dict[str, float]:
        """The targets a run on the first ``n`` requests is held to: on the whole trace the SLO; on a
        shorter prefix each TTFT target scaled by the prefix's prefill bound over the whole trace's
        (a prefix starts colder: its own requests' reachable tail differs from the trace's)."""
        if n >= self.total:
            return dict(self.slo)
        times = self.bound_times()
        out = {}
        for key, target in self.slo.items():
            metric, stat = key.split("_")
            whole, part = _stat(times[:self.total], stat), _stat(times[:n], stat)
            out[key] = target * part / whole if metric == "ttft" and whole > 0 and part > 0 else target
        return out

    def _outcome(self, cfg: FleetConfig, n: int, seed: int, data: dict, cached: bool) -> Outcome:
        misses, ratio = [], 0.0
        for key, target in self.targets(n).items():
            value = data["stats"].get(key)
            r = math.inf if value is None else value / target
            ratio = max(ratio, r)
            if value is None or value > target:
                misses.append(f"{key} {'-' if value is None else f'{value:.3f}'} s > {target:.3g} s")
        if data["rejected"]:
            ratio = math.inf
            misses.append(f"{data['rejected']} requests refused")
        return Outcome(cfg, n, seed, data["stats"], data["goodput"], data["goodput_fraction"], data["rejected"],
                       ratio, not misses, misses, round(cfg.cost_per_hour(self.prices), 4),
                       data["wall_seconds"], data["token_hit_rate"], cached)


_WORKER: Evaluator | None = None
"""The evaluator whose simulations a forked worker runs (set before the workers are forked)."""

_CACHE_FIELDS = frozenset({"stats", "goodput", "goodput_fraction", "rejected", "token_hit_rate", "wall_seconds"})
"""Fields of one cached simulation (what :meth:`Evaluator._simulate` returns)."""


def cache_problem(path: str) -> str | None:
    """Why ``path`` cannot serve as the planner's cache file, or ``None``: checked before any
    simulation runs, so that no run's results are lost to a path found bad after it. A missing file
    is fine when its directory exists and is writable (the file is made on the first save)."""
    p = Path(path)
    if p.is_dir():
        return "is a directory"
    if not p.parent.is_dir():
        return f"no directory {p.parent}"
    if not os.access(p.parent, os.W_OK | os.X_OK):
        return f"directory {p.parent} is not writable"
    if p.exists():
        try:
            read_cache(path)
        except PlanError as exc:
            return str(exc).removeprefix(f"--cache {path}: ")
    return None


def read_cache(path: str) -> dict[str, dict]:
    """The planner cache in ``path`` (a JSON object: simulation key -> result with the fields of
    :data:`_CACHE_FIELDS`); ``{}`` when there is no such file yet.

    Raises:
        PlanError: the file cannot be read, is not JSON, or is not a planner cache (naming ``--cache``
            and ``path``); the file is left as it is.
    """
    p = Path(path)
    if not p.exists():
        return {}
    if p.is_dir():
        raise PlanError(f"--cache {path}: is a directory")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanError(f"--cache {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise PlanError(f"--cache {path}: not a planner cache (not JSON: {exc})") from None
    if not isinstance(data, dict):
        raise PlanError(f"--cache {path}: not a planner cache (a JSON {type(data).__name__}, not an object)")
    for value in data.values():
        if not isinstance(value, dict) or not _CACHE_FIELDS <= value.keys() or not isinstance(value["stats"], dict):
            raise PlanError(f"--cache {path}: not a planner cache (an entry is not a simulation result)")
    return data


def _ignore_sigint() -> None:
    """A pool worker's start: Ctrl-C is the parent's to handle (it terminates the pool). The
    worker starts with SIGINT blocked (see :meth:`Evaluator.evaluate_many`): ignored first, then
    unblocked, so one that came in between is dropped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _simulate_job(job: tuple[int, tuple[FleetConfig, int, int]]) -> tuple[int, dict]:
    """One simulation in a forked worker of :meth:`Evaluator.evaluate_many`: ``(index, data)``."""
    assert _WORKER is not None
    i, (cfg, n, seed) = job
    return i, _WORKER._simulate(cfg, n, seed)


def prefill_bound(evaluator: Evaluator) -> dict[str, float]:
    """TTFT statistics (``ttft_mean``, ``ttft_p50``, ``ttft_p90``, ``ttft_p99``; seconds) of
    :func:`_prefill_times`: a lower bound of every fleet's statistic on the trace (each request's
    TTFT is at least its own bound, so every percentile and the mean of the TTFTs is at least the
    bound's)."""
    a = evaluator.bound_times()[:evaluator.total]
    return {f"ttft_{s}": round(_stat(a, s), 6) for s in ("mean", "p50", "p90", "p99")}


def _prefill_times(reqs, chunk_tokens: int = 8192, block_tokens: int = 512, unit: int = 64) -> np.ndarray:
    """Per request (trace order), a lower bound of its TTFT in seconds on any fleet of the H200 cost
    model (:func:`~hybridkv.fleet.costmodel.h200_kimi_linear_48b`, ``step_seconds``).

    Reuse: at most what the oracle (:func:`~hybridkv.replay.oracle.oracle_from_trace`, ``unit``-token
    granularity, ``block_tokens`` per trace hash id) finds in requests that arrive earlier (arrival
    order, ties in trace order); at least the prompt's last token is computed. The ``L`` tokens left
    take at least ``k = ceil(L / chunk_tokens)`` steps; each step that computes a chunk of ``n``
    of them lasts at least ``step_seconds([(start, n)])`` alone (a step's time grows with every
    token, pair and sequence added). Summed over any split into ``k' >= k`` chunks:
    ``sum(overhead + max(compute_j, memory_j)) >= k * overhead + max(sum compute_j, sum memory_j)``
    with ``sum compute_j >= linear * L + attention * pairs + seq * k`` (``pairs`` fixed by the
    start and ``L``) and ``sum memory_j >= k * dense + experts * L * cover(chunk) / chunk`` (the
    expert coverage ``cover(n)`` is concave with ``cover(0) = 0``, so ``cover(n) / n`` falls with
    ``n``). Store and host loads, queueing and decode only add time.
    """
    from hybridkv.fleet.costmodel import h200_kimi_linear_48b
    from hybridkv.replay.oracle import oracle_from_trace
    from hybridkv.replay.trace import scaled_input_length
    cost = h200_kimi_linear_48b()
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].timestamp_ms)       # stable: ties in trace order
    oracle = oracle_from_trace([reqs[i] for i in order], block_tokens, unit)
    hits = [0] * len(reqs)
    for pos, i in enumerate(order):
        hits[i] = oracle.per_request[pos]
    if cost.experts:
        cover = 1.0 - (1.0 - cost.experts_per_token / cost.experts) ** chunk_tokens
    else:
        cover = 0.0
    times = []
    for r, hit in zip(reqs, hits):
        end = scaled_input_length(r, block_tokens)
        s = min(hit, end - 1)
        n = end - s
        k = -(-n // chunk_tokens)
        compute = (cost.linear_s_per_token * n + cost.attention_s_per_pair * (n * s + n * (n + 1) // 2)
                   + cost.seq_s * k)
        memory = k * cost.dense_weights_s + cost.expert_weights_s * cover * n / chunk_tokens
        times.append(k * cost.overhead_s + max(compute, memory))
    return np.asarray(times, dtype=np.float64)


@dataclass(slots=True)
class PlanResult:
    """What :func:`plan` found: ``plan`` (the cheapest outcome on the whole trace that meets every
    target, or ``None``), ``best`` (the nearest miss when none does), ``front`` (the Pareto front of
    whole-trace outcomes: cost, TTFT p99, goodput), ``next_cheaper`` (the most expensive whole-trace
    outcome cheaper than the plan, which misses), ``bound`` (:func:`prefill_bound`), ``why``
    (sentences: why infeasible, or why the next cheaper point fails), ``rungs`` (per rung of the
    screening and of the halving: stage, requests, candidates, structures, instances; last, the
    whole-trace stage: per structure whether it was bisected, the instances it was checked at,
    its worst ratio there and the instances it needs), ``runs`` / ``cache_hits`` (simulations run / answered by the
    cache), ``planned_slo`` (the targets searched: those asked, or the nearest reachable ones when a
    TTFT target is below the bound, :data:`RELAX`), ``unchecked`` (with a plan: each configuration of
    the search space, at the most instances that cost less than the plan, that was neither simulated
    on the whole trace there nor ruled out by a whole-trace miss at as many instances or more: the
    search ranked it out on prefixes, so it may meet the targets for less) and ``resolution`` (one
    sentence saying so, or that every cheaper configuration was simulated or ruled out, or that no
    configuration of the space costs less than the plan; empty without a plan)."""

    slo: dict[str, float]
    plan: Outcome | None
    best: Outcome | None
    front: list[Outcome]
    next_cheaper: Outcome | None
    bound: dict[str, float]
    why: list[str]
    rungs: list[dict] = field(default_factory=list)
    runs: int = 0
    cache_hits: int = 0
    planned_slo: dict[str, float] = field(default_factory=dict)
    unchecked: list[FleetConfig] = field(default_factory=list)
    resolution: str = ""

    @property
    def relaxed(self) -> bool:
        """The targets asked for are out of reach and the plan is for :attr:`planned_slo`."""
        return self.planned_slo != self.slo


def min_instances(evaluate: Callable[[int], Outcome], lo: int, hi: int, max_instances: int) -> Outcome | None:
    """The fewest instances in ``(lo, max_instances]`` whose outcome meets every target, assuming
    meeting is monotone in instances: doubling from ``hi`` until one meets (``None`` if none by
    ``max_instances``), then bisection between the last miss and it. ``lo``: a count known to
    miss (0: none known); ``hi`` a first guess."""
    hi = max(hi, lo + 1)
    best = None
    while True:
        out = evaluate(hi)
        if out.meets:
            best = out
            break
        lo = hi
        if hi >= max_instances:
            return None
        hi = min(hi * 2, max_instances)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        out = evaluate(mid)
        if out.meets:
            hi, best = mid, out
        else:
            lo = mid
    return best


def pareto_front(outcomes: list[Outcome]) -> list[Outcome]:
    """Outcomes no other beats on all of cost (lower), TTFT p99 (lower) and goodput (higher); one
    per configuration, sorted by cost."""
    uniq = {o.config: o for o in outcomes}
    pts = list(uniq.values())

    def key(o):
        return (o.cost_per_hour, o.stats["ttft_p99"], -(o.goodput or 0.0))

    front = []
    for o in pts:
        a = key(o)
        if not any(all(x <= y for x, y in zip(key(p), a)) and key(p) != a for p in pts):
            front.append(o)
    return sorted(front, key=key)


def candidates(policies: tuple[str, ...], shares=SHARES, stores=STORES, routers=ROUTERS,
               hosts=HOSTS) -> list[FleetConfig]:
    """The non-instance part of the search space (instances set to 1); the first is the baseline."""
    return [FleetConfig(1, s, g, b, p, r, h) for h in hosts for g, b in stores for s in shares for p in policies
            for r in routers]


def default_policies() -> tuple[str, ...]:
    """The replay's default checkpoint policy at 512 tokens per block, and the same without the
    interval checkpoints (fewer slots taken)."""
    from hybridkv.replay.runner import default_policy
    base = default_policy(512, 64)
    return base, "branch+tail=512+supersede"


def _rank(o: Outcome) -> tuple[float, float, float]:
    """Order of candidates within a rung: the worst target's value over the target, then mean TTFT
    (which separates candidates a tail near the bound ties), then cost."""
    return (o.ratio, o.stats.get("ttft_mean", math.inf), o.cost_per_hour)


def _halve(ev: Evaluator, groups: dict, sizes: list[int], keep: float, final_keep: int, label: str,
           rungs: list[dict]) -> tuple[dict, dict]:
    """Successive halving of every group's candidates on the prefixes ``sizes``, each group on its
    own: after each rung a group keeps its best ``keep`` share (at least ``final_keep + 1``), after
    the last its best ``final_keep``. Returns ``(survivors, last_outcomes)`` per group (no prefix:
    the first ``final_keep`` in order, no outcomes)."""
    alive = {g: list(cs) for g, cs in groups.items()}
    last: dict = {g: [] for g in groups}
    for i, size in enumerate(sizes):
        flat = [c for cs in alive.values() for c in cs]
        ev.stage = f"{label} {i + 1}/{len(sizes)}: {len(flat)} on {size:,} requests"
        by = dict(zip(flat, ev.evaluate_many([(c, size, 0) for c in flat])))
        rungs.append({"stage": label, "requests": size, "candidates": len(flat), "groups": len(alive),
                      "instances": sorted({c.instances for c in flat})})
        for g, cs in alive.items():
            ranked = sorted(cs, key=lambda c: _rank(by[c]))
            k = final_keep if i == len(sizes) - 1 else max(final_keep + 1, math.ceil(len(ranked) * keep))
            alive[g] = ranked[:k]
            last[g] = [by[c] for c in alive[g]]
    if not sizes:
        alive = {g: cs[:final_keep] for g, cs in alive.items()}
    return alive, last


def _most_instances_below(cfg: FleetConfig, cost: float, prices: Prices, max_instances: int) -> int:
    """The most instances (at most ``max_instances``) at which ``cfg``'s structure costs less than
    ``cost`` USD/h (0: none)."""
    n = max_instances
    while n >= 1 and replace(cfg, instances=n).cost_per_hour(prices) >= cost - COST_TOL:
        n -= 1
    return n


COST_TOL = 1e-9
"""Tolerance of cost comparisons (USD/h)."""
NEAR = 0.10
"""A structure whose best survivor misses a target by at most this share (at the most instances that
cost less than the plan so far) has its second survivor tried too."""


def plan(ev: Evaluator, *, max_instances: int = MAX_INSTANCES, space: list[FleetConfig] | None = None,
         first_fraction: float = FIRST_FRACTION, keep: float = KEEP, growth: int = GROWTH,
         screen_keep: int = SCREEN_KEEP, headroom: float | None = None,
         near: float | None = None) -> PlanResult:
    """Search (module docstring) and return the :class:`PlanResult`.

    Raises:
        PlanError: ``max_instances`` below 1 or an empty search space.
    """
    if max_instances < 1:
        raise PlanError(f"--max-instances {max_instances} must be 1 or more")
    space = space if space is not None else candidates(default_policies())
    if not space:
        raise PlanError("the search space is empty")
    bound = prefill_bound(ev)
    why: list[str] = []
    asked = dict(ev.slo)
    planned = dict(asked)
    for key, target in asked.items():
        if key in bound and bound[key] > target:
            planned[key] = math.ceil(bound[key] * (1 + RELAX) * 100) / 100
            why.append(f"{key} <= {target:g} s cannot be met: the fastest each request's first token can come "
                       f"(its own prefill on an idle instance reusing every token an earlier request makes "
                       f"reusable) already has {key} {bound[key]:.3f} s; planned instead for the nearest reachable "
                       f"target, {key} <= {planned[key]:g} s (the bound + {RELAX:.0%})")
    ev.slo = planned
    base = space[0]
    first = max(int(ev.total * first_fraction), 1)
    sizes = []
    n = first
    while n < ev.total / 2:            # a prefix of most of the trace would cost a whole run for little
        sizes.append(n)
        n *= growth
    rungs: list[dict] = []
    # 2. instances for the baseline on the first prefix
    ev.stage = "instances, baseline"
    start = min_instances(lambda k: ev.evaluate(replace(base, instances=k), sizes[0] if sizes else None), 0, 1,
                         max_instances)
    n_ref = start.config.instances if start is not None else max_instances
    headroom = HEADROOM if headroom is None else headroom
    near = NEAR if near is None else near
    probe = min(max(1, math.ceil(headroom * n_ref)), max_instances)
    # 3. successive halving per structure, the device and routing choices screened in two structures
    groups: dict = {}
    for c in space:
        groups.setdefault(c.structure, []).append(replace(c, instances=probe))
    dearest = max(groups, key=lambda g: (groups[g][0].cost_per_hour(ev.prices), g))
    screen = {g: groups[g] for g in dict.fromkeys([base.structure, dearest])}
    kept, _ = _halve(ev, screen, sizes, keep, screen_keep, "screen", rungs)

    def choice(c: FleetConfig) -> tuple:
        return (c.cache_share, c.policy, c.router)

    chosen = {choice(c) for cs in kept.values() for c in cs}
    tried = {g: [c for c in cs if choice(c) in chosen] or cs[:1] for g, cs in groups.items()}
    best, last = _halve(ev, tried, sizes, keep, 2, "structures", rungs)
    # 4. branch and bound on the whole trace, the cheapest structure first (a low first plan leaves the
    #    dearer structures few instances to beat it with: most are then done in one simulation)
    order = sorted(best, key=lambda g: (best[g][0].cost_per_hour(ev.prices),
                                        _rank(last[g][0]) if last[g] else (0.0, 0.0, 0.0), g))
    incumbent: Outcome | None = None
    bb: list[dict] = []

    def cheapest(o: Outcome | None) -> None:
        nonlocal incumbent
        if o is not None and (incumbent is None or o.cost_per_hour < incumbent.cost_per_hour - COST_TOL):
            incumbent = o

    pending = [best[g][0] for g in order]
    runner_up = {g: best[g][1] for g in order if len(best[g]) > 1}
    while pending:
        if incumbent is None:                                     # no plan yet: a whole bisection
            cfg = pending.pop(0)
            ev.stage = f"{ev.scope}, instances: {cfg.label()}"
            found = min_instances(lambda k, c=cfg: ev.evaluate(replace(c, instances=k)), 0, probe, max_instances)
            bb.append({"structure": list(cfg.structure), "bisected": True,
                       "instances": found.config.instances if found else None})
            cheapest(found)
            second = runner_up.pop(cfg.structure, None)
            if second is not None and found is not None:     # a structure that met: its second choice too
                pending.append(second)
            continue
        batch, checks = [], []
        while pending and len(batch) < ev.jobs:
            cfg = pending.pop(0)
            m = _most_instances_below(cfg, incumbent.cost_per_hour, ev.prices, max_instances)
            if m < 1:
                bb.append({"structure": list(cfg.structure), "bisected": False, "instances": None,
                           "pruned": "costs more than the plan at one instance"})
                continue
            batch.append(replace(cfg, instances=m))
        if not batch:
            continue
        ev.stage = f"{ev.scope}, below {incumbent.cost_per_hour:.2f} USD/h: {len(batch)} structures"
        checks = ev.evaluate_many([(c, None, 0) for c in batch])
        for c, o in zip(batch, checks):
            if not o.meets:
                bb.append({"structure": list(c.structure), "bisected": False, "instances": None,
                           "checked_at": c.instances, "ratio": None if math.isinf(o.ratio) else round(o.ratio, 6)})
                second = runner_up.pop(c.structure, None)
                if second is not None and o.ratio <= 1 + near:       # a near miss: the structure's second choice
                    pending.append(second)
                continue
            ev.stage = f"{ev.scope}, instances: {c.label()}"
            found = min_instances(lambda k, c=c: ev.evaluate(replace(c, instances=k)), 0, c.instances, c.instances)
            bb.append({"structure": list(c.structure), "bisected": True, "checked_at": c.instances,
                       "instances": found.config.instances if found else None})
            cheapest(found)
            second = runner_up.pop(c.structure, None)
            if second is not None:                           # a structure that met: its second choice too
                pending.append(second)
    ev.stage = ""
    rungs.append({"stage": "whole trace", "requests": ev.total, "structures": bb})
    whole = [o for o in ev.outcomes if o.requests == ev.total and o.seed == 0]
    meeting = sorted((o for o in whole if o.meets), key=lambda o: (o.cost_per_hour, o.ratio))
    best_plan = meeting[0] if meeting else None
    nearest = best_plan or (min(whole, key=lambda o: (o.ratio, o.cost_per_hour)) if whole else None)
    nxt = None
    if best_plan is not None:
        cheaper = [o for o in whole if o.cost_per_hour < best_plan.cost_per_hour and not o.meets]
        nxt = max(cheaper, key=lambda o: (o.cost_per_hour, -o.ratio)) if cheaper else None
        if nxt is not None:
            why.append(f"the next cheaper point ({nxt.config.label()}, {nxt.cost_per_hour:.2f} USD/h) misses: "
                       + "; ".join(nxt.misses))
    elif nearest is not None:
        why.append(f"no configuration tried (up to {max_instances} instances) meets every target; the nearest "
                   f"({nearest.config.label()}) misses: " + "; ".join(nearest.misses))
    unchecked = _unchecked(space, best_plan, whole, ev.prices, max_instances) if best_plan is not None else []
    resolution = ""
    if best_plan is not None and unchecked:
        resolution = (f"{len(unchecked)} of the {len(space)} configurations searched (cache share, policy, router, "
                       f"host tier, store) cost less than the plan at some instance count but were not simulated "
                       f"on the {_scope_noun(ev)} there: the search ranked them out on trace prefixes (at {probe} "
                       f"instance{'s' if probe != 1 else ''}), so one may meet the targets for less; simulate the plan's cheaper neighbours "
                       f"(benchmarks/bench_plan_validate.py) before buying")
    elif best_plan is not None and not any(_most_instances_below(c, best_plan.cost_per_hour, ev.prices,
                                                                 max_instances) >= 1 for c in space):
        resolution = "no configuration searched costs less than the plan, at any instance count"
    elif best_plan is not None:
        resolution = (f"every configuration searched that costs less than the plan was simulated on the "
                      f"{_scope_noun(ev)} and missed, at as many instances or more")
    ev.slo = asked
    return PlanResult(asked, best_plan, nearest, pareto_front(whole), nxt, bound, why, rungs, ev.runs, ev.hits,
                      planned, unchecked, resolution)


def _scope_noun(ev: Evaluator) -> str:
    return "whole trace" if ev.scope == "whole trace" else f"first {ev.total:,} requests"


def _unchecked(space: list[FleetConfig], plan_outcome: Outcome, whole: list[Outcome], prices: Prices,
               max_instances: int) -> list[FleetConfig]:
    """Each configuration of ``space`` at the most instances that cost less than ``plan_outcome``
    (none: skipped) that no whole-trace outcome in ``whole`` rules out: one of the same cache share,
    policy, router, host tier and store that missed at as many instances or more (fewer instances
    never meet more: the search's monotone assumption)."""
    out = []
    for c in space:
        m = _most_instances_below(c, plan_outcome.cost_per_hour, prices, max_instances)
        if m < 1:
            continue
        if not any(not o.meets and o.config.instances >= m and o.config == replace(c, instances=o.config.instances)
                   for o in whole):
            out.append(replace(c, instances=m))
    return out


def deploy_commands(cfg: FleetConfig, budget: DeviceBudget, model: str, max_num_seqs: int,
                    max_num_batched_tokens: int = 8192) -> list[list[str]]:
    """The commands that deploy ``cfg``: ``hybridkv store start`` (with a store), one ``hybridkv
    serve`` per instance (host ``gpu-K``, port 8000), and ``hybridkv router`` over them. Host names
    ``gpu-K`` and ``store-0`` stand for the machines'."""
    pages, slots = budget.pools(cfg.cache_share)
    cmds = []
    if cfg.store_gbps > 0:
        cmds.append(["hybridkv", "store", "start", "--port", "50051", "--segment-mb", str(int(cfg.store_gib * 1024))])
    for k in range(cfg.instances):
        cmd = ["hybridkv", "serve", "--model", model, "--host", "0.0.0.0", "--port", "8000",
               "--block-size", str(budget.block_size), "--prefix-match-unit", "64", "--policy", cfg.policy,
               "--kv-pages", str(pages), "--checkpoint-slots", str(slots), "--max-num-seqs", str(max_num_seqs),
               "--max-num-batched-tokens", str(max_num_batched_tokens),
               "--host-mib", str(int(cfg.host_gib * 1024))]
        if cfg.store_gbps > 0:
            cmd += ["--store", "mooncake://store-0:50051"]
        cmds.append(cmd)
    router = ["hybridkv", "router", "--policy", cfg.router, "--model", model, "--host", "0.0.0.0", "--port", "8080"]
    for k in range(cfg.instances):
        router += ["--worker", f"http://gpu-{k}:8000"]
    if cfg.router == "hybrid":
        router += ["--cost-model", "h200-kimi-linear-48b", "--store-gbps", f"{cfg.store_gbps:g}"]
    cmds.append(router)
    return cmds


def parse_slo_option(text: str) -> dict[str, float]:
    """:func:`~hybridkv.fleet.operating.parse_slo` with the error naming ``--slo``.

    Raises:
        PlanError: the SLO cannot be read.
    """
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise PlanError(f"--slo {text!r}: {exc}") from None
