"""Entries an engine installs from a lower tier are announced like the ones it computes: a
router's view built from the events holds what the device can serve, loaded or computed."""

from __future__ import annotations

import numpy as np
import pytest
from hkv_helpers import run_one, tokens

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.groups import reuse_cap
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import TorchBackend
from hybridkv.engine.build import build_engine
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request
from hybridkv.fleet.events import EventKind, EventPublisher, InstanceView
from hybridkv.model.config import HybridConfig
from hybridkv.store.memory import MemoryStore
from hybridkv.tiers.connector import host_tier_for, tier_for

UNIT = 64


def _host_engine(model, listener, block_size=256, pages=8):
    cfg = CacheConfig(block_size=block_size, prefix_match_unit=UNIT, num_kv_pages=pages, num_checkpoint_slots=4,
                      policy=CheckpointPolicy.parse(f"branch+tail={block_size}"))
    backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    ns = CacheIdentity(model_repo="tiny").digest()
    host = host_tier_for(64 << 20, backend, ns, UNIT, block_size)
    return Engine(cfg, backend, ns, tiers=[host], listener=listener), host


def _apply(view: InstanceView, pub: EventPublisher) -> list:
    events = pub.drain()
    for ev in events:
        view.apply(ev)
    return events


def test_an_install_from_the_host_tier_emits_stored_events_the_view_then_holds(tiny_model):
    v = tiny_model.config.vocab_size
    pub = EventPublisher(0)
    e, host = _host_engine(tiny_model, pub)
    view = InstanceView(UNIT)
    P = tokens(50, 1024, v)
    hashes = e.cache.hash_prompt(P)
    run_one(e, np.concatenate([P, tokens(51, 30, v)]))              # 4 pages and C(P_1024)
    for i in range(3):                                              # push P's pages out of the device
        run_one(e, tokens(60 + i, 1000, v), max_output_tokens=1)
    _apply(view, pub)
    assert e.cache.evicted_pages > 0 and host.stats.bytes_saved > 0
    assert view.match(hashes, 1024).kv_hit < 1024                   # the view heard P's removal

    q = np.concatenate([P, tokens(52, 40, v)])
    r = run_one(e, q)
    events = _apply(view, pub)
    assert r.reused == 1024 and host.stats.hit_tokens > 0           # served from the host tier
    loaded = [ev for ev in events if ev.kind is EventKind.BLOCKS_STORED and ev.first_unit is not None
              and ev.first_unit * UNIT < 1024]
    assert loaded, "no blocks_stored event for the installed pages"
    ck = [ev for ev in events if ev.kind is EventKind.CHECKPOINTS_STORED and 1024 in ev.boundaries]
    assert ck and ck[0].keys[list(ck[0].boundaries).index(1024)] == hashes[1024 // UNIT - 1]
    # the view now gives the device's own joint hit
    want = e.cache.lookup(q, touch=False)
    got = view.match(e.cache.hash_prompt(q), reuse_cap(len(q), UNIT))
    assert (got.kv_hit, got.hit) == (want.kv_hit, want.hit) and got.hit >= 1024


def test_an_install_from_the_store_is_announced_too(tiny_model):
    """A second engine that loads another's prefix from a shared store announces it."""
    v = tiny_model.config.vocab_size
    store = MemoryStore(capacity_bytes=256 << 20)

    def engine(listener):
        cfg = CacheConfig(block_size=1024, prefix_match_unit=UNIT, num_kv_pages=8, num_checkpoint_slots=4,
                          policy=CheckpointPolicy.parse("branch+tail=1024"), store_alignment=1024)
        backend = TorchBackend(tiny_model, cfg.num_kv_pages, cfg.block_size)
        ns = CacheIdentity(model_repo="tiny", weight_digest=tiny_model.weight_digest()).digest()
        return Engine(cfg, backend, ns, tiers=[tier_for(store, backend, ns, UNIT, cfg.store_boundary)],
                      listener=listener)

    P = tokens(70, 1024, v)
    run_one(engine(None), np.concatenate([P, tokens(71, 30, v)]))
    pub, view = EventPublisher(1), InstanceView(UNIT)
    b = engine(pub)
    q = np.concatenate([P, tokens(72, 30, v)])
    r = run_one(b, q)
    _apply(view, pub)
    assert r.reused == 1024
    got = view.match(b.cache.hash_prompt(q), reuse_cap(len(q), UNIT))
    want = b.cache.lookup(q, touch=False)
    assert (got.kv_hit, got.hit) == (want.kv_hit, want.hit) and got.hit == 1024


@pytest.mark.parametrize("seed", [0, 1])
def test_a_view_of_a_simulated_engine_with_a_host_tier_gives_the_caches_own_joint_hit(seed):
    """The in-process view of a simulated fleet instance (payload-free host tier, small device pool)
    agrees with the device after every request, through evictions and host installs."""
    cfg = CacheConfig(block_size=64, prefix_match_unit=UNIT, num_kv_pages=24, num_checkpoint_slots=6,
                      policy=CheckpointPolicy.parse("branch+tail+interval=256"), max_num_seqs=4,
                      max_num_batched_tokens=512)
    pub = EventPublisher(0)
    built = build_engine(HybridConfig.preset("tiny"), cfg, model_name="tiny", listener=pub, host_bytes=64 << 20)
    engine, view = built.engine, InstanceView(UNIT)
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, 1000, UNIT * rng.integers(2, 6)) for _ in range(4)]
    for i in range(60):
        p = np.concatenate([roots[rng.integers(0, 4)], rng.integers(0, 1000, rng.integers(1, 300))])
        engine.add_request(Request(f"r{i}", p, 1))
        engine.run_until_done()
        _apply(view, pub)
        for root in roots:
            q = np.concatenate([root, [1, 2, 3]])
            want = engine.cache.lookup(q, touch=False)
            got = view.match(engine.cache.hash_prompt(q), reuse_cap(len(q), UNIT))
            assert (got.hit, got.kv_hit) == (want.hit, want.kv_hit), i
    assert engine.cache.evicted_pages > 0 and built.host_tier.stats.hit_tokens > 0
