"""Bounded routing on a large fleet (:mod:`hybridkv.fleet.candidates`) and lazily made unit hashes
(:mod:`hybridkv.replay.unit_hashes`): a decision weighs a few instances, state stays bounded, and
least-load decides exactly as a full scan."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.fleet.candidates import MAX_HOLDERS, CandidateIndex
from hybridkv.fleet.routers import InstanceLoad


def _loads(tokens):
    return [InstanceLoad(outstanding_tokens=t) for t in tokens]


def test_lightest_follow_load_changes():
    loads = _loads([50, 10, 40, 30, 20, 60])
    idx = CandidateIndex(loads, limit=4)                 # k = 2 per key
    assert idx.candidates([], 0, list(range(6))) == [1, 4]
    loads[1].outstanding_tokens = 100                    # instance 1 got busy
    idx.changed(1)
    assert idx.candidates([], 0, list(range(6))) == [3, 4]
    assert idx.candidates([], 0, [0, 1, 2, 5]) == [0, 2]  # only live instances


def test_wait_key_adds_its_own_lightest():
    loads = _loads([1, 2, 3, 4])
    for j, q in enumerate([9.0, 8.0, 0.5, 0.1]):
        loads[j].queued_seconds = q
    idx = CandidateIndex(loads, limit=2, wait_key=lambda ld: ld.queued_seconds)   # k = 1 per key
    assert idx.candidates([], 0, [0, 1, 2, 3]) == [0, 3]


def test_holders_are_where_the_prefix_went_deepest_first():
    loads = _loads([0] * 20)
    idx = CandidateIndex(loads, limit=2)
    a, b = [bytes([i]) * 32 for i in range(4)], [bytes([20 + i]) * 32 for i in range(4)]
    idx.placed(a[:2], 2, 7)                              # a conversation's first turn went to 7
    idx.placed(a[:3], 3, 12)                             # its second to 12
    assert idx.candidates(a, 4, list(range(20))) == [0, 7, 12]
    assert idx.candidates(b, 4, list(range(20))) == [0]            # another prefix: no holder
    assert idx.candidates(a, 4, [0, 1, 12]) == [0, 12]             # 7 is down


def test_state_stays_bounded():
    loads = _loads([0] * 40)
    idx = CandidateIndex(loads, limit=4, history=16)
    for t in range(5000):
        j = t % 40
        loads[j].outstanding_tokens = (t * 7919) % 1000
        idx.changed(j)
        idx.placed([t.to_bytes(32, "little")], 1, j)
    assert all(len(h) <= 4 * 40 + 64 for h in idx._heaps)
    assert len(idx._placed) == 16
    hs = [t.to_bytes(32, "little") for t in range(4980, 5000)]
    assert len(idx.candidates(hs, len(hs), list(range(40)))) <= 2 + MAX_HOLDERS


def test_bad_limit_is_named():
    with pytest.raises(ValueError, match="route candidates 1 must be at least 2"):
        CandidateIndex(_loads([0, 0]), limit=1)


def _replay(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    assert main(["replay", "--no-progress", "--simulate", "--timed", "--model", "kimi-linear-48b-a3b",
                 "--json", str(out), *args]) == 0
    rep = json.loads(out.read_text())
    return rep


def _figures(rep):
    return {k: rep[k] for k in ("ttft_seconds", "queue_seconds", "e2e_seconds", "instances", "reused_tokens",
                                "computed_prompt_tokens", "tiers")}


def test_least_load_narrowed_decides_as_a_full_scan(tmp_path):
    """The lightest instance is always a candidate: 24 instances narrowed to 4 candidates route
    every request where the full scan does (every per-instance count the same)."""
    args = ("--instances", "24", "--router", "least-load", "--limit", "300", "--time-scale", "0.05")
    full = _replay(tmp_path, "full", *args, "--route-candidates", "0")
    narrow = _replay(tmp_path, "narrow", *args, "--route-candidates", "4")
    assert _figures(narrow) == _figures(full)


def test_a_large_fleet_finishes_with_bounded_state(tmp_path):
    """64 instances, hybrid narrowed to 16 candidates a decision, 1,000 requests at 20x the
    trace's rate on small pools (evicting): every request served; the report is written."""
    rep = _replay(tmp_path, "big", "--instances", "64", "--router", "hybrid", "--limit", "1000",
                  "--time-scale", "0.05", "--route-candidates", "16", "--kv-pages", "512",
                  "--checkpoint-slots", "64")
    assert rep["requests"] == 1000 and rep["rejected"]["requests"] == 0
    assert sum(i["requests"] for i in rep["instances"]) == 1000
    assert sum(i["requests"] > 0 for i in rep["instances"]) == 64        # the load spread over all
    assert rep["evictions"]["device"]["kv_pages"] > 0


