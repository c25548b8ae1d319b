"""The router generalisation grid of benchmarks/bench_routers.py (``--traces``): the development
and held-out trace sets never share a trace, and the verdict marks ``hybrid`` against the best
other router with the stated 2% tolerance."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_routers", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_routers.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_development_and_held_out_sets_are_disjoint(tmp_path, monkeypatch):
    """Defaults are chosen on ``dev`` only; a trace in both sets would be tuned on and reported on."""
    monkeypatch.setattr(bench, "SYNTH_REQUESTS", 20)        # small files; the seeds are what matters
    dev = bench.trace_set("dev", tmp_path)
    held = bench.trace_set("held-out", tmp_path)
    assert not set(bench.DEV_SEEDS) & set(bench.HELD_OUT_SEEDS)
    assert not set(dev) & set(held)
    assert not {p for p, _ in dev.values()} & {p for p, _ in held.values()}
    assert {"bundled", "synthetic_trace"} <= set(held)
    assert len(dev) == len(bench.SYNTH_KINDS) * len(bench.DEV_SEEDS)
    first = Path(dev["tenants-s1"][0]).read_text()
    assert len(first.splitlines()) == 20
    with pytest.raises(ValueError, match="'train'"):
        bench.trace_set("train", tmp_path)


def test_second_held_out_set_shares_no_seed_or_trace_with_the_others(tmp_path, monkeypatch):
    """``fresh`` (seeds 4-5) was first run after the defaults were fixed: it must not overlap the
    development set or the first held-out set."""
    monkeypatch.setattr(bench, "SYNTH_REQUESTS", 20)
    fresh = bench.trace_set("fresh", tmp_path)
    others = {**bench.trace_set("dev", tmp_path), **bench.trace_set("held-out", tmp_path)}
    assert not set(bench.FRESH_SEEDS) & (set(bench.DEV_SEEDS) | set(bench.HELD_OUT_SEEDS))
    assert set(fresh) == {f"{k}-s{s}" for k in bench.SYNTH_KINDS for s in bench.FRESH_SEEDS}
    assert not {p for p, _ in fresh.values()} & {p for p, _ in others.values()}
    assert Path(fresh["documents-s4"][0]).read_text() != Path(others["documents-s1"][0]).read_text()


def _row(router: str, p50: float, mean: float, p99: float, hopts=None) -> dict:
    return {"trace_name": "t", "instances": 8, "rate": 1, "router": router,
            "ttft": {"p50": p50, "mean": mean, "p99": p99}, "hybrid_options": hopts or {}}


def test_verdict_marks_hybrid_within_two_percent_of_the_best_other_router():
    rows = [_row("prefix-smg", 1.00, 2.00, 10.0), _row("kv-overlap", 1.10, 1.90, 9.0),
            _row("hybrid", 1.019, 1.95, 9.5)]            # p50 +1.9% (ok), mean +2.6% (trails), p99 +5.6%
    text, held, total = bench.verdict(rows, {})
    assert (held, total) == (1, 3)
    line = next(l for l in text.splitlines() if "| hybrid |" in l)
    assert "1.019 (ok)" in line and "TRAILS x1.026" in line and "TRAILS x1.056" in line


def test_verdict_compares_only_the_hybrid_options_asked_for():
    rows = [_row("least-load", 1.0, 1.0, 1.0), _row("hybrid", 5.0, 5.0, 5.0),
            _row("hybrid", 0.9, 0.9, 0.9, {"own_waiting": 0.0})]
    assert bench.verdict(rows, {"own_waiting": 0.0})[1:] == (3, 3)
    assert bench.verdict(rows, {})[1:] == (0, 3)
