"""``hybridkv replay``: run a Mooncake-format trace through the engine (the main job).

Real mode runs the model on every scheduled token and, with ``verify``,
re-runs sampled requests without any cache and compares logits at every
position the cached run computed. Simulate mode drives the same index,
matcher, policy and scheduler through :class:`SimulatedBackend` (no tensors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.groups import FullAttentionSpec, KDASpec
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import SimulatedBackend, TorchBackend
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request, Status
from hybridkv.model.config import HybridConfig
from hybridkv.replay.oracle import oracle_from_trace
from hybridkv.replay.report import ReplayReport, VerifyReport, ratio
from hybridkv.replay.trace import load_trace, request_token_array, scaled_output_length


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """Options of one replay (lengths in tokens). ``None`` pool sizes mean "sized so nothing is evicted"."""

    trace: str | None = None
    limit: int | None = 40
    model: str = "small"
    block_tokens: int = 512
    block_size: int = 512
    prefix_match_unit: int = 64
    policy: str | None = None
    mechanism: str = "extract"
    max_output_tokens: int = 4
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 4
    num_kv_pages: int | None = None
    num_checkpoint_slots: int | None = None
    verify: int = 0
    simulate: bool = False
    skip_bad: bool = False
    seed: int = 0
    progress: bool = True


def default_policy(block_tokens: int, prefix_match_unit: int) -> str:
    """``branch+tail=<block_tokens>``: the tail lands on the last whole trace block.

    The trace shares whole 512-token blocks (scaled: ``block_tokens``), so the
    next turn of a conversation can only hit a tail checkpoint placed on a
    block boundary; a unit-aligned tail inside the last partial block is never hit.
    """
    if block_tokens % prefix_match_unit == 0:
        return f"branch+tail={block_tokens}"
    return "branch+tail"


def _default_slots(opts: ReplayOptions, prompts) -> int:
    """Slots so that nothing is evicted: one per unit when simulating (no tensors), else 4 per request."""
    if opts.simulate:
        return 16 + sum(len(p) // opts.prefix_match_unit for p in prompts)
    return max(16, 4 * len(prompts))


def _model_config(name: str) -> HybridConfig:
    path = Path(name)
    return HybridConfig.from_hf(path) if path.is_dir() else HybridConfig.preset(name)


def _load_model(name: str, seed: int):
    from hybridkv.model.model import HybridModel
    path = Path(name)
    model = HybridModel.from_pretrained(path) if path.is_dir() else HybridModel.from_preset(name, seed=seed)
    return model.eval()


def _identity(model_name: str, digest: str) -> CacheIdentity:
    return CacheIdentity(model_repo=model_name, weight_digest=digest)


def run_replay(opts: ReplayOptions, console: Console | None = None) -> ReplayReport:
    """Replay the trace and return the report.

    Raises:
        TraceError: a bad trace line (unless ``skip_bad``), naming file and line.
        ConfigError: an invalid cache option, naming the value.
        ValueError: an unknown model preset or bad model directory.
    """
    console = console or Console(stderr=True)
    t0 = time.perf_counter()
    load = load_trace(opts.trace, limit=opts.limit, skip_bad=opts.skip_bad)
    reqs = load.requests
    policy = CheckpointPolicy.parse(opts.policy or default_policy(opts.block_tokens, opts.prefix_match_unit))
    mcfg = _model_config(opts.model)
    prompts = [request_token_array(r, opts.block_tokens, mcfg.vocab_size, seed=opts.seed) for r in reqs]
    out_lens = [1 if opts.simulate else min(opts.max_output_tokens, scaled_output_length(r, opts.block_tokens))
                for r in reqs]
    pages_needed = sum(-(-(len(p) + o) // opts.block_size) for p, o in zip(prompts, out_lens))
    cfg = CacheConfig(
        block_size=opts.block_size, prefix_match_unit=opts.prefix_match_unit,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        num_kv_pages=opts.num_kv_pages or pages_needed + opts.max_num_seqs,
        num_checkpoint_slots=opts.num_checkpoint_slots or _default_slots(opts, prompts),
        policy=policy, mechanism=opts.mechanism, max_num_seqs=opts.max_num_seqs)

    if opts.simulate:
        model = None
        full = FullAttentionSpec(cfg.block_size, mcfg.num_mla_layers, mcfg.kv_latent_dim)
        kda = KDASpec(mcfg.num_kda_layers, mcfg.kda_num_heads, mcfg.kda_head_dim, mcfg.conv_dim,
                      mcfg.conv_kernel_size - 1)
        backend = SimulatedBackend(full, kda)
        digest = "simulated"
    else:
        model = _load_model(opts.model, opts.seed)
        backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
        digest = model.weight_digest()
    engine = Engine(cfg, backend, _identity(opts.model, digest).digest())

    oracle = oracle_from_trace(reqs, opts.block_tokens, opts.block_size)
    verify_ids = _pick_verify(oracle.per_request, opts.verify) if not opts.simulate else set()
    requests = [Request(f"r{i}", p, o, record_logits=i in verify_ids)
                for i, (p, o) in enumerate(zip(prompts, out_lens))]
    for r in requests:
        engine.add_request(r)

    t_run = time.perf_counter()
    with Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not opts.progress, transient=False) as bar:
        task = bar.add_task("requests", total=len(requests))
        while engine.has_work:
            done = engine.step()
            if done:
                bar.advance(task, len(done))
        bar.update(task, completed=len(requests))
    run_seconds = time.perf_counter() - t_run

    verify = None
    if not opts.simulate:
        verify = _verify(model, [r for r in requests if r.record_logits], console)
    s = engine.stats
    kv_tok = backend.full_spec.bytes_per_token
    ck = backend.kda_spec.page_size_bytes
    total_bytes = s.prompt_tokens * kv_tok + s.requests * ck
    reused_bytes = s.reused_tokens * kv_tok + s.requests_with_hit * ck
    compute_seconds = backend.modelled_seconds if opts.simulate else run_seconds
    return ReplayReport(
        requests=s.requests, prompt_tokens=s.prompt_tokens, computed_prompt_tokens=s.computed_prompt_tokens,
        reused_tokens=s.reused_tokens, token_hit_rate=ratio(s.reused_tokens, s.prompt_tokens),
        request_hit_rate=ratio(s.requests_with_hit, s.requests),
        byte_weighted_hit_rate=ratio(reused_bytes, total_bytes),
        oracle_reused_tokens=oracle.reused_tokens, oracle_fraction=ratio(s.reused_tokens, oracle.reused_tokens),
        checkpoints_created=dict(s.checkpoints_created), branch_recompute_tokens=s.branch_recompute_tokens,
        checkpoint_bytes_peak=engine.cache.checkpoint_bytes_peak, kv_bytes_peak=engine.cache.kv_bytes_peak,
        verify=verify, wall_seconds=round(time.perf_counter() - t0, 3),
        prefill_tokens_per_second=ratio(s.computed_prompt_tokens, compute_seconds),
        mode="simulate" if opts.simulate else "model",
        config={"model": opts.model, "block_tokens": opts.block_tokens, "block_size": cfg.block_size,
                "prefix_match_unit": cfg.prefix_match_unit, "policy": str(policy), "mechanism": cfg.mechanism,
                "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
                "num_kv_pages": cfg.num_kv_pages, "num_checkpoint_slots": cfg.num_checkpoint_slots,
                "max_output_tokens": opts.max_output_tokens, "rejected": s.rejected,
                "evicted_pages": engine.cache.evicted_pages,
                "evicted_checkpoints": engine.cache.evicted_checkpoints},
        skipped_lines=load.skipped)


def _pick_verify(oracle_per_request, n: int) -> set[int]:
    """``n`` request indices spread over the trace, preferring requests that share a prefix."""
    if n <= 0:
        return set()
    sharing = [i for i, reused in enumerate(oracle_per_request) if reused > 0]
    pool = sharing if len(sharing) >= n else list(range(len(oracle_per_request)))
    picks = np.linspace(0, len(pool) - 1, num=min(n, len(pool))).round().astype(int)
    return {pool[i] for i in picks}


@torch.no_grad()
def _verify(model, requests: list[Request], console: Console) -> VerifyReport:
    """Re-run each request's tokens with no cache; compare every computed position."""
    max_diff, mismatches = 0.0, 0
    for r in requests:
        if r.status != Status.FINISHED:
            continue
        ids = np.concatenate([r.prompt, np.asarray(r.output[:-1], dtype=np.int64)])
        full = model(torch.from_numpy(ids)[None])[0]
        for pos, row in r.logits.items():
            max_diff = max(max_diff, float((row - full[pos]).abs().max()))
        t = r.prompt_len
        greedy = full[t - 1:].argmax(-1).tolist()
        mismatches += greedy != r.output
    return VerifyReport(requests=len(requests), max_abs_logit_diff=max_diff, greedy_mismatches=mismatches)
