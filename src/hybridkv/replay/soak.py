"""Soak: randomized workloads on the ``tiny`` model (or a DeepSeek-V4 preset, ``--model v4-tiny``),
every finished request checked against a full prefill (docs/how-to/soak.md).

Each *round* is derived from ``(seed, round index)`` alone: a random engine configuration
(policy, mechanism, block size, match unit, step budget, small pools, host tier, memory or
disk store, one or two engines sharing the store) and a random request sequence (prefix
trees, multi-turn sessions, identical resends, prompts shorter than a unit or a block, about
30% cancellations at a chosen stage). The driver steps the engines by hand and cancels
between steps. Every finished request is one *check*: its logits at every computed position
against a no-cache forward of ``prompt + output[:-1]`` (at most
:data:`~hybridkv.replay.soak_check.TOLERANCE`; routing and argmax ties apart,
:mod:`~hybridkv.replay.soak_check`), and the
same greedy tokens. After each round: no references held, every page free or evictable,
``check_invariants()`` passes, the connector holds no request and (after ``drain``) no
prefetch bytes; then the cache is cleared and must be empty.

A failure (wrong logits, a leak, an exception, a refused request that fits, a stuck loop)
records the seed, the round, its configuration and its request sequence, shrinks the sequence
(drops requests one at a time while the failure persists, within a time bound) and is
reported with the smallest sequence found; the command exits non-zero.

``python -m hybridkv.replay.soak --seed 0 --checks 200`` runs it without the ``hybridkv``
command; :func:`register_cli` adds ``hybridkv soak`` with the same options.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hybridkv._torch import torch
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import TorchBackend
from hybridkv.engine.build import EngineHandle, is_v4, load_model
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request, Status
from hybridkv.replay.args import (
    non_negative_int,
    finite_positive_float,
    positive_int,
    seed_value,
    add_swa_recovery_argument,
    thread_count,
    unwritable,
)
from hybridkv.replay.soak_check import Reference, check_request
from hybridkv.replay.soak_report import (
    SoakCounters,
    SoakFailure,
    SoakReport,
    add_counts,
)
from hybridkv.replay.soak_rounds import (
    EVICTION_CHOICES,
    STAGES,
    RequestSpec,
    RoundConfig,
    build_prompt,
    make_round,
    apply_eviction,
    round_eviction,
)
from hybridkv.store.base import ObjectStore
from hybridkv.store.disk import DiskStore
from hybridkv.store.faults import FaultyStore
from hybridkv.store.memory import MemoryStore
from hybridkv.tiers.connector import host_tier_for, tier_for

if TYPE_CHECKING:                 # imported where a model is loaded: it imports torch
    from hybridkv.model.model import HybridModel

PRESET = "tiny"
"""The model a soak runs on by default (preset weights from seed 0)."""

V4_SOAK_PRESETS = ("v4-tiny", "v4-small")
"""DeepSeek-V4 presets a soak runs on (``--model``; weights from seed 0)."""

PERIODIC_SOAK_UNIT = 64
"""Match unit of a DeepSeek-V4 round whose drawn unit does not divide ``periodic=P``'s period
(tokens; every drawn block size is a multiple of it)."""

FAILURE_KINDS = ("mismatch", "leak", "exception", "rejected", "stuck")

MAX_TICKS = 20_000          # driver loop iterations per round before a round counts as stuck
DRAIN_TIMEOUT_S = 10.0


# -- one run of a request sequence --------------------------------------------------------------------------
@dataclass(slots=True)
class Failure:
    """What went wrong in a round (``kind`` one of :data:`FAILURE_KINDS`)."""

    kind: str
    detail: str
    rid: int | None = None


@dataclass(slots=True)
class RunResult(SoakCounters):
    """Counters (:class:`SoakCounters`) and failures of one run of a request sequence;
    ``cancellations``: stage -> requests cancelled there; ``submitted``: requests submitted;
    ``frozen``: the sequence with every prompt resolved."""

    failures: list[Failure] = field(default_factory=list)
    cancellations: Counter = field(default_factory=Counter)
    submitted: int = 0
    frozen: list[RequestSpec] = field(default_factory=list)   # the sequence with every prompt resolved


def _faulty(store: ObjectStore, rc: RoundConfig, seed: int) -> FaultyStore:
    r = rc.faults
    rates = {"unavailable": r / 3, "slow": r, "lost_manifest": r, "corrupt": r, "vanish": r, "no_space": r,
             "two_writers": r}
    return FaultyStore(store, rates, seed=seed, slow_seconds=0.005)


def _build(model: HybridModel, rc: RoundConfig, store: ObjectStore | None, disk_dir: str | None,
           faulty: list[FaultyStore], index: int) -> EngineHandle:
    """Engine ``index`` of a round (what :func:`hybridkv.engine.build.build_engine` builds, over a store
    object the caller may share between engines). A fault-injecting wrapper goes on ``faulty``."""
    cfg = rc.cache_config()
    if is_v4(rc.model):            # its groups by spec; the strategy places the saved states (as build_engine)
        from hybridkv.cache.swa import SwaRecovery
        from hybridkv.engine.v4backend import V4Backend
        recovery = SwaRecovery.parse(rc.swa_recovery)
        recovery.check(cfg.prefix_match_unit)
        cfg = replace(cfg, policy=recovery.policy(cfg.policy))
        backend = V4Backend(model, cfg.num_kv_pages, cfg.block_size, cfg.prefix_match_unit, recovery)
    else:
        backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    ns = CacheIdentity(model_repo=rc.model, weight_digest=model.weight_digest()).digest()
    host = (host_tier_for(rc.host_bytes, backend, ns, cfg.prefix_match_unit, cfg.block_size,
                          write_through=rc.host_write_through, eviction=rc.eviction) if rc.host_bytes else None)
    if disk_dir is not None:                                            # one per engine, like processes
        store = DiskStore(disk_dir, capacity_bytes=rc.store_capacity, eviction=rc.eviction)
        if rc.faults:
            store = _faulty(store, rc, index)
            faulty.append(store)
    tier = tier_for(store, backend, ns, cfg.prefix_match_unit, cfg.store_boundary) if store is not None else None
    if tier is not None and rc.faults:
        tier.retry_seconds = 0.0       # retry at the next call: decisions stay independent of the clock
    handle = EngineHandle(engine=None, backend=backend, model=model, namespace=ns, host_tier=host, store_tier=tier)
    try:
        handle.engine = Engine(cfg, backend, ns, tiers=[t for t in (host, tier) if t is not None],
                               prefetch=rc.prefetch)
    except BaseException:
        handle.close()
        raise
    return handle


def _stage(engine: Engine, req: Request) -> str | None:
    if req.status == Status.WAITING:
        return "prefetch" if engine.connector is not None and engine.connector.prefetching(req) else "waiting"
    if req.status == Status.PREFILL:
        return "admitted" if req.computed == req.reused else "prefill"
    if req.status == Status.DECODE:
        return "decode"
    return None


def _leaks(handle: EngineHandle) -> list[str]:
    """What a drained engine still holds that it should not (empty: nothing)."""
    e, out = handle.engine, []
    c = e.cache
    if e.waiting or e.running:
        out.append(f"{len(e.waiting)} waiting and {len(e.running)} running requests after the round")
    if any(c.pages.refcount):
        out.append(f"page refcounts {sum(c.pages.refcount)} (pages {[p for p, n in enumerate(c.pages.refcount) if n]})")
    if any(c.checkpoints.refcount):
        out.append(f"checkpoint refcounts {sum(c.checkpoints.refcount)}")
    if c.pages.num_free + c.pages.num_evictable != c.pages.num_pages:
        out.append(f"pages free {c.pages.num_free} + evictable {c.pages.num_evictable} != {c.pages.num_pages}")
    try:
        c.check_invariants()
    except AssertionError as exc:
        out.append(f"check_invariants: {exc}")
    if e.connector is not None:
        if e.connector.num_requests:
            out.append(f"connector holds {e.connector.num_requests} requests")
        if not e.connector.drain(DRAIN_TIMEOUT_S):
            out.append(f"connector.drain did not finish within {DRAIN_TIMEOUT_S:g} s")
        if e.connector.prefetch_held_bytes:
            out.append(f"prefetch_held_bytes {e.connector.prefetch_held_bytes} after drain")
    if out:
        return out
    c.clear()                                        # an explicit purge must leave nothing behind
    try:
        c.check_invariants()
    except AssertionError as exc:
        out.append(f"check_invariants after clear(): {exc}")
    if c.pages.num_free != c.pages.num_pages or c.checkpoints.num_free != c.checkpoints.num_slots \
            or c.index.num_nodes:
        out.append(f"after clear(): {c.pages.num_free}/{c.pages.num_pages} pages, {c.checkpoints.num_free}/"
                   f"{c.checkpoints.num_slots} slots free, {c.index.num_nodes} index nodes")
    return out


def run_sequence(model: HybridModel, rc: RoundConfig, specs: list[RequestSpec], ref: Reference | None = None,
                 janitor: ThreadPoolExecutor | None = None) -> RunResult:
    """Run one request sequence under ``rc``, check every finished request and the drained engines.

    A disk store lives in a fresh temporary directory, removed afterwards (on ``janitor``'s
    thread when given: removing a store's fan-out directories takes a while on some filesystems).
    """
    ref = ref or Reference(model)
    vocab = model.config.vocab_size
    res = RunResult()
    tmp = tempfile.TemporaryDirectory(prefix="hkv-soak-") if rc.store == "disk" else None
    shared = MemoryStore(rc.store_capacity) if rc.store == "memory" else None
    faulty: list[FaultyStore] = []
    if shared is not None and rc.faults:
        shared = _faulty(shared, rc, 0)
        faulty.append(shared)
    handles: list[EngineHandle] = []
    reqs: dict[int, Request] = {}
    frozen: dict[int, list] = {}
    seen: Counter = Counter()
    present = {s.rid for s in specs}
    pending = sorted(specs, key=lambda s: (s.arrive, s.rid))
    by_rid = {s.rid: s for s in specs}

    def outputs() -> dict[int, list[int]]:
        return {rid: list(r.output) for rid, r in reqs.items()}

    def cancels(h: EngineHandle) -> None:
        e = h.engine
        for r in list(e.waiting) + list(e.running):
            spec = by_rid[int(r.request_id)]
            stage = _stage(e, r)
            if spec.cancel is None or STAGES.index(stage) < STAGES.index(spec.cancel):
                continue                          # not there yet (a stage it skipped counts as passed)
            seen[spec.rid] += 1
            if seen[spec.rid] > spec.cancel_after:
                e.cancel(r)
                res.cancellations[stage] += 1

    def finished(r: Request) -> None:
        check = check_request(ref, r)
        if check.tie is not None:
            res.routing_ties += 1                 # neither a check nor a mismatch: see check_request
            return
        if check.argmax_tie is not None:
            res.argmax_ties += 1                  # likewise: equal top logits ordered either way
            return
        res.checks += 1
        res.max_abs_logit_diff = max(res.max_abs_logit_diff, check.diff)
        if check.problem is not None:
            res.failures.append(Failure("mismatch", f"request #{r.request_id}: {check.problem}", int(r.request_id)))

    collected: set[int] = set()

    def collect(i: int) -> None:
        """Counters of engine ``i`` (before the leak check's purge evicts anything)."""
        if i in collected:
            return
        collected.add(i)
        h = handles[i]
        e, c = h.engine, h.engine.cache
        res.evicted_pages += c.evicted_pages
        res.evicted_checkpoints += c.evicted_checkpoints
        res.reused_tokens += e.stats.reused_tokens
        res.prompt_tokens += e.stats.prompt_tokens
        res.rejected += e.stats.rejected
        if h.store_tier is not None:
            res.store_hit_tokens += h.store_tier.stats.hit_tokens
            add_counts(res.store_misses, h.store_tier.stats.misses)
        if h.host_tier is not None:
            res.host_hit_tokens += h.host_tier.stats.hit_tokens
        if e.connector is not None:
            res.prefetch_used += e.connector.prefetch_used

    try:
        for i in range(rc.instances):
            handles.append(_build(model, rc, shared, tmp.name if tmp else None, faulty, i))
        tick = 0
        while pending or any(h.engine.has_work for h in handles):
            if tick > MAX_TICKS:
                res.failures.append(Failure("stuck", f"{MAX_TICKS} driver ticks without draining"))
                break
            for spec in list(pending):
                if spec.arrive > tick:
                    break
                dep = spec.after
                if dep is not None and dep in present and not (dep in reqs and reqs[dep].done):
                    continue
                prompt, frozen[spec.rid] = build_prompt(spec.segments, outputs(), vocab)
                if prompt.shape[0] == 0:              # a resolved prompt of nothing (an empty output)
                    prompt, frozen[spec.rid] = np.asarray([1], dtype=np.int64), [["l", [1]]]
                req = Request(str(spec.rid), prompt, spec.max_tokens, hints=tuple(spec.hints), record_logits=True)
                reqs[spec.rid] = handles[spec.instance % len(handles)].engine.add_request(req)
                res.submitted += 1
                pending.remove(spec)
            if not any(h.engine.has_work for h in handles):
                nxt = [s.arrive for s in pending if s.arrive > tick]
                tick = min(nxt) if nxt else tick + 1
                continue
            order = handles if tick % 2 == 0 else handles[::-1]       # the engines take turns going first
            for h in order:
                if not h.engine.has_work:
                    continue
                cancels(h)
                h.engine.admit()
                cancels(h)
                for r in h.engine.step():
                    finished(r)
                cancels(h)
            tick += 1
        for i, h in enumerate(handles):
            collect(i)
            for problem in _leaks(h):
                res.failures.append(Failure("leak", f"engine {i}: {problem}"))
    except Exception as exc:  # noqa: BLE001 - a crash of the product is a finding, not the end
        tb = traceback.format_exc(limit=8)
        res.failures.append(Failure("exception", f"{type(exc).__name__}: {exc}\n{tb}"))
    finally:
        for i, h in enumerate(handles):
            collect(i)
            try:
                h.close()
            except Exception as exc:  # noqa: BLE001 - a failing close is a finding too
                res.failures.append(Failure("exception", f"close: {type(exc).__name__}: {exc}"))
        for f in faulty:
            add_counts(res.faults_injected, {k: n for k, n in f.injected.items() if n})
            res.max_store_call_seconds = max(res.max_store_call_seconds, f.max_call_seconds)
        if tmp is not None:
            if janitor is not None:
                janitor.submit(tmp.cleanup)
            else:
                tmp.cleanup()
    for rid, r in reqs.items():
        if r.status == Status.REJECTED:
            res.failures.append(Failure("rejected", f"request #{rid} ({r.prompt_len} tokens, {r.max_output_tokens} "
                                                    f"out) refused although the pool fits it: {r.reject_reason}", rid))
    out = outputs()
    for s in specs:                                  # the sequence as it ran, every "o" made literal
        segs = frozen.get(s.rid) or build_prompt(s.segments, out, vocab)[1]
        res.frozen.append(RequestSpec(**{**_spec_dict(s), "segments": segs}))
    return res


def _spec_dict(s: RequestSpec) -> dict:
    return {k: getattr(s, k) for k in RequestSpec.__slots__}


# -- shrinking --------------------------------------------------------------------------------------------
def shrink(model: HybridModel, rc: RoundConfig, specs: list[RequestSpec], kind: str, seconds: float,
           ref: Reference | None = None, janitor: ThreadPoolExecutor | None = None) -> tuple[list[RequestSpec], int]:
    """Drop requests (then cancel plans) one at a time while a failure of ``kind`` persists.

    Returns:
        The smallest failing sequence found within ``seconds``, and the runs it took.
    """
    ref = ref or Reference(model)
    deadline = time.monotonic() + seconds
    current, runs = list(specs), 0

    def fails(cand: list[RequestSpec]) -> bool:
        nonlocal runs
        runs += 1
        return any(f.kind == kind for f in run_sequence(model, rc, cand, ref, janitor).failures)

    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for i in reversed(range(len(current))):
            if time.monotonic() >= deadline or len(current) == 1:
                break
            cand = current[:i] + current[i + 1:]
            if fails(cand):
                current, changed = cand, True
    for i, s in enumerate(current):                  # a cancel plan that does not matter is noise
        if time.monotonic() >= deadline:
            break
        if s.cancel is not None:
            cand = current[:i] + [RequestSpec(**{**_spec_dict(s), "cancel": None, "cancel_after": 0})] + current[i + 1:]
            if fails(cand):
                current = cand
    return current, runs


_MODELS: dict[str, HybridModel] = {}


def soak_model(name: str = PRESET) -> HybridModel:
    """Preset ``name`` (``tiny``, ``v4-tiny``, ``v4-small``; seed 0), loaded once per process."""
    if name not in _MODELS:
        _MODELS[name] = load_model(name, seed=0)
    return _MODELS[name]


def for_model(rc: RoundConfig, model_name: str, swa_recovery: str | None) -> RoundConfig:
    """Round settings ``rc`` as run on preset ``model_name``: unchanged for Kimi Linear; on a
    DeepSeek-V4 model, under ``swa_recovery`` with the drawn host tier, store, engines and faults,
    the block size and a drawn store alignment rounded up to a multiple of the largest
    compression rate (``v4-small``'s HCA rate is 128: a drawn 64 becomes 128; fewer, larger pages
    still hold each request), and the match unit at :data:`PERIODIC_SOAK_UNIT` where the drawn
    one does not divide the period of ``periodic=P``."""
    if not is_v4(model_name):
        return rc
    from hybridkv.cache.swa import SwaRecovery
    from hybridkv.engine.build import model_config
    cfg = model_config(model_name)
    rate = max(cfg.csa_rate, cfg.hca_rate)
    up = (lambda n: None if n is None else -(-n // rate) * rate)
    rc = replace(rc, model=model_name, swa_recovery=swa_recovery, block_size=up(rc.block_size),
                 store_alignment=up(rc.store_alignment))
    recovery = SwaRecovery.parse(swa_recovery)
    if recovery.kind == "periodic" and recovery.period % rc.prefix_match_unit:
        rc = replace(rc, prefix_match_unit=PERIODIC_SOAK_UNIT)
    return rc


def run_soak(seed: int, checks: int | None = None, seconds: float | None = None, *, rounds: int | None = None,
             first_round: int = 0, shrink_seconds: float = 60.0, stop_on_failure: bool = True,
             model: HybridModel | None = None, log=None, eviction: str = "lru", model_name: str = PRESET,
             swa_recovery: str | None = None) -> SoakReport:
    """Run rounds ``first_round, first_round + 1, ...`` of soak ``seed`` until a bound is reached.

    Args:
        seed: soak seed; round ``i`` depends only on ``(seed, i)``.
        checks: stop once this many requests were checked.
        seconds: stop starting rounds after this many seconds.
        rounds: stop after this many rounds.
        first_round: index of the first round.
        shrink_seconds: time given to shrinking each failing round.
        stop_on_failure: stop after the first failing round (after shrinking it).
        model: the model (default :func:`soak_model` of ``model_name``); it must be that preset
            with seed 0 for the reproduce command to hold.
        log: called with a line of progress now and then (``None``: silent).
        eviction: ``lru``, ``value`` or ``mixed`` (:func:`~hybridkv.replay.soak_rounds.round_eviction`).
        model_name: preset the rounds run on: ``tiny``, or ``v4-tiny`` / ``v4-small`` (DeepSeek-V4,
            with the drawn tiers, engines and faults, see :func:`for_model`).
        swa_recovery: DeepSeek-V4 only: ``window`` (default), ``periodic=P`` or ``recompute``.

    Raises:
        ValueError: no bound given, a bound that is not positive, an unknown ``eviction``, or
            ``swa_recovery`` with a Kimi Linear model.
        ConfigError: a bad ``swa_recovery`` (named).
    """
    if checks is None and seconds is None and rounds is None:
        raise ValueError("run_soak needs a bound: checks, seconds or rounds")
    round_eviction(eviction, 0)                    # an unknown choice fails before any round
    if swa_recovery is not None:
        if not is_v4(model_name):
            raise ValueError(f"swa_recovery={swa_recovery!r} applies to DeepSeek-V4 models; {model_name} is Kimi "
                             "Linear, whose KDA checkpoints are restored at the hit")
        from hybridkv.cache.swa import SwaRecovery
        SwaRecovery.parse(swa_recovery).check(PERIODIC_SOAK_UNIT)
    for name, v in (("checks", checks), ("seconds", seconds), ("rounds", rounds)):
        if v is not None and not v > 0:
            raise ValueError(f"{name}={v!r} must be positive")
    model = model or soak_model(model_name)
    vocab = model.config.vocab_size
    ref = Reference(model)
    report = SoakReport(seed=seed, first_round=first_round)
    flag = ("" if model_name == PRESET else f" --model {model_name}") \
        + ("" if swa_recovery is None else f" --swa-recovery {swa_recovery}") \
        + ("" if eviction == "lru" else f" --eviction {eviction}")
    t0 = time.monotonic()
    last_log = t0
    i = first_round
    janitor = ThreadPoolExecutor(1, thread_name_prefix="hybridkv-soak-cleanup")
    try:
        while True:
            if checks is not None and report.checks >= checks:
                break
            if rounds is not None and report.rounds >= rounds:
                break
            if seconds is not None and time.monotonic() - t0 >= seconds:
                break
            rc, specs = make_round(seed, i, vocab)
            rc = for_model(apply_eviction(rc, round_eviction(eviction, i)), model_name, swa_recovery)
            res = run_sequence(model, rc, specs, ref, janitor)
            report.add(rc, res)
            if res.failures:
                first = res.failures[0]
                if log is not None:
                    log(f"round {i}: {first.kind}: {first.detail.splitlines()[0]}; shrinking "
                        f"(up to {shrink_seconds:g} s)")
                small, runs = shrink(model, rc, res.frozen, first.kind, shrink_seconds, ref, janitor)
                report.failures.append(SoakFailure(
                    round=i, kind=first.kind, detail=first.detail, config=asdict(rc), requests=len(specs),
                    shrunk=[_spec_dict(s) for s in small], shrink_runs=runs,
                    reproduce=f"hybridkv soak --seed {seed} --first-round {i} --rounds 1{flag}"))
                if stop_on_failure:
                    break
            now = time.monotonic()
            if log is not None and now - last_log >= 10:
                last_log = now
                log(f"  {now - t0:6.0f} s  round {i}  {report.checks} checks  {report.mismatches} mismatches  "
                    f"{sum(report.cancellations.values())} cancelled  {report.evicted_pages} pages evicted")
            i += 1
    finally:
        janitor.shutdown(wait=True)               # every temporary store directory is gone
    report.wall_seconds = time.monotonic() - t0
    report.command = f"hybridkv soak --seed {seed} --first-round {first_round} --rounds {report.rounds}{flag}"
    return report


def run_case(path: str | Path, model: HybridModel | None = None) -> RunResult:
    """Rerun a recorded failure: a JSON file holding ``{"config": ..., "shrunk": [...]}`` (one entry of a
    report's ``failures``) or a whole soak report (its first failure).

    Raises:
        ValueError: the file is not JSON of that shape (the message names the file, what was found
            and the shape expected), or its config or requests have unknown or missing fields.
        OSError: the file cannot be read.
    """
    shape = ('a soak --json report with "failures", or one failure: an object with "config" (an object) '
             'and "shrunk" (an array of objects)')
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc}); expected {shape}") from None
    if isinstance(data, dict) and "failures" in data:
        if not isinstance(data["failures"], list):
            raise ValueError(f'"failures" is {type(data["failures"]).__name__}, not an array; expected {shape}')
        if not data["failures"]:
            raise ValueError("the report has no failure to rerun")
        data = data["failures"][0]
    if not (isinstance(data, dict) and isinstance(data.get("config"), dict) and isinstance(data.get("shrunk"), list)
            and all(isinstance(s, dict) for s in data["shrunk"])):
        found = f"an object with keys {sorted(data)}" if isinstance(data, dict) else f"a JSON {_json_kind(data)}"
        raise ValueError(f"holds {found}; expected {shape}")
    try:
        rc = RoundConfig(**data["config"])
        specs = [RequestSpec(**s) for s in data["shrunk"]]
    except TypeError as exc:           # unknown or missing fields
        raise ValueError(f"a recorded config or request does not fit this version: {exc}") from None
    return run_sequence(model or soak_model(rc.model), rc, specs)


def _json_kind(value) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


# -- command line -------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``soak`` options."""
    p.add_argument("--seed", type=seed_value, default=0,
                   help="soak seed; round i depends only on (seed, i) (default 0)")
    p.add_argument("--checks", type=positive_int, default=None, help="stop once N requests were checked")
    p.add_argument("--seconds", type=finite_positive_float, default=None, help="stop starting rounds after S seconds")
    p.add_argument("--rounds", type=positive_int, default=None, help="stop after N rounds")
    p.add_argument("--first-round", type=non_negative_int, default=0, help="index of the first round (default 0)")
    p.add_argument("--shrink-seconds", type=finite_positive_float, default=60.0,
                   help="time to shrink a failing round's request sequence (default 60)")
    p.add_argument("--keep-going", action="store_true", help="continue after a failing round")
    p.add_argument("--eviction", choices=EVICTION_CHOICES, default="lru",
                   help="eviction order of the device pools and host tier: lru (default; every earlier "
                        "round reproduces), value, mixed (value in odd rounds), probation (lru with the "
                        "device checkpoint pool's interval checkpoints on probation, --checkpoint-probation 0), "
                        "or utility (lru pages, the device checkpoint pool by expected saving, "
                        "--checkpoint-eviction utility)")
    p.add_argument("--model", choices=(PRESET, *V4_SOAK_PRESETS), default=PRESET,
                   help="preset the rounds run on (default tiny; DeepSeek-V4: v4-tiny, v4-small, with the same "
                        "drawn host tier, store, second engine and store faults)")
    add_swa_recovery_argument(p, f"periodic=P needs P a multiple of {PERIODIC_SOAK_UNIT}")
    p.add_argument("--case", help="rerun a recorded failure (a --json report, or one of its failures) instead")
    p.add_argument("--threads", type=thread_count, default=1, help="torch threads (default 1)")
    p.add_argument("--json", dest="json_path", help="write the report here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--verbose", action="store_true", help="keep the store tiers' warnings (unreachable store)")


def register_cli(subparsers) -> None:
    """Add ``soak`` to the ``hybridkv`` command's subparsers (``args.soak_func(args)`` runs it)."""
    p = subparsers.add_parser("soak", help="randomized workloads on the tiny model (or v4-tiny), every request checked "
                                           "against a full prefill",
                              description="Random engine configurations and request sequences (prefix trees, "
                                          "sessions, resends, short prompts, cancellations) on the tiny model (or a "
                                          "DeepSeek-V4 preset, --model); "
                                          "every finished request is compared with a full prefill and every "
                                          "drained engine is checked for leaks. Exit 1 on any failure.")
    add_arguments(p)
    p.set_defaults(soak_func=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> int:
    """``hybridkv soak``: exit 0 when every check passed, 1 on a failure, 2 on bad options."""
    if args.case is None and args.checks is None and args.seconds is None and args.rounds is None:
        print("error: give --checks N, --seconds S or --rounds N", file=sys.stderr)
        return 2
    if args.case is not None:                  # a rerun of one recorded failure: no new run, no report
        for flag, value in (("--json", args.json_path), ("--checks", args.checks), ("--seconds", args.seconds),
                            ("--rounds", args.rounds)):
            if value is not None:
                print(f"error: {flag} {value} has no effect with --case {args.case}: a rerun of a recorded "
                      "failure prints its checks and writes no report; drop one of them", file=sys.stderr)
                return 2
    if args.swa_recovery is not None and not is_v4(args.model):
        print(f"error: --swa-recovery {args.swa_recovery}: applies to DeepSeek-V4 models (--model v4-tiny or "
              f"v4-small); --model {args.model} is Kimi Linear, whose KDA checkpoints are restored at the hit",
              file=sys.stderr)
        return 2
    if args.swa_recovery is not None:
        from hybridkv.cache.config import ConfigError
        from hybridkv.cache.swa import SwaRecovery
        try:
            SwaRecovery.parse(args.swa_recovery).check(PERIODIC_SOAK_UNIT)
        except ConfigError as exc:
            print(f"error: --swa-recovery {args.swa_recovery}: {exc} (the soak draws units of 64 and 128 tokens)",
                  file=sys.stderr)
            return 2
    if args.case is not None and (args.model != PRESET or args.swa_recovery is not None):
        print(f"error: --model {args.model} / --swa-recovery have no effect with --case {args.case}: the recorded "
              "config names its model and strategy; drop them", file=sys.stderr)
        return 2
    if args.json_path is not None and args.case is None:     # fail before a long run, not after it
        problem = unwritable(args.json_path)
        if problem:
            print(f"error: --json {args.json_path}: {problem}", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    store_log = logging.getLogger("hybridkv.store")
    level = store_log.level
    if not args.verbose:              # injected unavailability would warn once per round's tier
        store_log.setLevel(logging.ERROR)
    try:
        return _soak(args)
    finally:
        store_log.setLevel(level)


def _soak(args: argparse.Namespace) -> int:
    if args.case is not None:
        try:
            res = run_case(args.case)
        except OSError as exc:
            print(f"error: --case {args.case}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError) as exc:       # a recorded value this version cannot run
            print(f"error: --case {args.case}: {exc}", file=sys.stderr)
            return 2
        print(f"case {args.case}: {res.checks} checks, max |dlogit| {res.max_abs_logit_diff:.3g}")
        for f in res.failures:
            print(f"  {f.kind}: {f.detail.splitlines()[0]}")
        return 1 if res.failures else 0
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run_soak(args.seed, args.checks, args.seconds, rounds=args.rounds, first_round=args.first_round,
                      shrink_seconds=args.shrink_seconds, stop_on_failure=not args.keep_going, log=log,
                      eviction=args.eviction, model_name=args.model, swa_recovery=args.swa_recovery)
    vocab = soak_model(args.model).config.vocab_size
    for f in report.failures:
        print(f.render(vocab))
    print(report.summary())
    if args.json_path is not None:
        Path(args.json_path).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridkv.replay.soak``: the same options as ``hybridkv soak``."""
    p = argparse.ArgumentParser(prog="python -m hybridkv.replay.soak", description=__doc__.splitlines()[0])
    add_arguments(p)
    return cmd_soak(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
