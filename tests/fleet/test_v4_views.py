"""The fleet knows cache groups by spec: a DeepSeek-V4 view (``csa`` + ``hca`` paged, ``swa``
boundary state) built from events that name their group, the joint hit by the family's rule
under each SWA recovery strategy, the shared store's view of V4 entries, and the hybrid router
on V4 views (the recompute cone priced or not)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache.groups import (BOUNDARY, FULL, KDA, KIMI_LINEAR, PREFIX, SAVED_AT_HIT, GroupSpec, RecomputeCone,
                                   SavedEvery, joint_hits)
from hybridkv.cache.swa import CSA, HCA, SWA, v4_family
from hybridkv.fleet.costmodel import h200_deepseek_v4_flash
from hybridkv.fleet.events import CacheEvent, EventKind, EventPublisher, InstanceView
from hybridkv.fleet.routers import FleetState, HybridOptions, HybridRouter, InstanceLoad, _ViewsPresence
from hybridkv.fleet.store import StoreCost, StoreView, paying_load

from test_routers import UNIT, chain, request

SPECS = (GroupSpec(CSA, PREFIX, 4), GroupSpec(HCA, PREFIX, 64), GroupSpec(SWA, BOUNDARY, UNIT))
PROMPT = chain(*(f"p{i}" for i in range(12)))


def family(restore=SAVED_AT_HIT):
    return v4_family(*SPECS, restore)


def v4_view(kv=(), states=(), restore=SAVED_AT_HIT, epoch=0) -> InstanceView:
    v = InstanceView(UNIT, family(restore))
    v.apply(CacheEvent(0, epoch, 0, EventKind.BLOCKS_STORED, tuple(kv), group="csa-hca"))
    v.apply(CacheEvent(0, epoch, 1, EventKind.CHECKPOINTS_STORED, tuple(states), group=SWA))
    return v


def test_a_v4_view_keeps_a_key_set_per_group_from_events_naming_their_group():
    v = v4_view(PROMPT[:6], [PROMPT[3]])
    assert set(v.held) == {CSA, HCA, SWA}
    assert v.held[CSA] == v.held[HCA] == set(PROMPT[:6]) and v.held[SWA] == {PROMPT[3]}
    m = v.match(PROMPT, 12 * UNIT)
    assert (m.kv_hit, m.hit, m.restart) == (6 * UNIT, 4 * UNIT, 4 * UNIT)
    # one prefix group named alone: only its set; the prefix run is the shortest of the groups
    v.apply(CacheEvent(0, 0, 2, EventKind.BLOCKS_STORED, tuple(PROMPT[6:8]), group=CSA))
    assert v.kv_run(PROMPT, 12 * UNIT) == 6 * UNIT and v.match(PROMPT, 12 * UNIT).kv_hit == 6 * UNIT
    # removed entries take the states on them; an event without a group is the page entry / swa
    v.apply(CacheEvent(0, 0, 3, EventKind.BLOCKS_REMOVED, tuple(PROMPT[3:]), group=None))
    assert v.held[HCA] == set(PROMPT[:3]) and not v.held[SWA]
    v.apply(CacheEvent(0, 0, 4, EventKind.CHECKPOINTS_STORED, (PROMPT[2],)))
    assert v.held[SWA] == {PROMPT[2]} and v.match(PROMPT, 12 * UNIT).hit == 3 * UNIT


def test_an_event_naming_a_group_the_family_lacks_is_refused_by_name():
    v = v4_view()
    with pytest.raises(ValueError, match=r"'full'.*deepseek-v4.*csa, hca, swa"):
        v.apply(CacheEvent(0, 0, 2, EventKind.BLOCKS_STORED, (PROMPT[0],), group=FULL))
    with pytest.raises(ValueError, match=r"checkpoints_stored names group 'csa'"):
        v.apply(CacheEvent(0, 0, 3, EventKind.CHECKPOINTS_STORED, (PROMPT[0],), group=CSA))
    kimi = InstanceView(UNIT)
    with pytest.raises(ValueError, match="'swa'"):
        kimi.apply(CacheEvent(0, 0, 0, EventKind.CHECKPOINTS_STORED, (PROMPT[0],), group=SWA))


def test_each_recovery_strategy_gives_its_hit_and_restart():
    """window: the deepest saved state; periodic: the prefix run, restart at the deepest state
    below; recompute: the prefix run, restart a cone below (0 for a hit shorter than it)."""
    kv, states = PROMPT[:8], [PROMPT[1], PROMPT[4]]
    window = v4_view(kv, states).match(PROMPT, 12 * UNIT)
    periodic = v4_view(kv, states, SavedEvery(2 * UNIT)).match(PROMPT, 12 * UNIT)
    cone = v4_view(kv, (), RecomputeCone(3 * UNIT)).match(PROMPT, 12 * UNIT)
    assert (window.kv_hit, window.hit, window.restart) == (8 * UNIT, 5 * UNIT, 5 * UNIT)
    assert (periodic.hit, periodic.restart) == (8 * UNIT, 5 * UNIT)
    assert (cone.hit, cone.restart) == (8 * UNIT, 5 * UNIT)
    assert v4_view(kv[:2], (), RecomputeCone(3 * UNIT)).match(PROMPT, 12 * UNIT).restart == 0


unit_sets = st.lists(st.integers(0, 11), max_size=12)
restores = st.sampled_from([SAVED_AT_HIT, SavedEvery(2 * UNIT), RecomputeCone(3 * UNIT)])


@settings(max_examples=60, deadline=None)
@given(views=st.lists(st.tuples(st.integers(0, 12), unit_sets, unit_sets), min_size=1, max_size=6),
       restore=restores, limit=st.integers(0, 13 * UNIT))
def test_the_routers_many_views_adapter_gives_each_v4_views_own_joint_hit(views, restore, limit):
    vs = [v4_view(PROMPT[:run] + [PROMPT[i] for i in holes], [PROMPT[i] for i in cks], restore)
          for run, holes, cks in views]
    kvs, hits, restarts = joint_hits(vs[0].family, _ViewsPresence(PROMPT[:limit // UNIT], UNIT, vs), limit)
    want = [v.match(PROMPT, limit) for v in vs]
    assert (kvs, hits, restarts) == ([m.kv_hit for m in want], [m.hit for m in want], [m.restart for m in want])


def test_the_publisher_names_the_engines_groups():
    pub = EventPublisher(3, family(RecomputeCone(128)))
    pub.stored(PROMPT[:2], [PROMPT[1]], [PROMPT[0]], [2 * UNIT], 0)
    pub.evicted([])
    assert [(e.kind, e.group) for e in pub.drain()] == [
        (EventKind.BLOCKS_STORED, "csa-hca"), (EventKind.CHECKPOINTS_STORED, SWA), (EventKind.CHECKPOINTS_REMOVED, SWA)]
    kimi = EventPublisher(0, KIMI_LINEAR)
    kimi.stored(PROMPT[:1], [PROMPT[0]], [])
    assert [e.group for e in kimi.drain()] == [FULL, KDA]
    old = EventPublisher(0)                              # a producer that names no group
    old.stored(PROMPT[:1], [PROMPT[0]], [])
    assert [e.group for e in old.drain()] == [None, None]


def test_the_store_view_holds_v4_page_and_state_entries_at_its_alignment():
    a = 2 * UNIT
    store = StoreView(UNIT, a, capacity_bytes=None, kv_bytes_per_token=10, checkpoint_bytes=1000,
                      family=family(SavedEvery(a)))
    store.apply(CacheEvent(0, 0, 0, EventKind.BLOCKS_STORED, tuple(PROMPT[:8]), first_unit=0, group="csa-hca"))
    store.apply(CacheEvent(0, 0, 1, EventKind.CHECKPOINTS_STORED, (PROMPT[1], PROMPT[2]), (2 * UNIT, 3 * UNIT),
                           group=SWA))
    assert set(store.kv) == {PROMPT[1], PROMPT[3], PROMPT[5], PROMPT[7]}    # entries end on the alignment
    assert store.checkpoints == {PROMPT[1]}                                   # a state off it is not written
    m = store.match(PROMPT, 12 * UNIT)
    assert (m.hit, m.restart) == (8 * UNIT, 2 * UNIT)
    assert store.bytes_held == 4 * a * 10 + 1000
    with pytest.raises(ValueError, match="'kda'"):
        store.apply(CacheEvent(0, 0, 2, EventKind.CHECKPOINTS_STORED, (PROMPT[3],), group=KDA))
    with pytest.raises(ValueError, match="boundary groups"):
        two = (*SPECS, GroupSpec("other", BOUNDARY))
        from hybridkv.cache.groups import Family
        StoreView(UNIT, a, family=Family("two", two, {SWA: SAVED_AT_HIT, "other": SAVED_AT_HIT}))


def test_a_store_cost_without_a_state_entry_reads_page_entries_only():
    with_state = StoreCost(1e9, 1e-3, 512, 100, 10_000)
    without = StoreCost(1e9, 1e-3, 512, 100, 10_000, loads_state=False)
    assert with_state.load_bytes(0, 1024) - without.load_bytes(0, 1024) == 10_000
    assert with_state.latency_seconds(0, 1024) == pytest.approx(2 * 3 * 1e-3)
    assert without.latency_seconds(0, 1024) == pytest.approx(2 * 2 * 1e-3)


def test_a_load_pays_only_net_of_the_restore_recompute_on_each_side():
    cost = h200_deepseek_v4_flash()
    store = StoreCost(1.1e9, 194e-6, 512, 6880, 8_000_000, loads_state=False)
    assert paying_load(cost, store, 0, 0, 8192) is not None
    # a store hit that recomputes more than the load saves does not pay
    assert paying_load(cost, store, 0, 0, 8192, 0.0, cost.prefill_seconds(0, 8192)) is None


def _fleet(views, outstanding):
    return FleetState(views=views, loads=[InstanceLoad(outstanding_tokens=n, queued_seconds=n * 1e-5)
                                          for n in outstanding])


def test_the_hybrid_router_prices_the_recompute_cone_of_a_v4_hit():
    """Under recompute a hit shorter than the cone rebuilds its state from token 0: priced, it
    saves nothing, and the less loaded instance wins; unpriced, the hit pulls the request. A hit
    far longer than the cone is worth its recompute."""
    cost = h200_deepseek_v4_flash()

    def restore(restart, hit):                           # recompute through every layer
        return cost.prefill_seconds(restart, hit)

    hashes = chain(*(f"u{i}" for i in range(40)))
    short = RecomputeCone(64 * UNIT)                     # longer than every hit here
    state = _fleet([v4_view(hashes[:16], (), short), v4_view((), (), short)], outstanding=[50, 0])
    assert HybridRouter(cost).route(request(hashes), state) == 0
    priced = HybridRouter(cost, restore=restore)
    assert priced.route(request(hashes), state) == 1 and priced.expected_hit() == 0
    off = HybridRouter(cost, options=HybridOptions(price_restore=False), restore=restore)
    assert off.route(request(hashes), state) == 0                   # the comparison switch: unpriced
    with pytest.raises(ValueError, match="price_restore='yes'"):
        HybridOptions(price_restore="yes")
    small = RecomputeCone(2 * UNIT)
    state = _fleet([v4_view(hashes[:32], (), small), v4_view((), (), small)], outstanding=[50, 0])
    router = HybridRouter(cost, restore=restore)
    assert router.route(request(hashes), state) == 0 and router.expected_hit() == 32 * UNIT
    assert router.expected_seconds() == pytest.approx(
        cost.prefill_seconds(32 * UNIT, 40 * UNIT + 1) + restore(30 * UNIT, 32 * UNIT))
