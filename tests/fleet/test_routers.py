"""Routers on hand-made views: misses, restarts (epochs), the whole prompt, joint vs KV-only hits."""

from __future__ import annotations

import hashlib

import pytest

from hybridkv.fleet.costmodel import h200_kimi_linear_48b
from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView
from hybridkv.fleet.routers import (
    ROUTER_NAMES,
    FleetState,
    HybridOptions,
    HybridRouter,
    InstanceLoad,
    KVOverlapRouter,
    PrefixRouter,
    RouterConfig,
    RouteRequest,
    least_loaded,
    make_router,
)

UNIT = 64


def chain(*parts: str) -> list[bytes]:
    """Chained unit hashes of a prompt made of named units (each part one unit)."""
    out, prev = [], b""
    for p in parts:
        prev = hashlib.sha256(prev + p.encode()).digest()
        out.append(prev)
    return out


def request(hashes: list[bytes], extra_tokens: int = 1) -> RouteRequest:
    t = len(hashes) * UNIT + extra_tokens
    return RouteRequest(hashes=hashes, prompt_tokens=t, limit=(t - 1) // UNIT * UNIT)


def view(epoch: int = 0, kv=(), checkpoints=(), instance: int = 0) -> InstanceView:
    v = InstanceView(UNIT)
    v.apply(CacheEvent(instance, epoch, 0, EventKind.BLOCKS_STORED, tuple(kv)))
    v.apply(CacheEvent(instance, epoch, 1, EventKind.CHECKPOINTS_STORED, tuple(checkpoints)))
    return v


def fleet(views, outstanding) -> FleetState:
    return FleetState(views=views, loads=[InstanceLoad(outstanding_tokens=n, prefill_tokens=n, queued_seconds=n * 1e-5)
                                          for n in outstanding])


def every_router():
    cost = h200_kimi_linear_48b()
    return [make_router(RouterConfig(name=n, unit=UNIT, block_size=512, cost=cost)) for n in ROUTER_NAMES]


def test_a_miss_goes_to_the_least_loaded_instance():
    hashes = chain(*"abcdefgh")
    state = fleet([view(), view(), view()], outstanding=[9000, 300, 5000])
    for router in every_router():
        if router.name in ("least-load", "hybrid", "kv-overlap"):
            assert router.route(request(hashes), state) == 1, router.name


def test_a_hit_beats_a_short_queue_but_not_a_long_one():
    hashes = chain(*"abcdefghijklmnop")
    hot = view(kv=hashes, checkpoints=[hashes[-1]])
    router = HybridRouter(h200_kimi_linear_48b())
    assert router.route(request(hashes), fleet([hot, view()], outstanding=[100, 0])) == 0
    # the hit saves ~16 units of prefill; 100,000 queued tokens cost far more
    assert router.route(request(hashes), fleet([hot, view()], outstanding=[100_000, 0])) == 1


def test_a_restarted_instance_stops_attracting_traffic():
    hashes = chain(*"abcdefgh")
    v0 = view(epoch=0, kv=hashes, checkpoints=[hashes[-1]])
    router = HybridRouter(h200_kimi_linear_48b())
    state = fleet([v0, view(instance=1)], outstanding=[200, 0])
    assert router.route(request(hashes), state) == 0           # its cache is worth the queue
    v0.apply(CacheEvent(0, 1, 0, EventKind.ALL_CLEARED, ()))    # restart: new epoch, sequence from 0
    v0.apply(CacheEvent(0, 0, 2, EventKind.BLOCKS_STORED, tuple(hashes)))   # a late event of the old epoch
    assert v0.stale_dropped == 1 and not v0.kv
    assert router.route(request(hashes), state) == 1


def test_a_newer_epoch_without_all_cleared_still_drops_the_old_entries():
    hashes = chain(*"abcd")
    v = view(epoch=0, kv=hashes, checkpoints=[hashes[-1]])
    v.apply(CacheEvent(0, 1, 0, EventKind.BLOCKS_STORED, tuple(hashes[:1])))
    assert v.kv == {hashes[0]} and not v.checkpoints


def test_the_whole_prompt_decides_not_its_first_message():
    first = chain("sys", "q1")                       # the shared first message
    one = chain("sys", "q1", "a1", "b1", "c1", "d1", "e1", "f1")
    two = chain("sys", "q1", "a2", "b2", "c2", "d2", "e2", "f2")
    asked = chain("sys", "q1", "a2", "b2", "c2", "d2", "e2", "f2", "g2")
    assert one[:2] == two[:2] == first
    state = fleet([view(kv=one, checkpoints=[one[-1]]), view(kv=two, checkpoints=[two[-1]], instance=1)],
                  outstanding=[0, 0])
    for router in every_router():
        if router.name in ("hybrid", "kv-overlap"):
            assert router.route(request(asked), state) == 1, router.name
    prefix = PrefixRouter(UNIT)
    empty = fleet([view(), view()], outstanding=[0, 0])
    first_home = prefix.route(request(one), empty)     # empty trees: the tenant map's first
    second_home = prefix.route(request(two), empty)    # 2 of 8 units < cache_threshold: the smaller tree
    assert second_home == 1 - first_home
    assert prefix.route(request(asked), empty) == second_home


def test_kv_only_overlap_is_not_a_hybrid_hit():
    hashes = chain(*"abcdefghijklmnop")
    kv_rich = view(kv=hashes, checkpoints=[hashes[0]])                  # 16 units of KV, checkpoint at 1
    joint = view(kv=hashes[:8], checkpoints=[hashes[7]], instance=1)    # 8 units, checkpoint at 8
    assert kv_rich.match(hashes, 16 * UNIT).hit == UNIT and kv_rich.match(hashes, 16 * UNIT).kv_hit == 16 * UNIT
    assert joint.match(hashes, 16 * UNIT).hit == 8 * UNIT
    state = fleet([kv_rich, joint], outstanding=[0, 0])
    assert HybridRouter(h200_kimi_linear_48b()).route(request(hashes), state) == 1
    assert KVOverlapRouter(512).route(request(hashes), state) == 0     # the KV-only router is fooled


def test_the_hot_spot_guard_skips_an_overloaded_instance():
    hashes = chain(*(f"u{i}" for i in range(400)))               # 25,600 tokens: ~0.5 s of prefill
    hot = view(kv=hashes, checkpoints=[hashes[-1]])
    loads = [InstanceLoad(queued_seconds=0.3), InstanceLoad(), InstanceLoad(), InstanceLoad()]
    state = FleetState([hot, view(), view(), view()], loads)
    assert HybridRouter(h200_kimi_linear_48b()).route(request(hashes), state) == 0
    guarded = HybridRouter(h200_kimi_linear_48b(), options=HybridOptions(hot_relative=2.0, hot_absolute_s=0.1))
    assert guarded.route(request(hashes), state) == 1           # 0.3 s > 2 x 0.075 + 0.1: not a candidate


def test_an_unknown_router_is_named():
    with pytest.raises(ValueError, match="'fastest'"):
        make_router(RouterConfig(name="fastest", unit=UNIT, block_size=512, cost=h200_kimi_linear_48b()))


def test_under_load_a_hit_is_worth_the_queue_it_shortens():
    """Instance 0 holds the prompt's KV and checkpoint but has the longer queue. With nothing
    waiting the hybrid router sends the request where its own TTFT is shortest (1); with
    requests waiting everywhere the prefill it adds delays every one of them, so the hit wins (0)."""
    hashes = chain(*"abcdefghijklmnopqrstuvwxyz0123456789")
    hot = view(kv=hashes, checkpoints=[hashes[-1]])
    cost = h200_kimi_linear_48b()
    req = request(hashes)
    saved = cost.prefill_seconds(0, req.prompt_tokens) - cost.prefill_seconds(len(hashes) * UNIT, req.prompt_tokens)
    gap = 3 * saved                                            # instance 0's extra queue: three savings

    def state(waiting: int) -> FleetState:
        return FleetState(views=[hot, view()], loads=[
            InstanceLoad(outstanding_tokens=9000, queued_seconds=1.0 + gap, waiting=waiting),
            InstanceLoad(outstanding_tokens=1000, queued_seconds=1.0, waiting=waiting)])

    # a fresh router for each decision: one that routed this prompt already counts it as waiting
    # where it went (RoutedPrompts), which is not the situation tested here; each waiting request
    # counted once (waiting_weight 1)
    def router():
        return HybridRouter(cost, options=HybridOptions(waiting_weight=1.0))

    def seed():
        return HybridRouter(cost, options=HybridOptions(weigh_waiting=False))

    assert router().route(req, state(0)) == 1 and seed().route(req, state(0)) == 1
    assert router().route(req, state(8)) == 0                # (1 + 8) savings outweigh a gap of 3
    assert seed().route(req, state(8)) == 1                  # the seed's score ignores who waits
    router = router()
    s0, _ = router.score(req, state(8), 0, 0)
    s1, _ = router.score(req, state(8), 1, 0)
    assert s0 - s1 == pytest.approx(9 * saved - gap, rel=1e-9)
    s0, _ = HybridRouter(cost).score(req, state(8), 0, 0)         # the default: each counted 8 times
    s1, _ = HybridRouter(cost).score(req, state(8), 1, 0)
    assert s0 - s1 == pytest.approx((1 + 8 * 8) * saved - gap, rel=1e-9)


def test_least_loaded_is_the_lightest_key_then_the_lowest_index():
    """The lightest (outstanding tokens, in flight, routed), ties to the lowest index, among the
    given indices in any order; a load class with its own key is ordered by that key."""
    import itertools
    values = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0)]
    loads = [InstanceLoad(outstanding_tokens=a, in_flight=b, routed=c) for a, b, c in values]
    for among in itertools.permutations(range(5), 3):
        want = min(among, key=lambda j: (values[j], j))
        assert least_loaded(loads, list(among)) == want
    assert least_loaded(loads) == 0
    assert least_loaded(loads, (j for j in (4, 1))) == 4

    class Reversed(InstanceLoad):
        def key(self):
            return (-self.routed,)
    odd = [Reversed(routed=r) for r in (1, 3, 2)]
    assert least_loaded(odd) == 1
    with pytest.raises(ValueError):
        least_loaded(loads, [])


