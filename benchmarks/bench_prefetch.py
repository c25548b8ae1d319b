"""Background prefetch vs loading at admission, through a real store.

Run by hand (not part of the test suite)::

    .venv/bin/python benchmarks/bench_prefetch.py                    # MooncakeStore on loopback
    .venv/bin/python benchmarks/bench_prefetch.py --store disk --prefixes 6 --repeats 2

A writer engine computes ``--prefixes`` distinct prefixes of ``--prefix-tokens``
tokens with the ``small`` preset and uploads their KV segments and tail
checkpoints to the store (``store_alignment`` 1024, policy ``tail=1024``). Then, per repeat, two
reader engines with empty device caches replay the same queue: each request is
one prefix + ``--suffix-tokens`` new tokens + 4 generated tokens, with
``max_num_seqs=1`` so each request waits while the previous one runs. One reader
prefetches (``Engine(prefetch=True)``: each step starts the next waiting
request's lookup + load on the store tier's worker thread, and the load runs
while the step computes), the other loads at admission (``prefetch=False``).
The two readers alternate, in rotating order.

Reported per reader: wall seconds for the whole queue, seconds spent inside
``TierConnector.fetch`` (admission stall: lookup, waiting for or doing the
load, install), installs served by a prefetch, and tokens reused. Both readers
must reuse the same tokens and produce the same greedy outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import TorchBackend
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request, Status
from hybridkv.model.model import HybridModel
from hybridkv.tiers.connector import tier_for

ALIGN = 1024


def engine(model, store, ns, prefetch: bool, max_num_seqs: int, pages: int, policy: str = "branch+tail"):
    cfg = CacheConfig(block_size=ALIGN, prefix_match_unit=64, max_num_batched_tokens=8192, num_kv_pages=pages,
                      num_checkpoint_slots=16, max_num_seqs=max_num_seqs,
                      policy=CheckpointPolicy.parse(policy), store_alignment=ALIGN)
    backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    tier = tier_for(store, backend, ns, 64, ALIGN)
    return Engine(cfg, backend, ns, tiers=[tier], prefetch=prefetch), tier


def run_reader(model, store, ns, prompts, prefetch: bool, pages: int) -> dict:
    e, tier = engine(model, store, ns, prefetch, 1, pages)
    stall = [0.0]
    fetch = e.connector.fetch

    def timed_fetch(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fetch(*args, **kwargs)
        finally:
            stall[0] += time.perf_counter() - t

    e.connector.fetch = timed_fetch
    reqs = [e.add_request(Request(f"q{i}", p, 4)) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    e.run_until_done()
    wall = time.perf_counter() - t
    assert all(r.status == Status.FINISHED for r in reqs)
    tier.close()
    return {"wall_s": wall, "fetch_s": stall[0], "prefetch_used": e.connector.prefetch_used,
            "reused": sum(r.reused for r in reqs), "outputs": [r.output for r in reqs],
            "bytes_loaded": tier.stats.bytes_loaded}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", choices=("mooncake", "disk"), default="mooncake")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=8192)
    p.add_argument("--suffix-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)

    if args.store == "mooncake":
        from hybridkv.store.mooncake import loopback, procs, service
        from hybridkv.store.mooncake.client import MooncakeStore
        from hybridkv.store.mooncake.support import LOOPBACK_SHIM_NAME
        if LOOPBACK_SHIM_NAME not in os.environ.get("LD_PRELOAD", ""):
            env = loopback.loopback_env()
            env.setdefault("GLOG_minloglevel", "1")
            if LOOPBACK_SHIM_NAME in env.get("LD_PRELOAD", ""):
                os.execve(sys.executable, [sys.executable, *sys.argv], env)
    torch.set_num_threads(1)
    model = HybridModel.from_preset("small", seed=0)
    v = model.config.vocab_size
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, v, args.prefix_tokens, dtype=np.int64) for _ in range(args.prefixes)]
    pages = args.prefixes * (args.prefix_tokens // ALIGN + 2) + 8
    work = tempfile.mkdtemp(prefix="hybridkv-bench-prefetch-")
    stop = None
    if args.store == "mooncake":
        port, metrics_port = procs.find_free_ports(2)
        service.start_store(port, metrics_port, 2 << 30, work)
        stop = lambda: service.stop_store(work)
        store = MooncakeStore(f"127.0.0.1:{port}")
    else:
        from hybridkv.store.disk import DiskStore
        store = DiskStore(os.path.join(work, "store"))
    results: dict[str, list[dict]] = {"prefetch": [], "at admission": []}
    try:
        ns = CacheIdentity(model_repo="bench_prefetch", weight_digest=model.weight_digest()).digest()
        writer, wtier = engine(model, store, ns, False, 1, pages, policy=f"tail={ALIGN}")
        for i, pre in enumerate(prefixes):
            writer.add_request(Request(f"w{i}", np.concatenate([pre, rng.integers(0, v, 64)]), 1))
        t = time.perf_counter()
        writer.run_until_done()
        print(f"writer: {args.prefixes} prefixes of {args.prefix_tokens} tokens uploaded in "
              f"{time.perf_counter() - t:.1f} s ({wtier.stats.bytes_saved / 1e6:.1f} MB)")
        wtier.close()
        for rep in range(args.repeats):
            prompts = [np.concatenate([pre, rng.integers(0, v, args.suffix_tokens)]) for pre in prefixes]
            order = ["prefetch", "at admission"] if rep % 2 == 0 else ["at admission", "prefetch"]
            got = {}
            for name in order:
                got[name] = run_reader(model, store, ns, prompts, name == "prefetch", pages)
                results[name].append(got[name])
            a, b = got["prefetch"], got["at admission"]
            assert a["reused"] == b["reused"] == args.prefixes * args.prefix_tokens, (a["reused"], b["reused"])
            assert a["outputs"] == b["outputs"], "readers' greedy outputs differ"
            print(f"repeat {rep}: " + "; ".join(f"{n} wall {r['wall_s']:.2f} s fetch {r['fetch_s']:.3f} s "
                                                 f"prefetched {r['prefetch_used']}" for n, r in got.items()))
    finally:
        store.close()
        if stop is not None:
            stop()
    summary = {}
    for name, runs in results.items():
        summary[name] = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "fetch_s", "prefetch_used")}
        summary[name]["reused_tokens"] = runs[0]["reused"]
        summary[name]["bytes_loaded"] = runs[0]["bytes_loaded"]
    ratio = statistics.median(b["fetch_s"] / max(a["fetch_s"], 1e-9)
                              for a, b in zip(results["prefetch"], results["at admission"]))
    print(f"\n{args.store}: {args.prefixes} requests, each reusing {args.prefix_tokens} tokens from the store "
          f"({summary['prefetch']['bytes_loaded'] / 1e6:.1f} MB loaded per reader), medians of {args.repeats}:")
    for name, r in summary.items():
        print(f"  {name:<13} wall {r['wall_s']:7.2f} s   admission stall (fetch) {r['fetch_s']:7.3f} s   "
              f"installs from a prefetch {r['prefetch_used']:.0f}")
    print(f"  admission stall at admission / with prefetch: {ratio:.2f}x (median of per-repeat ratios)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "summary": summary,
                       "fetch_ratio": ratio,
                       "runs": {n: [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
                                for n, runs in results.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
