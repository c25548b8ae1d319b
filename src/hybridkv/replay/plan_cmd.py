"""``hybridkv plan``: the cheapest fleet that meets service-level targets on a trace
(:mod:`hybridkv.replay.plan`), printed as a table, plotted, and written as JSON."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hybridkv.replay.plan import (
    DEFAULT_GPU_HOUR_USD,
    DEFAULT_HOST_GB_MONTH_USD,
    DEFAULT_STORE_GB_MONTH_USD,
    DEFAULT_STORE_GBPS_MONTH_USD,
    HOSTS,
    MAX_INSTANCES,
    ROUTERS,
    SHARES,
    STORES,
    Evaluator,
    PlanError,
    PlanResult,
    Prices,
    cache_problem,
    deploy_commands,
    h200_budget,
    parse_slo_option,
    candidates,
    default_policies,
    plan,
)
from hybridkv.replay.args import max_num_seqs, positive_int, time_scale, unwritable


def _price(text: str) -> float:
    """A price in USD: a finite number >= 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (x >= 0 and x != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite price >= 0 (USD)")
    return x


def _list(kind: str, one):
    """An argparse type: a comma-separated list of ``kind`` values, each read by ``one`` (which
    raises ``ValueError`` naming the value), none given twice."""
    def parse(text: str) -> tuple:
        items = [t.strip() for t in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"{text!r}: an empty {kind} in the list")
        try:
            out = tuple(one(t) for t in items)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if len(set(out)) != len(out):
            raise argparse.ArgumentTypeError(f"{text!r}: a {kind} is given twice")
        return out
    return parse


def _share(t: str) -> float:
    x = _number(t, "cache share")
    if not 0 < x < 1:
        raise ValueError(f"cache share {t!r} must be in (0, 1)")
    return x


def _host(t: str) -> float:
    if t == "none":                            # as --stores spells "no tier"
        return 0.0
    x = _number(t, "host tier size")
    if not 0 <= x <= MAX_HOST_GIB:
        raise ValueError(f"host tier size {t!r} must be GiB in [0, {MAX_HOST_GIB:g}]")
    return x


def _store(t: str) -> tuple[float, float]:
    if t == "none":
        return (0.0, 0.0)
    gib, sep, gbps = t.partition("@")
    if not sep:
        raise ValueError(f"store {t!r} is not GIB@GBPS (e.g. 256@1.1) or none")
    g, b = _number(gib, "store size"), _number(gbps, "store bandwidth")
    if not (0 < g <= MAX_STORE_GIB and 0 < b <= MAX_STORE_GBPS):
        raise ValueError(f"store {t!r}: size must be GiB in (0, {MAX_STORE_GIB:g}], bandwidth GB/s in "
                         f"(0, {MAX_STORE_GBPS:g}]")
    return (g, b)


def _router(t: str) -> str:
    from hybridkv.fleet.routers import ROUTER_NAMES as KNOWN
    if t not in KNOWN:
        raise ValueError(f"router {t!r} is not one of {', '.join(KNOWN)}")
    return t


def _number(t: str, what: str) -> float:
    try:
        x = float(t)
    except ValueError:
        raise ValueError(f"{what} {t!r} is not a number") from None
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"{what} {t!r} is not a finite number")
    return x


