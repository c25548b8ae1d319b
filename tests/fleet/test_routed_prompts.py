"""The hybrid router counts prompts it routed that have no first token yet (RoutedPrompts):
the next turn of a conversation queued behind its first turn goes where that turn will be
cached, before any event says so; the record ends when nothing waits or the epoch changes."""

from __future__ import annotations

import hashlib

import pytest

from hybridkv.fleet.costmodel import h200_kimi_linear_48b
from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView
from hybridkv.fleet.routers import FleetState, HybridOptions, HybridRouter, InstanceLoad, RoutedPrompts

from test_routers import UNIT, chain, request, view

TAIL = 512
"""Tail checkpoint block (tokens): 8 units."""

FIRST = chain(*(f"u{i}" for i in range(16)))            # two whole 512-token blocks


def next_turn(extra_units: int = 6) -> list[bytes]:
    """The second turn: the first turn's 16 units, then its answer and a new question."""
    out, prev = list(FIRST), FIRST[-1]
    for i in range(extra_units):
        prev = hashlib.sha256(prev + f"w{i}".encode()).digest()
        out.append(prev)
    return out


def busy_fleet(waiting0: int, waiting1: int, views: list[InstanceView] | None = None) -> FleetState:
    """Two instances with the same queue; instance 1 the lighter by outstanding tokens (the
    least loaded), nothing of either prompt in their views (``views``: those of an earlier
    call, the same caches; new ones are new caches, which no record outlives)."""
    return FleetState(views=views or [view(), view(instance=1)], loads=[
        InstanceLoad(outstanding_tokens=5000, queued_seconds=2.0, waiting=waiting0),
        InstanceLoad(outstanding_tokens=4000, queued_seconds=2.0, waiting=waiting1)])


def routers():
    cost = h200_kimi_linear_48b()
    return (HybridRouter(cost, tail_tokens=TAIL),
            HybridRouter(cost, options=HybridOptions(count_routed=False), tail_tokens=TAIL))


def test_the_next_turn_follows_its_first_turn_while_that_one_waits():
    """The first turn goes to the lighter instance (1). While it waits there (no first token,
    nothing published), the next turn arrives and instance 0 has become the lighter: counting
    the routed prompt it follows the first turn (1); on the events alone it is a miss
    everywhere and goes to the least loaded (0), which would compute the conversation again."""
    views = [view(), view(instance=1)]
    before = FleetState(views=views, loads=[InstanceLoad(outstanding_tokens=5000, queued_seconds=2.0),
                                            InstanceLoad(outstanding_tokens=3000, queued_seconds=2.0)])
    after = FleetState(views=views, loads=[InstanceLoad(outstanding_tokens=3000, queued_seconds=2.0, waiting=1),
                                           InstanceLoad(outstanding_tokens=5000, queued_seconds=2.0, waiting=1)])
    counted, events_only = routers()
    for r in (counted, events_only):
        assert r.route(request(FIRST), before) == 1
    assert counted.route(request(next_turn()), after) == 1
    assert counted.expected_hit() == 16 * UNIT        # the first turn's tail block, priced
    assert events_only.route(request(next_turn()), after) == 0
    assert events_only.expected_hit() == 0


def test_the_hit_counted_is_the_first_turns_tail_block():
    """The first turn's 16 units give a KV run of 16 units and a checkpoint at its last whole
    512-token block (unit 16); a prompt sharing 12 of them gets the KV run 12 and the hit at
    the block below (unit 8) -- no checkpoint is assumed where none will be."""
    counted, _ = routers()
    first = busy_fleet(0, 0)
    counted.route(request(FIRST), first)
    rp = counted._routed(busy_fleet(0, 1, first.views), UNIT)[1]
    v = InstanceView(UNIT)
    assert rp.extend(next_turn(), v, (0, 0, 0)) == (16 * UNIT, 16 * UNIT, 16 * UNIT)
    branch = FIRST[:12] + [hashlib.sha256(FIRST[11] + b"other").digest()]
    assert rp.extend(branch, v, (0, 0, 0)) == (12 * UNIT, 0, 0)    # no checkpoint on the first 12 units
    rp.checkpoints[FIRST[7]] = 0                               # an interval checkpoint at unit 8
    assert rp.extend(branch, v, (0, 0, 0)) == (12 * UNIT, 8 * UNIT, 8 * UNIT)


