"""``hybridkv plan``: the search (bisection, halving, cache), its validation rules, the emitted
deploy commands and bad inputs. Every simulation here runs on a short prefix of the bundled trace."""

from __future__ import annotations

import json
import math

import pytest

from hybridkv.cli import build_parser, main
from hybridkv.fleet.operating import parse_slo
from hybridkv.replay.plan import (
    DeviceBudget,
    Evaluator,
    FleetConfig,
    Outcome,
    PlanError,
    Prices,
    deploy_commands,
    h200_budget,
    min_instances,
    pareto_front,
    plan,
)

MODEL = "kimi-linear-48b-a3b"
POLICY = "branch+tail=512+interval=7168+supersede"
LIMIT = 48
"""Requests of the trace prefix the searches plan on (a few tenths of a second per simulation)."""
TOL = 1e-9
"""Tolerance of cost comparisons (USD/h)."""


def _outcome(n: int, meets: bool, cost: float = 1.0, p99: float = 1.0, goodput: float = 1.0) -> Outcome:
    cfg = FleetConfig(n, 0.2, 0.0, 0.0, POLICY, "hybrid")
    return Outcome(cfg, 10, 0, {"ttft_p99": p99, "ttft_p50": p99 / 2}, goodput, 1.0, 0, 0.5 if meets else 2.0,
                   meets, [] if meets else ["ttft_p99"], cost, 0.0, None)


def _evaluator(slo: str, tmp_path=None, limit: int = LIMIT) -> Evaluator:
    return Evaluator(None, MODEL, parse_slo(slo), Prices(), h200_budget(MODEL, 4),
                     cache_file=None if tmp_path is None else str(tmp_path / "cache.json"), limit=limit)


def _small_space() -> list[FleetConfig]:
    return [FleetConfig(1, 0.2, 0.0, 0.0, POLICY, "least-load"),
            FleetConfig(1, 0.05, 1024.0, 1.1, POLICY, "hybrid")]


@pytest.mark.parametrize("threshold", [1, 3, 5, 17, 40])
def test_min_instances_is_a_bisection_on_a_monotone_predicate(threshold):
    calls = []

    def evaluate(k):
        calls.append(k)
        return _outcome(k, k >= threshold)

    got = min_instances(evaluate, 0, 1, 64)
    assert got is not None and got.config.instances == threshold
    # doubling to the first count that meets, then bisection below it: about 2 log2(threshold) calls
    assert len(calls) <= 2 * math.ceil(math.log2(threshold)) + 2
    assert len(set(calls)) == len(calls)            # never the same count twice


def test_min_instances_gives_up_past_the_limit():
    assert min_instances(lambda k: _outcome(k, False), 0, 1, 8) is None


def test_pareto_front_drops_dominated_points():
    a = _outcome(2, True, cost=2.0, p99=1.0, goodput=3.0)
    b = _outcome(3, True, cost=3.0, p99=1.5, goodput=2.0)     # dearer, slower, less goodput than a
    c = _outcome(1, False, cost=1.0, p99=4.0, goodput=1.0)
    front = pareto_front([a, b, c])
    assert [o.config.instances for o in front] == [1, 2]


def test_simulations_are_cached_in_memory_and_in_the_cache_file(tmp_path):
    ev = _evaluator("ttft_p99=30", tmp_path)
    cfg = FleetConfig(2, 0.2, 0.0, 0.0, POLICY, "least-load")
    first = ev.evaluate(cfg)
    again = ev.evaluate(cfg)
    assert (ev.runs, ev.hits) == (1, 1)
    assert again.cached and again.stats == first.stats
    other = _evaluator("ttft_p99=30", tmp_path)      # a new process reading the same cache file
    third = other.evaluate(cfg)
    assert (other.runs, other.hits) == (0, 1) and third.stats == first.stats
    other.evaluate(FleetConfig(3, 0.2, 0.0, 0.0, POLICY, "least-load"))
    assert other.runs == 1
    assert len(json.loads((tmp_path / "cache.json").read_text())) == 2