MAX_HOST_GIB = 65536.0
"""Largest host tier per instance accepted (GiB)."""
MAX_STORE_GIB = 1 << 20
"""Largest store accepted (GiB)."""
MAX_STORE_GBPS = 1000.0
"""Largest store bandwidth accepted (GB/s)."""


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand's options."""
    p = sub.add_parser("plan", help="the cheapest fleet that meets latency targets on a trace (simulated)",
                       description="Search instances, device cache share (checkpoint slots against KV pages), "
                                   "host tier size, store size and bandwidth, checkpoint "
                                   "policy and router on the timed fleet simulator and print the cheapest "
                                   "configuration that meets every target, the Pareto front (cost, TTFT p99, "
                                   "goodput), why the next cheaper point fails, and the commands that deploy it.")
    p.add_argument("--trace", default=None, help="Mooncake-format trace (default: the bundled conversation trace)")
    p.add_argument("--model", default="kimi-linear-48b-a3b",
                   help="model preset (default kimi-linear-48b-a3b, priced by the h200-kimi-linear-48b cost model)")
    p.add_argument("--slo", required=True, metavar="KEY=SECONDS[,...]",
                   help="targets every plan meets: ttft_, e2e_ or queue_ with mean, p50, p90 or p99, e.g. "
                        "ttft_p99=2.0,ttft_p50=0.5")
    p.add_argument("--gpu-hour-usd", type=_price, default=DEFAULT_GPU_HOUR_USD,
                   help=f"price of one H200-hour (default {DEFAULT_GPU_HOUR_USD:g}, an assumption; see "
                        "docs/how-to/plan-a-fleet.md)")
    p.add_argument("--host-gb-month-usd", type=_price, default=DEFAULT_HOST_GB_MONTH_USD,
                   help=f"price of one GiB-month of host memory (default {DEFAULT_HOST_GB_MONTH_USD:g}, from AWS "
                        "r7i/c7i list prices)")
    p.add_argument("--store-gb-month-usd", type=_price, default=DEFAULT_STORE_GB_MONTH_USD,
                   help=f"price of one GiB-month of shared store (default {DEFAULT_STORE_GB_MONTH_USD:g}, DRAM)")
    p.add_argument("--store-gbps-month-usd", type=_price, default=DEFAULT_STORE_GBPS_MONTH_USD,
                   help=f"price of one GB/s of store bandwidth for a month (default {DEFAULT_STORE_GBPS_MONTH_USD:g}, "
                        "an assumption)")
    p.add_argument("--max-instances", type=positive_int, default=MAX_INSTANCES,
                   help=f"most instances tried (default {MAX_INSTANCES})")
    p.add_argument("--max-num-seqs", type=max_num_seqs, default=4,
                   help="requests running at once per instance, as replay's (default 4)")
    p.add_argument("--time-scale", type=time_scale, default=1.0,
                   help="multiply the trace's arrival times by this (default 1; 0.5: twice the rate)")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="plan on the first N requests only (default: the whole trace)")
    p.add_argument("--shares", type=_list("cache share", _share), default=SHARES, metavar="X[,X...]",
                   help="device cache shares searched, the first the baseline's (default "
                        f"{','.join(f'{x:g}' for x in SHARES)})")
    p.add_argument("--hosts", type=_list("host tier size", _host), default=HOSTS, metavar="GIB|none[,...]",
                   help="host tier sizes per instance searched, GiB, 0 or none for no host tier, the first the baseline's (default "
                        f"{','.join(f'{x:g}' for x in HOSTS)})")
    p.add_argument("--stores", type=_list("store", _store), default=STORES, metavar="GIB@GBPS|none[,...]",
                   help="shared stores searched, the first the baseline's (default "
                        + ",".join("none" if b <= 0 else f"{g:g}@{b:g}" for g, b in STORES) + ")")
    p.add_argument("--routers", type=_list("router", _router), default=ROUTERS, metavar="NAME[,NAME...]",
                   help=f"routers searched, the first the baseline's (default {','.join(ROUTERS)})")
    p.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="simulations run at once, one process and core each (default: 2, or 1 on a one-core "
                        "machine)")
    p.add_argument("--cache", default=None, metavar="FILE",
                   help="JSON file of simulation results to reuse and extend (default: memory only)")
    p.add_argument("--json", default=None, metavar="FILE", help="write everything found to this JSON file")
    p.add_argument("--png", default=None, metavar="FILE", help="plot the Pareto front to this PNG file")
    p.set_defaults(plan_func=cmd_plan)


def _row(o) -> list[str]:
    c = o.config
    store = "-" if c.store_gbps <= 0 else f"{c.store_gib:g} GiB @ {c.store_gbps:g}"
    g = "-" if o.goodput is None else f"{o.goodput:.3f}"
    host = "-" if c.host_gib <= 0 else f"{c.host_gib:g}"
    return [f"{o.cost_per_hour:.2f}", str(c.instances), f"{c.cache_share:g}", host, store, c.policy, c.router,
            f"{o.stats['ttft_p50']:.3f}", f"{o.stats['ttft_p99']:.3f}", g, "yes" if o.meets else "no"]


HEADER = ["USD/h", "instances", "cache share", "host (GiB each)", "store (GiB @ GB/s)", "policy", "router",
          "TTFT p50 (s)", "TTFT p99 (s)", "goodput (req/s)", "meets"]
