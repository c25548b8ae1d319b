"""The fleet on simulated engines: events mirror the cache, restarts, decode timing, the timed report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.groups import reuse_cap
from hybridkv.cli import main
from hybridkv.engine.build import build_engine
from hybridkv.engine.request import Request
from hybridkv.fleet.costmodel import StepCostModel, h200_kimi_linear_48b
from hybridkv.fleet.events import CacheEvent, EventKind, EventPublisher, InstanceView
from hybridkv.fleet.instance import FleetInstance, FleetRequest, SimulatedStore
from hybridkv.fleet.routers import HybridRouter, KVOverlapRouter, RoundRobin
from hybridkv.fleet.simulator import Fleet, latency_summary
from hybridkv.fleet.store import StoreCost, StoreView
from hybridkv.model.config import HybridConfig

UNIT = 64


def config(pages: int = 4096, slots: int = 256, policy: str = "branch+tail+interval=256") -> CacheConfig:
    return CacheConfig(block_size=64, prefix_match_unit=UNIT, num_kv_pages=pages, num_checkpoint_slots=slots,
                       policy=CheckpointPolicy.parse(policy), max_num_seqs=4, max_num_batched_tokens=512)


def builder(cfg: CacheConfig):
    tiny = HybridConfig.preset("tiny")
    return lambda listener, step_cost: build_engine(tiny, cfg, model_name="tiny", listener=listener,
                                                    step_cost=step_cost)


def prompts(seed: int, n: int) -> list[np.ndarray]:
    """Prompts sharing prefixes: a few roots, each extended by random units."""
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, 1000, UNIT * rng.integers(1, 6)) for _ in range(3)]
    return [np.concatenate([roots[rng.integers(0, 3)], rng.integers(0, 1000, rng.integers(1, 400))])
            for _ in range(n)]


@pytest.mark.parametrize("pages, slots", [(4096, 256), (24, 6)])
def test_a_view_built_from_events_gives_the_caches_own_joint_hit(pages, slots):
    cfg = config(pages, slots)
    pub = EventPublisher(0)
    built = builder(cfg)(pub, None)
    engine, view = built.engine, InstanceView(UNIT)
    probes = prompts(1, 40)
    for i, p in enumerate(prompts(0, 60)):
        engine.add_request(Request(f"r{i}", p, 1))
        engine.run_until_done()
        for ev in pub.drain():
            view.apply(ev)
        for q in probes[i % 4:: 10]:
            want = engine.cache.lookup(q, touch=False)
            got = view.match(engine.cache.hash_prompt(q), reuse_cap(len(q), UNIT))
            assert (got.hit, got.kv_hit) == (want.hit, want.kv_hit)
    assert engine.cache.evicted_pages > 0 or pages > 24


def fleet_requests(ps, gap_s: float, output_tokens: int = 8) -> list[FleetRequest]:
    return [FleetRequest(i, Request(f"r{i}", p, 1), arrival=i * gap_s, output_tokens=output_tokens)
            for i, p in enumerate(ps)]


def test_a_restarted_instance_loses_its_traffic_through_the_fleet():
    cfg, cost = config(), h200_kimi_linear_48b()
    instances = [FleetInstance(k, builder(cfg), cost, cfg.max_num_seqs) for k in range(2)]
    fleet = Fleet(instances, HybridRouter(cost), UNIT, cost)
    shared = np.arange(2000) % 997
    first = fleet_requests([shared], 0.0)
    fleet.run(first)
    j = first[0].instance
    again = fleet_requests([shared], 0.0)
    again[0].arrival = 10.0
    fleet.run(again)
    assert again[0].instance == j and again[0].request.reused > 0     # its cache drew the request back
    fleet.restart(j)
    third = fleet_requests([shared], 0.0)
    third[0].arrival = 20.0
    instances[j].load.outstanding_tokens = 1          # j a little busier: only its lost cache could draw it
    fleet.run(third)
    assert fleet.state.views[j].epoch == 1
    assert third[0].instance == 1 - j and third[0].request.reused == 0


def test_timings_are_ordered_and_decode_is_modelled():
    cfg = config()
    cost = StepCostModel(name="flat", overhead_s=0.001, linear_s_per_token=1e-5, attention_s_per_pair=0.0,
                         dense_weights_s=0.002)
    instances = [FleetInstance(k, builder(cfg), cost, cfg.max_num_seqs) for k in range(2)]
    frs = fleet_requests(prompts(2, 30), 0.01, output_tokens=20)
    Fleet(instances, RoundRobin(), UNIT, cost).run(frs)
    for fr in frs:
        assert fr.arrival <= fr.admitted <= fr.first_token <= fr.finished
        assert fr.finished - fr.first_token >= 19 * 0.003 - 1e-9      # 19 more tokens, each a step >= 3 ms
    assert sum(i.stats.requests for i in instances) == 30


def test_latency_summary_is_ordered():
    s = latency_summary([0.5, 0.1, 2.0, 0.3, 9.0])
    assert s["p50"] <= s["p90"] <= s["p99"] and s["p50"] == 0.5
    assert latency_summary([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def _timed(tmp_path, *args):
    out = tmp_path / "r.json"
    assert main(["replay", "--no-progress", "--timed", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def _sane(rep, instances):
    for key in ("ttft_seconds", "queue_seconds", "e2e_seconds"):
        s = rep[key]
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"], key
    for q in ("mean", "p50", "p90", "p99"):
        assert rep["queue_seconds"][q] <= rep["ttft_seconds"][q] <= rep["e2e_seconds"][q]
    assert len(rep["instances"]) == instances
    assert sum(i["requests"] for i in rep["instances"]) == rep["requests"]
    assert sum(i["reused_tokens"] for i in rep["instances"]) == rep["reused_tokens"]
    assert all(set(i) == {"requests", "busy_seconds", "reused_tokens", "queue_peak"} for i in rep["instances"])
    assert rep["load_skew"] >= 1.0 and rep["rejected"]["requests"] == 0


def test_simulated_timed_report_keys(tmp_path):
    rep = _timed(tmp_path, "--simulate", "--limit", "200", "--instances", "3", "--time-scale", "0.5")
    _sane(rep, 3)
    assert rep["router"] == "hybrid" and rep["time_scale"] == 0.5 and "H200" in rep["cost_model"]
    assert rep["requests"] == 200 and 0 < rep["oracle_fraction"] <= 1.0


def test_real_timed_replay_is_exact(tmp_path):
    rep = _timed(tmp_path, "--model", "tiny", "--limit", "8", "--instances", "2", "--verify", "2",
                 "--time-scale", "1000", "--router", "least-load")
    _sane(rep, 2)
    assert rep["verify"]["requests"] == 2 and rep["verify"]["greedy_mismatches"] == 0
    assert rep["verify"]["max_abs_logit_diff"] <= 1e-4


@pytest.mark.parametrize("args, named", [
    (["--router", "hybrid"], "--router hybrid needs --timed"),
    (["--timed", "--time-scale", "0"], "--time-scale: '0' must be a number in [1e-06, 1000000]"),
    (["--timed", "--router", "fastest"], "fastest"),
])
def test_bad_timed_options_are_named(args, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--limit", "5", "--no-progress", *args])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_an_unknown_cost_model_is_named(tmp_path, capsys):
    rc = main(["replay", "--simulate", "--timed", "--limit", "5", "--no-progress", "--cost-model", "gpu9000"])
    assert rc == 2 and "gpu9000" in capsys.readouterr().err


def store_fleet(bytes_per_s: float) -> tuple[Fleet, list[FleetInstance]]:
    cfg = CacheConfig(block_size=512, prefix_match_unit=UNIT, num_kv_pages=512, num_checkpoint_slots=64,
                      policy=CheckpointPolicy.parse("branch+tail=512"), max_num_seqs=4)
    cost = h200_kimi_linear_48b()
    store = StoreCost(bytes_per_s=bytes_per_s, latency_s=1e-4, alignment=512, kv_bytes_per_token=16_128,
                      checkpoint_bytes=1 << 20)
    view = StoreView(UNIT, 512)
    shared = SimulatedStore(view, store)
    instances = [FleetInstance(k, builder(cfg), cost, 4, shared) for k in range(2)]
    return Fleet(instances, RoundRobin(), UNIT, cost, view), instances


def test_a_simulated_store_install_is_owned_by_the_requests_namespace():
    """The entries a simulated store load installs belong to the request's namespace, as the store
    tier's installs do, so a purge by that owner removes them (before: owner ``None``, kept, and a
    later request of the purged tenant hit them)."""
    from hybridkv.cache.namespace import CacheIdentity
    from hybridkv.cache.purge import PurgeSelector, purge_device

    tenant = CacheIdentity(model_repo="tiny", tenant="a").digest()
    fleet, instances = store_fleet(1e12)
    prompt = np.arange(4000) % 991
    frs = [FleetRequest(i, Request(f"r{i}", prompt, 1, namespace=tenant), arrival=float(i), output_tokens=8)
           for i in range(2)]
    fleet.run(frs)
    assert frs[1].instance == 1 and instances[1].stats.store_hit_tokens == 3584
    cache = instances[1].handle.engine.cache
    path = cache.index.walk(frs[1].request.hashes[: 3584 // UNIT])
    assert len(path) == 3584 // UNIT and {n.owner for n in path} == {tenant}
    assert purge_device(cache, PurgeSelector(owners={tenant})).nodes >= len(path)
    assert cache.lookup(prompt, tenant, touch=False).hit == 0


@pytest.mark.parametrize("bytes_per_s, loads", [(1e12, True), (1e6, False)])
def test_a_simulated_store_serves_another_instance_only_when_loading_pays(bytes_per_s, loads):
    fleet, instances = store_fleet(bytes_per_s)
    prompt = np.arange(4000) % 991
    frs = fleet_requests([prompt, prompt], 1.0)            # round-robin: the second goes to the other instance
    fleet.run(frs)
    second, st = frs[1], instances[1].stats
    assert second.instance == 1
    if loads:
        assert second.request.reused == 3584 and st.store_hit_tokens == 3584 and st.store_bytes_loaded > 0
        assert second.first_token - second.admitted < frs[0].first_token - frs[0].admitted
    else:
        assert second.request.reused == 0 and st.store_declined == 1 and st.store_bytes_loaded == 0


def test_the_store_view_matches_whole_entries_and_outlives_restarts():
    hashes = [bytes([i]) * 32 for i in range(10)]                           # 10 units of 64: entries of 256 end at 256, 512
    v = StoreView(UNIT, 256)
    v.apply(CacheEvent(0, 0, 0, EventKind.BLOCKS_STORED, tuple(hashes[:9])))
    v.apply(CacheEvent(0, 0, 1, EventKind.CHECKPOINTS_STORED, (hashes[3], hashes[6], hashes[7])))
    assert v.match(hashes, 640).hit == 512 and v.match(hashes, 640).kv_hit == 512
    v.apply(CacheEvent(0, 1, 0, EventKind.ALL_CLEARED, ()))
    v.apply(CacheEvent(0, 1, 1, EventKind.BLOCKS_REMOVED, tuple(hashes)))
    assert v.match(hashes, 640).hit == 512
    with pytest.raises(ValueError, match="100"):
        StoreView(UNIT, 100)


def test_a_store_with_a_capacity_evicts_the_least_recently_used():
    unit_bytes, ckpt_bytes = UNIT * 100, 1000
    a = [bytes([1, i]) * 16 for i in range(4)]                    # two prompts of 4 units, entries of 128
    b = [bytes([2, i]) * 16 for i in range(4)]
    v = StoreView(UNIT, 128, capacity_bytes=8 * unit_bytes + 3 * ckpt_bytes, kv_bytes_per_token=100,
                  checkpoint_bytes=ckpt_bytes)
    for seq, hs in enumerate((a, b)):
        v.apply(CacheEvent(0, 0, 2 * seq, EventKind.BLOCKS_STORED, tuple(hs), first_unit=0))   # entries hs[1], hs[3]
        v.apply(CacheEvent(0, 0, 2 * seq + 1, EventKind.CHECKPOINTS_STORED, (hs[3],)))
    assert v.match(a, 256).hit == 256 and v.match(b, 256).hit == 256 and v.evicted_bytes == 0
    v.touch(a, 256)                                               # a load read a: b is now the oldest
    c = [bytes([3, i]) * 16 for i in range(2)]
    v.apply(CacheEvent(0, 0, 4, EventKind.BLOCKS_STORED, tuple(c), first_unit=0))
    v.apply(CacheEvent(0, 0, 5, EventKind.CHECKPOINTS_STORED, (c[1],)))
    assert v.match(a, 256).hit == 256 and v.match(c, 128).hit == 128
    assert v.match(b, 256).hit == 0                               # b's first entry went first
    assert v.bytes_held <= v.capacity_bytes and v.bytes_peak <= v.capacity_bytes
    assert v.evicted_bytes == 2 * unit_bytes + 0 * ckpt_bytes     # one entry of 2 units
    assert set(v.kv) == {a[1], a[3], b[3], c[1]}
    assert v.checkpoints <= v.kv.keys()
    with pytest.raises(ValueError, match="capacity_bytes=0"):
        StoreView(UNIT, 128, capacity_bytes=0, kv_bytes_per_token=100, checkpoint_bytes=1)
    with pytest.raises(ValueError, match="kv_bytes_per_token=0"):
        StoreView(UNIT, 128, capacity_bytes=10)


def test_the_store_view_holds_and_charges_only_checkpoints_on_entry_boundaries():
    unit_bytes, ckpt_bytes = UNIT * 100, 1000
    hashes = [bytes([4, i]) * 16 for i in range(8)]                # 8 units of 64; entries of 256
    v = StoreView(UNIT, 256, kv_bytes_per_token=100, checkpoint_bytes=ckpt_bytes)
    pub = EventPublisher(0)
    pub.stored(hashes, [hashes[1], hashes[3], hashes[6], hashes[7]], [], [128, 256, 448, 512], 0)
    for ev in pub.drain():
        v.apply(ev)
    assert v.bytes_held == 8 * unit_bytes + 2 * ckpt_bytes       # 128 and 448 are not entry boundaries
    assert v.checkpoints == {hashes[3], hashes[7]} and set(v.kv) == {hashes[3], hashes[7]}
    assert v.match(hashes, 512).hit == 512
    with pytest.raises(ValueError, match="2 checkpoint boundaries for 1 checkpoint keys"):
        pub.stored(hashes, [hashes[3]], [], [256, 512])


def test_engine_events_carry_each_checkpoint_boundary():
    cfg = config(policy="branch+tail+interval=128")
    inst = FleetInstance(0, builder(cfg), StepCostModel(name="flat", overhead_s=0.001,
                         linear_s_per_token=1e-5, attention_s_per_pair=0.0), cfg.max_num_seqs)
    fr = FleetRequest(0, Request("r0", np.arange(700) % 97, 4), arrival=0.0, output_tokens=4)
    inst.enqueue(fr, 0.0, 0.0)
    events = []
    while inst.has_work:
        inst.step()
        events += [e for e in inst.publisher.drain() if e.kind is EventKind.CHECKPOINTS_STORED]
    g, hashes = cfg.prefix_match_unit, fr.request.match.hashes
    bounds = [b for e in events for b in e.boundaries]
    assert all(len(e.boundaries) == len(e.keys) for e in events)
    for e in events:                                               # each key is the chained hash ending at its boundary
        assert list(e.keys) == [hashes[b // g - 1] for b in e.boundaries]
    assert {128, 256, 384, 512, 640} <= set(bounds)                # interval=128 over a 700-token prompt


def test_decoding_requests_hold_their_pages_until_their_last_token():
    cfg = config()
    cost = StepCostModel(name="flat", overhead_s=0.001, linear_s_per_token=1e-5, attention_s_per_pair=0.0)
    inst = FleetInstance(0, builder(cfg), cost, cfg.max_num_seqs)
    pool = inst.handle.engine.cache.pages
    fr = FleetRequest(0, Request("r0", np.arange(300) % 97, 200), arrival=0.0, output_tokens=200)
    inst.enqueue(fr, 0.0, 0.0)
    inst.step()
    assert fr.first_token is not None and inst.decoding == [fr]
    held = pool.num_pages - pool.num_free - pool.num_evictable
    assert held == -(-(300 + 200 - 1) // cfg.block_size)          # prompt + output - 1 tokens, as admitted
    while inst.has_work:
        inst.step()
    assert fr.finished is not None and pool.num_pages - pool.num_free - pool.num_evictable == 0
    assert not inst.handle.engine.detached and fr.request.status.value == "finished"


def test_a_restart_from_the_command_line(tmp_path):
    rep = _timed(tmp_path, "--simulate", "--limit", "120", "--instances", "2", "--restart", "1@20",
                 "--restart", "0@1e9", "--store-gib", "0.5", "--time-scale", "4")
    _sane(rep, 2)
    assert [r["instance"] for r in rep["restarts"]] == [1]       # 0@1e9: after the last arrival, never done
    assert rep["restarts"][0]["requested"] == 20.0 <= rep["restarts"][0]["at"] < 168.0   # the 120th arrives at 168 s
    assert rep["store"]["capacity_bytes"] == 2**29 and rep["store"]["bytes_peak"] <= 2**29
    tier = rep["tiers"]["store"]                 # the simulated store's loads, as a store tier reports them
    assert tier["hit_tokens"] == rep["store"]["hit_tokens"] > 0
    assert tier["loads_taken"] == rep["store"]["loads"] > 0 and tier["loads_declined"] == rep["store"]["declined"]
    assert tier["bytes_peak"] == rep["store"]["bytes_peak"] > 0
    # every byte written is still held or was evicted, so at least the peak and at least what went
    assert tier["bytes_saved"] >= max(tier["bytes_peak"], rep["store"]["evicted_bytes"])


@pytest.mark.parametrize("args, named", [
    (["--timed", "--restart", "3"], "'3' is not INSTANCE@SECONDS"),
    (["--timed", "--restart", "x@1"], "instance 'x'"),
    (["--timed", "--restart", "1@-2"], "seconds '-2'"),
    (["--restart", "1@2"], "--restart"),
])
def test_bad_restarts_are_named(args, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--limit", "5", "--no-progress", *args])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_a_restart_of_a_missing_instance_is_named(tmp_path, capsys):
    rc = main(["replay", "--simulate", "--timed", "--limit", "5", "--no-progress", "--instances", "2",
               "--restart", "5@1"])
    assert rc == 2 and "restart of instance 5" in capsys.readouterr().err


def test_a_crash_requeues_what_it_held_and_its_lost_cache_attracts_nothing():
    cfg, cost = config(), h200_kimi_linear_48b()
    instances = [FleetInstance(k, builder(cfg), cost, cfg.max_num_seqs) for k in range(2)]
    fleet = Fleet(instances, KVOverlapRouter(cfg.block_size), UNIT, cost)
    rng = np.random.default_rng(3)
    shared = np.arange(2000) % 997
    ps = [np.concatenate([shared, rng.integers(0, 1000, 100)]) for _ in range(16)]
    frs = fleet_requests(ps, 0.05, output_tokens=400)                 # arrivals 0 .. 0.75 s; decodes of seconds
    fleet.schedule_crash(0, 0.3, cold_start_s=5.0)
    fleet.run(frs)
    (crash,) = fleet.crashes_done
    assert crash["instance"] == 0 and crash["requested"] == 0.3 <= crash["at"] and crash["requeued"] > 0
    assert crash["back_at"] == pytest.approx(crash["at"] + 5.0, abs=1e-6)
    requeued = [fr for fr in frs if fr.requeues]
    assert len(requeued) == crash["requeued"]
    for fr in frs:                                                    # every request ends, none refused
        assert fr.finished is not None and not fr.rejected and fr.first_token is not None
        assert fr.arrival <= fr.ttft_end <= fr.finished
    for inst in instances:                     # kv-overlap's page counts came back to zero through the crash
        assert inst.load.pages == {} and inst.load.partial_pages == 0 and inst.load.prefill_tokens == 0
    for fr in requeued + [fr for fr in frs if fr.arrival >= crash["at"]]:
        assert fr.instance == 1                                       # nothing goes to an instance that is down
    view = fleet.state.views[0]
    assert view.epoch == 1 and view.stale_dropped == 0
    old = instances[1].handle.engine.cache.hash_prompt(shared)
    assert not view.kv.intersection(old)                              # the new epoch dropped the lost cache
    # instance 1 is a little busier: only instance 0's lost cache could draw the next request there
    late = fleet_requests([ps[0]], 0.0)
    late[0].arrival = crash["back_at"] + 10.0
    instances[1].load.outstanding_tokens = 10 * cfg.block_size        # 10 blocks, less than the 31 shared ones
    fleet.run(late)
    assert late[0].instance == 1 and late[0].request.reused > 0


def test_a_crash_from_the_command_line(tmp_path):
    rep = _timed(tmp_path, "--simulate", "--limit", "120", "--instances", "2", "--crash", "1@20",
                 "--cold-start", "5", "--time-scale", "4", "--router", "kv-overlap")
    (crash,) = rep["crashes"]
    assert set(crash) == {"instance", "requested", "at", "back_at", "requeued"}
    assert crash["instance"] == 1 and crash["back_at"] == pytest.approx(crash["at"] + 5.0, abs=1e-6)
    assert rep["requeued"]["requests"] == rep["requeued"]["times"] == crash["requeued"]
    assert rep["rejected"]["requests"] == 0 and rep["ttft_seconds"]["p50"] is not None
    if crash["requeued"]:
        assert rep["requeued"]["ttft_seconds"]["p50"] > 0


@pytest.mark.parametrize("args, named", [
    (["--crash", "1@2"], "--crash"),
    (["--timed", "--crash", "1@2", "--cold-start", "-1"], "--cold-start: '-1' must be a number in [0, 1000000000]"),
    (["--timed", "--crash", "1@"], "seconds '' in '1@' is not a number"),          # named the spec: before, "'' is not a number"
    (["--timed", "--crash", "1@2@3"], "seconds '2@3' in '1@2@3' is not a number"),
    (["--timed", "--cold-start", "5"], "--cold-start 5 needs --crash"),
    (["--timed", "--crash=-1@2"], "instance -1 in '-1@2' must be 0 or more"),
])
def test_bad_crashes_are_named(args, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--limit", "5", "--no-progress", *args])
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_crashes_are_in_the_summary_and_one_after_the_run_is_warned_of(tmp_path, capsys):
    rep = _timed(tmp_path, "--simulate", "--limit", "60", "--instances", "2", "--crash", "1@20",
                 "--crash", "0@1e6", "--cold-start", "5")
    out, err = capsys.readouterr()
    assert [c["instance"] for c in rep["crashes"]] == [1]                 # the late one did not happen
    assert "crash of instance 1" in out and "crash of instance 0" not in out
    assert "--crash 0@1e+06 not done" in err and "--crash 1@" not in err


def test_a_crash_of_a_missing_instance_is_named(capsys):
    rc = main(["replay", "--simulate", "--timed", "--limit", "5", "--no-progress", "--instances", "2",
               "--crash", "5@1"])
    assert rc == 2 and "crash of instance 5" in capsys.readouterr().err


def test_a_crash_asked_for_while_the_instance_is_down_does_not_crash_it_again_at_its_return():
    """One instance, crashed at 0.3 s and again at 0.31 s (still down; the requests arriving
    meanwhile queue on it, the only instance). Before: the second crash waited for the queued
    work's clock (the return) and then lost all 16 requests again (23 requeues); after: it is
    dropped (down already), and only the 7 requests the first crash held are requeued, once."""
    cfg, cost = config(), h200_kimi_linear_48b()
    instances = [FleetInstance(0, builder(cfg), cost, cfg.max_num_seqs)]
    fleet = Fleet(instances, KVOverlapRouter(cfg.block_size), UNIT, cost)
    rng = np.random.default_rng(3)
    shared = np.arange(2000) % 997
    frs = fleet_requests([np.concatenate([shared, rng.integers(0, 1000, 100)]) for _ in range(16)], 0.05,
                         output_tokens=400)
    fleet.schedule_crash(0, 0.3, cold_start_s=2.0)
    fleet.schedule_crash(0, 0.31, cold_start_s=2.0)
    fleet.run(frs)
    (crash,) = fleet.crashes_done
    assert crash["requested"] == 0.3
    assert sum(fr.requeues for fr in frs) == crash["requeued"] == sum(fr.requeues > 0 for fr in frs)
    assert all(fr.finished is not None and not fr.rejected for fr in frs)


def test_requests_a_crash_requeued_are_counted_once(tmp_path):
    """Both instances crash at 20 s; 4 requests they held are requeued and end elsewhere. Before:
    the crashed engines' counters kept the lost attempts (requests 124 of a 120-request trace,
    instances' requests summing to 124, prompt tokens counted twice); after: each request counts
    once, where it ended, and the prompt tokens are the trace's (those of a run without crashes)."""
    common = ("--simulate", "--limit", "120", "--instances", "2", "--time-scale", "4")
    rep = _timed(tmp_path, *common, "--crash", "0@20", "--crash", "1@20", "--cold-start", "5")
    plain = _timed(tmp_path, *common)
    assert rep["requeued"]["requests"] > 0
    assert rep["requests"] == plain["requests"] == 120
    assert sum(i["requests"] for i in rep["instances"]) == rep["requests"] - rep["rejected"]["requests"]
    assert rep["prompt_tokens"] == plain["prompt_tokens"]
    assert rep["computed_prompt_tokens"] + rep["reused_tokens"] == rep["prompt_tokens"]


