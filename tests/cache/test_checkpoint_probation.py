"""Checkpoint probation (``CacheConfig.checkpoint_probation``, :class:`ProbationOrder`): checkpoints
placed on speculation (``interval``) wait on probation until used, and go first while probation is
at its share; a use promotes them; the order's bookkeeping stays exact."""

from __future__ import annotations

import numpy as np
import pytest
from small_checkpoint_cache import BLOCK, UNIT, serve_once, small_cache

from hybridkv.cache.config import CacheConfig, ConfigError
from hybridkv.store.eviction import ProbationOrder



def test_probation_goes_first_at_its_share_and_a_hit_promotes():
    o = ProbationOrder(capacity=4, share=0.25)       # probation may hold 1 member while others need room
    o.mark(1)
    o.mark(2)
    for item in (1, 10, 2, 11):
        o.describe(item)
        o.add(item)
    assert o.on_probation(1) and o.on_probation(2) and not o.on_probation(10)
    assert o.victim() == 1                             # 2 on probation >= 1: its oldest first
    o.discard(1)
    assert o.victim() == 2                             # 1 left, still at its share
    o.hit(2)                                           # a use promotes it
    assert not o.on_probation(2) and o.victim() == 10  # now plain lru over the rest
    o.mark(3)
    o.describe(3)
    o.add(3)
    assert o.victim() == 3                             # at its share (1 >= 1): probation first
    assert sorted(o) == [2, 3, 10, 11] and len(o) == 4


def test_probation_below_its_share_keeps_its_members():
    o = ProbationOrder(capacity=8, share=0.5)          # room for 4 on probation
    o.mark(1)
    for item in (1, 10, 11):
        o.describe(item)
        o.add(item)
    assert o.victim() == 10                            # 1 < 4 on probation: the others' oldest
    o.discard(10)
    o.discard(11)
    assert o.victim() == 1                             # nothing else evictable


def test_forget_clears_the_mark():
    o = ProbationOrder(capacity=2, share=0.0)
    o.mark(1)
    o.describe(1)
    o.add(1)
    o.forget(1)                                        # the slot is freed
    o.describe(1)
    o.add(1)                                           # new content in the same slot, not marked
    assert not o.on_probation(1)


@pytest.mark.parametrize("bad", [(0, 0.5), (4, -0.1), (4, 1.5)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError, match="probation"):
        ProbationOrder(*bad)


@pytest.mark.parametrize("value, eviction", [(1.5, "lru"), (-0.1, "lru"), (True, "lru"), (0.5, "value")])
def test_config_refuses(value, eviction):
    with pytest.raises(ConfigError, match="checkpoint_probation"):
        CacheConfig(block_size=BLOCK, prefix_match_unit=UNIT, checkpoint_probation=value, eviction=eviction)


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


@pytest.mark.parametrize("probation, kept", [(None, False), (0.0, True)])
def test_interval_checkpoints_do_not_push_out_a_tail(probation, kept):
    """A conversation's tail, then a one-off prompt whose prefill places 4 interval checkpoints in
    a 4-slot pool: under one lru order they push the tail out; on probation they evict each other."""
    cache = small_cache(checkpoint_probation=probation)
    conv = _tokens(1, 4 * UNIT + 1)
    serve_once(cache, conv, {4 * UNIT: "tail"})
    serve_once(cache, _tokens(2, 5 * UNIT), {b * UNIT: "interval" for b in range(1, 5)})
    turn = np.concatenate([conv[:4 * UNIT], _tokens(3, 2 * UNIT)])
    hit, _ = serve_once(cache, turn, {})
    assert (hit == 4 * UNIT) is kept


def test_soak_rounds_with_probation_are_exact_and_leak_free(tiny_model):
    """``hybridkv soak --eviction probation``: the soak's rounds with interval checkpoints on
    probation in the device checkpoint pool stay exact (every request against a full prefill) and
    leak-free, with checkpoints evicted."""
    from hybridkv.replay import soak

    rep = soak.run_soak(0, rounds=3, model=tiny_model, eviction="probation")
    assert rep.ok, "\n".join(f.render(tiny_model.config.vocab_size) for f in rep.failures)
    assert rep.checks >= 20 and rep.coverage["eviction"] == {"lru": 3}
    assert rep.command.endswith("--eviction probation")


def test_replay_option_reaches_the_cache_and_keeps_more_reuse():
    """``ReplayOptions.checkpoint_probation`` (``replay --checkpoint-probation``) reaches the device
    checkpoint pool: on the bundled trace's first 1,000 requests with 60 checkpoint slots, interval
    checkpoints on probation leave the tails in place and more tokens are reused."""
    from rich.console import Console

    from hybridkv.replay.runner import ReplayOptions, run_replay

    def reused(probation):
        return run_replay(ReplayOptions(limit=1000, simulate=True, progress=False, block_tokens=512,
                                        num_checkpoint_slots=60, host_bytes=0, checkpoint_probation=probation),
                          Console(stderr=True, quiet=True)).reused_tokens

    assert reused(0.0) > reused(None)


def test_cli_refuses_probation_with_value(capsys):
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--checkpoint-probation", "0", "--eviction", "value"])
    assert exc.value.code == 2
    assert "--checkpoint-probation 0 works with --eviction lru, not value" in capsys.readouterr().err
