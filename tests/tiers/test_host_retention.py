"""HostTier retention: what a device eviction of an entry the host already holds does
(``inclusive``, ``demote``), and device copies evicted first (``exclusive``)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.groups import KDA, FullAttentionSpec, KDASpec, entry_shapes
from hybridkv.engine.backend import SimulatedBackend
from hybridkv.engine.build import model_config
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request
from hybridkv.tiers.host import HOST_RETENTION, HostTier

B = 64                       # tokens per page, per unit, per host entry
NS = b"n" * 32
MODEL = model_config("small")
SHAPES = entry_shapes(FullAttentionSpec.for_model(MODEL, B), KDASpec.for_model(MODEL), B)
CK = KDASpec.for_model(MODEL).page_size_bytes
KEYS = [bytes([i]) * 32 for i in range(1, 9)]


def _tier(retention: str, entries: int = 2) -> HostTier:
    return HostTier(entries * CK, NS, B, B, SHAPES, payload=False, groups=(KDA,), retention=retention)


def _save(t: HostTier, i: int, on_device: bool = False, speculative: bool = False) -> None:
    key = KEYS[i]
    assert t.save_entries([(key, None, KDA, (i + 1) * B, None)], on_device={key} if on_device else (),
                          speculative={key} if speculative else ()) == [True]


def _held(t: HostTier) -> list[int]:
    return [i for i, ok in enumerate(t.exists([(k, KDA) for k in KEYS])) if ok]


@pytest.mark.parametrize("retention, kept", [("inclusive", [1, 2]), ("demote", [0, 2]), ("exclusive", [0, 2])])
def test_a_demotion_refreshes_the_entry_unless_inclusive(retention, kept):
    t = _tier(retention)
    _save(t, 0, on_device=True)                  # written through, then the device evicts it
    _save(t, 1, on_device=True)
    t.demoted([(KEYS[0], KDA), (KEYS[5], KDA)])  # a key not held is ignored
    _save(t, 2)
    assert _held(t) == kept
    assert t.demotions_held == 1


def test_exclusive_evicts_device_copies_before_older_entries():
    t = _tier("exclusive", entries=3)
    _save(t, 0)                                  # demoted (saved by the write-back): the device has none
    _save(t, 1, on_device=True)
    _save(t, 2, on_device=True)
    _save(t, 3)                                  # lru would drop 0; exclusive drops the oldest device copy
    assert _held(t) == [0, 2, 3]
    t.load_many([KEYS[0]], [(B, KDA)])           # a promotion: the device holds 0 again
    t.demoted([(KEYS[2], KDA)])                  # and 2 is no longer on the device
    _save(t, 4)
    assert _held(t) == [2, 3, 4]
    assert t.used_bytes == 3 * CK and t.stats.evictions == 2


def test_exclusive_device_copy_takes_only_free_room_or_another_copy():
    t = _tier("exclusive")
    _save(t, 0)
    _save(t, 1, speculative=True)
    assert t.save_entries([(KEYS[2], None, KDA, 3 * B, None)], on_device={KEYS[2]}) == [False]   # refused
    assert _held(t) == [0, 1] and t.stats.evictions == 0
    t.demoted([(KEYS[0], KDA)])
    _save(t, 3)                                  # a demoted entry: the speculative one gives way
    assert _held(t) == [0, 3]


def test_demotion_takes_a_speculative_entry_off_probation():
    t = _tier("demote", entries=4)
    t.probation_share = 0.0                      # speculative entries go first whenever room is needed
    _save(t, 0, speculative=True)
    _save(t, 1, speculative=True)
    t.demoted([(KEYS[0], KDA)])                  # e.g. promoted, then evicted again by the device
    for i in (2, 3, 4):
        _save(t, i)
    assert _held(t) == [0, 2, 3, 4]


def test_bad_retention_is_named():
    assert HOST_RETENTION == ("inclusive", "demote", "exclusive")
    with pytest.raises(ValueError, match="retention='lru'"):
        _tier("lru")


def _run(engine: Engine, i: int, tokens: np.ndarray) -> int:
    r = engine.add_request(Request(f"r{i}", tokens, 1))
    engine.run_until_done()
    return r.reused


@pytest.mark.parametrize("retention, held_at_demotion, reused",
                         [("inclusive", 4, 0), ("demote", 2, 0), ("exclusive", 2, 3 * B)])
def test_engine_keeps_what_the_device_gave_up(retention, held_at_demotion, reused):
    """Four device slots, a host of four checkpoints written through; each prompt's ``tail`` places
    two checkpoints (at ``T`` and ``T - 1`` aligned). A's go to the device and the host; C and D
    evict A's and B's from the device. The host keeps A's only when the copies of what the device
    still holds give up their room first (``exclusive``); then A's next turn resumes from it."""
    cfg = CacheConfig(block_size=B, prefix_match_unit=B, num_kv_pages=64, num_checkpoint_slots=4,
                      policy=CheckpointPolicy.parse(f"tail={B}"), max_num_seqs=1)
    backend = SimulatedBackend(FullAttentionSpec.for_model(MODEL, B), KDASpec.for_model(MODEL),
                               vocab_size=MODEL.vocab_size)
    host = HostTier(4 * CK, NS, B, B, SHAPES, payload=False, groups=(KDA,), write_through=True,
                    retention=retention)
    engine = Engine(cfg, backend, NS, tiers=[host])
    prompts = [np.full(3 * B, 10 + k, dtype=np.int64) for k in range(4)]      # A, B, C, D: nothing shared
    for i, p in enumerate(prompts):
        assert _run(engine, i, p) == 0
    assert engine.cache.evicted_checkpoints == 4                             # A's and B's
    assert host.demotions_held == held_at_demotion       # A's were held; B's too unless the host let them go
    turn = np.concatenate([prompts[0], np.full(B, 99, dtype=np.int64)])
    assert _run(engine, 9, turn) == reused


def test_protected_segment_keeps_entries_loaded_before():
    """Entry 0 was loaded once: demoted again later, it outlives the one-off demotions that
    would push it out of one LRU order; once protected entries exceed their share, the oldest
    rejoins the main order as its most recent entry (segmented LRU), not evicted outright."""
    def fill(t: HostTier) -> None:
        _save(t, 0)
        t.load_many([KEYS[0]], [(B, KDA)])           # a host hit (promotion): remembered
        t.demoted([(KEYS[0], KDA)])                  # the device let it go again
        for i in (1, 2, 3, 4):                       # one-off demotions
            _save(t, i)

    plain = _tier("demote", entries=3)
    fill(plain)
    assert _held(plain) == [2, 3, 4]
    t = HostTier(3 * CK, NS, B, B, SHAPES, payload=False, groups=(KDA,), retention="demote", protected_share=0.5)
    fill(t)
    assert _held(t) == [0, 3, 4]
    t.load_many([KEYS[3]], [(B, KDA)])               # a second protected entry: 2 of 3 > half
    _save(t, 5)
    assert _held(t) == [0, 3, 5]                     # 0 left the segment for the main order's newest: 4 went
    _save(t, 6)
    assert _held(t) == [3, 5, 6]                     # then 0, the main order's oldest


def test_protected_share_bad_values_are_named():
    for bad in (0.0, 1.5, "x", True):
        with pytest.raises(ValueError, match="protected_share"):
            HostTier(CK, NS, B, B, SHAPES, payload=False, groups=(KDA,), protected_share=bad)
    with pytest.raises(ValueError, match="eviction='value'"):
        HostTier(CK, NS, B, B, SHAPES, payload=False, groups=(KDA,), eviction="value", protected_share=0.5)