def test_own_waiting_below_one_keeps_shared_prefix_traffic_off_a_long_queue_of_few_requests():
    """The same request (a shared prefix both instances hold) priced with each instance's own
    waiting count goes to the one with the longer queue but fewer requests waiting (its work
    delays fewer); with the fleet's mean count it goes to the shorter queue. Hand-computed:
    cost_j = q_j + (1 + n_j) * W, W the same on both."""
    cost = h200_kimi_linear_48b()
    hashes = chain(*"abcdefgh")
    shared = hashes[:2]
    req = request(hashes)
    w = cost.prefill_seconds(2 * UNIT, req.prompt_tokens)
    n_few, n_many = 2, 20
    q_many = 1.0
    q_few = q_many + 5 * w                   # a longer queue, by less than the 18 extra waiting times W

    def state() -> FleetState:
        return FleetState(views=[view(kv=shared, checkpoints=shared[-1:]), view(kv=shared, checkpoints=shared[-1:])],
                          loads=[InstanceLoad(outstanding_tokens=90_000, queued_seconds=q_few, waiting=n_few),
                                 InstanceLoad(outstanding_tokens=60_000, queued_seconds=q_many, waiting=n_many)])

    assert w > 0
    own = HybridRouter(cost, options=HybridOptions(own_waiting=1.0, waiting_weight=1.0))
    assert own.route(req, state()) == 0
    fleet_mean = HybridRouter(cost, options=HybridOptions(own_waiting=0.0))
    assert fleet_mean.route(req, state()) == 1
    s0, hit0 = fleet_mean.score(req, state(), 0, 0)
    s1, hit1 = fleet_mean.score(req, state(), 1, 0)
    assert hit0 == hit1 == 2 * UNIT
    assert s1 - s0 == pytest.approx(q_few - q_many, rel=1e-9)      # equal weights: the queues decide
    half = HybridRouter(cost, options=HybridOptions(own_waiting=0.5, waiting_weight=1.0))
    s0, _ = half.score(req, state(), 0, 0)
    s1, _ = half.score(req, state(), 1, 0)
    mean = (n_few + n_many) / 2
    assert s0 - s1 == pytest.approx(q_many - q_few + ((0.5 * n_many + 0.5 * mean) - (0.5 * n_few + 0.5 * mean)) * w,
                                    rel=1e-9)