def test_plan_meets_the_targets_and_a_tighter_slo_costs_no_less():
    loose_ev = _evaluator("ttft_p99=60")
    loose = plan(loose_ev, max_instances=8, space=_small_space())
    assert loose.plan is not None and loose.plan.meets and not loose.relaxed
    assert loose.plan.stats["ttft_p99"] <= 60
    # a target just under what the loose plan reaches: tighter, still reachable with more instances
    tight_target = loose.plan.stats["ttft_p99"] * 0.8
    tight_ev = _evaluator(f"ttft_p99={tight_target:.6f}")
    tight = plan(tight_ev, max_instances=8, space=_small_space())
    assert tight.plan is not None and tight.plan.stats["ttft_p99"] <= tight_target
    assert tight.plan.cost_per_hour >= loose.plan.cost_per_hour - TOL
    if tight.next_cheaper is not None:              # the next cheaper point is said to miss, and does
        assert not tight.next_cheaper.meets
        assert tight.next_cheaper.cost_per_hour < tight.plan.cost_per_hour
    assert any(r["requests"] == LIMIT for r in tight.rungs)       # the last rung runs the whole (prefix) trace


def test_a_target_below_the_prefill_bound_is_said_unreachable_and_planned_at_the_nearest():
    ev = _evaluator("ttft_p99=0.001")
    result = plan(ev, max_instances=4, space=_small_space()[:1])
    assert result.relaxed
    assert result.planned_slo["ttft_p99"] > result.bound["ttft_p99"] > 0.001
    assert "cannot be met" in result.why[0] and "0.001" in result.why[0]


def test_emitted_deploy_commands_parse_with_the_cli_parser():
    budget = h200_budget(MODEL, 4)
    cfg = FleetConfig(3, 0.2, 1024.0, 1.1, POLICY, "hybrid")
    cmds = deploy_commands(cfg, budget, MODEL, 4)
    parser = build_parser()
    pages, slots = budget.pools(0.2)
    kinds = [c[1] for c in cmds]
    assert kinds == ["store", "serve", "serve", "serve", "router"]
    store = parser.parse_args(cmds[0][1:])
    assert store.segment_mb == 1024 * 1024
    for cmd in cmds[1:4]:
        args = parser.parse_args(cmd[1:])
        assert (args.kv_pages, args.checkpoint_slots, args.policy) == (pages, slots, POLICY)
        assert args.store == "mooncake://store-0:50051"
    router = parser.parse_args(cmds[-1][1:])
    assert router.policy == "hybrid" and len(router.worker) == 3
    no_store = deploy_commands(FleetConfig(1, 0.5, 0.0, 0.0, POLICY, "least-load"), budget, MODEL, 4)
    assert [c[1] for c in no_store] == ["serve", "router"]
    for cmd in no_store:
        parser.parse_args(cmd[1:])


def test_device_budget_splits_the_pools_by_cache_share():
    b = h200_budget(MODEL, 4)
    pages_lo, slots_lo = b.pools(0.05)
    pages_hi, slots_hi = b.pools(0.5)
    assert slots_hi > slots_lo and pages_hi < pages_lo
    for pages, slots in ((pages_lo, slots_lo), (pages_hi, slots_hi)):
        used = pages * b.kv_bytes_per_token * b.block_size + slots * b.checkpoint_bytes
        assert used <= b.pool_bytes
    full = DeviceBudget(10e9, 0.9, 9.5e9, 100, 1000, 16, 1)
    with pytest.raises(PlanError, match="no device memory"):
        full.pools(0.2)


