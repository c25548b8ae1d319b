"""Shared tails in the ``utility`` checkpoint order without a lower tier: a conversation tail that
:data:`SHARED_TAIL_HITS` requests resumed from (a first turn's tail that ended on a tenant's
system prompt) is kept when a next turn would retire it (``supersede``), relabelled ``branch``
with its hits back to 0 and out of its tail group (:meth:`UtilityOrder.relabel`). With a lower
tier, or under another order, ``supersede`` retires it as before."""

from __future__ import annotations

import numpy as np
import pytest
from small_checkpoint_cache import UNIT, small_cache

from hybridkv.cache.pools import SHARED_TAIL_HITS, UtilityOrder

TOL = 1e-9          # priorities are small products of integers and shares


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


def test_relabel_restarts_the_hits_and_leaves_the_group():
    o = UtilityOrder()
    o.mark(1, "tail", 100.0, "g")
    o.describe(1, cost=100.0, key=b"k1")
    o.add(1)
    o.hit(1)
    o.hit(1)
    assert o.group_of(1) == "g" and o.info[1].hits == 2
    o.relabel(1, "branch")
    assert o.group_of(1) is None and o.info[1].hits == 0 and o._what[1] == ("branch", 100.0)
    assert abs(o.priority(1) - o.floor - o.use_share("branch") * 100.0) < TOL
    assert abs(o._prio[1] - o.priority(1)) < TOL
    o.relabel(2, "branch")                       # not described: nothing happens
    assert 2 not in o._what


@pytest.mark.parametrize("order,lower,kept", [("utility", False, True), ("utility", True, False),
                                              (None, False, False)])
def test_a_tail_two_requests_resumed_from_is_kept_past_supersede(order, lower, kept):
    """A first turn places its tail at 2 units; two next turns resume from it at once and each
    places its own tail (``supersede``). The shared tail stays (as a ``branch``, hits 0) only
    under ``utility`` without a lower tier; a later request then resumes from it."""
    cache = small_cache("tail+supersede", checkpoint_eviction=order)
    cache.lower_tiers = lower
    head = _tokens(1, 2 * UNIT)
    first = np.concatenate([head, _tokens(2, 1)])
    m = cache.lookup(first)
    a = cache.acquire(m, len(first) + 8)
    cache.publish(a, m.hashes, len(first), {2 * UNIT: (None, "tail")})
    cache.release(a)
    slot = cache.index.walk(cache.hash_prompt(first)[:2])[-1].checkpoint
    turns = [np.concatenate([head, _tokens(s, UNIT + 1)]) for s in (3, 4)]
    held = []
    for t in turns:                              # both resume from the shared tail before either publishes
        m = cache.lookup(t)
        assert m.hit == 2 * UNIT
        held.append((m, cache.acquire(m, len(t) + 8), t))
    if order == "utility":
        assert cache._hits(slot) == SHARED_TAIL_HITS
    for m, a, t in held:
        cache.publish(a, m.hashes, len(t), {3 * UNIT: (None, "tail")})
    for _, a, _ in held:
        cache.release(a)
    cache.check_invariants()
    node = cache.index.walk(cache.hash_prompt(first)[:2])[-1]
    assert (node.checkpoint == slot) is kept
    if kept:
        assert cache.labels[slot] == "branch" and cache._hits(slot) == 0
        assert cache.checkpoints.order.group_of(slot) is None
    later = np.concatenate([head, _tokens(5, UNIT + 1)])
    assert cache.lookup(later).hit == (2 * UNIT if kept else 0)
