"""Every router on the bundled trace in timed simulation (issue 9 item 6).

For 8 and 32 instances and the trace's own arrival rate, 2x and 4x it (time scale 1, 0.5,
0.25), each router's TTFT p50 / p99, load skew (max / mean busy seconds), fraction of the
oracle reused, bytes loaded from the simulated shared store and the least busy instance's
share (``load_min_share``: min / mean busy seconds), plus a lower bound on TTFT per column
(:func:`idle_oracle_ttft`: oracle reuse on an idle instance). Writes
``OUT.json`` (every run's figures, rewritten as each run ends), ``OUT_bound.json`` (the bound) and
``OUT.png`` (TTFT CDF per router, one panel per fleet size and rate), and prints a markdown table
(the one docs/results/routing.md shows; no ``.md`` file is written, since every ``.md`` under
``docs/`` is a page of the documentation site).

Run by hand:  PYTHONPATH=src .venv/bin/python benchmarks/bench_routers.py [--out docs/results/routing] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console

import numpy as np

from hybridkv.fleet.costmodel import StepCostModel, cost_model, h200_kimi_linear_48b
from hybridkv.fleet.routers import ROUTER_NAMES, HybridOptions
from hybridkv.replay.oracle import oracle_from_trace
from hybridkv.replay.runner import ReplayOptions, run_replay
from hybridkv.replay.trace import load_trace

SIZES = (8, 32)
RATES = (1, 2, 4)
DEFAULT_ROUTERS = ("round-robin", "least-load", "prefix", "kv-overlap", "hybrid")
"""The issue's routers (``--routers`` may name the extra ``prefix-smg`` too)."""


def idle_oracle_ttft(prompt_lengths: list[int], reused: list[int], cost: StepCostModel,
                     chunk_tokens: int) -> list[float]:
    """Per request, a lower bound on its TTFT in seconds: prefill of tokens
    ``[reused[i], prompt_lengths[i])`` alone on an idle instance, in chunks of at most
    ``chunk_tokens`` (the engine's ``max_num_batched_tokens``), each chunk one step priced by
    ``cost.step_seconds([(start, n)])`` (overhead plus roofline; no decoders, no other request).

    With ``reused`` the oracle's reuse (the longest prefix any earlier request left, never
    evicted), no router can do better: it ignores queueing, decode batches sharing a step, store
    transfer time and any eviction. A fully reused prompt still computes its last token (the
    oracle caps reuse at ``T - 1``). Raises ``ValueError`` if the lists differ in length, a
    reuse is outside ``[0, length)`` or ``chunk_tokens < 1``.
    """
    if len(prompt_lengths) != len(reused):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths but {len(reused)} reuse counts")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    out = []
    for length, hit in zip(prompt_lengths, reused):
        if not 0 <= hit < length:
            raise ValueError(f"reuse {hit} outside [0, {length}) for a {length}-token prompt")
        t, start = 0.0, hit
        while start < length:
            n = min(chunk_tokens, length - start)
            t += cost.step_seconds([(start, n)])
            start += n
        out.append(t)
    return out


def bound_row(limit: int | None, cost_name: str | None) -> dict:
    """:func:`idle_oracle_ttft` over the trace as the replay sees it (512 tokens per hash id, the
    oracle at the engine's 64-token match unit, 8,192-token chunks): ``{"p50", "p99", "mean"}``
    in seconds. The same in every column: it depends on neither fleet size nor rate."""
    opts = ReplayOptions(limit=limit, simulate=True)
    reqs = load_trace(opts.trace, limit=limit).requests
    oracle = oracle_from_trace(reqs, 512, opts.prefix_match_unit)
    cost = cost_model(cost_name) if cost_name else h200_kimi_linear_48b()
    t = idle_oracle_ttft(list(oracle.prompt_lengths), list(oracle.per_request), cost, opts.max_num_batched_tokens)
    return {"p50": float(np.percentile(t, 50)), "p99": float(np.percentile(t, 99)), "mean": float(np.mean(t)),
            "requests": len(t)}


