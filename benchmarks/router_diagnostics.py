"""Two checks behind docs/concepts/routing.md "Emulations checked against their sources".

* ``kv-overlap``: how often Dynamo's default router queue would hold a request (every live
  instance with more than ``router_queue_threshold`` (4.0) x ``max_num_batched_tokens``
  (8,192) pending prefill tokens, :attr:`~hybridkv.fleet.routers.InstanceLoad.prefill_tokens`,
  when it arrives), and how many instances got no request.
* ``prefix``: the largest approximate tree (tokens) any instance reaches, against SGLang's
  ``max_tree_size`` of 2**26 characters per tenant.

Both wrap the router's ``route`` to read the state it decides on; the decisions are the
router's own. Run:  PYTHONPATH=src .venv/bin/python benchmarks/router_diagnostics.py 32x1 8x4
"""

from __future__ import annotations

import argparse

from rich.console import Console

import hybridkv.fleet.routers as routers
from hybridkv.replay.runner import ReplayOptions, run_replay

QUEUE_THRESHOLD = 4.0 * 8192
"""Dynamo's default ``router_queue_threshold`` times the replay's ``max_num_batched_tokens``."""


def run(router: str, instances: int, rate: int):
    return run_replay(ReplayOptions(limit=None, model="kimi-linear-48b-a3b", simulate=True, timed=True,
                                    instances=instances, router=router, time_scale=1.0 / rate, progress=False),
                      Console(quiet=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("columns", nargs="+", help="INSTANCESxRATE, e.g. 32x1")
    args = ap.parse_args()
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
