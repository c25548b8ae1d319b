"""Checkpoint-policy frontier on the whole trace, simulate mode, nothing evicted.

For each policy: fraction of the oracle (infinite KV, a checkpoint at every
block) reached, and peak checkpoint bytes relative to a checkpoint at every
512-token block. Writes ``OUT.json`` and a plot (``OUT.png``) and prints a markdown table (the one
docs/results/policies.md shows; no ``.md`` file is written, since every ``.md`` under ``docs/`` is a
page of the documentation site).

Run by hand:  .venv/bin/python benchmarks/bench_policies.py [--out docs/results/policies]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hybridkv.replay.runner import ReplayOptions, run_replay

POLICIES = [
    "interval=512",                       # a checkpoint at every block: the byte reference
    "tail=512",
    "tail",
    "branch+tail=512",
    "branch+tail",
    "branch+tail=512+interval=16384",
    "branch+tail=512+interval=12288",
    "branch+tail=512+interval=10240",
    "branch+tail=512+interval=8192",
    "branch+tail=512+interval=6144",
    "branch+tail=512+interval=4096",
    "branch+tail=512+supersede",
    "branch+tail=512+interval=8192+supersede",
    "branch+tail=512+interval=7168+supersede",      # the replay default
    "branch+tail=512+interval=6144+supersede",
    "branch+tail=512+interval=4096+supersede",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/results/policies", help="prefix of the .json and .png written")
    ap.add_argument("--model", default="small")
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    rows = []
    for policy in POLICIES:
        t = time.perf_counter()
        rep = run_replay(ReplayOptions(limit=args.limit, model=args.model, policy=policy, simulate=True,
                                       progress=False))
        rows.append({"policy": policy, "oracle_fraction": rep.oracle_fraction,
                     "checkpoint_bytes_peak": rep.checkpoint_bytes_peak,
                     "checkpoints_created": rep.checkpoints_created,
                     "branch_recompute_tokens": rep.branch_recompute_tokens,
                     "token_hit_rate": rep.token_hit_rate, "seconds": time.perf_counter() - t})
        print(json.dumps(rows[-1]), flush=True)
    every = rows[0]["checkpoint_bytes_peak"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [("| policy | oracle fraction | checkpoint bytes (GiB) | vs every block | checkpoints | "
             "branch recompute tokens |"), "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['policy']}` | {r['oracle_fraction']:.4f} | {r['checkpoint_bytes_peak'] / 2**30:.2f} | "
                     f"{r['checkpoint_bytes_peak'] / every:.3f} | {sum(r['checkpoints_created'].values()):,} | "
                     f"{r['branch_recompute_tokens']:,} |")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        x, y = r["checkpoint_bytes_peak"] / every, r["oracle_fraction"]
        ax.scatter(x, y)
        ax.annotate(r["policy"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(0.10, ls=":", c="gray")
    ax.axhline(0.98, ls=":", c="gray")
    ax.set_xscale("log")
    ax.set_xlabel("peak checkpoint bytes / every-block checkpoint bytes")
    ax.set_ylabel("reused tokens / oracle")
    ax.set_title("Checkpoint policy frontier (whole trace, simulate)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
