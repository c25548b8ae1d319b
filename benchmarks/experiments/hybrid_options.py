"""The hybrid router with other ``HybridOptions`` on the bundled trace (a hand-run experiment).

Runs ``hybridkv replay --simulate --timed --model kimi-linear-48b-a3b --router hybrid`` through
:func:`~hybridkv.replay.runner.run_replay`, with the router built from the options given as JSON
(field names of :class:`~hybridkv.fleet.routers.HybridOptions`), and prints TTFT p50 / p99 /
mean (seconds), load skew, oracle fraction and store GB loaded.

Run by hand:
    PYTHONPATH=src .venv/bin/python benchmarks/experiments/hybrid_options.py INSTANCES RATE ['{"count_routed": false}']
"""

from __future__ import annotations

import json
import sys

from rich.console import Console

import hybridkv.replay.timed as timed
from hybridkv.fleet.routers import HybridOptions, HybridRouter
from hybridkv.replay.runner import ReplayOptions, run_replay


def main(argv: list[str]) -> None:
    n, rate = int(argv[0]), float(argv[1])
    options = HybridOptions(**json.loads(argv[2] if len(argv) > 2 else "{}"))
    build = timed.make_router

    def make(cfg):
        if cfg.name != "hybrid":
            return build(cfg)
        return HybridRouter(cfg.cost, cfg.store, options, cfg.max_num_seqs, cfg.block_size)

    timed.make_router = make          # the replay builds its router through this name
    rep = run_replay(ReplayOptions(limit=None, model="kimi-linear-48b-a3b", simulate=True, timed=True, instances=n,
                                   router="hybrid", time_scale=1 / rate, progress=False), Console(quiet=True))
    t = rep.ttft_seconds
    print(f"{n}x{rate:g} {options}: TTFT p50 {t['p50']:.3f} p99 {t['p99']:.3f} mean {t['mean']:.3f} s, "
          f"skew {rep.load_skew:.2f}, oracle {rep.oracle_fraction:.3f}, store {rep.tiers['store']['bytes_loaded'] / 1e9:.1f} GB")


if __name__ == "__main__":
    main(sys.argv[1:])