def test_waiting_weight_counts_each_waiting_request_k_times():
    """Instance 0 holds the prompt but its queue is longer by five times the prefill the hit
    saves; two requests wait on each. Counting each waiting request once, the hit is worth
    (1 + 2) savings, less than the gap, and the request spills to 1; counted 8 times (the
    default) it is worth (1 + 16) savings and stays on the holder. Hand-computed:
    cost_j = q_j + (1 + K * n) * W_j."""
    hashes = chain(*"abcdefghijklmnopqrstuvwxyz0123456789")
    cost = h200_kimi_linear_48b()
    req = request(hashes)
    saved = cost.prefill_seconds(0, req.prompt_tokens) - cost.prefill_seconds(len(hashes) * UNIT, req.prompt_tokens)
    gap = 5 * saved

    def state() -> FleetState:
        return FleetState(views=[view(kv=hashes, checkpoints=[hashes[-1]]), view()], loads=[
            InstanceLoad(outstanding_tokens=9000, queued_seconds=1.0 + gap, waiting=2),
            InstanceLoad(outstanding_tokens=1000, queued_seconds=1.0, waiting=2)])

    once = HybridOptions(waiting_weight=1.0)
    assert HybridRouter(cost, options=once).route(req, state()) == 1
    assert HybridRouter(cost).route(req, state()) == 0
    assert HybridOptions().waiting_weight == 8.0
    for k in (1.0, 8.0):
        r = HybridRouter(cost, options=HybridOptions(waiting_weight=k))
        s0, _ = r.score(req, state(), 0, 0)
        s1, _ = r.score(req, state(), 1, 0)
        assert s0 - s1 == pytest.approx((1 + k * 2) * saved - gap, rel=1e-9)


