"""benchmarks/router_diagnostics.py ``--spread``: where each router put one column's requests, the
figures docs/results/routing.md ("Why the rest trails") quotes per instance."""

import importlib.util
import json
from pathlib import Path

from hybridkv.replay.synth import synth_requests, write_lines

_spec = importlib.util.spec_from_file_location(
    "router_diagnostics", Path(__file__).resolve().parents[2] / "benchmarks" / "router_diagnostics.py")
diag = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(diag)


def test_spread_accounts_for_every_request_by_instance_and_by_prefix(tmp_path):
    trace = tmp_path / "documents.jsonl"
    write_lines(synth_requests("documents", 60, seed=1), trace)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    out = diag.spread(str(trace), 3, 2, "prefix-smg", {}, None, prefix_blocks=3, top=100)
    assert sum(n for n, _ in out["instances"].values()) == len(lines)
    assert set(out["instances"]) <= {0, 1, 2}
    keys = {tuple(line["hash_ids"][:3]) for line in lines}
    assert len(out["prefixes"]) == len(keys)                 # top=100: every prefix listed
    assert sum(n for n, _ in out["prefixes"]) == len(lines)
    assert all(n == sum(where.values()) for n, where in out["prefixes"])
    counts = [n for n, _ in out["prefixes"]]
    assert counts == sorted(counts, reverse=True)              # the most requested first
    assert out["ttft"]["p50"] <= out["ttft"]["p99"]


def test_spread_restores_the_report_summary_it_wraps(tmp_path):
    trace = tmp_path / "tenants.jsonl"
    write_lines(synth_requests("tenants", 20, seed=2), trace)
    before = diag.timed.timing_summary
    diag.spread(str(trace), 2, 1, "hybrid", {"waiting_weight": 1.0}, None, prefix_blocks=2, top=1)
    assert diag.timed.timing_summary is before


def test_explain_reports_the_decision_and_what_followed(tmp_path):
    trace = tmp_path / "documents.jsonl"
    write_lines(synth_requests("documents", 40, seed=3), trace)
    before = diag.routers.HybridRouter.route
    rows = diag.explain(str(trace), 3, 4, {}, None, {0, 25, 39})
    assert [r["request"] for r in rows] == [0, 25, 39]
    for r in rows:
        scores = [c["score"] for c in r["candidates"]]
        assert scores == sorted(scores, reverse=True)
        assert r["chosen"] in {0, 1, 2}
        assert abs(r["tie_band"] - 0.1 * r["p0"]) <= 1e-3          # the default tie_relative, rounded
        assert 0 <= r["reused"] < r["prompt_tokens"]
        assert r["ttft"] >= r["waited"] >= 0
    assert rows[0]["reused"] == 0 and rows[0]["predicted_wait"] == 0.0   # the first request: nothing cached
    assert diag.routers.HybridRouter.route is before
