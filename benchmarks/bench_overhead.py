"""Cache bookkeeping overhead vs the prefill time that reuse saves (real `small` model, CPU).

Run by hand (not part of the test suite)::

    python benchmarks/bench_overhead.py                          # trace (30 requests) + synthetic (30)
    python benchmarks/bench_overhead.py --workload synthetic --json out.json
    python benchmarks/bench_overhead.py --simulate-trace         # also time `hybridkv replay --simulate` on the whole trace

What is measured. The engine (``TorchBackend`` over ``HybridModel.from_preset("small")``, or ``--preset``,
``torch.set_num_threads(1)``) runs every request twice:

* **cached**: the replay's default policy (:func:`hybridkv.replay.runner.default_policy`
  of the workload's block length, or ``--policy``); the coordinator methods
  ``hash_prompt``, ``lookup``, ``acquire``, ``publish`` (and inside it ``publish_units``,
  ``_publish_checkpoint``, ``retire_checkpoint``), ``release`` and the scheduler's ``plan_captures`` are
  wrapped (on the instance / module attribute, in this script only) with
  ``time.perf_counter`` accumulators. Nested calls (``lookup`` -> ``hash_prompt``,
  ``publish`` -> ``publish_units``) are timed per method *inclusive*, and
  the overhead total counts only the outermost call so nothing is counted twice.
  ``--clock cpu`` times them with ``time.thread_time`` (CPU seconds of the engine's
  thread) instead of ``time.perf_counter``: time the process spends descheduled by other
  jobs on a loaded machine is then not counted (the prefill times stay wall seconds).
* **baseline**: the same engine with policy ``none`` (no checkpoint can exist, so
  every request prefills its whole prompt): the no-cache prefill time of the
  same prompts, chunked the same way. ``--no-baseline`` leaves it out (half the run
  time; the overhead figures stay, the saved-prefill ones are ``None``).

The two engines run in lockstep (one step of each in turn), so background load
on a shared machine hits both alike. ``backend.run`` is timed in both; steps that
carry prefill chunks are charged to their request (``--max-num-seqs 1`` by
default, so every step holds one request). Per request, each time is the minimum
over ``--repeats``.
Saved prefill time per request = baseline prefill seconds - cached prefill
seconds (measured; the cached side includes extracting checkpoints inside the
forward). A second estimate multiplies reused tokens by the baseline's mean
seconds per prefill token. Overhead / saved is reported against both.

Workloads: ``trace`` = the first ``--requests`` requests of the bundled Mooncake
trace, 64 tokens per hash id (``request_token_array``); ``synthetic`` =
``--requests`` prompts of 2k-8k tokens over a few shared prefixes (system
prompt + unique suffix), in an interleaved order.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import hybridkv.engine.engine as engine_mod
from hybridkv.cache.config import CacheConfig, CheckpointPolicy, ConfigError
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import TorchBackend
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request, Status
from hybridkv.model.model import HybridModel
from hybridkv.replay.runner import default_policy
from hybridkv.replay.trace import load_trace, request_token_array, scaled_output_length

CACHE_METHODS = ("hash_prompt", "lookup", "acquire", "publish", "publish_units", "_publish_checkpoint",
                 "retire_checkpoint", "release")


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``--clock`` choices: the clock the wrapped cache methods are timed with (seconds)."""


class Timers:
    """Inclusive seconds per wrapped name, plus the outermost-only total (``clock``: seconds)."""

    clock = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.incl: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.total = 0.0
        self.depth = 0

    def wrap(self, name: str, fn):
        self.incl.setdefault(name, 0.0)
        self.calls.setdefault(name, 0)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.depth += 1
            t = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = self.clock() - t
                self.depth -= 1
                self.incl[name] += dt
                self.calls[name] += 1
                if self.depth == 0:
                    self.total += dt
        return timed


def trace_workload(n: int, block_tokens: int, vocab: int, max_out: int):
    reqs = load_trace(limit=n).requests
    prompts = [request_token_array(r, block_tokens, vocab) for r in reqs]
    outs = [min(max_out, scaled_output_length(r, block_tokens)) for r in reqs]
    return prompts, outs, block_tokens