def test_a_crash_not_done_because_the_instance_was_down_is_warned_of_with_that_reason(tmp_path, capsys):
    # Before: "--crash 1@21 not done: the fleet's work ended at 31.6 s", though 21 s is before that;
    # it was not done because instance 1 was down then (crashed at 20 s, back at 25 s).
    rep = _timed(tmp_path, "--simulate", "--limit", "60", "--instances", "2", "--crash", "1@20",
                 "--crash", "1@21", "--cold-start", "5")
    err = capsys.readouterr().err
    (crash,) = rep["crashes"]
    assert crash["requested"] == 20.0 and rep["makespan_seconds"] > 21.0
    assert "--crash 1@21 not done: instance 1 was down then" in err and "work ended" not in err


@pytest.mark.parametrize("router", ["hybrid", "kv-overlap"])
def test_a_request_queued_while_every_instance_is_down_is_priced_on_an_empty_cache(router):
    """One instance serves a prompt, then crashes (back 5 s later with an empty cache); the same
    prompt arriving while it is down queues on it. Its view still shows the lost cache until the
    return (``all_cleared`` is heard then), so pricing from it gave a hit the new engine does not
    have: a queued prefill of the prompt net of the lost KV (and, for kv-overlap, prefill tokens
    net of that overlap). It is priced as what it is: the whole prompt from zero."""
    cfg, cost = config(), h200_kimi_linear_48b()
    instances = [FleetInstance(0, builder(cfg), cost, cfg.max_num_seqs)]
    chosen = HybridRouter(cost) if router == "hybrid" else KVOverlapRouter(cfg.block_size)
    fleet = Fleet(instances, chosen, UNIT, cost)
    prompt = np.arange(2000) % 997
    first = fleet_requests([prompt], 0.0)
    fleet.run(first)
    assert fleet.state.views[0].match(first[0].hashes, reuse_cap(len(prompt), UNIT)).hit > 0   # the view holds it
    down_at = first[0].finished + 1.0
    fleet.schedule_crash(0, down_at, cold_start_s=5.0)
    again = fleet_requests([prompt], 0.0)
    again[0].arrival = down_at + 0.5                                   # while the only instance is down
    fleet.run(again)
    assert fleet.crashes_done and not fleet.crashes_done[0]["requeued"]
    assert again[0].instance == 0 and again[0].requeues == 0
    assert again[0].predicted_s == pytest.approx(cost.prefill_seconds(0, len(prompt)))   # set when queued
    if router == "kv-overlap":
        assert again[0].pages[2] == len(prompt)                         # every prompt token to prefill
    assert again[0].request.reused == 0                                 # as it happened: the cache was empty


