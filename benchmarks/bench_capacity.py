"""Capacity sweep (issue 12 item 5): device KV + checkpoint capacity at fractions of what
nothing-evicted needs, ``lru`` vs ``value`` eviction, on the bundled trace in simulate mode.

Run by hand (not part of the test suite)::

    python benchmarks/bench_capacity.py                          # 1, 2, 5, 10, 20 %; whole trace
    python benchmarks/bench_capacity.py --fractions 0.05 --limit 3000 --json out.json --png out.png
    python benchmarks/bench_capacity.py --trace benchmarks/traces/synthetic_trace.jsonl --host-factor 0

First one replay with pools large enough that nothing is evicted gives the peak KV pages and
checkpoint slots; each capacity ``f`` then gets ``ceil(f * peak)`` pages and slots (at least
``max_num_seqs`` requests' worth of pages, so every request can run). Reported per run: the
fraction of the every-unit oracle reused, and prefill seconds saved (reused tokens at the
cost model's rate, :class:`hybridkv.engine.backend.SimulatedBackend`), with eviction counts.
With ``--host-factor F`` (default 2, the issue's "host at 2x the device") each run also gets a
host tier of ``F`` times the device capacity in bytes (``pages * page bytes + slots * slot bytes``):
simulate mode's payload-free host tier (real keys, capacity, eviction order, demotion of device
evictions and promotion of host hits; docs/concepts/eviction.md), holding KV pages and checkpoints. Orders:
``lru`` (device and host), ``value`` (device pools by value, host LRU: the default
``host_eviction``) and, with a host, ``value+host-value`` (both by value).
``--host-factor 0``: device only. The baseline (100%) has no host.
"""

from __future__ import annotations

import argparse
import json
import math

from rich.console import Console

from hybridkv.replay.runner import ReplayOptions, run_replay

FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20)
ORDERS = ("lru", "value", "value+host-value")
ORDER_SETTINGS = {"lru": ("lru", "lru"), "value": ("value", "lru"), "value+host-value": ("value", "value")}
"""Row name -> (``eviction`` of the device pools, ``host_eviction``)."""


def sweep(fractions, limit: int | None, console: Console, host_factor: float = 2.0,
          trace: str | None = None) -> list[dict]:
    """One baseline replay, then ``lru`` and ``value`` at each fraction, with a host tier of
    ``host_factor`` times the device bytes (0: none); a row per run. ``trace``: a trace file
    in the bundled trace's format (``None``: the bundled trace)."""
    base_opts = ReplayOptions(trace=trace, limit=limit, simulate=True, progress=False, host_bytes=0)
    base = run_replay(base_opts, console)
    block = base.config["block_size"]
    rate = base.prefill_tokens_per_second
    page_bytes = base.kv_bytes_peak // _peak_units(base.kv_bytes_peak, base, "kv")
    slot_bytes = base.checkpoint_bytes_peak // _peak_units(base.checkpoint_bytes_peak, base, "ck")
    peak_pages = base.kv_bytes_peak // page_bytes
    peak_slots = base.checkpoint_bytes_peak // slot_bytes
    rows = [{"policy": "none", "fraction": 1.0, "pages": peak_pages, "slots": peak_slots, "host_bytes": 0,
             "oracle_fraction": base.oracle_fraction, "reused_tokens": base.reused_tokens,
             "saved_seconds": base.reused_tokens / rate, "kv_evictions": 0, "checkpoint_evictions": 0,
             "host_hit_tokens": 0, "host_evictions": 0}]
    min_pages = 4 * -(-max(1, base.prompt_tokens // max(1, base.requests)) // block)
    for f in fractions:
        pages = max(min_pages, math.ceil(f * peak_pages))
        slots = max(8, math.ceil(f * peak_slots))
        host_bytes = int(host_factor * (pages * page_bytes + slots * slot_bytes))
        orders = ORDERS if host_bytes else ORDERS[:2]
        for eviction in orders:
            device, host = ORDER_SETTINGS[eviction]
            opts = ReplayOptions(trace=trace, limit=limit, simulate=True, progress=False, num_kv_pages=pages,
                                 num_checkpoint_slots=slots, eviction=device, host_eviction=host,
                                 host_bytes=host_bytes)
            r = run_replay(opts, console)
            ev = r.evictions["device"]
            rows.append({"policy": eviction, "fraction": f, "pages": pages, "slots": slots, "host_bytes": host_bytes,
                         "oracle_fraction": r.oracle_fraction, "reused_tokens": r.reused_tokens,
                         "saved_seconds": r.reused_tokens / rate, "kv_evictions": ev["kv_pages"],
                         "checkpoint_evictions": ev["checkpoints"], "rejected": r.rejected["requests"],
                         "host_hit_tokens": r.tiers["host"]["hit_tokens"],
                         "host_evictions": r.evictions["host"]["entries"]})
            console.print(rows[-1])
    return rows


def _peak_units(peak_bytes: int, base, kind: str) -> int:
    """Pages or slots at the peak: bytes over the per-unit size the simulated model reports."""
    from hybridkv.cache.groups import FullAttentionSpec, KDASpec
    from hybridkv.engine.build import model_config
    cfg = model_config(base.config["model"])
    unit = (FullAttentionSpec.for_model(cfg, base.config["block_size"]).page_size_bytes if kind == "kv"
            else KDASpec.for_model(cfg).page_size_bytes)
    return max(1, peak_bytes // unit)


def table(rows: list[dict]) -> str:
    """Markdown table of the sweep."""
    out = [("| device capacity | pages / slots | host GiB | eviction | oracle fraction | prefill s saved | "
            "host hit tokens | KV evictions | checkpoint evictions | host evictions |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {100 * r['fraction']:g}% | {r['pages']:,} / {r['slots']:,} | "
                   f"{r.get('host_bytes', 0) / 2**30:.2f} | {r['policy']} | "
                   f"{100 * r['oracle_fraction']:.2f}% | {r['saved_seconds']:,.0f} | "
                   f"{r.get('host_hit_tokens', 0):,} | {r['kv_evictions']:,} | "
                   f"{r['checkpoint_evictions']:,} | {r.get('host_evictions', 0):,} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str = "bundled trace, simulate") -> None:
    """Oracle fraction vs device capacity, one line per eviction order (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in ORDERS:
        pts = [(100 * r["fraction"], 100 * r["oracle_fraction"]) for r in rows if r["policy"] == policy]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("device KV + checkpoint capacity, % of nothing-evicted peak")
    ax.set_ylabel("% of every-unit oracle reused")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    p.add_argument("--trace", help="trace file (default: the bundled trace), e.g. benchmarks/traces/synthetic_trace.jsonl")
    p.add_argument("--limit", type=int, default=None, help="first N requests (default: the whole trace)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--png", help="write the plot here")
    p.add_argument("--host-factor", type=float, default=2.0,
                   help="host tier bytes as a multiple of the device capacity's bytes (default 2; 0: none)")
    args = p.parse_args()
    if args.host_factor < 0:
        p.error(f"--host-factor {args.host_factor} must be 0 or more")
    console = Console(stderr=True)
    rows = sweep(args.fractions, args.limit, console, args.host_factor, args.trace)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.png:
        host = f"host tier at {args.host_factor:g}x the device" if args.host_factor else "no host tier"
        trace = f"{args.trace.rsplit('/', 1)[-1]}" if args.trace else "bundled trace"
        plot(rows, args.png, f"{trace}, simulate, {host}")


if __name__ == "__main__":
    main()