def synthetic_workload(n: int, vocab: int, max_out: int, seed: int = 0, num_prefixes: int = 5):
    """``n`` prompts of 2k-8k tokens: one of ``num_prefixes`` shared prefixes (2k-6k) + a unique suffix."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, vocab, int(rng.integers(2048, 6145)), dtype=np.int64) for _ in range(num_prefixes)]
    prompts = []
    for i in range(n):
        pre = prefixes[i % num_prefixes]
        total = int(rng.integers(max(2048, len(pre) + 128), 8193))
        prompts.append(np.concatenate([pre, rng.integers(3, vocab, total - len(pre), dtype=np.int64)]))
    return prompts, [max_out] * n, 512


class EngineRun:
    """One engine over every prompt; per request: prefill seconds, hit, kv_hit, cache overhead seconds."""

    def __init__(self, model, prompts, outs, cfg: CacheConfig, namespace: bytes, instrument: bool) -> None:
        self.backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
        self.eng = Engine(cfg, self.backend, namespace)
        self.timers = Timers()
        self.cfg = cfg
        if instrument:
            for name in CACHE_METHODS:
                setattr(self.eng.cache, name, self.timers.wrap(name, getattr(self.eng.cache, name)))
        self.per_req: dict[str, dict] = {}
        run = self.backend.run

        def timed_run(items):
            prefill = [r for r in self.eng.running if r.status == Status.PREFILL]
            t = time.perf_counter()
            out = run(items)
            dt = time.perf_counter() - t
            for r in prefill:   # one request per step with max_num_seqs=1; else split evenly
                self.per_req[r.request_id]["prefill_s"] += dt / len(prefill)
            return out

        self.backend.run = timed_run
        self.reqs = [Request(f"r{i}", p, o) for i, (p, o) in enumerate(zip(prompts, outs))]
        for r in self.reqs:
            self.per_req[r.request_id] = {"prompt": len(r.prompt), "prefill_s": 0.0, "overhead_s": 0.0}
            self.eng.add_request(r)
        self.last_total = 0.0
        self.wall = 0.0

    def step(self) -> None:
        t = time.perf_counter()
        done = self.eng.step()
        self.wall += time.perf_counter() - t
        for r in done:        # with max_num_seqs=1 every call since the last finish is this request's
            self.per_req[r.request_id]["overhead_s"] = self.timers.total - self.last_total
            self.last_total = self.timers.total

    def result(self) -> dict[str, dict]:
        for r in self.reqs:
            d = self.per_req[r.request_id]
            d.update(hit=r.match.hit, kv_hit=r.match.kv_hit, matched_units=len(r.match.path),
                     hashed_units=len(r.match.hashes), status=r.status.name)
        return self.per_req


def run_lockstep(model, prompts, outs, cached_cfg, base_cfg, namespace):
    """The cached and the baseline engine stepped alternately, so both see the same background load
    (``base_cfg=None``: the cached engine alone; the baseline returned is ``None``)."""
    cached = EngineRun(model, prompts, outs, cached_cfg, namespace, True)
    base = EngineRun(model, prompts, outs, base_cfg, namespace, False) if base_cfg is not None else None
    real_plan = engine_mod.plan_captures
    timed_plan = cached.timers.wrap("plan_captures", real_plan)
    # the module function is shared by both engines: time only the cached engine's calls
    engine_mod.plan_captures = lambda config, *a, **k: (timed_plan if config is cached_cfg else real_plan)(
        config, *a, **k)
    try:
        while cached.eng.has_work or (base is not None and base.eng.has_work):
            if cached.eng.has_work:
                cached.step()
            if base is not None and base.eng.has_work:
                base.step()
    finally:
        engine_mod.plan_captures = real_plan
    return cached, base


def bench_workload(name, model, prompts, outs, block, args, namespace):
    g = 64
    block_size = -(-block // g) * g
    pages = sum(-(-(len(p) + o) // block_size) for p, o in zip(prompts, outs)) + 4
    common = {"block_size": block_size, "prefix_match_unit": g, "max_num_batched_tokens": args.max_num_batched_tokens,
                  "num_kv_pages": pages, "num_checkpoint_slots": max(16, 4 * len(prompts)), "max_num_seqs": args.max_num_seqs}
    policy = args.policy or default_policy(block, g)
    cached_cfg = CacheConfig(policy=CheckpointPolicy.parse(policy), checkpoint_probation=args.checkpoint_probation,
                             **common, **dict(args.cache_option))
    base_cfg = None if args.no_baseline else CacheConfig(policy=CheckpointPolicy.parse("none"), **common)
    run_lockstep(model, [prompts[0][:512]], [1], cached_cfg, base_cfg, namespace)   # warm-up
    runs = []
    for rep in range(args.repeats):
        c, b = run_lockstep(model, prompts, outs, cached_cfg, base_cfg, namespace)
        runs.append((c.result(), c.timers, b.result() if b else None, c.wall, b.wall if b else None, c.eng))
    # per request: the minimum over repeats of each measured time (least noise from other jobs)
    ids = list(runs[0][0])
    rows = []
    for rid in ids:
        c0 = runs[0][0][rid]
        rows.append(dict(c0, prefill_cached_s=min(r[0][rid]["prefill_s"] for r in runs),
                         prefill_base_s=None if base_cfg is None else min(r[2][rid]["prefill_s"] for r in runs),
                         overhead_s=min(r[0][rid]["overhead_s"] for r in runs)))
    n = len(rows)
    hit_tokens = sum(r["hit"] for r in rows)
    matched_units = sum(r["matched_units"] for r in rows)
    hashed_units = sum(r["hashed_units"] for r in rows)
    overhead = sum(r["overhead_s"] for r in rows)
    cached_prefill = sum(r["prefill_cached_s"] for r in rows)
    prompt_tokens = sum(r["prompt"] for r in rows)
    if base_cfg is None:
        base_prefill = saved_measured = saved_est = None
    else:
        base_prefill = sum(r["prefill_base_s"] for r in rows)
        saved_measured = base_prefill - cached_prefill
        saved_est = hit_tokens * base_prefill / prompt_tokens
    best = min(runs, key=lambda r: r[1].total)[1]
    breakdown = {k: {"calls": best.calls[k], "us_per_call": 1e6 * best.incl[k] / max(best.calls[k], 1),
                     "us_per_request": 1e6 * best.incl[k] / n, "seconds": best.incl[k]} for k in best.incl}
    hit_rows = [r for r in rows if r["hit"] > 0]
    return {
        "workload": name, "requests": n, "prompt_tokens": prompt_tokens, "reused_tokens": hit_tokens,
        "requests_with_hit": len(hit_rows), "matched_units": matched_units, "hashed_units": hashed_units,
        "block_size": block_size, "prefix_match_unit": g, "repeats": args.repeats, "policy": policy,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "checkpoints_created": dict(runs[0][5].stats.checkpoints_created), "clock": args.clock,
        "baseline_prefill_s": base_prefill, "cached_prefill_s": cached_prefill,
        "prefill_tokens_per_s_baseline": prompt_tokens / base_prefill if base_prefill else None,
        "saved_prefill_s_measured": saved_measured, "saved_prefill_s_estimated": saved_est,
        "overhead_s": overhead, "overhead_us_per_request": 1e6 * overhead / n,
        "overhead_us_per_matched_unit": 1e6 * overhead / matched_units if matched_units else None,
        "overhead_us_per_hashed_unit": 1e6 * overhead / hashed_units,
        "overhead_pct_of_saved_measured": 100 * overhead / saved_measured if saved_measured and saved_measured > 0 else None,
        "overhead_pct_of_saved_estimated": 100 * overhead / saved_est if saved_est and saved_est > 0 else None,
        "overhead_pct_of_baseline_prefill": 100 * overhead / base_prefill if base_prefill else None,
        "hit_requests_overhead_us_mean": (1e6 * statistics.mean(r["overhead_s"] for r in hit_rows)
                                          if hit_rows else None),
        "breakdown_best_repeat": breakdown,
        "wall_cached_s": [r[3] for r in runs], "wall_baseline_s": [r[4] for r in runs],
        "per_request": rows,
    }


def simulate_trace() -> dict:
    """``hybridkv replay --simulate --all`` on the bundled trace: wall seconds and requests/s."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sim.json")
        cmd = [sys.executable, "-m", "hybridkv.cli", "replay", "--simulate", "--no-progress", "--json", path]
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        process_s = time.perf_counter() - t
        with open(path) as f:
            rep = json.load(f)
    return {"command": "hybridkv replay --simulate --no-progress --json PATH", "requests": rep["requests"],
            "prompt_tokens": rep["prompt_tokens"], "wall_seconds": rep["wall_seconds"],
            "requests_per_s": rep["requests"] / rep["wall_seconds"],
            "prompt_tokens_per_s": rep["prompt_tokens"] / rep["wall_seconds"], "process_seconds": process_s,
            "token_hit_rate": rep["token_hit_rate"]}


