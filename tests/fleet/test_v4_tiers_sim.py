"""A simulated DeepSeek-V4 engine has a (payload-free) host tier, and the simulated fleet's shared
store carries its groups (``csa-hca`` page entries, ``swa`` state entries), under each SWA
recovery strategy."""

from __future__ import annotations

import json

import pytest

from hybridkv.replay.runner import ReplayOptions, run_replay

# shared prefixes of 1..6 units of 64 tokens, each prefix seen again after other prompts
ROWS = [[0, 1, 2, 3, 4, 5, 40], [20, 21, 22, 41], [0, 1, 2, 3, 4, 5, 42], [20, 21, 22, 43], [30, 31, 32, 33, 44],
        [0, 1, 2, 3, 4, 5, 45], [30, 31, 32, 33, 46], [20, 21, 22, 47], [0, 1, 2, 3, 48]]
STRATEGIES = ["window", "periodic=128", "recompute"]


def _trace(path, rows, gap_ms=100):
    path.write_text("".join(json.dumps({"timestamp": gap_ms * i, "input_length": 512 * len(h), "output_length": 2,
                                        "hash_ids": h}) + "\n" for i, h in enumerate(rows)))
    return str(path)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_simulated_v4_engine_demotes_evicted_entries_to_its_host_tier_and_hits_there(tmp_path, strategy):
    """Device pools too small for the trace: evicted pages (and saved states, when the strategy
    keeps any) go to the host tier, and later prompts reuse them from there."""
    trace = _trace(tmp_path / "t.jsonl", ROWS * 2)
    rep = run_replay(ReplayOptions(trace=trace, limit=None, model="v4-tiny", block_tokens=64, simulate=True,
                                   swa_recovery=strategy, progress=False, host_bytes=64 << 20, num_kv_pages=12,
                                   max_num_seqs=1))
    host = rep.tiers["host"]
    assert host["hit_tokens"] > 0, host
    assert rep.reused_tokens >= host["hit_tokens"]
    states = rep.config["swa_restore"]["device_bytes_per_cached_token"]["swa_states"]
    assert (states == 0) == (strategy == "recompute")


def _timed(tmp_path, strategy, router="round-robin"):
    trace = _trace(tmp_path / "t.jsonl", ROWS * 2, gap_ms=2000)
    return run_replay(ReplayOptions(trace=trace, limit=None, model="v4-tiny", block_tokens=64, simulate=True,
                                    swa_recovery=strategy, progress=False, host_bytes=0, timed=True, instances=2,
                                    router=router))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_simulated_store_carries_v4_groups_and_instances_load_from_it(tmp_path, strategy):
    """Round robin sends a prompt's next turn to the other instance: its prefix comes from the
    shared store. A load reads page entries, plus a state entry unless the strategy saves none."""
    rep = _timed(tmp_path, strategy)
    store = rep.store
    assert store["hit_tokens"] > 0 and store["loads"] > 0, store
    from hybridkv.engine.v4backend import SimulatedV4Backend
    from hybridkv.model.v4.config import V4Config
    b = SimulatedV4Backend(V4Config.preset("v4-tiny"), 64, 64, strategy)
    # bytes read = tokens of page entries x their bytes per token + state entries x their bytes
    states = [n for n in range(store["loads"] + 1)
              if store["bytes_loaded"] >= n * b.checkpoint_bytes
              and (store["bytes_loaded"] - n * b.checkpoint_bytes) % b.kv_bytes_per_token == 0]
    if strategy == "recompute":
        assert states[0] == 0 and sum(rep.checkpoints_created.values()) == 0      # page entries alone
    else:
        assert max(states) >= 1
    assert rep.tiers["store"]["hit_tokens"] == store["hit_tokens"]



@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pages", [4096, 24])
def test_a_v4_view_built_from_events_gives_the_caches_own_joint_hit(strategy, pages):
    """A simulated V4 engine's events (naming csa-hca and swa) build a view whose joint hit,
    prefix run and restart point are the engine's own lookup's, with and without evictions."""
    import numpy as np

    from hybridkv.cache.config import CacheConfig, CheckpointPolicy
    from hybridkv.cache.groups import reuse_cap
    from hybridkv.engine.build import build_engine
    from hybridkv.engine.request import Request
    from hybridkv.fleet.events import EventPublisher, InstanceView
    from hybridkv.model.v4.config import V4Config

    unit = 64
    cfg = CacheConfig(block_size=64, prefix_match_unit=unit, num_kv_pages=pages, num_checkpoint_slots=64,
                      policy=CheckpointPolicy.parse("branch+tail+interval=256"), max_num_seqs=4,
                      max_num_batched_tokens=512)
    pub = EventPublisher(0)
    built = build_engine(V4Config.preset("v4-tiny"), cfg, model_name="v4-tiny", listener=pub, swa_recovery=strategy)
    pub.family = built.backend.family
    engine, view = built.engine, InstanceView(unit, built.backend.family)
    rng = np.random.default_rng(0)
    roots = [rng.integers(0, 1000, unit * int(rng.integers(2, 7))) for _ in range(3)]
    prompts = [np.concatenate([roots[int(rng.integers(0, 3))], rng.integers(0, 1000, int(rng.integers(1, 300)))])
               for _ in range(40)]
    hits = 0
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, 1))
        engine.run_until_done()
        for ev in pub.drain():
            assert ev.group in ("csa-hca", "swa")
            view.apply(ev)
        for q in prompts[i % 3:: 7]:
            want = engine.cache.lookup(q, touch=False)
            got = view.match(engine.cache.hash_prompt(q), reuse_cap(len(q), unit))
            assert (got.hit, got.kv_hit, got.restart) == (want.hit, want.kv_hit, want.restart)
            hits += got.hit > 0
    assert hits > 0
    assert engine.cache.evicted_pages > 0 or pages > 24
