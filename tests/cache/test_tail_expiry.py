"""Tail expiry in the ``utility`` checkpoint order (:class:`UtilityOrder`): a conversation tail
placed in a group (the checkpoint its conversation's first turn resumed from) that was never hit
and is older, in its group's own clock (tails placed in the group), than every return the group
has had is relabelled ``expired`` and ranks by that label's learned share; evicted never-hit
tails are remembered as ghosts, so a return after an eviction still teaches the gap. The
coordinator gives a tail its group only without a lower tier."""

from __future__ import annotations

import numpy as np
import pytest
from small_checkpoint_cache import UNIT, serve_once, small_cache

from hybridkv.cache.pools import EXPIRED, EXPIRY_MIN_RETURNS, UtilityOrder
from hybridkv.cache.purge import PurgeSelector, purge_device

TOL = 1e-9          # priorities are small products of integers and shares


def _tail(o: UtilityOrder, item: int, group, saving: float = 100.0) -> None:
    o.mark(item, "tail", saving, group)
    o.describe(item, cost=saving, key=b"k%d" % item)
    o.add(item)


def _returns(o: UtilityOrder, group, n: int, first: int = 0) -> int:
    """``n`` tails of ``group``, each hit right after the next one is placed (return gap 1), and
    one more left unhit; the next free item id."""
    for i in range(first, first + n + 1):
        _tail(o, i, group)
        if i > first:
            o.hit(i - 1)
    return first + n + 1


def test_a_tail_older_than_every_return_of_its_group_expires():
    """Group ``a`` has had 19 returns, each after one more tail of its own: a never-hit tail two
    of ``a``'s tails old expires (ranked by ``expired``'s share, 1/3 then 1/4, never above its
    priority before) and goes before fresher ones that save less; a tail of a quiet group ``b``
    keeps its rank however many tails ``a`` places, until two of ``b``'s own follow it (the
    largest gap of any group applies to a group without returns of its own)."""
    o = UtilityOrder()
    _tail(o, 1000, "b")
    nxt = _returns(o, "a", EXPIRY_MIN_RETURNS)
    last_unhit = nxt - 1
    x = 100
    _tail(o, x, "a", saving=200)                 # would rank above the others: it saves twice as much
    _tail(o, 101, "a")                           # the last unhit tail of the warm-up is now 2 old
    assert o._what[last_unhit][0] == EXPIRED and o._what[x][0] == "tail"
    _tail(o, 102, "a")                           # x is 2 of a's tails old: past the gap of 1
    assert o._what[x][0] == EXPIRED and o.placed[EXPIRED] == 2
    assert abs(o.priority(x) - 200 / 4) < TOL    # expired: 0 uses of 2 placed -> 1/4
    assert o._prio[x] <= 200 / 4 + TOL and o._prio[x] < o._prio[101] and o._prio[x] < o._prio[102]
    assert [i for i in o if i in (last_unhit, x, 101, 102)][:2] == [last_unhit, x]
    assert o._what[1000][0] == "tail"            # b's clock has not moved
    _tail(o, 1001, "b")
    _tail(o, 1002, "b")
    assert o._what[1000][0] == EXPIRED and o._what[1001][0] == "tail"


def test_nothing_expires_before_enough_returns():
    """With 18 returns in all, the largest gap is not trusted yet: no tail expires, however old."""
    o = UtilityOrder()
    nxt = _returns(o, "a", EXPIRY_MIN_RETURNS - 1)
    for i in range(nxt, nxt + 10):
        _tail(o, i, "a")
    assert EXPIRED not in o.placed and o.returns == EXPIRY_MIN_RETURNS - 1


def test_a_hit_tail_and_an_ungrouped_tail_never_expire():
    o = UtilityOrder()
    nxt = _returns(o, "a", EXPIRY_MIN_RETURNS)
    _tail(o, 200, "a")
    o.hit(200)
    o.mark(201, "tail", 100)                     # no group
    o.describe(201, cost=100)
    o.add(201)
    for i in range(nxt, nxt + 5):
        _tail(o, 300 + i, "a")
    assert o._what[200][0] == "tail" and o._what[201][0] == "tail"


def test_a_ghost_teaches_the_gap_and_counts_a_use_of_expired():
    """An expired tail is evicted (a ghost: its content key kept, at most ``ghosts`` of them); a
    request that later goes past its boundary counts as a return: the group's largest gap grows to
    that return's age (4 of its tails) and ``expired`` gains a use."""
    o = UtilityOrder(ghosts=2)
    nxt = _returns(o, "a", EXPIRY_MIN_RETURNS)
    _tail(o, 500, "a")
    for i in range(3):
        _tail(o, 501 + i, "a")
    assert o._what[500][0] == EXPIRED
    o.forget(500)
    assert o.ghosts[b"k500"][2] is True
    _tail(o, 504, "a")
    o.resumed(b"k500")                           # 4 of a's tails placed since it
    assert o._groups["a"][2] == 4 and o.max_gap == 4 and o.used[EXPIRED] == 1
    assert o.returns == EXPIRY_MIN_RETURNS + 1 and b"k500" not in o.ghosts
    o.resumed(b"k500")                           # once only
    assert o.returns == EXPIRY_MIN_RETURNS + 1
    for i in (501, 502, 503):                    # three more ghosts: the oldest is dropped
        o.forget(i)
    assert list(o.ghosts) == [b"k502", b"k503"]
    del nxt