def _print(res: dict) -> None:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)
    print(f"\n== {res['workload']}: {res['requests']} requests, {res['prompt_tokens']} prompt tokens, "
          f"{res['reused_tokens']} reused ({res['requests_with_hit']} requests with a hit), "
          f"{res['matched_units']} matched / {res['hashed_units']} hashed 64-token units; policy {res['policy']}, "
          f"checkpoints created {res['checkpoints_created']}")
    print(f"baseline prefill {f(res['baseline_prefill_s'], '.2f')} s "
          f"({f(res['prefill_tokens_per_s_baseline'], '.0f')} tok/s), cached prefill {res['cached_prefill_s']:.2f} s")
    print(f"saved prefill: measured {f(res['saved_prefill_s_measured'], '.3f')} s, "
          f"estimated (reused x s/token) {f(res['saved_prefill_s_estimated'], '.3f')} s")
    print(f"cache overhead ({res['clock']} clock) {1e3 * res['overhead_s']:.2f} ms = {res['overhead_us_per_request']:.0f} us/request, "
          f"{f(res['overhead_us_per_matched_unit'], '.1f')} us/matched unit, "
          f"{res['overhead_us_per_hashed_unit']:.1f} us/hashed unit")
    print(f"overhead / saved: {f(res['overhead_pct_of_saved_measured'], '.3f')} % (measured), "
          f"{f(res['overhead_pct_of_saved_estimated'], '.3f')} % (estimated); "
          f"/ baseline prefill {f(res['overhead_pct_of_baseline_prefill'], '.3f')} %")
    print(f"{'method':<20}{'calls':>7}{'us/call':>10}{'us/request':>12}   (inclusive, best repeat)")
    for k, v in res["breakdown_best_repeat"].items():
        print(f"{k:<20}{v['calls']:>7}{v['us_per_call']:>10.1f}{v['us_per_request']:>12.1f}")


