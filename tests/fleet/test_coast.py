"""Coasting (:attr:`hybridkv.fleet.simulator.Fleet.coast`): an instance with only modelled
decoders takes its decode steps as one plan, applied when the fleet next needs it. The plan
must be the steps the loop would have taken one by one, so every router's report is the same
with it and without it, on a fleet where plans are cut short by arrivals (woken early) and run
to a decoder's end."""

from __future__ import annotations

import json
import math

import pytest

from hybridkv.cli import main
from hybridkv.fleet.costmodel import cost_model
from hybridkv.fleet.instance import FleetInstance, _decode_pricer
from hybridkv.fleet.simulator import Fleet

SAME_SECONDS_REL = 1e-12
"""Relative tolerance on seconds in the reports compared (the plans take the same steps)."""


def _replay(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    assert main(["replay", "--no-progress", "--simulate", "--timed", "--model", "kimi-linear-48b-a3b",
                 "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def _same(a, b, path=""):
    """Every figure of two reports equal (seconds within SAME_SECONDS_REL), but the run's own
    times and scratch paths."""
    if isinstance(a, dict):
        skip = {"wall_seconds", "cpu_seconds", "requests_per_second", "requests_per_cpu_second",
                "peak_rss_bytes", "prefill_tokens_per_second", "store"} if path == "" else set()
        assert set(a) == set(b), path
        for k in a:
            if k not in skip and not (path.endswith("config") and k == "store"):
                _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=SAME_SECONDS_REL, abs_tol=0.0), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("router", ["hybrid", "least-load", "kv-overlap", "prefix-smg"])
def test_coasting_changes_no_figure(tmp_path, monkeypatch, router):
    planned = []
    plan = FleetInstance.coast_plan

    def spy(self, arrivals):
        got = plan(self, arrivals)
        planned.append(0 if got is None else len(got.starts))
        return got

    monkeypatch.setattr(FleetInstance, "coast_plan", spy)
    # dense arrivals on many lightly loaded instances (as on a large fleet), small pools (evicting)
    args = ("--instances", "40", "--router", router, "--limit", "400", "--time-scale", "0.15",
            "--kv-pages", "64", "--checkpoint-slots", "16")
    on = _replay(tmp_path, "on", *args)
    assert sum(planned) > 500                             # decode steps were planned, not stepped
    monkeypatch.setattr(Fleet, "coast", False)
    planned.clear()
    off = _replay(tmp_path, "off", *args)
    assert not planned
    assert on["evictions"]["device"]["kv_pages"] > 0     # the pools overflowed: eviction ran
    _same(on, off)


def test_the_decode_pricer_is_the_cost_models_step():
    cost = cost_model("h200-kimi-linear-48b")
    for b in (1, 3, 4, 16):
        price = _decode_pricer(cost, b, 1000)
        for ctx in (0, 1, 999, 123_457, 4_000_000):
            assert math.isclose(price(ctx), cost.step_seconds([], b, ctx), rel_tol=SAME_SECONDS_REL)
