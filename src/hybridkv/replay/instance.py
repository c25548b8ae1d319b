"""One engine instance of a replay: builds its engine (:func:`hybridkv.engine.build.build_engine`), runs its requests.

The same function runs in-process (one instance) and in worker processes
(several instances sharing a store); everything it takes and returns pickles.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from hybridkv._torch import torch
from hybridkv.cache.config import CacheConfig
from hybridkv.engine.build import EngineHandle, build_engine, load_model, model_config
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request, Status
from hybridkv.fleet.costmodel import v4_restore_pricer
from hybridkv.replay.trace import TraceRequest, TraceUnits

TURN_FAILED = -1
"""Shared ``turn`` value: an instance failed; the others raise."""


@dataclass(slots=True)
class InstanceSpec:
    """Work of one instance.

    Attributes:
        instance_id: 0-based.
        model: preset name or model directory.  seed: weight / token seed.
        config: validated cache config.
        prompts: ``int64[T]`` prompt ids, in trace order.
        indices: trace indices of those prompts.
        output_lengths: tokens to generate per prompt.
        verify: trace indices whose logits are recorded and checked.
        store_url: ``none`` or a store URL shared by all instances.
        host_bytes: capacity of the host tier (write-back of evicted device
            entries), bytes; 0 disables it.
        host_write_through: the host tier also saves entries as they are computed.
        host_groups: the groups the host tier holds (``("kda",)``: checkpoints only).
        simulate: cost model instead of the model (the host tier is then payload-free:
            byte accounting only; a store is not modelled).
        trace: with ``units``, the trace request of each prompt (same order as ``prompts``).
        units: key the cache by :class:`~hybridkv.replay.trace.TraceUnits` payloads of ``trace``
            instead of hashing ``prompts`` (simulation, where the prompts are placeholders).
        swa_recovery: DeepSeek-V4 models: ``window``, ``periodic=P`` or ``recompute``
            (:class:`~hybridkv.cache.swa.SwaRecovery`); ``None`` for Kimi Linear.
    """

    instance_id: int
    model: str
    seed: int
    config: CacheConfig
    prompts: list
    indices: list[int]
    output_lengths: list[int]
    verify: set[int] = field(default_factory=set)
    store_url: str = "none"
    host_bytes: int = 0
    host_write_through: bool = False
    host_groups: tuple[str, ...] = ("full", "kda")
    simulate: bool = False
    trace: list[TraceRequest] = field(default_factory=list)
    units: TraceUnits | None = None
    swa_recovery: str | None = None


@dataclass(slots=True)
class InstanceResult:
    """Counters of one instance (picklable; merged by the runner)."""

    stats: dict
    kv_bytes_peak: int
    checkpoint_bytes_peak: int
    kv_bytes_per_token: int
    checkpoint_bytes: int
    evicted_pages: int
    evicted_checkpoints: int
    compute_seconds: float
    tiers: dict = field(default_factory=dict)
    store_misses: Counter = field(default_factory=Counter)
    verify_requests: int = 0
    max_abs_logit_diff: float = 0.0
    greedy_mismatches: int = 0
    reject_reasons: Counter = field(default_factory=Counter)   # refusal kind (reject_code) -> requests
    reject_examples: dict = field(default_factory=dict)        # refusal kind -> (tokens, reason) of its largest request
    reused: dict = field(default_factory=dict)          # trace index -> reused tokens (admitted requests)
    interrupted: bool = False                           # stopped by Ctrl-C before its requests were done
    weight_digest: str | None = None                    # the model's (None: simulated): what cache purge --weight-digest takes
    restores: list[tuple[int, int]] = field(default_factory=list)  # DeepSeek-V4: (restart, hit) of each restore
    restore_seconds: list[float] = field(default_factory=list)   # simulated V4: each restore's modelled seconds


def _drive(engine: Engine, spec: InstanceSpec, requests: list[Request], progress, turn, stop=None) -> None:
    """Run the requests: all queued at once, or one at a time in trace order when ``turn`` is shared.

    ``stop`` (a shared event, with ``turn``) is set by the runner on Ctrl-C: the instance
    raises ``KeyboardInterrupt`` before its next request (worker processes ignore SIGINT
    itself, so an interrupt never lands inside a step or an import).
    """
    if turn is None:
        for r in requests:
            engine.add_request(r)
        while engine.has_work:
            done = engine.step()
            if done and progress is not None:
                progress(len(done))
        return
    try:
        for i, r in zip(spec.indices, requests):
            while turn.value != i:
                if stop is not None and stop.is_set():
                    raise KeyboardInterrupt
                if turn.value < 0:
                    raise RuntimeError(f"instance {spec.instance_id}: another instance failed; stopping")
                time.sleep(0.002)
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            engine.add_request(r)
            engine.run_until_done()
            turn.value = i + 1
            if progress is not None:
                progress(1)
    except KeyboardInterrupt:
        raise
    except BaseException:
        turn.value = TURN_FAILED              # wake every other instance: the replay is over
        raise


def run_instance(spec: InstanceSpec, progress=None, turn=None, threads: int | None = None,
                 stop=None) -> InstanceResult:
    """Run every request of ``spec`` through one engine; ``progress(n)`` after requests finish.

    With ``turn`` (a shared integer holding the next trace index to run), the
    instance runs its requests one at a time in global trace order: request
    ``i`` starts once ``turn == i`` and sets ``turn = i + 1`` when it finishes,
    so instances see each other's store entries exactly as a single ordered
    replay would. An instance that fails sets ``turn = -1`` and the others stop. Without
    it, requests run concurrently up to ``max_num_seqs``.
    ``threads`` sets torch's intra-op threads of this process (not when simulating: no torch runs). A ``KeyboardInterrupt``
    (Ctrl-C in-process, or ``stop`` set by the runner) while requests run ends the run
    early: the result holds what ran until then, with ``interrupted`` set (and no
    verification).
    """
    if threads is not None and not spec.simulate:
        torch.set_num_threads(threads)
    host = {"host_bytes": spec.host_bytes, "host_groups": spec.host_groups,
            "host_write_through": spec.host_write_through and spec.host_bytes > 0}
    v4 = {"swa_recovery": spec.swa_recovery} if spec.swa_recovery is not None else {}
    if spec.simulate:               # no tensors: a payload-free host tier, no store (the store option is ignored)
        mcfg = model_config(spec.model)
        if spec.swa_recovery is not None:          # DeepSeek-V4: each restore's recompute priced by the V4-Flash model
            v4["restore_cost"] = v4_restore_pricer(mcfg, spec.swa_recovery)
        built = build_engine(mcfg, spec.config, model_name=spec.model, **host, **v4)
    else:
        built = build_engine(load_model(spec.model, spec.seed), spec.config, model_name=spec.model,
                             store_url=spec.store_url, **host, **v4)
    engine = built.engine
    requests = [Request(f"r{i}", p, o, record_logits=i in spec.verify)
                for i, p, o in zip(spec.indices, spec.prompts, spec.output_lengths)]
    if spec.units is not None:
        if len(spec.trace) != len(requests):
            raise ValueError(f"instance {spec.instance_id}: {len(spec.trace)} trace requests for "
                             f"{len(requests)} prompts")
        for r, hs in zip(requests, spec.units.hashes_all(spec.trace, engine.cache)):
            r.hashes = hs
    t0 = time.perf_counter()
    interrupted = False
    try:
        _drive(engine, spec, requests, progress, turn, stop)
    except KeyboardInterrupt:                 # Ctrl-C: report what ran so far (see run_replay)
        interrupted = True
    finally:
        built.close()                         # the store tier's worker thread, staging arena and the store
    seconds = time.perf_counter() - t0
    return collect_result(built, spec.indices, requests, seconds, interrupted)


def collect_result(built: EngineHandle, indices: list[int], requests: list[Request], seconds: float,
                   interrupted: bool = False) -> InstanceResult:
    """The counters of one instance's engine after its run (and the verification of the
    requests that recorded logits, when there is a model).

    Args:
        built: the instance's engine (closed or not).
        indices: trace index of each request.
        requests: the engine requests, in the same order.
        seconds: engine time of a real run (a simulated run reports its modelled seconds).
        interrupted: the run was stopped early (Ctrl-C): no verification, flagged in the result.
    """
    engine, backend, model = built.engine, built.backend, built.model
    s = engine.stats
    res = InstanceResult(
        stats={k: getattr(s, k) for k in s.__slots__}, kv_bytes_peak=engine.cache.kv_bytes_peak,
        checkpoint_bytes_peak=engine.cache.checkpoint_bytes_peak,
        kv_bytes_per_token=backend.kv_bytes_per_token, checkpoint_bytes=backend.checkpoint_bytes,
        evicted_pages=engine.cache.evicted_pages, evicted_checkpoints=engine.cache.evicted_checkpoints,
        compute_seconds=backend.modelled_seconds if model is None else seconds,
        tiers=built.tier_stats())
    refused = [r for r in requests if r.status == Status.REJECTED]
    res.reject_reasons = Counter(r.reject_code or r.reject_reason for r in refused)
    for r in refused:                                          # tokens: prompt plus output, what it asked for
        kind, size = r.reject_code or r.reject_reason, r.prompt_len + r.max_output_tokens
        if size > res.reject_examples.get(kind, (-1, ""))[0]:
            res.reject_examples[kind] = (size, r.reject_reason)
    res.reused = {i: r.reused for i, r in zip(indices, requests) if r.match is not None}
    if built.store_tier is not None:
        res.store_misses = Counter(built.store_tier.stats.misses)
    res.interrupted = interrupted
    res.restores = list(getattr(backend, "restores", ()))
    res.restore_seconds = list(getattr(backend, "restore_seconds", ()))
    res.weight_digest = model.weight_digest() if model is not None else None     # cached since the build
    if model is not None and not interrupted:
        _verify(model, [r for r in requests if r.record_logits], res)
    return res


def _verify(model, requests: list[Request], res: InstanceResult) -> None:
    """Re-run each request's tokens with no cache (no autograd); compare every computed position."""
    with torch.no_grad():
        _verify_requests(model, requests, res)


def _verify_requests(model, requests: list[Request], res: InstanceResult) -> None:
    """:func:`_verify`'s work."""
    for r in requests:
        if r.status != Status.FINISHED:
            continue
        ids = np.concatenate([r.prompt, np.asarray(r.output[:-1], dtype=np.int64)])
        full = model(torch.from_numpy(ids)[None])[0]
        for pos, row in r.logits.items():
            res.max_abs_logit_diff = max(res.max_abs_logit_diff, float((row - full[pos]).abs().max()))
        greedy = full[r.prompt_len - 1:].argmax(-1).tolist()
        res.greedy_mismatches += greedy != r.output
        res.verify_requests += 1