def test_the_order_keeps_at_most_twice_its_slots_of_group_records():
    """A pool of 2 slots: at most 4 tail groups are kept, the least recently placed into
    forgotten first; a return to a tail of a forgotten group still counts in the order's returns
    and largest gap, and the group's next tail starts a new record on a fresh clock."""
    o = UtilityOrder(ghosts=2)
    for i, g in enumerate("abcd"):
        _tail(o, i, g)
    _tail(o, 10, "a")                            # a placed into again: b is now the least recent
    _tail(o, 11, "e")
    assert list(o._groups) == ["c", "d", "a", "e"]
    for i in range(12, 20):                      # b's tail 1 waits 3 more of b's tails... none come
        _tail(o, i, "e")
    o.hit(1)                                     # b's record is gone: the return is still counted
    assert o.returns == 1 and o.max_gap == 0 and "b" not in o._groups
    _tail(o, 20, "b")
    assert o._groups["b"][:3] == [1, 0, -1] and len(o._groups) == 4


def test_an_order_without_a_pool_size_keeps_every_group():
    o = UtilityOrder()
    for i in range(50):
        _tail(o, i, i)
    assert len(o._groups) == 50

def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


def test_a_conversations_tails_share_the_group_of_its_head():
    """A first turn resumes from a branch checkpoint at 2 units (a tenant's system prompt) and
    places its tail: the tail's group is that checkpoint's content key; the next turn resumes from
    the tail and its tail inherits the group; a request that goes past the boundary of an evicted
    never-hit tail teaches the order a return. With a lower tier no tail gets a group."""
    for lower in (False, True):
        cache = small_cache("branch+tail", checkpoint_eviction="utility")
        cache.lower_tiers = lower
        order = cache.checkpoints.order
        head = _tokens(1, 2 * UNIT)
        serve_once(cache, np.concatenate([head, _tokens(2, UNIT + 1)]), {2 * UNIT: "branch"})
        turn1 = np.concatenate([head, _tokens(3, UNIT + 1)])
        assert serve_once(cache, turn1, {3 * UNIT: "tail"})[0] == 2 * UNIT
        hashes1 = cache.hash_prompt(turn1)
        head_key = cache.index.walk(hashes1[:2])[-1].key
        t1 = cache.index.walk(hashes1[:3])[-1].checkpoint
        assert order.group_of(t1) == (None if lower else head_key)
        turn2 = np.concatenate([turn1[:3 * UNIT], _tokens(4, UNIT + 1)])
        assert serve_once(cache, turn2, {4 * UNIT: "tail"})[0] == 3 * UNIT
        hashes2 = cache.hash_prompt(turn2)
        t2 = cache.index.walk(hashes2[:4])[-1].checkpoint
        assert order.group_of(t2) == (None if lower else head_key)
        if lower:
            assert not order._groups
            continue
        cache._evict_checkpoint(t2)                  # evicted before anyone came back to it
        assert len(order.ghosts) == 1
        turn3 = np.concatenate([turn2[:4 * UNIT], _tokens(5, UNIT + 1)])
        hit, _ = serve_once(cache, turn3, {})
        assert hit < 4 * UNIT and not order.ghosts and order.returns == 2   # turn1's tail (hit), t2 (ghost)


@pytest.mark.parametrize("how", ["selector", "prefix"])
def test_a_purge_leaves_no_ghost_or_group_of_what_it_removed(how):
    """A purge is no eviction: a never-hit tail it removes (by a selector, or
    :meth:`remove_prefix`) is not remembered as a ghost and the groups keyed by removed
    checkpoints are dropped, so nothing of the purged entries stays in the order, and the same
    prompt sent again after the purge teaches no return."""
    cache = small_cache("branch+tail", checkpoint_eviction="utility")
    order = cache.checkpoints.order
    head = _tokens(1, 2 * UNIT)
    serve_once(cache, np.concatenate([head, _tokens(2, UNIT + 1)]), {2 * UNIT: "branch"})
    turn1 = np.concatenate([head, _tokens(3, UNIT + 1)])
    serve_once(cache, turn1, {3 * UNIT: "tail"})
    assert order._groups and order._born
    if how == "selector":
        assert purge_device(cache, PurgeSelector(created_before=1e18)).checkpoints == 2
    else:
        assert cache.remove_prefix(cache.hash_prompt(turn1)[0]) == 4
    assert not order.ghosts and not order._groups and not order._born
    returns = order.returns
    serve_once(cache, np.concatenate([turn1[:3 * UNIT], _tokens(4, UNIT + 1)]), {})
    assert order.returns == returns
