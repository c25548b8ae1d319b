"""HostTier: tensors held in host memory, LRU by bytes, idempotent saves, shape checks."""

from __future__ import annotations

import pytest
import torch
from tier_helpers import held

from hybridkv.cache.groups import FullAttentionSpec, KDASpec, entry_shapes
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.layout import checkpoint_components

UNIT, ALIGN = 64, 128
SHAPES = entry_shapes(FullAttentionSpec(ALIGN, num_layers=2, latent_dim=8),
                      KDASpec(num_layers=3, num_heads=2, head_dim=4, conv_dim=24, conv_width=3), ALIGN)
HASHES = [bytes([i]) * 32 for i in range(1, 17)]


def kv(seed: int) -> dict:
    return {"latents": torch.randn(2, ALIGN, 8, generator=torch.Generator().manual_seed(seed))}


def kda(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    from hybridkv.model.state import KDACheckpoint
    return checkpoint_components(KDACheckpoint(torch.randn(3, 2, 4, 4, generator=g),
                                               torch.randn(3, 24, 3, generator=g), ALIGN))


KV_BYTES = 2 * ALIGN * 8 * 4


def test_save_load_roundtrip_and_private_copy():
    t = HostTier(1 << 20, b"ns", UNIT, ALIGN, SHAPES)
    src = kv(1)
    assert t.save_entries([t.entry(HASHES, ALIGN, "full", src), t.entry(HASHES, ALIGN, "kda", kda(2))]) == [True, True]
    expect = src["latents"].clone()
    src["latents"].zero_()                                   # the tier copied: later writes do not leak in
    got = t.load_many(HASHES, [(ALIGN, "full"), (ALIGN, "kda"), (2 * ALIGN, "full")])
    assert torch.equal(got[0]["latents"], expect)
    assert torch.equal(got[1]["conv.k"], kda(2)["conv.k"])
    assert got[2] is None and t.stats.misses["absent"] == 1
    assert t.stats.bytes_saved == t.used_bytes and t.stats.bytes_loaded > 0
    rm = t.lookup(HASHES, 16 * UNIT)
    assert (rm.kv_length, rm.best_joint, rm.missing_branching_boundary) == (ALIGN, ALIGN, None)


def test_lru_eviction_by_bytes_and_idempotent_save():
    # inclusive: a load is a use here (the default, exclusive, evicts a loaded entry first: the
    # device installs it; tests/tiers/test_host_retention.py)
    t = HostTier(3 * KV_BYTES, b"ns", UNIT, ALIGN, SHAPES, retention="inclusive")
    for i in range(1, 4):
        assert t.save_entries([t.entry(HASHES, i * ALIGN, "full", kv(i))]) == [True]
    t.load_many(HASHES, [(ALIGN, "full")])                     # touch the first: the second is now oldest
    assert t.save_entries([t.entry(HASHES, ALIGN, "full", kv(99))]) == [True]   # held already: a no-op
    assert torch.equal(t.load_many(HASHES, [(ALIGN, "full")])[0]["latents"], kv(1)["latents"])
    assert t.save_entries([t.entry(HASHES, 4 * ALIGN, "full", kv(4))]) == [True]
    assert held(t, HASHES, [ALIGN, 2 * ALIGN, 3 * ALIGN, 4 * ALIGN], "full") == [True, False, True, True]
    assert t.used_bytes == 3 * KV_BYTES
    t.invalidate(HASHES, ALIGN, "full")
    assert held(t, HASHES, [ALIGN], "full") == [False] and t.used_bytes == 2 * KV_BYTES


def test_entry_larger_than_capacity_is_refused_and_bad_input_named():
    t = HostTier(KV_BYTES - 1, b"ns", UNIT, ALIGN, SHAPES)
    assert t.save_entries([t.entry(HASHES, ALIGN, "full", kv(1))]) == [False]
    with pytest.raises(ValueError, match="full entry components"):
        t.save_entries([t.entry(HASHES, ALIGN, "full", {"latents": torch.zeros(2, ALIGN, 9)})])
    with pytest.raises(ValueError, match="capacity_bytes=0"):
        HostTier(0, b"ns", UNIT, ALIGN, SHAPES)
    with pytest.raises(ValueError, match="store_alignment=100"):
        HostTier(1 << 20, b"ns", UNIT, 100, SHAPES)
    assert t.used_bytes == 0


@pytest.mark.gpu
def test_pinned_async_copies_from_cuda():
    """On CUDA: entries land in pinned host memory through async copies, and the recorded event
    is waited before the entry is handed out."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = HostTier(1 << 20, b"ns", UNIT, ALIGN, SHAPES, pin_memory=True)
    src = {"latents": kv(3)["latents"].cuda()}
    assert t.save_entries([t.entry(HASHES, ALIGN, "full", src)]) == [True]
    held = t._entries[(HASHES[ALIGN // UNIT - 1], "full")]
    assert held.tensors["latents"].is_pinned() and held.ready is not None
    got = t.load_many(HASHES, [(ALIGN, "full")])[0]["latents"]
    assert held.ready is None and torch.equal(got, src["latents"].cpu())


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_host_quota_holds_under_a_tenant_flood(eviction):
    """Owner B saves far more than its quota; it evicts its own entries, never A's."""
    t = HostTier(16 * KV_BYTES, b"ns", UNIT, ALIGN, SHAPES, eviction=eviction, quota_bytes=2 * KV_BYTES)
    assert t.save_entries([t.entry(HASHES, ALIGN, "full", kv(0))], owner=b"A") == [True]
    for i in range(2, 9):                                                   # 7 entries of B, quota 2
        assert t.save_entries([t.entry(HASHES, i * ALIGN, "full", kv(i))], owner=b"B") == [True]
        assert t._order.owner_bytes[b"B"] <= 2 * KV_BYTES
    assert t.exists([(HASHES[ALIGN // UNIT - 1], "full")]) == [True]        # A's entry stayed
    assert t.stats.evictions == 7 - 2 and t.stats.bytes_evicted == 5 * KV_BYTES
    with pytest.raises(ValueError, match="quota_bytes=0"):
        HostTier(KV_BYTES, b"ns", UNIT, ALIGN, SHAPES, quota_bytes=0)


LONG = [bytes([i]) * 32 for i in range(1, 41)]          # 40 units: 20 aligned boundaries


def _chain(t, b):
    return t.chain_hash(LONG, b)


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_speculative_flood_cannot_push_out_demoted_entries(eviction):
    """Host-only checkpoints (speculative) fill at most their probation share while demoted
    entries need the room; a flood of them evicts its own oldest, never the demoted ones."""
    t = HostTier(8 * KV_BYTES, b"ns", UNIT, ALIGN, SHAPES, eviction=eviction, probation_share=0.25)
    demoted = [i * ALIGN for i in range(1, 6)]                       # 5 main entries (5/8 of the tier)
    for b in demoted:
        assert t.save_entries([t.entry(LONG, b, "full", kv(b))]) == [True]
    flood = [i * ALIGN for i in range(6, 17)]                        # 11 speculative entries
    for b in flood:
        assert t.save_entries([t.entry(LONG, b, "full", kv(b))], speculative={_chain(t, b)}) == [True]
        assert t._probation_bytes <= 3 * KV_BYTES                     # free room + its share, never more
    assert held(t, LONG, demoted, "full") == [True] * 5
    assert held(t, LONG, flood, "full") == [False] * 8 + [True] * 3   # FIFO: the newest stay
    assert t.used_bytes == 8 * KV_BYTES


def test_probation_fills_free_room_and_a_hit_promotes():
    # inclusive: the hit entry stays a main entry here (exclusive makes it a device copy, the
    # first victim: tests/tiers/test_host_retention.py)
    t = HostTier(4 * KV_BYTES, b"ns", UNIT, ALIGN, SHAPES, probation_share=0.25, retention="inclusive")
    spec = [ALIGN, 2 * ALIGN, 3 * ALIGN, 4 * ALIGN]
    assert t.save_entries([t.entry(LONG, b, "full", kv(b)) for b in spec],
                          speculative={_chain(t, b) for b in spec}) == [True] * 4   # room: all held
    t.load_many(LONG, [(ALIGN, "full")])                           # used: now a main entry
    assert t.save_entries([t.entry(LONG, 5 * ALIGN, "full", kv(5))]) == [True]   # a main save
    assert held(t, LONG, spec, "full") == [True, False, True, True]  # the oldest unused one went
    # probation is over its share (3 of 4 entries): speculative saves evict probation, FIFO
    assert t.save_entries([t.entry(LONG, 6 * ALIGN, "full", kv(6))], speculative={_chain(t, 6 * ALIGN)}) == [True]
    assert held(t, LONG, [ALIGN, 3 * ALIGN, 5 * ALIGN, 6 * ALIGN], "full") == [True, False, True, True]
    # saved again as a main entry (e.g. written back on a device eviction): off probation
    assert t.save_entries([t.entry(LONG, 4 * ALIGN, "full", kv(4))]) == [True]
    assert t._probation_bytes == KV_BYTES                             # only the newest speculative one left


def test_probation_share_bad_values_are_named():
    for bad in (-0.1, 1.5, "x", True):
        with pytest.raises(ValueError, match="probation_share"):
            HostTier(KV_BYTES, b"ns", UNIT, ALIGN, SHAPES, probation_share=bad)
