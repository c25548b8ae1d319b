"""Eviction orders (lru, value): held items are never victims, value ranks by decayed uses times
cost per byte, owners are counted, and the lazy heap agrees with a brute-force minimum; the disk
store's capacity follows the order it was given."""

from __future__ import annotations

import math
import random

import pytest

from hybridkv.store.disk import DiskStore
from hybridkv.store.eviction import LRUOrder, ValueOrder, make_order


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
    """Three equal items; 0 is used four more times (w = 5). Each eviction advances the clock by
    the victim's share of the described bytes; 0's weight halves per turnover, so after enough
    turnovers a fresh item outranks it."""
    order = ValueOrder(half_life=1.0)
    for i in range(3):
        order.describe(i, nbytes=100, cost=50)
        order.add(i)
    for _ in range(4):
        order.hit(0)                            # distinct uses at one clock reading: w = 1 + 4
    assert order.weight(0) == pytest.approx(5.0) and order.weight(1) == pytest.approx(1.0)
    assert order.priority(0) == pytest.approx(math.log2(5 * 50 / 100))
    assert order.pop() == 1 and order.clock == pytest.approx(1 / 3)      # 100 of 300 described bytes
    order.forget(1)
    clock, victims = 1 / 3, []
    for k in range(3, 20):                      # a fresh item per eviction: 0's weight decays meanwhile
        order.describe(k, nbytes=100, cost=50)
        order.add(k)
        w0 = order.weight(0)
        victims.append(order.pop())
        clock += 100 / 300                      # three items described at each eviction
        assert order.clock == pytest.approx(clock)
        order.forget(victims[-1])
        if victims[-1] == 0:
            break
    assert victims[-1] == 0 and 0 not in victims[:-1]
    assert w0 < 1 and len(victims) > 3 * math.log2(5) - 1   # gone once below a single use: ~log2(5) turnovers


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