"""Columns of the Pareto table."""


def render(result: PlanResult, commands: list[list[str]], console: Console, wall: float, cpu: float,
           scope: str = "whole trace") -> None:
    """Print the plan, the Pareto front, why the next cheaper point fails, and the deploy commands;
    ``scope`` names what the front was simulated on (``whole trace`` or ``first N requests``)."""
    t = Table(title=f"Pareto front ({scope}): cost, TTFT p99, goodput", header_style="bold")
    for h in HEADER:
        t.add_column(h, overflow="fold")
    for o in result.front:
        t.add_row(*_row(o), style="bold green" if o is result.plan else None)
    console.print(t)
    if result.relaxed:
        console.print("[bold red]the targets asked for cannot be met[/bold red]; the plan below meets "
                      f"{', '.join(f'{k} <= {v:g} s' for k, v in result.planned_slo.items())}", highlight=False)
    if result.plan is not None:
        console.print(f"[bold]plan:[/bold] {result.plan.config.label()}: {result.plan.cost_per_hour:.2f} USD/h, "
                      f"TTFT p99 {result.plan.stats['ttft_p99']:.3f} s", highlight=False)
    else:
        console.print("[bold red]no plan:[/bold red] no configuration met every target", highlight=False)
    for line in result.why:
        console.print(f"why: {line}", highlight=False)
    if result.resolution:
        console.print(f"resolution: {result.resolution}", highlight=False)
    console.print(f"{result.runs} simulations run, {result.cache_hits} answered by the cache, {wall:.1f} s wall, "
                  f"{cpu:.1f} s CPU (this process and its simulation workers)", highlight=False)
    if commands:
        console.print("[bold]deploy:[/bold]")
        for line in deploy_lines(commands):
            console.print("  " + line, highlight=False, soft_wrap=True)


def deploy_lines(commands: list[list[str]]) -> list[str]:
    """The deploy commands as printed, each once: all of them when there are at most three, else the
    first two, ``...`` and the last (the router)."""
    lines = [shlex.join(c) for c in commands]
    return lines if len(lines) <= 3 else lines[:2] + ["..."] + lines[-1:]


def png_problem(path: str) -> str | None:
    """Why the plot cannot be saved as ``path`` (an unwritable path, or a file name ending that names
    no image format matplotlib writes), or ``None``; a name with no ending is written as PNG."""
    problem = unwritable(path)
    if problem:
        return problem
    fmt = Path(path).suffix[1:].lower()
    if fmt:
        from matplotlib.backend_bases import FigureCanvasBase
        known = FigureCanvasBase.get_supported_filetypes()
        if fmt not in known:
            return f"format {fmt!r} is not an image format written ({', '.join(sorted(known))})"
    return None


