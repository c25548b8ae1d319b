"""``hybridkv plan``'s resolution: the configurations of the search space that could cost less than the
plan and were neither simulated on the whole trace there nor ruled out by a miss at as many instances
or more (``PlanResult.unchecked``), counted in one printed line and in the JSON. Checked against an
exhaustive grid on a short prefix of the bundled trace."""

from __future__ import annotations

import json
from dataclasses import replace

from hybridkv.cli import main
from hybridkv.fleet.operating import parse_slo
from hybridkv.replay.plan import Evaluator, FleetConfig, Prices, h200_budget, plan

MODEL = "kimi-linear-48b-a3b"
POLICY = "branch+tail=512+interval=7168+supersede"
LIMIT = 48
"""Requests of the trace prefix planned on (a few tenths of a second per simulation)."""
SLO = "ttft_p99=4"
"""A target the prefix meets at a few instances (so that there are cheaper counts to miss)."""
MAX_INSTANCES = 4
TOL = 1e-9
"""Tolerance of cost comparisons (USD/h)."""


def _evaluator() -> Evaluator:
    return Evaluator(None, MODEL, parse_slo(SLO), Prices(), h200_budget(MODEL, 4), limit=LIMIT)


def _space() -> list[FleetConfig]:
    """One structure, six device and routing choices: the halving keeps two, so some never reach the
    whole (prefix) trace."""
    return [FleetConfig(1, share, 0.0, 0.0, POLICY, router) for share in (0.2, 0.05, 0.5)
            for router in ("hybrid", "least-load")]


def _most_below(cfg: FleetConfig, cost: float, prices: Prices) -> int:
    return max((n for n in range(1, MAX_INSTANCES + 1)
                if replace(cfg, instances=n).cost_per_hour(prices) < cost - TOL), default=0)


def test_every_cheaper_configuration_is_either_ruled_out_by_a_miss_or_named_unchecked():
    ev = _evaluator()
    space = _space()
    result = plan(ev, max_instances=MAX_INSTANCES, space=space)
    assert result.plan is not None and result.plan.meets
    whole = [o for o in ev.outcomes if o.requests == ev.total and o.seed == 0]
    cost = result.plan.cost_per_hour
    unchecked = set(result.unchecked)
    assert unchecked, "the halving dropped choices before the whole trace: some must be unchecked"
    grid = _evaluator()
    for cfg in space:
        m = _most_below(cfg, cost, ev.prices)
        if m < 1:
            continue
        at_m = replace(cfg, instances=m)
        missed_at_or_above = any(not o.meets and o.config.instances >= m
                                 and replace(o.config, instances=1) == cfg for o in whole)
        assert (at_m in unchecked) != missed_at_or_above, at_m.label()
        # a cheaper configuration that meets the targets is never hidden: it is among the unchecked
        for n in range(1, m + 1):
            if grid.evaluate(replace(cfg, instances=n)).meets:
                assert at_m in unchecked, at_m.label()
    assert result.resolution.startswith(f"{len(unchecked)} of the {len(space)} configurations searched")
    assert "bench_plan_validate.py" in result.resolution


def test_with_every_cheaper_configuration_simulated_the_resolution_says_so():
    ev = _evaluator()
    result = plan(ev, max_instances=MAX_INSTANCES, space=_space()[:1])     # one choice: its bisection covers it
    assert result.plan is not None and result.plan.config.instances > 1
    assert result.unchecked == []
    assert result.resolution.startswith("every configuration searched that costs less than the plan was "
                                        f"simulated on the first {LIMIT} requests and missed")


def test_cli_prints_the_resolution_and_writes_it_to_the_json(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    code = main(["plan", "--slo", SLO, "--limit", str(LIMIT), "--max-instances", str(MAX_INSTANCES), "--jobs", "1",
                 "--shares", "0.2,0.05,0.5", "--hosts", "0", "--stores", "none", "--routers", "hybrid,least-load",
                 "--json", str(out_json)])
    assert code == 0
    data = json.loads(out_json.read_text())
    printed = " ".join(capsys.readouterr().out.split())           # the console wraps long lines
    assert data["resolution"] and f"resolution: {data['resolution']}" in printed
    searched = 12                                   # 3 shares x 2 policies x 2 routers
    assert data["resolution"].startswith(f"{len(data['unchecked'])} of the {searched} configurations searched")
    cost = data["plan"]["cost_per_hour"]
    for c in data["unchecked"]:
        assert FleetConfig(**c).cost_per_hour(Prices()) < cost - TOL


def test_a_plan_nothing_in_the_space_undercuts_says_so_not_that_cheaper_ones_missed():
    """A plan at one instance of the cheapest structure: no configuration of the space costs less,
    so the resolution says that (not that every cheaper one was simulated and missed)."""
    ev = Evaluator(None, MODEL, parse_slo("ttft_p99=1000"), Prices(), h200_budget(MODEL, 4), limit=LIMIT)
    result = plan(ev, max_instances=MAX_INSTANCES, space=_space()[:1])
    assert result.plan is not None and result.plan.config.instances == 1
    assert result.unchecked == []
    assert result.resolution.startswith("no configuration searched costs less than the plan")