def test_route_candidates_one_is_refused(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", "--no-progress", "--simulate", "--timed", "--instances", "4", "--limit", "20",
                 "--route-candidates", "1", "--json", str(out)]) == 2
    assert "--route-candidates" in capsys.readouterr().err


def test_lazy_hashes_are_the_hashes_of_the_whole_trace():
    from hybridkv.engine.build import build_engine, model_config
    from hybridkv.cache.config import CacheConfig
    from hybridkv.replay.trace import TraceUnits, load_trace
    from hybridkv.replay.unit_hashes import UnitHasher

    reqs = load_trace(None, limit=200).requests
    mcfg = model_config("small")
    engine = build_engine(mcfg, CacheConfig(block_size=512, prefix_match_unit=64, num_kv_pages=64,
                                            num_checkpoint_slots=16), model_name="small").engine
    units = TraceUnits(512, 64, mcfg.vocab_size, 0)
    want = units.hashes_all(reqs, engine.cache)
    for max_blocks in (1 << 18, 1):                      # a memo emptied at every request: the same hashes
        hasher = UnitHasher(units, engine.cache, max_blocks)
        assert [hasher(r) for r in reqs] == want
    assert hasher.emptied > 0


def test_the_memo_keeps_a_prefix_in_use_across_generations():
    """A memo generation that fills up becomes the previous one; a prompt's blocks found there are
    carried into the new one (not hashed again), and the hashes stay those of the whole trace."""
    from hybridkv.engine.build import build_engine, model_config
    from hybridkv.cache.config import CacheConfig
    from hybridkv.replay.trace import TraceUnits, load_trace
    from hybridkv.replay.unit_hashes import UnitHasher

    reqs = load_trace(None, limit=300).requests
    mcfg = model_config("small")
    engine = build_engine(mcfg, CacheConfig(block_size=512, prefix_match_unit=64, num_kv_pages=64,
                                            num_checkpoint_slots=16), model_name="small").engine
    units = TraceUnits(512, 64, mcfg.vocab_size, 0)
    hasher = UnitHasher(units, engine.cache, max_blocks=200)
    assert [hasher(r) for r in reqs] == units.hashes_all(reqs, engine.cache)
    assert hasher.emptied > 2 and hasher.carried > 0
    assert len(hasher._memo.blocks) <= 200 + max(len(r.hash_ids) for r in reqs)


def test_lightest_are_the_k_lightest_through_many_changes():
    """The k lightest held apart from the heap stay the k lightest by each key (then the lowest
    index) through random load changes, with every instance live and with some down."""
    import random

    rng = random.Random(7)
    n, limit = 37, 10
    loads = _loads([rng.randrange(50) for _ in range(n)])
    for ld in loads:
        ld.queued_seconds = rng.random()
    idx = CandidateIndex(loads, limit=limit, wait_key=lambda ld: ld.queued_seconds)
    k = limit // 2

    def brute(live):
        by_load = sorted(live, key=lambda j: (loads[j].key(), j))[:k]
        by_wait = sorted(live, key=lambda j: (loads[j].queued_seconds, j))[:k]
        return sorted(set(by_load) | set(by_wait))

    for t in range(3000):
        j = rng.randrange(n)
        if rng.random() < 0.7:
            loads[j].outstanding_tokens = rng.randrange(50)
        if rng.random() < 0.5:
            loads[j].queued_seconds = rng.choice([0.0, rng.random()])
        idx.changed(j)
        live = list(range(n)) if t % 3 else sorted(rng.sample(range(n), rng.randrange(1, n)))
        assert idx.candidates([], 0, live) == brute(live), t
    assert all(len(h) <= 4 * n + 64 for h in idx._heaps)