@pytest.mark.parametrize("text, needle", [
    ("ttft_p98=2", "unknown SLO key 'ttft_p98'"),
    ("ttft_p99", "not KEY=SECONDS"),
    ("ttft_p99=-1", "ttft_p99='-1'"),
    ("ttft_p99=abc", "not a number"),
    ("ttft_p99=1,ttft_p99=2", "given twice"),
    ("", "empty"),
    ("ttft_p99=inf", "ttft_p99='inf'"),
])
def test_bad_slo_is_named(text, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        parse_slo(text)


def test_bad_prices_and_models_are_named():
    with pytest.raises(PlanError, match="--gpu-hour-usd -1"):
        Prices(gpu_hour=-1.0)
    with pytest.raises(PlanError, match="--store-gb-month-usd nan"):
        Prices(store_gb_month=float("nan"))
    with pytest.raises(PlanError, match="--model 'small'"):
        h200_budget("small", 4)


def test_hosts_accepts_none_as_no_host_tier():
    args = build_parser().parse_args(["plan", "--slo", "ttft_p99=1", "--hosts", "none,64,256"])
    assert args.hosts == (0.0, 64.0, 256.0)
    with pytest.raises(SystemExit):            # none and 0 are the same size
        build_parser().parse_args(["plan", "--slo", "ttft_p99=1", "--hosts", "none,0"])


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--slo", "ttft_p97=1"], "unknown SLO key 'ttft_p97'"),
    (["plan", "--slo", "ttft_p99=1", "--gpu-hour-usd", "-3"], "--gpu-hour-usd"),
    (["plan", "--slo", "ttft_p99=1", "--model", "small"], "--model 'small'"),
    (["plan", "--slo", "ttft_p99=1", "--trace", "/nonexistent/t.jsonl"], "--trace /nonexistent/t.jsonl"),
    (["plan", "--slo", "ttft_p99=1", "--json", "/nonexistent/dir/p.json"], "--json /nonexistent/dir/p.json"),
    (["plan", "--slo", "ttft_p99=1", "--hosts", "0,-4"], "host tier size '-4'"),
    (["plan", "--slo", "ttft_p99=1", "--stores", "none,256"], "store '256' is not GIB@GBPS"),
    (["plan", "--slo", "ttft_p99=1", "--routers", "hybrid,fastest"], "router 'fastest'"),
    (["plan", "--slo", "ttft_p99=1", "--shares", "0.2,1.5"], "cache share '1.5'"),
    (["plan", "--slo", "ttft_p99=1", "--shares", "0.2,0.2"], "given twice"),
])
def test_cli_bad_inputs_exit_2_with_one_line(argv, needle, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:                  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_plans_a_prefix_and_writes_json_and_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    code = main(["plan", "--slo", "ttft_p99=60", "--limit", "16", "--max-instances", "4", "--jobs", "1",
                 "--shares", "0.2", "--hosts", "0", "--stores", "none,256@1.1", "--routers", "hybrid",
                 "--json", str(out_json), "--png", str(out_png)])
    assert code == 0
    data = json.loads(out_json.read_text())
    assert data["plan"]["meets"] and data["commands"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parser = build_parser()
    import shlex
    for line in data["commands"]:
        parser.parse_args(shlex.split(line)[1:])
    captured = capsys.readouterr()
    assert "plan:" in captured.out
    progress = captured.out + captured.err      # a --limit run names its requests, not the whole trace
    assert "[all 16 requests, " in progress and "[whole trace" not in progress
    # the space asked for and no other: two structures, both reaching the whole (prefix) trace
    structures = {tuple(e["structure"]) for e in data["rungs"][-1]["structures"]}
    assert structures == {(0.0, 0.0, 0.0), (256.0, 1.1, 0.0)}
    assert {o["config"]["router"] for o in data["evaluated"]} == {"hybrid"}


def test_progress_scope_names_a_limited_run_by_its_requests():
    assert _evaluator("ttft_p99=30", limit=16).scope == "all 16 requests"


def test_seeds_move_arrivals_within_the_trace_resolution():
    from hybridkv.replay.trace import load_trace
    ev = _evaluator("ttft_p99=30")
    try:
        path = ev._trace_for(1)
        moved = load_trace(path).requests
        base = ev.load.requests
        gaps = [b.timestamp_ms - a.timestamp_ms for a, b in zip(base, base[1:]) if b.timestamp_ms > a.timestamp_ms]
        assert any(m.timestamp_ms != b.timestamp_ms for m, b in zip(moved, base))
        for m, b in zip(moved, base):
            assert 0 <= m.timestamp_ms - b.timestamp_ms < min(gaps)
        assert ev._trace_for(0) is None                      # seed 0: the trace itself
    finally:
        ev.close()
    assert not __import__("pathlib").Path(path).exists()


def _structured_space() -> list[FleetConfig]:
    """Three structures (none; a store; a host tier), two device choices each."""
    return [FleetConfig(1, share, gib, gbps, POLICY, "hybrid", host)
            for gib, gbps, host in ((0.0, 0.0, 0.0), (256.0, 1.1, 0.0), (0.0, 0.0, 64.0)) for share in (0.2, 0.5)]


def test_every_structure_reaches_the_whole_trace_and_nothing_cheaper_meets():
    ev = _evaluator("ttft_p99=20")
    space = _structured_space()
    result = plan(ev, max_instances=4, space=space)
    assert result.plan is not None and result.plan.meets
    final = result.rungs[-1]
    assert final["stage"] == "whole trace"
    # each structure's survivor was simulated on the whole trace (or bisected), none dropped on prefixes
    assert {tuple(e["structure"]) for e in final["structures"]} == {c.structure for c in space}
    # exhaustive check of the space: no configuration cheaper than the plan meets the targets
    grid = _evaluator("ttft_p99=20")
    for cfg in space:
        for n in range(1, 5):
            c = FleetConfig(n, cfg.cache_share, cfg.store_gib, cfg.store_gbps, cfg.policy, cfg.router, cfg.host_gib)
            if c.cost_per_hour(ev.prices) < result.plan.cost_per_hour - TOL:
                assert not grid.evaluate(c).meets, c.label()


def test_prefill_bound_is_below_every_simulated_percentile():
    """Each request's TTFT is at least its bound, so every percentile of a simulated fleet's TTFTs is at
    least the bound's: checked on an idle fleet (16 instances, a store and host tiers), where the two
    nearly meet."""
    import io

    import numpy as np
    from rich.console import Console

    from hybridkv.replay.plan import _prefill_times
    from hybridkv.replay.runner import ReplayOptions, run_replay
    from hybridkv.replay.trace import load_trace
    n = 300
    bound = _prefill_times(load_trace(None, limit=n).requests)
    pages, slots = h200_budget(MODEL, 4).pools(0.2)
    report = run_replay(ReplayOptions(limit=n, model=MODEL, simulate=True, timed=True, instances=16, router="hybrid",
                                      num_kv_pages=pages, num_checkpoint_slots=slots, host_bytes=64 << 30,
                                      simulated_host=True, store_gib=1024, store_gbps=10.0, progress=False),
                        Console(file=io.StringIO()))
    pcts = [p for p, _ in report.ttft_cdf_seconds]
    sim = np.array([x for _, x in report.ttft_cdf_seconds])
    low = np.percentile(bound, pcts)
    assert (sim >= low - 1e-5).all()              # the report rounds to microseconds
    assert sim[pcts.index(99)] <= 1.5 * low[pcts.index(99)]     # and on an idle fleet the bound is close


def test_timed_simulation_builds_a_host_tier_only_when_asked():
    import io

    from rich.console import Console

    from hybridkv.replay.runner import ReplayOptions, run_replay
    pages, slots = h200_budget(MODEL, 4).pools(0.5)
    tiers = []
    for on in (False, True):
        report = run_replay(ReplayOptions(limit=120, model=MODEL, simulate=True, timed=True, instances=2,
                                          num_kv_pages=pages // 40, num_checkpoint_slots=slots, host_bytes=8 << 30,
                                          simulated_host=on, store_gbps=0.0, progress=False),
                            Console(file=io.StringIO()))
        tiers.append(report.tier_capacity)
    assert "host" not in tiers[0]
    assert tiers[1]["host"]["capacity_bytes"] == 2 * (8 << 30)
    assert tiers[1]["host"]["bytes_peak"] > 0      # the device's evictions were written back to it


def test_host_tier_is_priced_per_instance():
    prices = Prices(gpu_hour=2.0, host_gb_month=7.3)
    cfg = FleetConfig(3, 0.2, 0.0, 0.0, POLICY, "hybrid", host_gib=100.0)
    assert math.isclose(cfg.cost_per_hour(prices), 3 * 2.0 + 3 * 100.0 * 7.3 / 730, rel_tol=1e-12)
    assert cfg.structure == (0.0, 0.0, 100.0)
    cmds = deploy_commands(cfg, h200_budget(MODEL, 4), MODEL, 4)
    assert all(c[c.index("--host-mib") + 1] == str(100 * 1024) for c in cmds if c[1] == "serve")


def test_parallel_workers_give_the_serial_results():
    cfgs = [FleetConfig(2, 0.2, 0.0, 0.0, POLICY, "least-load"),
            FleetConfig(2, 0.5, 256.0, 1.1, POLICY, "hybrid", 64.0)]
    serial = _evaluator("ttft_p99=30").evaluate_many([(c, None, 0) for c in cfgs])
    ev = _evaluator("ttft_p99=30")
    ev.jobs = 2
    parallel = ev.evaluate_many([(c, None, 0) for c in cfgs])
    assert ev.runs == 2
    for a, b in zip(serial, parallel):
        assert a.config == b.config
        for k, v in a.stats.items():
            assert math.isclose(v, b.stats[k], rel_tol=1e-9, abs_tol=1e-9), k


FAST = ["--limit", "16", "--max-instances", "2", "--jobs", "1", "--shares", "0.2", "--hosts", "0",
        "--stores", "none", "--routers", "least-load"]
"""Options of a small plan (a second or so), so a bad path found only after the search stays cheap."""


@pytest.mark.parametrize("case, needle", [
    ("missing-dir", "--cache {d}/nope/c.json: no directory {d}/nope"),
    ("directory", "--cache {d}/somedir: is a directory"),
    ("list", "--cache {d}/list.json: not a planner cache (a JSON list"),
    ("not-json", "--cache {d}/bad.json: not a planner cache (not JSON"),
    ("ill-typed", "--cache {d}/typed.json: not a planner cache (an entry"),
    ("png-format", "--png {d}/out.txt: format 'txt'"),
    ("trace-dir", "--trace {d}/somedir: is a directory"),
])
def test_cli_bad_cache_png_and_trace_paths_exit_2_before_any_simulation(case, needle, tmp_path, capsys):
    (tmp_path / "somedir").mkdir()
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "bad.json").write_text("{x")
    (tmp_path / "typed.json").write_text('{"k": [1, 2]}')
    stored = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    flag, value = {"missing-dir": ("--cache", "nope/c.json"), "directory": ("--cache", "somedir"),
                   "list": ("--cache", "list.json"), "not-json": ("--cache", "bad.json"),
                   "ill-typed": ("--cache", "typed.json"), "png-format": ("--png", "out.txt"),
                   "trace-dir": ("--trace", "somedir")}[case]
    code = main(["plan", "--slo", "ttft_p99=60", *FAST, flag, str(tmp_path / value)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("error: ")
    assert needle.format(d=tmp_path) in captured.err
    assert captured.err.strip().count("\n") == 0 and "Traceback" not in captured.err
    assert captured.out == ""                                      # no simulation ran, nothing printed
    # nothing stored is lost or overwritten, and no stray file is left beside the path
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == stored
    assert not list(tmp_path.glob("*.tmp"))


def test_deploy_commands_are_each_printed_once_for_one_instance_and_no_store(capsys):
    from hybridkv.replay.plan_cmd import deploy_lines
    cfg = FleetConfig(1, 0.2, 0.0, 0.0, POLICY, "least-load")
    cmds = deploy_commands(cfg, h200_budget(MODEL, 4), MODEL, 4)
    assert len(cmds) == 2
    assert deploy_lines(cmds) == [" ".join(c) for c in cmds]
    many = deploy_commands(FleetConfig(3, 0.2, 256.0, 1.1, POLICY, "hybrid"), h200_budget(MODEL, 4), MODEL, 4)
    lines = deploy_lines(many)                                     # store, 3 serve, router
    assert lines[2] == "..." and len(lines) == 4 and lines[-1].startswith("hybridkv router")
    code = main(["plan", "--slo", "ttft_p99=60", *FAST[:2], "--max-instances", "1", *FAST[4:]])
    assert code == 0
    out = capsys.readouterr().out
    deploy = out[out.index("deploy:"):].splitlines()[1:]
    assert sum(line.strip().startswith("hybridkv router") for line in deploy) == 1
    assert sum(line.strip().startswith("hybridkv serve") for line in deploy) == 1


def _sigint_as_at_a_terminal() -> None:
    """A child's SIGINT as a terminal's foreground job has it: default disposition, not blocked.
    An ignored or blocked SIGINT survives exec (a shell's background job ignores it, and a library
    loaded by an earlier test may ignore or block it in the test process), and Python keeps an
    ignored SIGINT ignored."""
    import signal
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_plan_prints_one_line_keeps_the_cache_and_ends_the_workers(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    cache = tmp_path / "cache.json"
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "plan", "--slo", "ttft_p99=60", "--limit", "600",
                             "--jobs", "2", "--cache", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_sigint_as_at_a_terminal)

    def stored() -> int:
        try:
            return len(json.loads(cache.read_text()))
        except (OSError, ValueError):
            return 0

    try:
        deadline = time.monotonic() + 60
        while stored() < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)                     # past the first (serial) runs: the worker pool is at work
        assert proc.poll() is None, "the plan ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)       # Ctrl-C reaches the whole foreground group, workers too
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    kept = stored()
    assert kept >= 3
    assert last == f"interrupted; {kept} simulations kept in the cache {cache}"
    with pytest.raises(ProcessLookupError):      # no worker outlives the plan
        os.killpg(proc.pid, 0)
    assert not list(tmp_path.glob("*.tmp"))
