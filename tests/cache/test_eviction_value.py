"""Eviction by value in the device pools (DESIGN §8): the pollution scenario (a stream of long
one-off prompts must not push out a short prefix most requests share under ``value``, while it
does under ``lru``), tenant quotas under a flood, and the referenced-entries-are-never-evicted rule."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache.config import CacheConfig, CheckpointPolicy, ConfigError
from hybridkv.cache.coordinator import HybridCacheCoordinator
from hybridkv.cache.pools import CheckpointPool
from hybridkv.store.eviction import ValueOrder

NS = b"n" * 32
UNIT, BLOCK = 64, 128
PAGE_BYTES, SLOT_BYTES = 4096, 1000
SHARED = 256                  # tokens of the prefix most requests share (2 pages)
ONE_OFF = 2048                # tokens of each long one-off prompt (16 pages)
FLOAT_TOL = 1e-9              # relative tolerance of the order's float clock and weights


def make_cache(eviction: str, pages: int = 40, slots: int = 4, quota: float | None = None) -> HybridCacheCoordinator:
    cfg = CacheConfig(block_size=BLOCK, prefix_match_unit=UNIT, num_kv_pages=pages, num_checkpoint_slots=slots,
                      policy=CheckpointPolicy.parse("branch+tail"), eviction=eviction, tenant_quota=quota)
    pool = CheckpointPool(slots, slot_bytes=SLOT_BYTES, eviction=eviction)
    return HybridCacheCoordinator(cfg, NS, pool, page_bytes=PAGE_BYTES, copy_page=None)


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


def serve(cache, prompt, checkpoints, namespace=None):
    """Look up, acquire, publish ``prompt`` with checkpoints at ``checkpoints`` (tokens), release.
    Returns the lookup's joint hit (tokens)."""
    match = cache.lookup(prompt, namespace)
    alloc = cache.acquire(match, len(prompt) + 8)
    assert alloc is not None
    cache.publish(alloc, match.hashes, len(prompt), {b: (None, "tail") for b in checkpoints})
    cache.release(alloc)
    cache.check_invariants()
    return match.hit