def test_the_record_ends_when_nothing_waits_or_the_generation_changes():
    rp = RoutedPrompts(UNIT, TAIL)
    rp.trim(1, 0)
    rp.add(0, FIRST, 0, 16 * UNIT, 0)
    rp.trim(1, 0)
    assert set(rp.kv) == set(FIRST) and set(rp.checkpoints) == {FIRST[15]}
    rp.trim(1, 1)                                   # a restart: the view is in a new generation
    assert not rp.kv and not rp.checkpoints and not rp.seqs
    rp.add(1, FIRST, 0, 16 * UNIT, 1)
    rp.trim(0, 1)                                   # nothing waits: all got their first token
    assert not rp.kv and not rp.seqs


def test_only_the_newest_waiting_prompts_are_kept_and_old_entries_pruned():
    rp = RoutedPrompts(UNIT, TAIL)
    rp.trim(5, 0)
    prompts = [chain(*(f"p{k}-{i}" for i in range(8))) for k in range(6)]
    for k, p in enumerate(prompts):
        rp.add(k, p, 0, 8 * UNIT, 0)
    rp.trim(1, 0)                                   # one still waits: the newest
    assert [q for q, _, _ in rp.seqs] == [5]
    # 48 units recorded, 8 held by the waiting prompt: over PRUNE_FACTOR (4) times, so pruned
    assert set(rp.kv) == set(prompts[5]) and set(rp.checkpoints) == {prompts[5][-1]}


def test_units_the_view_held_are_not_recorded():
    rp = RoutedPrompts(UNIT, TAIL)
    rp.trim(1, 0)
    rp.add(0, FIRST, 10, 16 * UNIT, 0)
    assert set(rp.kv) == set(FIRST[10:])


def test_a_view_in_a_new_epoch_drops_the_record_in_the_router():
    counted, _ = routers()
    first = busy_fleet(0, 0)
    counted.route(request(FIRST), first)
    restarted = busy_fleet(1, 1, first.views)
    restarted.views[1].apply(CacheEvent(1, 1, 2, EventKind.ALL_CLEARED, ()))
    counted._routed(restarted, UNIT)
    assert not counted.routed[1].kv


def test_tail_tokens_must_be_positive():
    with pytest.raises(ValueError, match="tail_tokens=0"):
        HybridRouter(h200_kimi_linear_48b(), tail_tokens=0)


def test_a_routed_tail_checkpoint_counts_on_kv_the_view_already_holds():
    """The view holds the first turn's KV (published by an earlier prompt) but no checkpoint at
    its tail; the waiting first turn will place one there: the hit is the tail, not 0."""
    rp = RoutedPrompts(UNIT, TAIL)
    rp.trim(1, 0)
    rp.add(0, FIRST, 16, 16 * UNIT, 0)               # the view held all 16 units: none recorded
    v = view(kv=FIRST)
    assert not rp.kv
    assert rp.extend(next_turn(), v, (16 * UNIT, 0, 0)) == (16 * UNIT, 16 * UNIT, 16 * UNIT)
    other = RoutedPrompts(UNIT, TAIL)                # a record of another conversation only
    other.trim(1, 0)
    other.add(0, chain("z0", "z1"), 0, 2 * UNIT, 0)
    assert other.extend(next_turn(), v, (16 * UNIT, 0, 0)) == (16 * UNIT, 0, 0)


