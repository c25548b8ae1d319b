"""Validate a ``hybridkv plan`` result (issue 30, item 6) on the whole trace.

1. **Seeds**: the plan's configuration re-simulated with arrival seeds 1, 2, 3 (each arrival moved
   later by a uniform draw within the trace's smallest gap between arrivals,
   :meth:`hybridkv.replay.plan.Evaluator._trace_for`) must meet the planned targets.
2. **Grid**: every configuration of a reduced space cheaper than the plan is simulated: cache
   share (``--shares``) x host tier (none, the plan's, ``--hosts``) x store (none, the plan's,
   ``--stores``) x router (``--routers``) at the plan's policy, each at the largest
   instance count that keeps it cheaper than the plan (more instances than the plan's when it
   drops the store or the host tier; fewer instances only lose, by the monotone assumption the
   bisection makes too); none may meet the targets.
3. **Tighter SLO**: with ``--tighter PLAN_JSON`` (a plan for tighter targets on the same trace
   and prices), its cost must not be below this plan's; with ``--looser PLAN_JSON``, its cost
   must not be above.

Prints a Markdown table and writes every figure to ``--out``.

Run by hand:
    PYTHONPATH=src .venv/bin/python benchmarks/bench_plan_validate.py --plan /tmp/plan.json \
        --out /tmp/plan_validate.json [--tighter /tmp/plan_tight.json] [--looser /tmp/plan_loose.json] \
        [--cache /tmp/cache.json] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from hybridkv.replay.plan import ROUTERS, SHARES, Evaluator, FleetConfig, Prices, h200_budget

TOL = 1e-3
"""Tolerance of cost comparisons (USD/h; the plan JSON rounds costs to 1e-4)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="JSON written by hybridkv plan --json")
    p.add_argument("--out", required=True)
    p.add_argument("--tighter", default=None, help="JSON of a plan for tighter targets")
    p.add_argument("--looser", default=None, help="JSON of a plan for looser targets")
    p.add_argument("--jobs", type=int, default=2, help="simulations at once (forked workers)")
    p.add_argument("--cache", default=None, help="the planner's cache file (simulations reused)")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--cached-only", action="store_true",
                   help="report only what the cache holds (a check not yet simulated is listed as not run)")
    p.add_argument("--routers", default=",".join(ROUTERS), help="routers of the grid (default the planner's)")
    p.add_argument("--shares", default=",".join(f"{x:g}" for x in SHARES), help="cache shares of the grid")
    p.add_argument("--stores", default="256@1.1",
                   help="stores GIB@GBPS of the grid besides none and the plan's (default 256@1.1)")
    p.add_argument("--hosts", default="64",
                   help="host tiers (GiB) of the grid besides none and the plan's (default 64)")
    args = p.parse_args(argv)
    data = json.loads(Path(args.plan).read_text())
    if data["plan"] is None:
        print(f"{args.plan}: no plan to validate", file=sys.stderr)
        return 2
    slo = data["planned_slo"]
    prices = Prices(**data["prices"])
    ev = Evaluator(None if data["trace"] == "bundled" else data["trace"], data["model"], slo, prices,
                   h200_budget(data["model"], data["max_num_seqs"]), data["max_num_seqs"], data["time_scale"],
                   args.cache, log=lambda line: print(line, file=sys.stderr), limit=data["requests"], jobs=args.jobs)
    plan_cfg = FleetConfig(**data["plan"]["config"])
    plan_cost = plan_cfg.cost_per_hour(prices)
    rows, t0 = [], time.perf_counter()

    seeds = [int(x) for x in args.seeds.split(",") if x]
    checks = [(f"plan, arrival seed {seed}", plan_cfg, seed) for seed in seeds]
    stores = list(dict.fromkeys([(0.0, 0.0), (plan_cfg.store_gib, plan_cfg.store_gbps) if plan_cfg.store_gbps > 0
                                 else (0.0, 0.0)] + [tuple(float(v) for v in x.split("@")) for x in
                                                     args.stores.split(",") if x]))
    hosts = list(dict.fromkeys([0.0, plan_cfg.host_gib] + [float(x) for x in args.hosts.split(",") if x]))
    for share in (float(x) for x in args.shares.split(",") if x):
        for host in hosts:
            for gib, gbps in stores:
                for router in args.routers.split(","):
                    base = FleetConfig(1, share, gib, gbps, plan_cfg.policy, router, host)
                    n = int(plan_cost // prices.gpu_hour) + 1 if prices.gpu_hour > 0 else plan_cfg.instances
                    while n >= 1 and FleetConfig(n, share, gib, gbps, plan_cfg.policy, router, host).cost_per_hour(
                            prices) >= plan_cost - TOL:
                        n -= 1
                    if n >= 1:
                        checks.append(("grid: cheaper than the plan", FleetConfig(
                            n, base.cache_share, gib, gbps, base.policy, router, host), 0))
    try:
        todo = [(c, None, seed) for _, c, seed in checks
                if not args.cached_only or ev.key(c, ev.total, seed) in ev.cache]
        done = {(o.config, o.seed): o for o in ev.evaluate_many(todo)}
    finally:
        ev.close()
    for check, cfg, seed in checks:
        o = done.get((cfg, seed))
        if o is None:
            rows.append({"check": check, "config": cfg.label(), "not_run": True})
            continue
        grid = check.startswith("grid")
        rows.append({"check": check, "config": cfg.label(), "cost_per_hour": o.cost_per_hour,
                     "ttft_p99": o.stats["ttft_p99"], "meets": o.meets, "ok": (not o.meets) if grid else o.meets})
    for other, word in ((args.tighter, "tighter"), (args.looser, "looser")):
        if not other:
            continue
        other_plan = json.loads(Path(other).read_text())
        t = other_plan["plan"]
        cost = t["cost_per_hour"] if t else math.inf
        # a tighter target never costs less; a looser one never costs more (within TOL)
        ok = cost >= plan_cost - TOL if word == "tighter" else (bool(t) and cost <= plan_cost + TOL)
        rows.append({"check": f"{word} targets {other_plan['planned_slo']}",
                     "config": FleetConfig(**t["config"]).label() if t else "no plan",
                     "cost_per_hour": cost, "ttft_p99": t["stats"]["ttft_p99"] if t else None,
                     "meets": bool(t and t["meets"]), "ok": ok})
    out = {"plan": args.plan, "planned_slo": slo, "plan_cost_per_hour": plan_cost, "rows": rows,
           "all_ok": all(r.get("ok", False) for r in rows), "not_run": sum(r.get("not_run", False) for r in rows), "wall_seconds": round(time.perf_counter() - t0, 1),
           "simulations": ev.runs, "cache_hits": ev.hits}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print("| check | configuration | USD/h | TTFT p99 (s) | meets | as required |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r.get("not_run"):
            print(f"| {r['check']} | {r['config']} | - | - | not run | - |")
            continue
        p99 = "-" if r["ttft_p99"] is None else f"{r['ttft_p99']:.3f}"
        print(f"| {r['check']} | {r['config']} | {r['cost_per_hour']:.2f} | {p99} | "
              f"{'yes' if r['meets'] else 'no'} | {'yes' if r['ok'] else '**no**'} |")
    print(f"\nall as required: {out['all_ok']}; {out['not_run']} not run; {ev.runs} simulations, {ev.hits} cached, "
          f"{out['wall_seconds']} s")
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