def run_one(job: tuple) -> dict:
    """One timed simulation: ``(instances, rate multiplier, router, limit, cost model, store GiB
    [, trace path, hybrid options dict])`` -> figures (store GiB ``None``: the replay's default
    capacity; trace ``None``: the bundled trace; options: :class:`HybridOptions` fields, for
    ``hybrid`` only)."""
    n, rate, router, limit, cost, store_gib = job[:6]
    trace = job[6] if len(job) > 6 else None
    hopts = job[7] if len(job) > 7 else {}
    t0 = time.perf_counter()
    rep = run_replay(ReplayOptions(trace=trace, limit=limit, model="kimi-linear-48b-a3b", simulate=True, timed=True,
                                   instances=n, router=router, time_scale=1.0 / rate, cost_model=cost,
                                   store_gib=store_gib, hybrid=HybridOptions(**(hopts or {})), progress=False),
                     Console(quiet=True))
    wall = time.perf_counter() - t0
    return {"instances": n, "rate": rate, "router": router, "requests": rep.requests,
            "trace": trace, "limit": limit, "hybrid_options": hopts or {},
            "ttft": rep.ttft_seconds, "ttft_cdf": rep.ttft_cdf_seconds, "queue": rep.queue_seconds,
            "load_skew": rep.load_skew, "load_min_share": _min_share(rep.instances),
            "oracle_fraction": rep.oracle_fraction,
            "store_bytes": rep.tiers["store"]["bytes_loaded"] if rep.tiers else 0,
            "store_capacity_bytes": rep.store.get("capacity_bytes"), "store_peak_bytes": rep.store.get("bytes_peak"),
            "store_evicted_bytes": rep.store.get("evicted_bytes"),
            "cost_model": rep.cost_model, "wall_seconds": round(wall, 2),
            "requests_per_second": round(rep.requests / wall, 1)}


def _min_share(instances: list[dict] | None) -> float | None:
    """Least busy instance's busy seconds over the mean (``None``: no per-instance figures)."""
    busy = [i["busy_seconds"] for i in instances or []]
    mean = sum(busy) / len(busy) if busy else 0.0
    return min(busy) / mean if mean > 0 else None


