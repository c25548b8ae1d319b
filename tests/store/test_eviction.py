"""Eviction orders (lru, value): held items are never victims, value ranks by decayed uses times
cost per byte, owners are counted, and the lazy heap agrees with a brute-force minimum; the value
order's shadows pick a short half-life where recency wins and a long one under scans past a hot
set; the disk store's capacity follows the order it was given."""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from hybridkv.store.disk import DiskStore
from hybridkv.store.eviction import LRUOrder, RecencyOrder, ValueOrder, make_order


@pytest.mark.parametrize("policy", ["lru", "value"])
def test_a_discarded_item_is_never_a_victim(policy):
    order = make_order(policy)
    for i in range(3):
        order.describe(i, nbytes=10, cost=1)
        order.add(i)
    victim = order.victim()
    order.discard(victim)                       # a request references it
    assert order.victim() != victim and victim not in order and len(order) == 2
    order.discard(0), order.discard(1), order.discard(2)
    assert order.victim() is None and order.pop() is None


def test_lru_evicts_least_recently_added_or_hit_first():
    order = LRUOrder()
    for i in range(3):
        order.add(i)
    order.hit(0)
    assert list(order) == [1, 2, 0] and order.pop() == 1


def test_value_keeps_the_reused_item_until_its_uses_decay():
    """Three equal items; 0 is used four more times. Each write advances the clock by its bytes
    over the most bytes described (1, then 1/2, 1/3: the write clock); 0's weight halves per
    turnover, so after enough turnovers of fresh writes a fresh item outranks it."""
    order = ValueOrder(half_life=1.0)
    for i in range(3):
        order.describe(i, nbytes=100, cost=50)
        order.add(i)
    assert order.clock == pytest.approx(1 + 1 / 2 + 1 / 3)
    for _ in range(4):
        order.hit(0)                            # distinct uses at one clock reading: decayed 1, plus 4
    assert order.weight(0) == pytest.approx(2 ** -(1 / 2 + 1 / 3) + 4)
    assert order.weight(1) == pytest.approx(2 ** -(1 / 3)) and order.weight(2) == pytest.approx(1.0)
    assert order.priority(0) == pytest.approx(math.log2((2 ** -(5 / 6) + 4) * 50 / 100) + order.clock)
    clock = order.clock
    assert order.pop() == 1 and order.clock == clock        # an eviction does not move the write clock
    order.forget(1)
    victims = []
    for k in range(3, 30):                      # a fresh item per eviction: 0's weight decays meanwhile
        order.describe(k, nbytes=100, cost=50)
        order.add(k)
        clock += 100 / 300                      # the most bytes described: three items
        assert order.clock == pytest.approx(clock)
        w0 = order.weight(0)
        victims.append(order.pop())
        order.forget(victims[-1])
        if victims[-1] == 0:
            break
    assert victims[-1] == 0 and 0 not in victims[:-1]
    assert w0 < 1 and len(victims) > 3 * math.log2(4.5) - 1   # gone once below a fresh use: ~log2(4.56) turnovers


def test_value_breaks_ties_deepest_first_and_weighs_cost_per_byte():
    order = ValueOrder()
    order.describe("shallow", nbytes=10, cost=10, depth=64)
    order.describe("deep", nbytes=10, cost=10, depth=128)
    order.describe("dense", nbytes=5, cost=10, depth=0)
    for k in ("shallow", "deep", "dense"):
        order.add(k)
    assert [order.pop() for _ in range(3)] == ["deep", "shallow", "dense"]


@pytest.mark.parametrize("policy", ["lru", "value"])
def test_owner_bytes_and_owner_victims(policy):
    order = make_order(policy)
    order.describe("a1", nbytes=10, owner="A")
    order.describe("b1", nbytes=30, owner="B")
    order.describe("b2", nbytes=5, owner="B")
    for k in ("a1", "b1", "b2"):
        order.add(k)
    assert order.owner_bytes == {"A": 10, "B": 35}
    assert order.victim("B") in ("b1", "b2") and order.victim("C") is None
    order.discard("b1")                          # held: still counted, never a victim
    assert order.owner_bytes["B"] == 35 and order.victim("B") == "b2"
    order.forget("b1"), order.forget("b2")
    assert order.owner_bytes == {"A": 10} and order.victim("B") is None


def test_value_heap_agrees_with_a_brute_force_minimum():
    rng = random.Random(7)
    order, naive = ValueOrder(), {}
    for step in range(3000):
        item = rng.randrange(40)
        op = rng.random()
        if op < 0.4:
            order.describe(item, nbytes=rng.randrange(1, 9), cost=rng.randrange(0, 5), depth=rng.randrange(4),
                           owner=rng.choice("AB"))
            order.add(item)
        elif op < 0.6 and item in order:
            order.hit(item)
        elif op < 0.75:
            order.discard(item)
        elif op < 0.85:
            order.forget(item)
        else:
            owner = rng.choice([None, "A", "B"])
            got = order.pop(owner)
            cands = [i for i in naive if owner is None or order.info[i].owner == owner]
            want = min(cands, key=lambda i: naive[i]) if cands else None
            assert got == want, step
        naive = {i: order._live[i][:3] for i in list(order._live)}   # the key each member was last scored with


def test_disk_store_value_eviction_keeps_the_object_that_is_read(tmp_path):
    store = DiskStore(tmp_path, capacity_bytes=3 * 1100, eviction="value")
    store.put([("hot", b"x" * 1000), ("cold", b"y" * 1000)])
    for _ in range(3):
        assert store.get(["hot"]) == [b"x" * 1000]
    store.put([("new1", b"z" * 1000), ("new2", b"w" * 1000)])   # one must go: the unread, oldest one
    assert store.exists(["hot", "cold"]) == [True, False]
    store.check_invariants()