def plot(result: PlanResult, path: str) -> None:
    """Every whole-trace outcome (cost against TTFT p99, colour by goodput), the front joined, the
    plan starred, the p99 target planned (and the one asked, when out of reach) and the prefill bound."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = {o.config: o for o in result_points(result)}.values()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sc = ax.scatter([o.cost_per_hour for o in pts], [o.stats["ttft_p99"] for o in pts],
                    c=[o.goodput or 0.0 for o in pts], cmap="viridis", s=28)
    fig.colorbar(sc, ax=ax, label="goodput (requests/s within every target)")
    ax.plot([o.cost_per_hour for o in result.front], [o.stats["ttft_p99"] for o in result.front], "k--", lw=1,
            label="Pareto front")
    if result.plan is not None:
        ax.scatter([result.plan.cost_per_hour], [result.plan.stats["ttft_p99"]], marker="*", s=260, c="red",
                   label="plan")
    if "ttft_p99" in result.planned_slo:
        ax.axhline(result.planned_slo["ttft_p99"], color="red", lw=0.8, ls=":", label="TTFT p99 target planned")
    if result.relaxed and "ttft_p99" in result.slo:
        ax.axhline(result.slo["ttft_p99"], color="grey", lw=0.8, ls=":", label="TTFT p99 target asked (unreachable)")
    if "ttft_p99" in result.bound:
        ax.axhline(result.bound["ttft_p99"], color="black", lw=0.6, ls="-.", label="prefill bound (p99)")
    ax.set_xlabel("fleet cost (USD per hour)")
    ax.set_ylabel("TTFT p99 (s)")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def interrupted_line(ev: Evaluator | None, cache: str | None) -> str:
    """The one line printed when Ctrl-C stops ``plan``: how many simulations the cache file keeps
    (every one finished is saved as it finishes), or, with no cache file, that they are not kept."""
    if cache:
        return f"interrupted; {0 if ev is None else len(ev.cache)} simulations kept in the cache {cache}"
    return (f"interrupted; {0 if ev is None else ev.runs} simulations run, not kept (give --cache FILE to keep "
            "them)")


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its finished children (the workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


_POINTS: dict[int, list] = {}


def result_points(result: PlanResult) -> list:
    """The whole-trace outcomes behind ``result`` (set by :func:`cmd_plan`)."""
    return _POINTS.get(id(result), result.front)


def cmd_plan(args, console: Console | None = None) -> int:
    """Run ``hybridkv plan``; 0 with a plan, 1 when no configuration meets the targets (a plan for the
    nearest reachable targets may still be printed), 2 on bad input."""
    console = console or Console(stderr=True)
    out = Console(width=max(Console().width, 150))
    for flag, path, check in (("--json", args.json, unwritable), ("--png", args.png, png_problem),
                              ("--cache", args.cache, cache_problem)):
        problem = check(path) if path else None
        if problem:
            console.print(f"[red]error:[/red] {flag} {escape(path)}: {escape(problem)}", markup=True, highlight=False, soft_wrap=True)
            return 2
    if args.trace is not None and not Path(args.trace).is_file():
        why = "is a directory" if Path(args.trace).is_dir() else "no such file"
        console.print(f"[red]error:[/red] --trace {escape(args.trace)}: {why}", markup=True, highlight=False, soft_wrap=True)
        return 2
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    ev = None
    try:
        slo = parse_slo_option(args.slo)
        prices = Prices(args.gpu_hour_usd, args.host_gb_month_usd, args.store_gb_month_usd, args.store_gbps_month_usd)
        budget = h200_budget(args.model, args.max_num_seqs)
        ev = Evaluator(args.trace, args.model, slo, prices, budget, args.max_num_seqs, args.time_scale, args.cache,
                       log=lambda line: console.print(f"[dim]{escape(line)}[/dim]", highlight=False), limit=args.limit,
                       jobs=args.jobs)
        try:
            space = candidates(default_policies(), shares=args.shares, stores=args.stores, routers=args.routers,
                               hosts=args.hosts)
            result = plan(ev, max_instances=args.max_instances, space=space)
        finally:
            ev.close()
    except (PlanError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", markup=True, highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:       # Ctrl-C: the workers are gone (the pool terminated), the cache saved
        console.print(interrupted_line(ev, args.cache), markup=False, highlight=False, soft_wrap=True)
        return 130
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    whole = [o for o in ev.outcomes if o.requests == ev.total and o.seed == 0]
    _POINTS[id(result)] = whole
    commands = deploy_commands(result.plan.config, budget, args.model, args.max_num_seqs) if result.plan else []
    scope = "whole trace" if args.limit is None else f"first {ev.total:,} requests"
    render(result, commands, out, wall, cpu, scope)
    if args.png:
        plot(result, args.png)
    if args.json:
        data = {"slo": slo, "planned_slo": result.planned_slo, "prices": asdict(prices),
                "model": args.model, "trace": args.trace or "bundled", "requests": ev.total,
                "max_num_seqs": args.max_num_seqs, "time_scale": args.time_scale, "jobs": args.jobs,
                "device_pool_bytes": budget.pool_bytes,
                "plan": result.plan.as_dict() if result.plan else None,
                "best": result.best.as_dict() if result.best else None,
                "next_cheaper": result.next_cheaper.as_dict() if result.next_cheaper else None,
                "front": [o.as_dict() for o in result.front], "bound": result.bound, "why": result.why,
                "resolution": result.resolution, "unchecked": [asdict(c) for c in result.unchecked],
                "rungs": result.rungs, "runs": result.runs, "cache_hits": result.cache_hits,
                "wall_seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "commands": [shlex.join(c) for c in commands],
                "evaluated": [o.as_dict() for o in ev.outcomes]}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0 if result.plan is not None and not result.relaxed else 1
