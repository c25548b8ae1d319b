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


@pytest.mark.parametrize("router", ["prefix", "prefix-smg"])
def test_prefix_routers_on_a_large_fleet_decide_as_a_scan_of_every_tree(tmp_path, monkeypatch, router):
    """Above HOLDER_MAP_ABOVE instances the holder map and the size heap replace the scan of
    every tree: the same decisions (every figure of the report the same)."""
    import hybridkv.fleet.routers as routers

    args = ("--instances", "40", "--router", router, "--limit", "400", "--time-scale", "0.15")
    mapped = _replay(tmp_path, "mapped", *args)
    monkeypatch.setattr(routers, "HOLDER_MAP_ABOVE", 1 << 30)
    scanned = _replay(tmp_path, "scanned", *args)
    _same(mapped, scanned)


@pytest.mark.parametrize("cls_name", ["PrefixRouter", "SMGPrefixRouter"])
def test_holder_map_follows_bounded_trees_and_instances_down(cls_name):
    """Bounded trees (LRU nodes evicted) and a fleet with instances down: the holder map's
    decisions are the scan's, request by request, and it forgets what the trees evicted."""
    import random as _random

    import hybridkv.fleet.routers as routers
    from hybridkv.fleet.routers import FleetState, InstanceLoad, PrefixOptions, RouteRequest

    cls = getattr(routers, cls_name)
    opts = PrefixOptions(max_tree_tokens=64 * 40, balance_abs_threshold=6)
    mapped, scanned = cls(64, opts), cls(64, opts)
    n, rng = 48, _random.Random(7)
    loads = [InstanceLoad() for _ in range(n)]
    stems = [[bytes([s, u]) * 16 for u in range(30)] for s in range(12)]
    for t in range(600):
        stem = stems[rng.randrange(len(stems))]
        hashes = stem[:rng.randrange(1, 20)] + [t.to_bytes(32, "little")] * rng.randrange(0, 2)
        live = sorted(rng.sample(range(n), n - rng.randrange(0, 4)))
        for ld in loads:
            ld.in_flight, ld.routed = rng.randrange(0, 9), rng.randrange(0, 50)
        req = RouteRequest(hashes=hashes, prompt_tokens=64 * len(hashes) + 10, limit=64 * len(hashes))
        saved = routers.HOLDER_MAP_ABOVE
        a = mapped.route(req, FleetState(views=[], loads=loads, live=live))
        routers.HOLDER_MAP_ABOVE = 1 << 30
        try:
            b = scanned.route(req, FleetState(views=[], loads=loads, live=live))
        finally:
            routers.HOLDER_MAP_ABOVE = saved
        assert a == b, t
    assert mapped._holders is not None and scanned._holders is None
    held = {k for tree in mapped.trees for k in tree.kv}
    assert set(mapped._holders) == held                  # evicted nodes left the map
    for k, have in mapped._holders.items():
        at = {have} if isinstance(have, int) else have
        assert at == {j for j, tree in enumerate(mapped.trees) if k in tree.kv}


def test_the_decode_pricers_terms_give_its_price():
    """coast_plan inlines the pricer's arithmetic from its ``terms``: the same seconds."""
    cost = cost_model("h200-kimi-linear-48b")
    for b in (1, 3, 16):
        price = _decode_pricer(cost, b, 1000)
        lin, att, seq, w, kv, st, over = price.terms
        for ctx in (0, 999, 123_457):
            compute, memory = lin + att * ctx + seq, w + kv * ctx + st
            assert over + (compute if compute >= memory else memory) == price(ctx)