def test_disk_store_refuses_an_unknown_eviction_policy(tmp_path):
    with pytest.raises(ValueError, match="'fifo'"):
        DiskStore(tmp_path, eviction="fifo")


def test_lru_owner_victims_agree_with_the_order_whenever_first_asked():
    """The per-owner queues are built on the first ``victim(owner)`` and kept from then on: at
    every step, before and after that, each owner's victim is its least recent member in the
    order (the first of ``iter(order)`` with that owner)."""
    rng = random.Random(7)
    owners = [b"a", b"b", None]
    for ask_from in (0, 150, 10_000):                      # from the start, mid-way, never
        order = LRUOrder()
        for step in range(600):
            item = rng.randrange(40)
            op = rng.random()
            if op < 0.15:
                order.describe(item, 1 + item % 3, 1.0, item, rng.choice(owners))
            elif op < 0.55:
                order.add(item)
            elif op < 0.75:
                order.discard(item)
            elif op < 0.9:
                order.hit(item, rng.random() < 0.5)
            else:
                order.forget(item)
            if step >= ask_from:
                members = list(order)
                for o in (b"a", b"b"):
                    want = next((m for m in members if order.info[m].owner == o), None)
                    assert order.victim(o) == want
                assert order.victim() == (members[0] if members else None)


class _Cache:
    """A cache of ``capacity`` equal items over an order, as the pools drive it: a miss evicts
    the order's victim when full and describes a new item under the content key."""

    def __init__(self, order, capacity: int) -> None:
        self.order, self.capacity, self.item, self.next = order, capacity, {}, 0
        self.hits = 0

    def access(self, name: str) -> None:
        key = hashlib.sha256(name.encode()).digest()
        item = self.item.get(key)
        if item is not None:
            self.hits += 1
            self.order.hit(item)
            return
        while len(self.item) >= self.capacity:
            victim = self.order.pop()
            self.order.forget(victim)
            del self.item[next(k for k, v in self.item.items() if v == victim)]
        self.next += 1
        self.item[key] = self.next
        self.order.describe(self.next, nbytes=100, cost=64, key=key)
        self.order.add(self.next)


def test_value_shadows_pick_a_short_half_life_where_recency_wins():
    """A hot set used 20 times, then never again, while fresh items are each reused once at a
    distance of 0.8 capacity: a long memory keeps the stale hot set and misses the reuses, a
    short one (LRU-like) hits them. The order, starting at ``h = 1``, moves to a short one."""
    order = ValueOrder()
    cache = _Cache(order, 64)
    for r in range(20):
        for i in range(32):
            cache.access(f"hot{i}")
    for j in range(3000):
        cache.access(f"new{j}")
        if j >= 51:
            cache.access(f"new{j - 51}")        # its one reuse, 51 items (0.8 capacity) later
    assert order.half_life <= 1 / 16 and order.switches >= 1
    assert min(order.shadows, key=lambda s: s.h).score > max(order.shadows, key=lambda s: s.h).score


def test_value_shadows_pick_a_long_half_life_under_scans_past_a_hot_set():
    """A hot set of half the capacity used three times, then each item reused after 1.5
    capacities of traffic (two one-off items per hot access): LRU (and the shortest half-life)
    misses every reuse, a long memory keeps the hot set. The order keeps a long half-life and
    hits every hot reuse (LRU holds none)."""
    order = ValueOrder()
    cache = _Cache(order, 64)
    for r in range(3):
        for i in range(32):
            cache.access(f"hot{i}")
    n, hits = 0, []
    for r in range(40):
        before = cache.hits
        for i in range(32):
            cache.access(f"hot{i}")
            cache.access(f"scan{n}")
            cache.access(f"scan{n + 1}")
            n += 2
        hits.append(cache.hits - before)
    by_h = sorted(order.shadows, key=lambda s: s.h)
    assert order.half_life >= 1.0 and by_h[0].score < 1e-6 * by_h[-1].score   # the shortest hits nothing
    assert hits[-10:] == [32] * 10


def test_value_grid_and_shadow_items_must_be_valid():
    with pytest.raises(ValueError, match="grid"):
        ValueOrder(grid=())
    with pytest.raises(ValueError, match="shadow_items=0"):
        ValueOrder(shadow_items=0)
    with pytest.raises(ValueError, match="half_life=0"):
        ValueOrder().set_half_life(0)


@pytest.mark.parametrize("seed", range(4))
def test_recency_order_ranks_exactly_as_lru_without_descriptions(seed):
    """``make_order("lru", described=False)``: after every call of a random sequence the same
    members, iteration order and victim as :class:`LRUOrder`; no description, byte or owner
    count is kept, and a victim by owner is refused (it knows no owners)."""
    rng = random.Random(seed)
    plain, full = make_order("lru", described=False), make_order("lru")
    assert isinstance(plain, RecencyOrder) and plain.name == "lru" and isinstance(full, LRUOrder)
    for _ in range(600):
        item, op = rng.randrange(12), rng.choice(["describe", "add", "add", "hit", "discard", "forget", "pop"])
        for order in (plain, full):
            if op == "describe":
                order.describe(item, nbytes=rng.randrange(1, 9) if order is plain else 4, owner=b"t")
            elif op == "hit":
                order.hit(item, count=item % 2 == 0)
            elif op == "pop":
                order.pop()
            else:
                getattr(order, op)(item)
        assert list(plain) == list(full) and len(plain) == len(full) and plain.victim() == full.victim()
        assert all((i in plain) == (i in full) for i in range(12))
    assert plain.info == {} and plain.owner_bytes == {} and plain.total_bytes == 0
    with pytest.raises(ValueError, match="keeps no owners"):
        plain.victim(owner=b"t")