def cache_option(text: str) -> tuple[str, object]:
    """``FIELD=VALUE`` -> ``(FIELD, value)``: ``none`` -> None, then int, float, else the string."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: give FIELD=VALUE")
    if raw.lower() == "none":
        return name, None
    for conv in (int, float):
        try:
            return name, conv(raw)
        except ValueError:
            pass
    return name, raw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("trace", "synthetic", "both"), default="both")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--block-tokens", type=int, default=64, help="trace tokens per hash id")
    p.add_argument("--max-output-tokens", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--policy", help="checkpoint policy of the cached run (default: the replay default)")
    p.add_argument("--simulate-trace", action="store_true", help="also time the whole-trace simulate replay")
    p.add_argument("--checkpoint-probation", type=float, default=None,
                   help="CacheConfig.checkpoint_probation of the cached run (default: off)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="clock of the cache methods' timers: wall (time.perf_counter) or cpu (time.thread_time, "
                        "CPU seconds of the engine's thread: not charged for time other jobs hold the core)")
    p.add_argument("--no-baseline", action="store_true",
                   help="run the cached engine only (no policy-none engine: no saved-prefill figures)")
    p.add_argument("--cache-option", action="append", default=[], type=cache_option, metavar="FIELD=VALUE",
                   help="another CacheConfig field of the cached run (repeatable; e.g. checkpoint_eviction=utility; "
                        "VALUE none, a number or a string)")
    p.add_argument("--preset", default="small",
                   help="model preset (default small; tiny prefills far faster, so many more requests fit in a "
                        "run: the bookkeeping is the same code, the checkpoints a resumed request copies are smaller)")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(CacheConfig)} - {
        "policy", "checkpoint_probation", "block_size", "prefix_match_unit", "max_num_batched_tokens",
        "num_kv_pages", "num_checkpoint_slots", "max_num_seqs"}      # set by the script (bench_workload)
    for name, _ in args.cache_option:
        if name not in fields:
            p.error(f"--cache-option {name}=...: not a CacheConfig field this run can set (choose from {sorted(fields)})")
    try:                                        # a bad value: one line, before the model is built
        CacheConfig(**dict(args.cache_option))
    except (ConfigError, TypeError, ValueError) as e:
        p.error(f"--cache-option: {e}")
    Timers.clock = staticmethod(CLOCKS[args.clock])
    torch.set_num_threads(1)
    model = HybridModel.from_preset(args.preset, seed=0).eval()
    vocab = model.config.vocab_size
    namespace = CacheIdentity(model_repo=args.preset, weight_digest=model.weight_digest()).digest()
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
           f"torch {torch.__version__}, 1 thread", "preset": args.preset, "results": []}
    loads = []
    if args.workload in ("trace", "both"):
        loads.append(("trace", *trace_workload(args.requests, args.block_tokens, vocab, args.max_output_tokens)))
    if args.workload in ("synthetic", "both"):
        loads.append(("synthetic", *synthetic_workload(args.requests, vocab, args.max_output_tokens)))
    for name, prompts, outs, block in loads:
        res = bench_workload(name, model, prompts, outs, block, args, namespace)
        _print(res)
        out["results"].append(res)
    if args.simulate_trace:
        sim = simulate_trace()
        out["simulate"] = sim
        print(f"\nsimulate replay of the whole trace: {sim['requests']} requests in {sim['wall_seconds']:.2f} s "
              f"= {sim['requests_per_s']:.0f} requests/s ({sim['prompt_tokens_per_s'] / 1e6:.1f} M prompt tokens/s)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
