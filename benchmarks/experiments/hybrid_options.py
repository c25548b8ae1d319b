"""The hybrid router with other ``HybridOptions`` on the bundled trace (a hand-run experiment).

Runs ``hybridkv replay --simulate --timed --model kimi-linear-48b-a3b --router hybrid`` through
:func:`~hybridkv.replay.runner.run_replay`, with the router's options given as JSON (field names
of :class:`~hybridkv.fleet.routers.HybridOptions`; ``own_waiting`` is also the command line's
``--own-waiting``), and prints TTFT p50 / p99 / mean (seconds), load skew, oracle fraction and
store GB loaded.

Run by hand:
    PYTHONPATH=src .venv/bin/python benchmarks/experiments/hybrid_options.py INSTANCES RATE ['{"count_routed": false}']
"""

from __future__ import annotations

import json
import sys

from rich.console import Console

from hybridkv.fleet.routers import HybridOptions
from hybridkv.replay.runner import ReplayOptions, run_replay


def main(argv: list[str]) -> None:
    n, rate = int(argv[0]), float(argv[1])
    options = HybridOptions(**json.loads(argv[2] if len(argv) > 2 else "{}"))
    rep = run_replay(ReplayOptions(limit=None, model="kimi-linear-48b-a3b", simulate=True, timed=True, instances=n,
                                   router="hybrid", hybrid=options, time_scale=1 / rate, progress=False),
                     Console(quiet=True))
    t = rep.ttft_seconds
    print(f"{n}x{rate:g} {options}: TTFT p50 {t['p50']:.3f} p99 {t['p99']:.3f} mean {t['mean']:.3f} s, "
          f"skew {rep.load_skew:.2f}, oracle {rep.oracle_fraction:.3f}, store {rep.tiers['store']['bytes_loaded'] / 1e9:.1f} GB")


if __name__ == "__main__":
    main(sys.argv[1:])