def test_a_record_ends_with_its_prompts_first_token_though_other_prompts_wait_there():
    """The HTTP router keeps one hybrid router per set of workers in rotation, all on the same
    workers' loads. Router A (workers 0, 1, 2) sends the first turn to worker 0; worker 2 leaves,
    and router B (0, 1) sends other requests, two of them to worker 0, while the first turn gets
    its first token and ends (its KV then evicted: the view holds none of it). Worker 2 returns:
    router A routes the next turn. Two requests wait on worker 0, none of them A's: before, A kept
    its record as one of the 2 newest waiting there and priced the first turn's tail as a hit on
    worker 0 (16 units), which it does not hold; after, a record ends once as many requests as were
    routed there up to it have had their first token (the instance serves first come, first served)."""
    from hybridkv.fleet.events import InstanceView as View
    from hybridkv.fleet.routers import RouteRequest
    from hybridkv.serve.fleet_view import FleetIdentity
    from hybridkv.serve.router import RouterService, RouterSettings, _Ticket
    from hybridkv.serve.tokenizer import load_codec

    service = RouterService([f"http://127.0.0.1:{p}" for p in (1, 2, 3)], load_codec("tiny", 512),
                            RouterSettings("hybrid", h200_kimi_linear_48b(), store_bytes_per_s=0))
    service.workers.fleet = FleetIdentity((), b"", UNIT, TAIL, 512)
    states = service.workers.states
    for w in states:
        w.healthy, w.view = True, View(UNIT)

    def send(hashes: list[bytes], exclude: set[int] = frozenset()) -> tuple[int, _Ticket]:
        req = RouteRequest(hashes, len(hashes) * UNIT + 1, len(hashes) * UNIT, 64)
        i = service.pick(req, set(exclude))
        return i, _Ticket(states[i], req.prompt_tokens, req.output_tokens, 0.5)

    i, first = send(FIRST)
    assert i == 0
    states[2].healthy = False                              # worker 2 out: router B from now on
    others = [send(chain(*(f"o{k}-{u}" for u in range(16)))) for k in range(4)]
    assert [j for j, _ in others] == [1, 0, 1, 0]
    first.first_byte()
    first.done()
    assert states[0].load.waiting == 2
    states[2].healthy = True                               # back: router A again
    a = service._routers[((0, 1, 2), None, 1)]         # live workers, store, slots (unknown: 1)
    fleet = FleetState([w.view for w in states], [w.load for w in states])
    assert a.score(request(next_turn()), fleet, 0, 0)[1] == 0     # nothing of the first turn on worker 0
    assert not a.routed[0].seqs


def test_the_tables_stay_bounded_while_prompts_wait_without_a_pause():
    """A server never idle (two prompts always waiting) whose prompts' KV the view holds whole
    (a repeated document, its own question cached too): no prompt adds a unit, each adds its
    tail checkpoint. Before, the checkpoints were pruned only with the units (never here: none
    added), one per prompt routed in the busy spell (2,000 after 2,000 prompts); after, both
    tables keep at most PRUNE_FACTOR times what the waiting prompts hold."""
    rp = RoutedPrompts(UNIT, TAIL)
    for k in range(2000):
        units = chain(*(f"doc{k}-{i}" for i in range(16)))
        rp.trim(2, 0, max(0, k - 2))                    # k routed before, 2 of them waiting
        rp.add(k, units, len(units), 16 * UNIT, 0, ahead=k)
        assert len(rp.checkpoints) <= RoutedPrompts.PRUNE_FACTOR * max(len(rp.seqs), 1)
        assert len(rp.kv) <= RoutedPrompts.PRUNE_FACTOR * max(rp._held, 1)
    assert [q for q, _, _ in rp.seqs] == [1997, 1998, 1999]


def test_a_routed_prompt_gives_no_hit_to_the_same_prompt_of_another_namespace():
    """Hashes are bound to the request's namespace (tenant, adapter, salt): tenant A's waiting
    prompt makes its own next turn a hit on its instance and the same tokens under tenant B a
    miss there (no unit hash in common)."""
    import numpy as np

    from hybridkv.fleet.events import EventPublisher
    from test_fleet import builder, config

    cache = builder(config())(EventPublisher(0), None).engine.cache
    tokens = np.arange(16 * UNIT + 100) % 997
    ns_a, ns_b = hashlib.sha256(b"tenant-a").digest(), hashlib.sha256(b"tenant-b").digest()
    a, b = cache.hash_prompt(tokens, ns_a), cache.hash_prompt(tokens, ns_b)
    assert len(a) == len(b) == 17 and not set(a) & set(b)
    counted, _ = routers()
    first = busy_fleet(0, 0)
    assert counted.route(request(a[:16]), first) == 1                    # the lighter
    waiting = busy_fleet(0, 1, first.views)
    assert counted.score(request(a), waiting, 1, 0)[1] == 16 * UNIT      # A's own next turn: the tail
    assert counted.score(request(b), waiting, 1, 0)[1] == 0              # B: nothing