class _LRUStoreModel:
    """The store view's capacity rule written plainly, to check the lazy one against: every
    entry (a KV entry keyed by the unit hash ending it, ``("u", key)``, or a checkpoint,
    ``("c", key)``) in one OrderedDict moved to the end on each use; the oldest evicted first,
    an entry taking its checkpoint."""

    def __init__(self, unit: int, alignment: int, cap: int, unit_bytes: int, ckpt_bytes: int) -> None:
        from collections import OrderedDict
        self.unit, self.alignment, self.cap = unit, alignment, cap
        self.unit_bytes, self.ckpt_bytes = unit_bytes, ckpt_bytes
        self.order: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.held = self.peak = self.evicted = 0

    def _use(self, entry: tuple[str, bytes]) -> bool:
        new = entry not in self.order
        self.order[entry] = None
        self.order.move_to_end(entry)
        return new

    def stored(self, keys, first: int) -> None:
        """Units ``first, first + 1, ...`` of a prompt: those ending an entry are held."""
        step = self.alignment // self.unit
        ends = [k for i, k in enumerate(keys, first + 1) if i % step == 0]
        self.held += sum(self._use(("u", k)) for k in ends) * self.unit_bytes
        self._evict()

    def checkpoints_stored(self, keys, boundaries) -> None:
        new = [k for k, b in zip(keys, boundaries) if b % self.alignment == 0 and ("u", k) in self.order]
        self.held += sum(self._use(("c", k)) for k in new) * self.ckpt_bytes
        self._evict()

    def touch(self, hashes, end: int) -> None:
        for k in hashes[:end // self.unit]:
            if ("u", k) in self.order:
                self._use(("u", k))
        if end and ("c", hashes[end // self.unit - 1]) in self.order:
            self._use(("c", hashes[end // self.unit - 1]))

    def _evict(self) -> None:
        while self.held > self.cap and self.order:
            (kind, key), _ = self.order.popitem(last=False)
            self.held -= self.unit_bytes if kind == "u" else self.ckpt_bytes
            self.evicted += self.unit_bytes if kind == "u" else self.ckpt_bytes
            if kind == "u" and self.order.pop(("c", key), 0) is None:
                self.held -= self.ckpt_bytes
                self.evicted += self.ckpt_bytes
        self.peak = max(self.peak, self.held)

    def units(self) -> set[bytes]:
        return {k for kind, k in self.order if kind == "u"}

    def checkpoints(self) -> set[bytes]:
        return {k for kind, k in self.order if kind == "c"}


@pytest.mark.parametrize("seed", range(6))
def test_the_store_view_evicts_as_a_plain_lru_of_its_entries_would(seed):
    rng = np.random.default_rng(seed)
    entry_bytes, ckpt_bytes, alignment = 2 * UNIT * 100, 1500, 2 * UNIT
    cap = int(rng.integers(3, 20)) * entry_bytes + int(rng.integers(0, 5)) * ckpt_bytes
    v = StoreView(UNIT, alignment, capacity_bytes=cap, kv_bytes_per_token=100, checkpoint_bytes=ckpt_bytes)
    ref = _LRUStoreModel(UNIT, alignment, cap, entry_bytes, ckpt_bytes)
    # chains of unit keys: a few roots, prompts extending them (a key names its whole prefix)
    chains = [[bytes([seed, r, 0, i]) * 8 for i in range(int(rng.integers(4, 30)))] for r in range(6)]
    for step in range(400):
        hs = chains[int(rng.integers(len(chains)))]
        op = rng.random()
        if op < 0.45:                                                     # a stored run [a, b) of one chain
            a = int(rng.integers(0, len(hs)))
            b = int(rng.integers(a + 1, len(hs) + 1))
            v.apply(CacheEvent(0, 0, step, EventKind.BLOCKS_STORED, tuple(hs[a:b]), first_unit=a))
            ref.stored(hs[a:b], a)
        elif op < 0.75:                                                   # checkpoints, some off the entries
            idx = sorted({int(i) for i in rng.integers(0, len(hs), int(rng.integers(1, 4)))})
            keys, bounds = tuple(hs[i] for i in idx), tuple((i + 1) * UNIT for i in idx)
            v.apply(CacheEvent(0, 0, step, EventKind.CHECKPOINTS_STORED, keys, bounds))
            ref.checkpoints_stored(keys, bounds)
        else:                                                             # a load read [0, end)
            end = int(rng.integers(0, len(hs) + 1)) * UNIT
            v.touch(hs, end)
            ref.touch(hs, end)
        assert set(v.kv) == ref.units(), step
        assert v.checkpoints == ref.checkpoints(), step
        assert (v.bytes_held, v.bytes_peak, v.evicted_bytes) == (ref.held, ref.peak, ref.evicted), step
    assert ref.evicted > 0                                                 # the capacity was reached


@pytest.mark.parametrize("bytes_per_s, loads", [(1e12, True), (1e6, False)])
def test_a_store_hits_queued_seconds_include_the_load(bytes_per_s, loads):
    """A request sent where only the store holds its prefix books as its queued seconds the
    prefill past the store's hit plus the store load when loading pays (priced_prefill, the
    instance's own rule), else the whole prefill; the hybrid router books the work it priced."""
    from hybridkv.fleet.routers import FleetState, InstanceLoad, RouteRequest, priced_prefill

    fleet, instances = store_fleet(bytes_per_s)
    store = fleet.store_cost = instances[0].store.cost
    prompt = np.arange(4000) % 991
    frs = fleet_requests([prompt, prompt], 1.0)            # round-robin: the second goes to the other instance
    fleet.run(frs)
    cost = fleet.estimate
    assert frs[1].instance == 1 and instances[1].stats.store_hit_tokens == (3584 if loads else 0)
    if loads:
        want = cost.prefill_seconds(3584, 4000) + store.transfer_seconds(0, 3584) + store.latency_seconds(0, 3584)
        assert want > cost.prefill_seconds(3584, 4000) + 2 * 8 * store.latency_s * (1 - 1e-9)
    else:
        want = cost.prefill_seconds(0, 4000)
    assert frs[1].predicted_s == pytest.approx(want, rel=1e-12)
    assert frs[0].predicted_s == pytest.approx(cost.prefill_seconds(0, 4000), rel=1e-12)

    hashes = frs[1].hashes
    sview = StoreView(UNIT, 512)
    sview.apply(CacheEvent(0, 0, 0, EventKind.BLOCKS_STORED, tuple(hashes[:56])))
    sview.apply(CacheEvent(0, 0, 1, EventKind.CHECKPOINTS_STORED, (hashes[55],), (3584,)))
    state = FleetState(views=[InstanceView(UNIT), InstanceView(UNIT)], loads=[InstanceLoad(), InstanceLoad()],
                       store=sview)
    router = HybridRouter(cost, store)
    router.route(RouteRequest(hashes=hashes, prompt_tokens=4000, limit=reuse_cap(4000, UNIT)), state)
    assert router.expected_hit() == (3584 if loads else 0)
    assert router.expected_seconds() == priced_prefill(cost, store, 4000, 0, 0, 3584)[0]
    assert router.expected_seconds() == pytest.approx(want, rel=1e-12)


def test_a_store_load_reads_whole_entries_priced_as_the_router_prices_them():
    """With store entries (1024 tokens) larger than pages (512), an instance holding part of
    an entry locally still reads that whole entry: the load is priced and counted from the entry
    boundary, the start ``priced_prefill`` uses, while pages are installed from the page boundary
    (before: priced from the page boundary, so router and instance could disagree on whether
    loading pays)."""
    from hybridkv.fleet.store import load_start

    cfg = CacheConfig(block_size=512, prefix_match_unit=UNIT, num_kv_pages=512, num_checkpoint_slots=64,
                      policy=CheckpointPolicy.parse("branch+tail=1024"), max_num_seqs=4, store_alignment=1024)
    cost = h200_kimi_linear_48b()
    store = StoreCost(bytes_per_s=1e12, latency_s=1e-4, alignment=1024, kv_bytes_per_token=16_128,
                      checkpoint_bytes=1 << 20)
    view = StoreView(UNIT, 1024, kv_bytes_per_token=16_128, checkpoint_bytes=1 << 20)
    instances = [FleetInstance(k, builder(cfg), cost, 4, SimulatedStore(view, store)) for k in range(2)]
    fleet = Fleet(instances, RoundRobin(), UNIT, cost, view, store)
    prompt = np.arange(4000) % 991
    other = (np.arange(3000) * 7) % 983 + 1
    frs = fleet_requests([prompt, prompt[:600], other, prompt], 1.0)        # round-robin: 0, 1, 0, 1
    fleet.run(frs)
    st, last = instances[1].stats, frs[3]
    assert last.instance == 1 and st.store_loads == 1
    got = st.store_hit_tokens                  # no local checkpoint: the local joint hit is 0, its KV run 576
    assert got == 3072
    assert load_start(576, got, 1024) == 0 < load_start(576, got, 512) == 512
    assert st.store_bytes_loaded == store.load_bytes(0, got)
    assert st.store_seconds == pytest.approx(store.load_seconds(0, got), rel=1e-12)
