"""Lead checkpoints of the ``utility`` order without a lower tier (:data:`LEAD`,
:attr:`MatchResult.lead`): one checkpoint a block past where a request's own content begins (its
KV hit), placed by :func:`plan_captures`, saving over the boundary just below it, skipped when the
saving of the request's other checkpoints is measured, never the checkpoint a passed one hands its
uses to, and evicted without raising the order's floor unless a request resumed from it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from small_checkpoint_cache import BLOCK, UNIT, serve_once, small_cache

from hybridkv.cache.coordinator import LEAD
from hybridkv.cache.pools import UtilityOrder
from hybridkv.engine.scheduler import plan_captures

TOL = 1e-9          # priorities are sums of a few products of small integers and shares


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


@pytest.mark.parametrize("order, lower, lead", [("utility", False, True), ("utility", True, False),
                                                (None, False, False)])
def test_lookup_names_the_block_past_the_kv_hit(order, lower, lead):
    """A prompt sharing 2 units with a cached one: its KV hit is 2 units, so the lead is the block
    boundary after it (3 units: blocks and units are one size here); only the ``utility`` order
    without a lower tier names one."""
    cache = small_cache("tail", checkpoint_eviction=order)
    cache.lower_tiers = lower
    first = _tokens(1, 4 * UNIT + 1)
    serve_once(cache, first, {})
    second = np.concatenate([first[: 2 * UNIT], _tokens(2, 4 * UNIT + 1)])
    match = cache.lookup(second)
    assert match.kv_hit == 2 * UNIT
    assert match.lead == (3 * BLOCK if lead else None)
    for shorter in cache.shorter_hits(match):
        assert shorter.lead == match.lead


def test_plan_captures_places_the_lead_unless_another_term_claims_it():
    """:func:`plan_captures` claims the lead as ``lead`` when it lies in ``(hit, T]``; a boundary
    another term claims keeps that term's label; a lead past the prompt is not placed."""
    cache = small_cache("tail+interval=128", checkpoint_eviction="utility")
    prompt = _tokens(3, 6 * UNIT + 1)
    match = cache.lookup(prompt)
    assert match.hit == 0 and match.lead == BLOCK
    plan = plan_captures(cache.config, match, len(prompt))
    assert plan[BLOCK] == LEAD and plan[2 * BLOCK] == "interval" and plan[6 * UNIT] == "tail"
    match.lead = 2 * BLOCK                          # the interval term's boundary
    assert LEAD not in plan_captures(cache.config, match, len(prompt)).values()
    match.lead = 7 * UNIT                           # past the prompt's 6 units
    assert LEAD not in plan_captures(cache.config, match, len(prompt)).values()


def test_a_lead_saves_over_the_boundary_below_it_and_others_skip_it():
    """A request with no hit places a lead at 1 unit and a tail at 4: the lead saves 1 unit, the
    tail 4 (over the request's start, not over the lead the order may evict first)."""
    cache = small_cache("tail", checkpoint_eviction="utility")
    prompt = _tokens(4, 4 * UNIT + 1)
    serve_once(cache, prompt, {UNIT: LEAD, 4 * UNIT: "tail"})
    hashes = cache.hash_prompt(prompt)
    lead, tail = (cache.index.walk(hashes[:k])[-1].checkpoint for k in (1, 4))
    order = cache.checkpoints.order
    assert isinstance(order, UtilityOrder)
    assert order._what[lead] == (LEAD, float(UNIT)) and order._what[tail] == ("tail", float(4 * UNIT))
    assert cache.labels[lead] == LEAD


def test_a_passed_checkpoint_hands_its_uses_to_the_next_one_that_is_not_a_lead():
    """A request resumes from an ``interval`` checkpoint at 2 units and places a lead at 3 and a
    branch at 5, with no branch between: the interval ranks as unused again and the branch, not
    the lead, takes its saving (5 units); the lead saves its own unit."""
    cache = small_cache("tail", checkpoint_eviction="utility")
    prompt = _tokens(7, 6 * UNIT + 1)
    serve_once(cache, prompt[: 3 * UNIT + 1], {2 * UNIT: "interval"})
    hit, _ = serve_once(cache, prompt, {3 * UNIT: LEAD, 5 * UNIT: "branch"})
    assert hit == 2 * UNIT
    hashes = cache.hash_prompt(prompt)
    low, lead, high = (cache.index.walk(hashes[:k])[-1].checkpoint for k in (2, 3, 5))
    order = cache.checkpoints.order
    assert order._what[low][0] == "shadowed" and order._what[lead] == (LEAD, float(UNIT))
    assert order._what[high] == ("branch", float(5 * UNIT))


@pytest.mark.parametrize("used", [False, True])
def test_a_lead_never_resumed_from_leaves_the_floor_as_it_is(used):
    """Four slots: a lead at 1 unit (resumed from once, or never), then four one-off prompts with
    a tail each. The lead is the first victim; the floor rises to its priority only if a request
    resumed from it, so a lead never used does not age the checkpoints that stay."""
    cache = small_cache("tail", checkpoint_eviction="utility")
    prompt = _tokens(5, 3 * UNIT + 1)
    serve_once(cache, prompt, {UNIT: LEAD})
    if used:
        branch = np.concatenate([prompt[:UNIT], _tokens(6, 2 * UNIT + 1)])
        assert serve_once(cache, branch, {})[0] == UNIT
    order = cache.checkpoints.order
    slot = cache.index.walk(cache.hash_prompt(prompt)[:1])[-1].checkpoint
    prio = order.priority(slot)
    for seed in range(10, 14):
        serve_once(cache, _tokens(seed, 6 * UNIT + 1), {6 * UNIT: "tail"})
    assert cache.index.walk(cache.hash_prompt(prompt)[:1])[-1].checkpoint is None
    assert cache.evicted_checkpoints == 1
    if used:
        assert order.floor == pytest.approx(prio, abs=TOL) and order.floor > 0
    else:
        assert order.floor == 0.0


def _replay(tmp_path, prompts, **opts):
    from rich.console import Console

    from hybridkv.replay.runner import ReplayOptions, run_replay
    trace = tmp_path / "t.jsonl"
    with open(trace, "w") as f:
        for k, ids in enumerate(prompts):
            f.write(json.dumps({"timestamp": 10_000 * k, "input_length": 512 * len(ids), "output_length": 1,
                                "hash_ids": ids}) + "\n")
    return run_replay(ReplayOptions(trace=str(trace), simulate=True, progress=False, block_tokens=512,
                                    num_checkpoint_slots=64, **opts), Console(stderr=True, quiet=True))


@pytest.mark.parametrize("host_bytes, order, reused", [(0, "utility", 512), (0, None, 0),
                                                       (64 << 20, "utility", 0)])
def test_replay_resumes_a_branch_one_block_past_an_earlier_start(tmp_path, host_bytes, order, reused):
    """A 16-block prompt, then (after three one-block fillers) one that shares its first block and
    goes on differently: under
    ``utility`` without a host tier the first left a lead checkpoint one block in, so the second
    resumes there (512 tokens); under ``lru``, or with a host tier, nothing lies below its branch
    (interval checkpoints every 14 blocks) and it reuses nothing."""
    prompts = [list(range(1, 17)), [90_001], [90_002], [90_003], [1, 99]]   # fillers: the first is published
    r = _replay(tmp_path, prompts, host_bytes=host_bytes, checkpoint_eviction=order)
    assert r.reused_tokens == reused
    assert (r.checkpoints_created.get(LEAD, 0) > 0) is bool(reused)