def test_a_prompt_routed_before_the_views_first_event_outlives_that_event():
    """A view that has heard nothing adopts the first epoch it hears without forgetting (it knew
    nothing to forget), so what the router recorded before it stays; a newer epoch after that,
    an ``all_cleared`` or a new view object each start a new generation, and the record ends."""
    v = InstanceView(UNIT)
    rp = RoutedPrompts(UNIT, TAIL)
    rp.add(0, FIRST, 0, 16 * UNIT, v.generation, 1)
    before = v.generation
    v.apply(CacheEvent(0, 7, 0, EventKind.BLOCKS_STORED, tuple(FIRST[:4])))    # the first event: epoch 7
    assert v.generation == before and v.epoch == 7
    rp.trim(1, v.generation)
    assert set(rp.kv) == set(FIRST) and [q for q, _, _ in rp.seqs] == [0]
    v.apply(CacheEvent(0, 8, 0, EventKind.BLOCKS_STORED, tuple(FIRST[:2])))    # a restart
    assert v.generation != before
    rp.trim(1, v.generation)
    assert not rp.kv and not rp.seqs
    rp.add(1, FIRST, 0, 16 * UNIT, v.generation, 1)
    cleared = v.generation
    v.apply(CacheEvent(0, 8, 1, EventKind.ALL_CLEARED, ()))
    assert v.generation != cleared
    rp.trim(1, v.generation)
    assert not rp.seqs
    assert InstanceView(UNIT).generation not in (before, cleared, v.generation)


def test_the_hybrid_router_records_a_prompt_routed_before_any_event_and_keeps_it():
    """Two turns of one conversation arrive before the instance has said anything: the second
    goes where the first went, and the first event heard (epoch 0) does not erase the record."""
    cost = h200_kimi_linear_48b()
    router = HybridRouter(cost, tail_tokens=TAIL)
    views = [InstanceView(UNIT), InstanceView(UNIT)]
    loads = [InstanceLoad(), InstanceLoad()]
    state = FleetState(views=views, loads=loads)
    j = router.route(request(FIRST), state)
    loads[j].waiting, loads[j].routed, loads[j].queued_seconds = 1, 1, 1e-3
    views[j].apply(CacheEvent(j, 0, 0, EventKind.BLOCKS_STORED, tuple(FIRST[:2])))   # its first event
    assert router.route(request(next_turn()), state) == j
    assert router.expected_hit() == 16 * UNIT


@pytest.mark.parametrize("policy", ["hybrid", "least-load"])
def test_the_http_router_books_the_prefill_past_the_workers_hit(policy):
    """The HTTP router's queued-seconds share of a request is the prefill past the hit on the
    worker it picked (the hybrid router's own price, or priced from the worker's view for a
    router that prices none), not the whole prompt's prefill (before: always from token 0)."""
    from hybridkv.fleet.events import InstanceView as View
    from hybridkv.fleet.routers import RouteRequest
    from hybridkv.serve.fleet_view import FleetIdentity
    from hybridkv.serve.router import RouterService, RouterSettings
    from hybridkv.serve.tokenizer import load_codec

    cost = h200_kimi_linear_48b()
    service = RouterService([f"http://127.0.0.1:{p}" for p in (1, 2)], load_codec("tiny", 512),
                            RouterSettings(policy, cost, store_bytes_per_s=0))
    service.workers.fleet = FleetIdentity((), b"", UNIT, TAIL, 512)
    for w in service.workers.states:
        w.healthy = True
    service.workers.states[0].view = view(kv=FIRST, checkpoints=FIRST[7:8])       # 8 units with a checkpoint
    service.workers.states[1].view = View(UNIT)
    service.workers.states[1].load.outstanding_tokens = 10_000                  # least-load picks worker 0
    t = len(FIRST) * UNIT + 1
    i, seconds = service._pick(RouteRequest(FIRST, t, len(FIRST) * UNIT, 16), set())
    assert i == 0
    assert seconds == pytest.approx(cost.prefill_seconds(8 * UNIT, t), rel=1e-12)
    assert seconds < cost.prefill_seconds(0, t)