def pollution_hits(eviction: str) -> list[int]:
    """Joint hits of the shared-prefix requests of a stream: 20 warm-up requests on the shared
    prefix, then 30 rounds of one shared-prefix request followed by three long one-off prompts
    (51 pages and 3 checkpoints of one-offs per round against 40 pages and 4 slots)."""
    cache = make_cache(eviction)
    shared = tokens(0, SHARED)
    seed = iter(range(1, 10_000))

    def shared_request() -> int:
        prompt = np.concatenate([shared, tokens(next(seed), 72)])
        return serve(cache, prompt, [SHARED, len(prompt) // UNIT * UNIT])

    for _ in range(20):
        shared_request()
    hits = []
    for _ in range(30):
        hits.append(shared_request())
        for _ in range(3):
            serve(cache, tokens(next(seed), ONE_OFF), [ONE_OFF - UNIT])
    return hits


def test_one_off_flood_does_not_push_out_the_shared_prefix_under_value():
    hits = pollution_hits("value")
    assert hits == [SHARED] * len(hits)


def test_one_off_flood_pushes_out_the_shared_prefix_under_lru():
    hits = pollution_hits("lru")
    assert hits[0] == SHARED                                   # warm before the first flood round
    assert hits[1:] == [0] * (len(hits) - 1)                   # gone after every round of one-offs


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_quota_holds_under_a_tenant_flood(eviction):
    """Tenant B floods with distinct prompts; with a 25% quota its cached bytes stay within 25% of
    each pool after every request, and tenant A's prefix (within its own quota) keeps hitting."""
    quota = 0.25
    cache = make_cache(eviction, pages=40, slots=8, quota=quota)
    ns_a, ns_b = b"a" * 32, b"b" * 32
    a_prompt = tokens(0, SHARED + 64)
    assert serve(cache, a_prompt, [SHARED], ns_a) == 0
    for i in range(40):
        serve(cache, tokens(100 + i, 512), [448], ns_b)
        assert cache.pages.order.owner_bytes.get(ns_b, 0) <= quota * 40 * PAGE_BYTES
        assert cache.checkpoints.order.owner_bytes.get(ns_b, 0) <= quota * 8 * SLOT_BYTES
    assert cache.pages.order.owner_bytes.get(ns_b, 0) > 0     # B does hold entries (up to its quota)
    assert serve(cache, a_prompt, [SHARED], ns_a) == SHARED   # A's entries were not evicted for B


def test_quota_never_evicts_what_a_running_request_holds():
    cache = make_cache("value", pages=40, slots=8, quota=0.1)
    ns = b"b" * 32
    prompt = tokens(3, 1024)
    match = cache.lookup(prompt, ns)
    alloc = cache.acquire(match, len(prompt) + 8)
    cache.publish(alloc, match.hashes, len(prompt), {})
    assert cache.enforce_quota(match.namespace) == 0           # every page is held: nothing evicted
    assert len(alloc.nodes) == 1024 // UNIT and all(n.parent is not None for n in alloc.nodes)
    cache.release(alloc)                                       # released: now the quota applies
    cache.check_invariants()
    assert cache.evicted_pages > 0
    assert cache.pages.order.owner_bytes.get(match.namespace, 0) <= 0.1 * 40 * PAGE_BYTES


def test_value_evicts_the_unreused_deep_entry_before_a_reused_one_of_equal_cost():
    cache = make_cache("value", pages=8, slots=8)
    reused, once = tokens(1, 256), tokens(2, 256)
    serve(cache, reused, [])
    serve(cache, once, [])
    for _ in range(3):
        serve(cache, np.concatenate([reused, tokens(9, 8)]), [])   # hits the 2 pages of `reused`
    serve(cache, tokens(3, 640), [])        # 6 pages with 4 free: two evictions, both of `once` (deepest first)
    assert cache.lookup(np.concatenate([reused, [1]]), touch=False).kv_hit == 256
    assert cache.lookup(np.concatenate([once, [1]]), touch=False).kv_hit == 0


def test_bad_eviction_settings_are_refused_naming_the_value():
    with pytest.raises(ConfigError, match="eviction='mru'"):
        CacheConfig(eviction="mru")
    with pytest.raises(ConfigError, match="tenant_quota=1.5"):
        CacheConfig(tenant_quota=1.5)
    with pytest.raises(ConfigError, match="host_eviction='lfu'"):
        CacheConfig(host_eviction="lfu")


@pytest.mark.parametrize("host_eviction", ["lru", "value"])
def test_the_host_tier_orders_by_host_eviction_not_by_the_device_pools_order(host_eviction):
    from hybridkv.engine.build import build_engine, model_config
    cfg = CacheConfig(block_size=64, prefix_match_unit=64, eviction="value", host_eviction=host_eviction)
    handle = build_engine(model_config("tiny"), cfg, model_name="tiny", host_bytes=1 << 20)
    try:
        assert handle.engine.cache.pages.order.name == "value"
        assert handle.host_tier._order.name == host_eviction
    finally:
        handle.close()


def test_value_forgets_stale_reuse_and_keeps_a_conversations_newest_turn():
    """Prompts reused often long ago must not outlive a conversation's newest turn: four 512-token
    prompts are reused ten times each, then six pool turnovers of one-off prompts pass; a 1024-token
    turn is served, then three more one-offs, and the next turn (the same prompt plus 64 tokens)
    must hit the whole turn. The stale prompts' counts have decayed, so they go first."""
    cache = make_cache("value", pages=40, slots=64)
    stale = [tokens(500 + i, 512) for i in range(4)]
    for _ in range(10):
        for s in stale:
            serve(cache, np.concatenate([s, tokens(9, 8)]), [512])
    seed = iter(range(1000, 10_000))
    for _ in range(30):                                   # 30 x 8 pages: six turnovers of the 40-page pool
        serve(cache, tokens(next(seed), 1024), [960])
    turn = tokens(7, 1024)
    serve(cache, turn, [1024])                            # its tail: where the next turn continues
    for _ in range(3):                                    # 24 pages: the turn must outlive 16 stale ones
        serve(cache, tokens(next(seed), 1024), [960])
    assert serve(cache, np.concatenate([turn, tokens(8, 64)]), [1024]) == 1024
    assert all(cache.lookup(np.concatenate([s, [1]]), touch=False).kv_hit == 0 for s in stale)


def test_value_weight_halves_per_turnover_and_repeated_lookups_count_once():
    """The order's clock counts turnovers of written content (each described item's bytes over
    the most bytes described; evictions do not move it); an unused item's weight halves per
    ``half_life`` turnovers; a repeated lookup refreshes without counting."""
    order = ValueOrder(half_life=1.0)
    for i in range(4):
        order.describe(i, nbytes=100, cost=10)
        order.add(i)
    clock = 1 + 1 / 2 + 1 / 3 + 1 / 4                     # 100 bytes over 100, 200, 300, 400 described
    assert order.clock == pytest.approx(clock, rel=FLOAT_TOL)
    order.hit(0)
    order.hit(0, count=False)                             # the same request looking up again: no new use
    w0 = 2 ** -(clock - 1) + 1
    assert order.weight(0) == pytest.approx(w0, rel=FLOAT_TOL)
    assert order.pop() == 1                               # the oldest unused first; 0 is worth more
    order.forget(1)
    assert order.clock == pytest.approx(clock, rel=FLOAT_TOL)           # an eviction: no turnover
    order.describe(4, nbytes=100, cost=10)
    order.add(4)
    clock += 100 / 400                                                   # the most described: 400 bytes
    assert order.clock == pytest.approx(clock, rel=FLOAT_TOL)
    assert order.weight(0) == pytest.approx(w0 * 2 ** -0.25, rel=FLOAT_TOL)
    assert order.weight(3) == pytest.approx(2 ** -0.25, rel=FLOAT_TOL)
    order.hit(0)                                          # a use: decayed weight plus one
    assert order.weight(0) == pytest.approx(w0 * 2 ** -0.25 + 1, rel=FLOAT_TOL)
    assert order.victim() == 2


def test_value_half_life_must_be_positive():
    with pytest.raises(ValueError, match="half_life=0"):
        ValueOrder(half_life=0)


def test_a_waiting_requests_repeated_lookups_count_as_one_use():
    """The engine looks a waiting request's prompt up again every step; until an acquire, those
    repeats refresh the matched entries without adding uses. After an acquire, the same prompt
    looked up again is another request's use."""
    cache = make_cache("value", pages=40, slots=8)
    prompt = tokens(4, 512)
    serve(cache, prompt, [448])
    again = np.concatenate([prompt, tokens(5, 64)])
    page = cache.lookup(again, touch=False).path[0].page
    for _ in range(3):
        match = cache.lookup(again)                       # one request waiting three steps
    assert cache.pages.order.info[page].hits == 1
    alloc = cache.acquire(match, len(again) + 8)
    cache.release(alloc)
    cache.lookup(again)                                   # the next request with the same prompt
    assert cache.pages.order.info[page].hits == 2