def test_a_tie_goes_to_the_deepest_kv_run_with_a_free_slot():
    """A tenant's system prompt (8 units) is cached as KV on instance 0, with its checkpoint only
    at the end of an earlier conversation's prompt: a new conversation's joint hit is 0
    everywhere, so every instance ties. With ``tie_kv_run`` (the default) it goes where its KV
    run is (the branch checkpoint made there serves the tenant's next conversations) though that
    instance is the more loaded; without, to the least loaded. A KV-run holder with no free
    sequence slot is passed over. With a checkpoint at the system prompt's end the hit is real
    and the cost alone sends it there."""
    system = chain(*"abcdefgh")
    old = system + [hashlib.sha256(system[-1] + p.encode()).digest() for p in "ijkl"]
    new = system + [hashlib.sha256(system[-1] + p.encode()).digest() for p in "mnop"]
    cost = h200_kimi_linear_48b()
    req = request(new)

    def state(in_flight: int, checkpoint=old[-1]) -> FleetState:
        return FleetState(views=[view(kv=old, checkpoints=[checkpoint]), view()], loads=[
            InstanceLoad(outstanding_tokens=2000, in_flight=in_flight),
            InstanceLoad(outstanding_tokens=1000, in_flight=0)])

    r = HybridRouter(cost, max_num_seqs=4)
    assert r.options.tie_kv_run
    assert r.route(req, state(3)) == 0                   # a free slot (3 of 4): the KV run wins the tie
    assert HybridRouter(cost, options=HybridOptions(tie_kv_run=False), max_num_seqs=4).route(req, state(3)) == 1
    assert HybridRouter(cost, max_num_seqs=4).route(req, state(4)) == 1      # every slot taken: load decides
    # the checkpoint at the system prompt's end: a real hit on 0, which the cost (not the tie) decides
    assert HybridRouter(cost, max_num_seqs=4).route(req, state(3, system[-1])) == 0


@pytest.mark.parametrize("field, value", [
    ("own_waiting", -0.1), ("own_waiting", 1.5), ("own_waiting", float("nan")), ("own_waiting", True),
    ("own_waiting", False), ("hot_relative", -1.0), ("hot_relative", True), ("hot_absolute_s", float("inf")),
    ("hot_absolute_s", False), ("tie_relative", "0.1"), ("tie_relative", None), ("weigh_waiting", "False"),
    ("count_decode", 0), ("count_routed", None), ("waiting_weight", -1.0), ("waiting_weight", float("inf")),
    ("waiting_weight", True), ("tie_kv_run", "yes"), ("tie_kv_run", 1)])
def test_hybrid_options_reject_values_out_of_range_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        HybridOptions(**{field: value})


def test_hybrid_options_take_numpy_numbers_and_bools():
    import numpy as np
    o = HybridOptions(own_waiting=np.float32(0.5), hot_relative=np.int64(2), weigh_waiting=np.bool_(True))
    assert o.own_waiting == 0.5 and o.hot_relative == 2


def test_every_router_refuses_a_fleet_with_no_live_instance():
    """Before: round-robin looped for ever, the others raised min()/max()/division errors."""
    from hybridkv.fleet.routers import NO_LIVE_INSTANCE
    for router in every_router():
        state = FleetState(views=[view(), view()], loads=[InstanceLoad(), InstanceLoad()], live=[])
        with pytest.raises(ValueError, match="no live instance"):
            router.route(request(chain(*"ab")), state)
    assert "every instance is down" in NO_LIVE_INSTANCE
