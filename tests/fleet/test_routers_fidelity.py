"""``prefix`` and ``kv-overlap`` decide as the public routers they stand for do (docs/concepts/routing.md,
"Emulations checked against their sources"): SGLang's ``cache_aware`` and Dynamo's
``DefaultWorkerSelector`` at their defaults. Expected values are worked out by hand below."""

from __future__ import annotations

import hashlib

import pytest

from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView
from hybridkv.fleet.routers import (
    FleetState,
    InstanceLoad,
    KVOverlapRouter,
    PrefixOptions,
    PrefixRouter,
    RouteRequest,
    SMGPrefixRouter,
    kv_admission,
    page_keys,
)

UNIT, PAGE = 64, 512          # 8 units a page, as the bench runs (512-token pages, 64-token units)


def chain(tag: str, n: int) -> list[bytes]:
    """``n`` chained unit hashes of a prompt named ``tag``."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}{i}".encode()).digest()
        out.append(prev)
    return out


def req(hashes: list[bytes], tokens: int) -> RouteRequest:
    return RouteRequest(hashes=hashes, prompt_tokens=tokens, limit=(tokens - 1) // UNIT * UNIT)


def view_of(keys) -> InstanceView:
    v = InstanceView(UNIT)
    v.apply(CacheEvent(0, 0, 0, EventKind.BLOCKS_STORED, tuple(keys)))
    return v


# -- SGLang cache_aware ---------------------------------------------------------------------------

def prefix_router(trees: list[set[bytes]], **options) -> PrefixRouter:
    r = PrefixRouter(UNIT, PrefixOptions(**options))
    for keys in trees:
        t = InstanceView(UNIT)
        t.kv.update(keys)
        r.trees.append(t)
    return r


def empty_fleet(n: int, in_flight=None, outstanding=None) -> FleetState:
    in_flight = in_flight or [0] * n
    outstanding = outstanding or [0] * n
    return FleetState([InstanceView(UNIT) for _ in range(n)],
                      [InstanceLoad(in_flight=f, outstanding_tokens=o) for f, o in zip(in_flight, outstanding)])


def test_prefix_needs_a_match_ratio_strictly_above_the_threshold():
    """A 640-token prompt (10 units). Tree 0 holds its first units plus 6 other units (the
    larger tree), tree 1 one unrelated unit. 3 of 10 units matched is a ratio of exactly 0.3:
    not above ``cache_threshold`` 0.3, so a miss, and a miss goes to the smaller tree (1);
    4 of 10 (0.4) is a hit on tree 0."""
    p = chain("p", 10)
    other = chain("o", 6)
    for matched, expected in ((3, 1), (4, 0)):
        r = prefix_router([{*p[:matched], *other}, set(chain("x", 1))])
        assert r.route(req(p, 640), empty_fleet(2)) == expected, matched


def test_prefix_balances_on_requests_in_flight_not_on_tokens():
    """In flight 70, 3, 5 (max - min = 67 > 64 and 70 > 1.5 * 3): imbalanced, and the fewest
    requests in flight win, instance 1, though it has by far the most outstanding tokens and
    instance 0 holds the whole prompt."""
    p = chain("p", 10)
    r = prefix_router([set(p), set(), set()])
    state = empty_fleet(3, in_flight=[70, 3, 5], outstanding=[0, 50_000, 0])
    assert r.route(req(p, 640), state) == 1
    assert p[-1] in r.trees[1].kv                       # the tree of the instance chosen takes the prompt


def test_prefix_balance_thresholds_are_strict_and_equal_loads_go_to_the_lowest_index():
    p = chain("p", 10)
    # max - min = 64: not above balance_abs_threshold, so the cache decides (instance 0 holds it all)
    r = prefix_router([set(p), set(), set()])
    assert r.route(req(p, 640), empty_fleet(3, in_flight=[67, 3, 3])) == 0
    # 68 - 3 = 65 > 64 and 68 > 4.5: imbalanced; instances 1 and 2 tie on 3 in flight, 1 comes first
    r = prefix_router([set(p), set(), set()])
    assert r.route(req(p, 640), empty_fleet(3, in_flight=[68, 3, 3])) == 1
    # 100 - 70 = 30 <= 64: balanced however large the loads
    r = prefix_router([set(p), set(), set()])
    assert r.route(req(p, 640), empty_fleet(3, in_flight=[100, 70, 70])) == 0


def test_prefix_ties_among_holders_follow_a_fixed_order_per_prefix_not_the_lowest_index():
    """Both instances hold each of 64 prompts. The same prompt always goes to the same
    holder (one order per matched prefix, as SGLang's per-node tenant map), but over the 64
    prefixes both holders win (a lowest-index rule would send all 64 to instance 0)."""
    prompts = [chain(f"s{k}", 4) for k in range(64)]
    held = {h for p in prompts for h in p}
    r = prefix_router([set(held), set(held)])
    first = [r.route(req(p, 256), empty_fleet(2)) for p in prompts]
    again = [r.route(req(p, 256), empty_fleet(2)) for p in prompts]
    assert first == again
    assert 10 <= first.count(1) <= 54
    other_seed = prefix_router([set(held), set(held)], seed=1)
    assert [other_seed.route(req(p, 256), empty_fleet(2)) for p in prompts] != first


def test_prefix_misses_go_to_the_smallest_tree_whatever_its_queue():
    """The fault the issue names, kept on purpose: a miss goes to the smallest tree even when
    that instance has the most requests in flight (while the load stays balanced)."""
    r = prefix_router([set(chain("a", 20)), set(chain("b", 2)), set(chain("c", 9))])
    assert r.route(req(chain("new", 10), 640), empty_fleet(3, in_flight=[0, 40, 0])) == 1


# -- SGLang's successor SMG (the extra prefix-smg) ------------------------------------------------

def smg_router(trees: list[set[bytes]]) -> SMGPrefixRouter:
    r = SMGPrefixRouter(UNIT)
    for keys in trees:
        t = InstanceView(UNIT)
        t.kv.update(keys)
        r.trees.append(t)
    return r


def loads_fleet(in_flight, routed) -> FleetState:
    return FleetState([InstanceView(UNIT) for _ in in_flight],
                      [InstanceLoad(in_flight=f, routed=r) for f, r in zip(in_flight, routed)])


def test_smg_sends_a_miss_to_the_least_loaded_then_least_routed():
    r = smg_router([set(chain("a", 30)), set(), set()])
    # in flight 2, 1, 1; routed 0, 5, 3: instances 1 and 2 tie on load, 2 was routed fewer
    assert r.route(req(chain("new", 10), 640), loads_fleet([2, 1, 1], [0, 5, 3])) == 2


def test_smg_sends_a_hit_to_the_least_loaded_holder_unless_the_gate_spills_it():
    p = chain("p", 10)
    assert smg_router([set(p), set(p), set()]).route(req(p, 640), loads_fleet([3, 1, 0], [0, 0, 0])) == 1
    # the one holder has 100 in flight, the mean is 25: 100 > 1.5 * 25 and 100 > 25 + 64, so it spills
    # to the least loaded (instances 1-3 tie at 0 in flight and 0 routed: the lowest index)
    assert smg_router([set(p), set(), set(), set()]).route(req(p, 640), loads_fleet([100, 0, 0, 0], [0] * 4)) == 1
    # 80 in flight, mean 20: 80 > 30 but not 80 > 84, so the holder keeps it
    assert smg_router([set(p), set(), set(), set()]).route(req(p, 640), loads_fleet([80, 0, 0, 0], [0] * 4)) == 0


# -- Dynamo DefaultWorkerSelector -----------------------------------------------------------------

def test_page_keys_and_admission_count_whole_pages():
    p = chain("p", 16)                                   # 1,025 tokens: 16 whole units, 2 whole pages
    assert page_keys(p, UNIT, PAGE) == [p[7], p[15]]
    keys, partial, prefill = kv_admission(view_of(p[:12]), p, 1025, PAGE)
    assert keys == [p[7], p[15]] and partial
    assert prefill == 1025 - 512                          # a 12-unit run is one whole page of overlap
    assert kv_admission(view_of(p), p[:8], 512, PAGE) == ([p[7]], False, 0)
    with pytest.raises(ValueError, match="multiple of unit"):
        page_keys(p, UNIT, 100)


def test_kv_overlap_logit_is_dynamos_cost_at_its_defaults():
    """``logit = (prefill_tokens + T - overlap * 512) / 512 + active_pages + new pages``, for a
    1,025-token prompt (2 whole pages + a partial one):

    * instance 0: KV run of 12 units (1 page of overlap); 1,000 tokens of others' prefill
      pending; one request in flight holding page 1 of this prompt and a partial page:
      ``(1000 + 1025 - 512) / 512 + (2 + 2 - 1 + 1) = 2.955078125 + 4``;
    * instance 1: nothing: ``1025 / 512 + 3``;
    * instance 2: the whole prompt's KV (2 pages of overlap), nothing pending:
      ``1 / 512 + 3``, the lowest."""
    p = chain("p", 16)
    busy = InstanceLoad()
    busy.hold([p[7]], True, 1000)
    state = FleetState([view_of(p[:12]), InstanceView(UNIT), view_of(p)], [busy, InstanceLoad(), InstanceLoad()])
    router = KVOverlapRouter(PAGE)
    assert router.logits(req(p, 1025), state) == {0: 1513 / 512 + 4, 1: 1025 / 512 + 3, 2: 1 / 512 + 3}
    assert router.route(req(p, 1025), state) == 2
    state.live = [0, 1]
    assert router.route(req(p, 1025), state) == 1


def test_kv_overlap_counts_a_page_shared_by_requests_in_flight_once_and_ignores_output():
    """Instance 0 caches the prompt's 2 pages and has 3 requests in flight with this same prompt
    (each with a long output): their 2 whole pages count once, plus 3 partial pages; this prompt
    adds no new whole page and its own partial one: ``1/512 + 5 + 0 + 1``. Instance 1 is idle:
    ``1025/512 + 3``."""
    p = chain("p", 16)
    busy = InstanceLoad()
    for _ in range(3):
        busy.hold(page_keys(p, UNIT, PAGE), True, 0)
        busy.in_flight_tokens += 1025 + 4000                # output tokens do not enter the logit
    state = FleetState([view_of(p), InstanceView(UNIT)], [busy, InstanceLoad()])
    logits = KVOverlapRouter(PAGE).logits(req(p, 1025), state)
    assert logits == {0: 1 / 512 + 2 + 3 + 1, 1: 1025 / 512 + 3}
    assert busy.active_pages == 5
    busy.release(page_keys(p, UNIT, PAGE), True)
    assert busy.active_pages == 4 and busy.pages == {p[7]: 2, p[15]: 2}


def test_kv_overlap_ties_go_to_the_smallest_tree_then_at_random_reproducibly():
    p = chain("p", 8)
    small, large = view_of(chain("x", 1)), view_of(chain("y", 5))
    state = FleetState([large, small, view_of(chain("z", 3))], [InstanceLoad(), InstanceLoad(), InstanceLoad()])
    assert KVOverlapRouter(PAGE).route(req(p, 512), state) == 1        # equal logits, smallest tree
    even = FleetState([InstanceView(UNIT) for _ in range(4)], [InstanceLoad() for _ in range(4)])
    picks = [KVOverlapRouter(PAGE, seed=7).route(req(p, 512), even) for _ in range(3)]
    assert len(set(picks)) == 1                                          # a fresh router, the same seed
    router = KVOverlapRouter(PAGE, seed=7)
    many = [router.route(req(p, 512), even) for _ in range(200)]
    assert many[0] == picks[0] and set(many) == {0, 1, 2, 3}             # uniform over the tied
