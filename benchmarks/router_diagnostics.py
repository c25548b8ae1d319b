"""Two checks behind docs/concepts/routing.md "Emulations checked against their sources".

* ``kv-overlap``: how often Dynamo's default router queue would hold a request (every live
  instance with more than ``router_queue_threshold`` (4.0) x ``max_num_batched_tokens``
  (8,192) pending prefill tokens, :attr:`~hybridkv.fleet.routers.InstanceLoad.prefill_tokens`,
  when it arrives), and how many instances got no request.
* ``prefix``: the largest approximate tree (tokens) any instance reaches, against SGLang's
  ``max_tree_size`` of 2**26 characters per tenant.

Both wrap the router's ``route`` to read the state it decides on; the decisions are the
router's own. Run:  PYTHONPATH=src .venv/bin/python benchmarks/router_diagnostics.py 32x1 8x4

``--spread`` instead: where each router put the requests of one column of the generalisation grid
(``benchmarks/bench_routers.py --traces``): per instance the requests it served and their TTFT p50
(seconds), and the instances that served the most requested shared prefixes (a prefix being the
first ``--prefix-blocks`` hash ids of a request: the system prompt and a document's first block
for ``hybridkv trace synth --kind documents``). Run:
PYTHONPATH=src .venv/bin/python benchmarks/router_diagnostics.py --spread /tmp/documents_s3.jsonl 8x4 \
    --routers prefix-smg,hybrid

``--explain I,J`` instead: how ``hybrid`` placed those requests of one column (its candidates'
scores, the tie band, the wait and work it predicted, and the wait, reuse and TTFT that followed).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

import numpy as np
from rich.console import Console

import hybridkv.fleet.routers as routers
import hybridkv.replay.timed as timed
from hybridkv.fleet.routers import HybridOptions
from hybridkv.replay.runner import ReplayOptions, run_replay

QUEUE_THRESHOLD = 4.0 * 8192
"""Dynamo's default ``router_queue_threshold`` times the replay's ``max_num_batched_tokens``."""


def run(router: str, instances: int, rate: int):
    return run_replay(ReplayOptions(limit=None, model="kimi-linear-48b-a3b", simulate=True, timed=True,
                                    instances=instances, router=router, time_scale=1.0 / rate, progress=False),
                      Console(quiet=True))


def spread(trace: str | None, instances: int, rate: int, router: str, hybrid: dict, limit: int | None,
           prefix_blocks: int, top: int) -> dict:
    """One timed simulation (the bench's settings): TTFT p50 / mean / p99 (seconds), per instance
    ``[requests, TTFT p50]``, and for the ``top`` most requested prefixes (the first
    ``prefix_blocks`` hash ids of the trace's lines) ``[requests, {instance: requests}]``."""
    seen: dict = {}
    summary = timed.timing_summary

    def keep(frs, insts):                   # the fleet's requests, as the report summarises them
        seen["frs"] = frs
        return summary(frs, insts)

    timed.timing_summary = keep
    try:
        rep = run_replay(ReplayOptions(trace=trace, limit=limit, model="kimi-linear-48b-a3b", simulate=True,
                                       timed=True, instances=instances, router=router, time_scale=1.0 / rate,
                                       hybrid=HybridOptions(**hybrid), progress=False), Console(quiet=True))
    finally:
        timed.timing_summary = summary
    served = [fr for fr in seen["frs"] if fr.first_token is not None]
    ttft: dict[int, list[float]] = defaultdict(list)
    for fr in served:
        ttft[fr.instance].append(fr.ttft_end - fr.arrival)
    out = {"ttft": {q: rep.ttft_seconds[q] for q in ("p50", "mean", "p99")},
           "instances": {j: [len(t), round(float(np.median(t)), 3)] for j, t in sorted(ttft.items())}}
    if trace is not None:
        with open(trace) as f:
            keys = [tuple(json.loads(line)["hash_ids"][:prefix_blocks]) for line in f if line.strip()]
        where: dict[tuple, Counter] = defaultdict(Counter)
        for fr in served:
            where[keys[fr.index]][fr.instance] += 1
        ranked = sorted(where.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        out["prefixes"] = [[sum(c.values()), dict(c.most_common())] for _, c in ranked]
    return out


def explain(trace: str | None, instances: int, rate: int, hybrid: dict, limit: int | None,
            watch: set[int]) -> list[dict]:
    """One timed simulation with ``hybrid``; for each request index in ``watch`` (arrival order):
    its prompt tokens, full prefill ``p0`` and the tie band (``tie_relative * p0``), seconds; the
    candidates ``hybrid`` scored (up to 8, best first: instance, score, hit priced, the view's KV run
    and joint hit, requests in flight, predicted wait); the instance chosen with the wait and the
    work it predicted there; and what happened: the wait before its engine admitted it, tokens
    reused, TTFT."""
    seen: dict = {"frs": None, "n": 0, "rows": {}}
    summary, route = timed.timing_summary, routers.HybridRouter.route

    def keep(frs, insts):
        seen["frs"] = frs
        return summary(frs, insts)

    def watched(self, req, fleet):
        i = seen["n"]
        seen["n"] += 1
        if i not in watch:
            return route(self, req, fleet)
        sm = fleet.store.match(req.hashes, req.limit) if fleet.store is not None else None
        cands = []
        for j in fleet.live:
            score, hit = self.score(req, fleet, j, sm.hit if sm else 0, sm.restart if sm else None)
            m, ld = fleet.views[j].match(req.hashes, req.limit), fleet.loads[j]
            cands.append({"instance": j, "score": round(score, 4), "hit": hit, "view_kv_run": m.kv_hit,
                          "view_joint_hit": m.hit, "in_flight": ld.in_flight,
                          "wait": round(self.queue_seconds(ld), 4)})
        cands.sort(key=lambda c: -c["score"])
        p0 = self.predicted_prefill(req, 0)
        j = route(self, req, fleet)
        seen["rows"][i] = {"request": i, "prompt_tokens": req.prompt_tokens, "p0": round(p0, 4),
                           "tie_band": round(self.options.tie_relative * p0, 4), "candidates": cands[:8],
                           "chosen": j, "predicted_wait": next(c["wait"] for c in cands if c["instance"] == j),
                           "predicted_work": round(self._expected_s, 4)}
        return j

    timed.timing_summary, routers.HybridRouter.route = keep, watched
    try:
        run_replay(ReplayOptions(trace=trace, limit=limit, model="kimi-linear-48b-a3b", simulate=True, timed=True,
                                 instances=instances, router="hybrid", time_scale=1.0 / rate,
                                 hybrid=HybridOptions(**hybrid), progress=False), Console(quiet=True))
    finally:
        timed.timing_summary, routers.HybridRouter.route = summary, route
    out = []
    for fr in seen["frs"]:
        row = seen["rows"].get(fr.index)
        if row is not None:
            row.update(waited=round(fr.admitted - fr.arrival, 4), reused=fr.request.reused,
                       ttft=round(fr.ttft_end - fr.arrival, 4))
            out.append(row)
    return sorted(out, key=lambda r: r["request"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("columns", nargs="+", help="INSTANCESxRATE, e.g. 32x1 (with --spread: TRACE INSTANCESxRATE)")
    ap.add_argument("--spread", action="store_true",
                    help="per-instance requests and TTFT p50, and where the most requested prefixes went")
    ap.add_argument("--routers", default="prefix-smg,hybrid", help="--spread: routers, comma-separated")
    ap.add_argument("--hybrid-options", default="{}", help="--spread: HybridOptions fields as JSON for hybrid")
    ap.add_argument("--limit", type=int, default=None, help="--spread: first N requests")
    ap.add_argument("--prefix-blocks", type=int, default=3, help="--spread: hash ids that name a prefix")
    ap.add_argument("--top", type=int, default=4, help="--spread: prefixes shown")
    ap.add_argument("--explain", default=None, metavar="I,J,...",
                    help="TRACE INSTANCESxRATE: how hybrid placed these requests (indices in arrival order): "
                         "the candidates' scores, the tie band, the prediction and what happened")
    args = ap.parse_args()
    if args.explain:
        if len(args.columns) != 2:
            ap.error("--explain takes TRACE (a path, or 'bundled') and INSTANCESxRATE")
        trace = None if args.columns[0] == "bundled" else args.columns[0]
        n, rate = map(int, args.columns[1].split("x"))
        for row in explain(trace, n, rate, json.loads(args.hybrid_options), args.limit,
                           {int(i) for i in args.explain.split(",")}):
            print(json.dumps(row), flush=True)
        return
    if args.spread:
        if len(args.columns) != 2:
            ap.error("--spread takes TRACE (a path, or 'bundled') and INSTANCESxRATE")
        trace = None if args.columns[0] == "bundled" else args.columns[0]
        n, rate = map(int, args.columns[1].split("x"))
        for router in args.routers.split(","):
            hybrid = json.loads(args.hybrid_options) if router == "hybrid" else {}
            print(json.dumps({"router": router, "hybrid_options": hybrid,
                              **spread(trace, n, rate, router, hybrid, args.limit, args.prefix_blocks, args.top)}),
                  flush=True)
        return
    seen = {"routed": 0, "held": 0, "tree": 0}
    kv_route, prefix_route = routers.KVOverlapRouter.route, routers.PrefixRouter.route

    def kv(self, req, fleet):
        seen["routed"] += 1
        seen["held"] += all(fleet.loads[j].prefill_tokens > QUEUE_THRESHOLD for j in fleet.live)
        return kv_route(self, req, fleet)

    def prefix(self, req, fleet):
        j = prefix_route(self, req, fleet)
        seen["tree"] = max(seen["tree"], len(self.trees[j].kv) * self.unit)
        return j

    routers.KVOverlapRouter.route, routers.PrefixRouter.route = kv, prefix
    for column in args.columns:
        n, rate = map(int, column.split("x"))
        seen.update(routed=0, held=0, tree=0)
        rep = run("kv-overlap", n, rate)
        idle = sum(1 for i in rep.instances if i["requests"] == 0)
        print(f"{column} kv-overlap: {seen['held']} of {seen['routed']} requests arrive with every instance over "
              f"{QUEUE_THRESHOLD:.0f} pending prefill tokens; {idle} instances got no request; "
              f"TTFT p50 {rep.ttft_seconds['p50']} s", flush=True)
        rep = run("prefix", n, rate)
        print(f"{column} prefix: largest tree {seen['tree']} tokens ({2**26 / seen['tree']:.2f} characters per "
              f"token would reach 2**26); TTFT p50 {rep.ttft_seconds['p50']} s", flush=True)


if __name__ == "__main__":
    main()
