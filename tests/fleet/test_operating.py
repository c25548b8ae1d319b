"""The timed report's operating figures: goodput against ``--slo``, queue skew, tier capacity,
device memory (cache share, decode KV displaced) and phases."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from hybridkv.cli import main
from hybridkv.fleet.operating import PHASE_WINDOWS, format_slo, parse_slo
from hybridkv.replay.runner import ReplayOptions, run_replay

TOL = 1e-6
"""Tolerance of seconds compared between two summaries of the same run (both rounded to 1 µs)."""


def _run(**kw):
    opts = dict(simulate=True, timed=True, instances=2, model="kimi-linear-48b-a3b", limit=40,
                router="least-load", num_kv_pages=3000, num_checkpoint_slots=40, progress=False)
    opts.update(kw)
    return run_replay(ReplayOptions(**opts), Console(file=io.StringIO()))


def test_slo_text_round_trips():
    slo = parse_slo(" ttft_p99=2.0, e2e_mean=30 ,queue_p50=0.25")
    assert slo == {"ttft_p99": 2.0, "e2e_mean": 30.0, "queue_p50": 0.25}
    assert parse_slo(format_slo(slo)) == slo


def test_goodput_and_targets_agree_with_the_latency_summary():
    r = _run(slo={"ttft_p99": 1e6, "ttft_p50": 0.5})
    g = r.goodput
    assert g["slo"] == {"ttft_p99": 1e6, "ttft_p50": 0.5}
    assert abs(g["targets"]["ttft_p99"]["value"] - r.ttft_seconds["p99"]) <= TOL
    assert abs(g["targets"]["ttft_p50"]["value"] - r.ttft_seconds["p50"]) <= TOL
    assert g["targets"]["ttft_p99"]["met"] is True
    assert g["targets"]["ttft_p50"]["met"] is (r.ttft_seconds["p50"] <= 0.5)
    # every request meets a TTFT bound of 1e6 s, so goodput counts those within 0.5 s (the tighter)
    assert 0 <= g["requests"] <= r.requests
    assert abs(g["fraction"] - g["requests"] / 40) <= TOL
    loose = _run(slo={"ttft_p99": 1e6})
    assert loose.goodput["requests"] == loose.requests == 40
    assert loose.goodput["requests"] >= g["requests"]
    assert _run().goodput is None                     # no SLO, no goodput
    assert "goodput" not in _run().to_dict()


def test_queue_skew_tiers_device_memory_and_phases_are_reported():
    r = _run(instances=3, store_gbps=1.1)
    d = r.to_dict()
    for key in ("queue_skew", "tier_capacity", "device_memory", "phases"):
        assert key in d
    qs = r.queue_skew
    assert len(qs["mean_queue"]) == 3
    assert qs["skew"] is None or qs["skew"] >= 1 - TOL
    dev = r.tier_capacity["device"]
    assert dev["capacity_bytes"] > 0 and 0 <= dev["occupancy"] <= 1 + TOL
    assert "store" in r.tier_capacity
    dm = r.device_memory
    assert (dm["kv_pages"], dm["checkpoint_slots"]) == (3000, 40)
    assert 0 < dm["cache_share"] < 1
    ph = r.phases
    windows = sorted(ph["cold_start"]["windows"] + ph["steady"]["windows"] + ph["drift"]["windows"])
    assert windows == list(range(PHASE_WINDOWS))          # every window in exactly one phase
    assert ph["cold_start"]["requests"] + ph["steady"]["requests"] + ph["drift"]["requests"] == 40


def test_decode_kv_displaced_by_a_small_page_pool_is_counted():
    roomy = _run(instances=1, num_kv_pages=5000)
    tight = _run(instances=1, num_kv_pages=260, max_num_seqs=4)
    assert roomy.device_memory["delayed_requests"] == 0
    assert tight.device_memory["delayed_requests"] + tight.device_memory["refused_requests"] > 0
    assert tight.device_memory["admission_waits"] >= tight.device_memory["delayed_requests"]


def test_replay_slo_option(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["replay", "--simulate", "--timed", "--instances", "2", "--limit", "20", "--router", "least-load",
                 "--model", "kimi-linear-48b-a3b", "--slo", "ttft_p99=30,e2e_p99=600", "--no-progress",
                 "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["goodput"]["targets"]) == {"ttft_p99", "e2e_p99"}
    assert "goodput" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needle", [
    (["replay", "--simulate", "--timed", "--slo", "ttft_p98=1"], "unknown SLO key 'ttft_p98'"),
    (["replay", "--simulate", "--slo", "ttft_p99=1"], "--slo ttft_p99=1 needs --timed"),
])
def test_replay_bad_slo_is_named(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