def table(rows: list[dict], bound: dict | None = None) -> str:
    """Markdown table; the best TTFT p50 / p99 of each (instances, rate) in bold (the bound row
    is not a router and is left out of the comparison)."""
    lines = [("| instances | rate | router | TTFT p50 (s) | TTFT p99 (s) | TTFT mean (s) | load skew (max / mean) | "
              "least busy / mean | oracle fraction | store GB loaded | sim wall (s) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["instances"] for r in rows}):
        for rate in sorted({r["rate"] for r in rows}):
            group = [r for r in rows if r["instances"] == n and r["rate"] == rate]
            if not group:
                continue
            best = {q: min(round(r["ttft"][q], 3) for r in group) for q in ("p50", "p99", "mean")}
            for r in group:
                cell = {q: (f"**{r['ttft'][q]:.3f}**" if round(r["ttft"][q], 3) == best[q] else f"{r['ttft'][q]:.3f}")
                        for q in best}
                share = r.get("load_min_share")
                lines.append(f"| {n} | {rate}x | {r['router']} | {cell['p50']} | {cell['p99']} | {cell['mean']} | "
                             f"{r['load_skew']:.2f} | {'-' if share is None else f'{share:.2f}'} | "
                             f"{r['oracle_fraction']:.3f} | {r['store_bytes'] / 1e9:.1f} | {r['wall_seconds']:.0f} |")
            if bound:
                lines.append(f"| {n} | {rate}x | bound (idle, oracle reuse) | {bound['p50']:.3f} | {bound['p99']:.3f} | "
                             f"{bound['mean']:.3f} | - | - | 1.000 | 0.0 | - |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """TTFT CDF per router, one panel per (instances, rate); rows without ``ttft_cdf`` are left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes, rates = sorted({r["instances"] for r in rows}), sorted({r["rate"] for r in rows})
    fig, axes = plt.subplots(len(sizes), len(rates), figsize=(4.2 * len(rates), 3.4 * len(sizes)), squeeze=False)
    for i, n in enumerate(sizes):
        for k, rate in enumerate(rates):
            ax = axes[i][k]
            for r in (r for r in rows if r["instances"] == n and r["rate"] == rate and r.get("ttft_cdf")):
                ps, xs = zip(*r["ttft_cdf"])
                ax.plot([max(x, 1e-3) for x in xs], [p / 100 for p in ps], label=r["router"],
                        color=f"C{ROUTER_NAMES.index(r['router'])}")     # one colour per router in every panel
            ax.set_xscale("log")
            ax.set_title(f"{n} instances, {rate}x trace rate", fontsize=9)
            ax.set_xlabel("TTFT (s)")
            ax.set_ylabel("fraction of requests")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


SYNTH_KINDS = ("tenants", "agentic", "documents", "hotset")
DEV_SEEDS = (1, 2)
"""Seeds of the synthesised traces the hybrid router's defaults were chosen on (the development set)."""
HELD_OUT_SEEDS = (3,)
"""Seeds of the synthesised traces held out (reported on, never tuned on)."""
FRESH_SEEDS = (4, 5)
"""Seeds of a second held-out set, first run after the defaults were chosen on the development set
(the first held-out set had been looked at by then)."""
SYNTH_REQUESTS = 1000
"""Requests per synthesised trace (at the generator's default 4 requests per second)."""
TRACE_LIMIT = 2000
"""First requests of the two recorded traces in the generalisation grid (one run well under a minute)."""
ALL_ROUTERS = DEFAULT_ROUTERS + ("prefix-smg",)


def trace_set(name: str, trace_dir: Path) -> dict[str, tuple[str | None, int | None]]:
    """``{trace name: (path, limit)}`` of a named set: ``dev`` (the four synthesised workloads at
    :data:`DEV_SEEDS`), ``held-out`` (the bundled trace, ``benchmarks/traces/synthetic_trace.jsonl``,
    each cut to :data:`TRACE_LIMIT` requests, and the four workloads at :data:`HELD_OUT_SEEDS`),
    ``fresh`` (the four workloads at :data:`FRESH_SEEDS`). Synthesised traces (:data:`SYNTH_REQUESTS` requests, ``hybridkv trace synth``'s defaults) are
    written under ``trace_dir`` once. Raises ``ValueError`` for another name."""
    from hybridkv.replay.synth import synth_requests, write_lines

    if name not in ("dev", "held-out", "fresh"):
        raise ValueError(f"trace set {name!r} is not one of dev, held-out, fresh")
    out: dict[str, tuple[str | None, int | None]] = {}
    if name == "held-out":
        out["bundled"] = (None, TRACE_LIMIT)
        out["synthetic_trace"] = (str(Path(__file__).parent / "traces" / "synthetic_trace.jsonl"), TRACE_LIMIT)
    trace_dir.mkdir(parents=True, exist_ok=True)
    for seed in {"dev": DEV_SEEDS, "held-out": HELD_OUT_SEEDS, "fresh": FRESH_SEEDS}[name]:
        for kind in SYNTH_KINDS:
            path = trace_dir / f"{kind}_s{seed}_{SYNTH_REQUESTS}.jsonl"
            if not path.exists():
                write_lines(synth_requests(kind, SYNTH_REQUESTS, seed=seed), path)
            out[f"{kind}-s{seed}"] = (str(path), None)
    return out


def _key(trace: str, n: int, rate: int, router: str, hopts: dict) -> str:
    return json.dumps([trace, n, rate, router, hopts if router == "hybrid" else {}], sort_keys=True)


def verdict(rows: list[dict], hopts: dict, tolerance: float = 0.02) -> tuple[str, int, int]:
    """Markdown table of every (trace, instances, rate): TTFT p50 / mean / p99 of each router
    (``hybrid`` with options ``hopts``), the best other router's value, and whether ``hybrid`` is
    best or within ``tolerance`` of it (``ok``) or trails (its ratio to the best other).
    Returns ``(table, cells where hybrid holds, cells in all)``, a cell being one figure of one column."""
    lines = ["| trace | instances | rate | router | TTFT p50 (s) | TTFT mean (s) | TTFT p99 (s) |",
             "|---|---|---|---|---|---|---|"]
    held = total = 0
    cols = sorted({(r["trace_name"], r["instances"], r["rate"]) for r in rows})
    for trace, n, rate in cols:
        group = {r["router"]: r for r in rows if (r["trace_name"], r["instances"], r["rate"]) == (trace, n, rate)
                 and (r["router"] != "hybrid" or r.get("hybrid_options", {}) == hopts)}
        if "hybrid" not in group or len(group) < 2:
            continue
        others = {k: v for k, v in group.items() if k != "hybrid"}
        marks = {}
        for q in ("p50", "mean", "p99"):
            best = min(v["ttft"][q] for v in others.values())
            h = group["hybrid"]["ttft"][q]
            ok = h <= best * (1 + tolerance) + 1e-4        # 0.1 ms: the table's resolution
            held += ok
            total += 1
            marks[q] = "ok" if ok else f"TRAILS x{h / best:.3f}"
        for name in ALL_ROUTERS:
            if name not in group:
                continue
            t = group[name]["ttft"]
            cell = [f"{t[q]:.3f}" + (f" ({marks[q]})" if name == "hybrid" else "") for q in ("p50", "mean", "p99")]
            lines.append(f"| {trace} | {n} | {rate}x | {name} | " + " | ".join(cell) + " |")
    return "\n".join(lines) + "\n", held, total


def compact_table(rows: list[dict], options: list[dict]) -> str:
    """One markdown row per (trace, instances, rate): TTFT p50 / mean / p99 (s) of each other
    router, then of ``hybrid`` with each of ``options``, ``*`` after a figure where that hybrid
    trails the best other router by more than 2% (:func:`verdict`'s rule); columns without every
    router are left out."""
    others = [r for r in ALL_ROUTERS if r != "hybrid"]
    head = others + [f"hybrid {json.dumps(o) if o else '(default)'}" for o in options]
    lines = ["| trace | n | rate | " + " | ".join(head) + " |", "|---|---|---|" + "---|" * len(head)]
    for trace, n, rate in sorted({(r["trace_name"], r["instances"], r["rate"]) for r in rows}):
        col = [r for r in rows if (r["trace_name"], r["instances"], r["rate"]) == (trace, n, rate)]
        by = {r["router"]: r for r in col if r["router"] != "hybrid"}
        hy = [next((r for r in col if r["router"] == "hybrid" and r.get("hybrid_options", {}) == o), None)
              for o in options]
        if len(by) < len(others) or None in hy:
            continue
        best = {q: min(by[k]["ttft"][q] for k in others) for q in ("p50", "mean", "p99")}
        cells = [" / ".join(f"{by[k]['ttft'][q]:.3f}" for q in best) for k in others]
        cells += [" / ".join(f"{h['ttft'][q]:.3f}" + ("*" if h["ttft"][q] > best[q] * 1.02 + 1e-4 else "")
                             for q in best) for h in hy]
        lines.append(f"| {trace} | {n} | {rate}x | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main_general(args) -> None:
    """The generalisation grid: every trace of ``--traces`` x ``--sizes`` x ``--rates`` x every
    router, results cached in ``--cache`` (a run already there is not repeated), then the
    :func:`verdict` table of ``hybrid`` with ``--hybrid-options``."""
    hopts = json.loads(args.hybrid_options)
    HybridOptions(**hopts)                              # a bad option fails before any run
    traces: dict[str, tuple[str | None, int | None]] = {}
    for name in args.traces.split(","):
        traces.update(trace_set(name, Path(args.trace_dir)))
    sizes = tuple(int(s) for s in args.sizes.split(","))
    rates = tuple(int(r) for r in args.rates.split(","))
    cache = Path(args.cache)
    rows = json.loads(cache.read_text()) if cache.exists() else []
    have = {_key(r["trace_name"], r["instances"], r["rate"], r["router"], r.get("hybrid_options", {})) for r in rows}
    routers = args.routers.split(",")
    jobs, names = [], []
    for tname, (path, limit) in traces.items():
        for n in sizes:
            for rate in rates:
                for router in routers:
                    o = hopts if router == "hybrid" else {}
                    if _key(tname, n, rate, router, o) not in have:
                        jobs.append((n, rate, router, limit, args.cost_model, args.store_gib, path, o))
                        names.append(tname)
    print(json.dumps({"runs": len(jobs), "cached": len(rows)}), flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for tname, row in zip(names, pool.map(run_one, jobs)):
            row["trace_name"] = tname
            row.pop("ttft_cdf", None)
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("trace_name", "instances", "rate", "router", "ttft", "wall_seconds")}),
                  flush=True)
            cache.write_text(json.dumps(rows, indent=1) + "\n")
    mine = [r for r in rows if r["trace_name"] in traces and r["instances"] in sizes and r["rate"] in rates]
    text, held, total = verdict(mine, hopts)
    print(text if not args.compact else compact_table(mine, [json.loads(o) for o in args.compact.split(";")]))
    print(f"hybrid {json.dumps(hopts)}: best or within 2% in {held} of {total} cells")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=None,
                    help="generalisation grid over trace sets, comma-separated: dev (synthesised, seeds 1-2), "
                         "held-out (bundled, synthetic_trace.jsonl, synthesised seed 3), fresh (synthesised, "
                         "seeds 4-5); every router, "
                         "results cached in --cache, the hybrid verdict table printed")
    ap.add_argument("--cache", default="benchmarks/results/routing_general.json",
                    help="--traces: JSON of every run, read first and extended")
    ap.add_argument("--trace-dir", default="/tmp/hybridkv-synth-traces", help="--traces: where synthesised traces go")
    ap.add_argument("--hybrid-options", default="{}", help="--traces: HybridOptions fields as JSON for hybrid")
    ap.add_argument("--compact", default=None,
                    help="--traces: print one row per column instead, hybrid with each of these option sets "
                         "(JSON, ';'-separated; {} the default)")
    ap.add_argument("--out", default="docs/results/routing", help="prefix of the .json, _bound.json and .png written")
    ap.add_argument("--limit", type=int, default=None, help="first N requests (default: the whole trace)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each takes one core)")
    ap.add_argument("--cost-model", default=None, help="as replay --cost-model (default: the H200 model)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="instance counts, comma-separated")
    ap.add_argument("--rates", default=",".join(map(str, RATES)), help="rate multipliers, comma-separated")
    ap.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), help="routers, comma-separated")
    ap.add_argument("--store-gib", type=float, default=None,
                    help="simulated store capacity in GiB (default: the replay's, 0: unlimited)")
    ap.add_argument("--replot", action="store_true", help="only print the table and rewrite OUT.png from OUT.json")
    args = ap.parse_args()
    if args.traces:
        if args.routers == ",".join(DEFAULT_ROUTERS):
            args.routers = ",".join(ALL_ROUTERS)
        main_general(args)
        return
    sizes = tuple(int(s) for s in args.sizes.split(","))
    rates = tuple(int(r) for r in args.rates.split(","))
    unknown = set(args.routers.split(",")) - set(ROUTER_NAMES)
    if unknown:
        ap.error(f"unknown router(s) {', '.join(sorted(unknown))}; choose from {', '.join(ROUTER_NAMES)}")
    jobs = [(n, rate, router, args.limit, args.cost_model, args.store_gib)
            for n in sizes for rate in rates for router in args.routers.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bound = bound_row(args.limit, args.cost_model)
    print(json.dumps({"bound": bound}), flush=True)
    out.with_name(out.name + "_bound.json").write_text(json.dumps(bound, indent=1) + "\n")
    if args.replot:                                    # table and plot from an earlier run's JSON
        rows = json.loads(out.with_suffix(".json").read_text())
    else:
        rows = []
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for row in pool.map(run_one, jobs):
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "ttft_cdf"}), flush=True)
                out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")   # as runs end
    plot(rows, out.with_suffix(".png"))
    print(table(rows, bound))


if __name__ == "__main__":
    main()
