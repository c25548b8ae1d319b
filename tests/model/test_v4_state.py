"""DeepSeek-V4 model: prefix consistency, the naive oracle, chunked prefill, decode, and the
state at a boundary (compressed pages + boundary state, restore, recompute cone)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.model.v4.cone import recompute_cone_rows, recompute_cone_tokens
from hybridkv.model.v4.config import V4Config
from hybridkv.model.v4.model import V4Model
from hybridkv.model.v4.oracle import NaiveV4
from hybridkv.model.v4.state import V4CompressedEntries, restore

#: A prefix pass against the same positions of a longer pass (fp32, different matmul shapes).
PREFIX_TOL = 5e-5
#: The model against the token-by-token oracle.
ORACLE_TOL = 5e-5
#: Chunked prefill / decode / restore against one pass (the issue's exactness bound).
CHUNK_TOL = 1e-4

VOCAB = 1024


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny():
    return V4Model.from_preset("v4-tiny", seed=1)


@pytest.fixture(scope="module")
def small():
    return V4Model.from_preset("v4-small", seed=2)


@pytest.fixture(scope="module")
def small_pass(small):
    ids = _ids(320, seed=7)
    logits, state = small.prefill(ids)
    return ids, logits, state


# ---- the model's math ------------------------------------------------------------------
def test_prefix_pass_equals_longer_pass(tiny):
    ids = _ids(260, seed=3)
    full, _ = tiny.prefill(ids)
    for c in (1, 17, 64, 131, 200):
        part, _ = tiny.prefill(ids[:c])
        assert float((part - full[:c]).abs().max()) <= PREFIX_TOL, c


def test_prefix_consistent_with_many_indexer_ties():
    # one indexer head: a score is a single ReLU, zero for about half the entries, so the
    # top-k cut falls inside ties all the time; the selection must not depend on the length
    cfg = dataclasses.replace(V4Config.preset("v4-tiny"), index_n_heads=1, index_topk=3)
    model = V4Model(cfg).init_random(5)
    ids = _ids(200, seed=8)
    full, _ = model.prefill(ids)
    for c in (40, 97, 150):
        part, _ = model.prefill(ids[:c])
        assert float((part - full[:c]).abs().max()) <= PREFIX_TOL, c


def test_model_matches_naive_oracle_at_every_position(tiny):
    ids = _ids(96, seed=4)          # 24 CSA entries > index_topk 8, 6 HCA entries, window 16
    got, _ = tiny.prefill(ids)
    want = NaiveV4(tiny).logits(ids)
    assert want.std() > 0.1
    assert float((got - want).abs().max()) <= ORACLE_TOL


# ---- chunked prefill and decode ----------------------------------------------------------
@settings(max_examples=5, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_chunks_at_64_aligned_boundaries(small, small_pass, steps):
    # v4-small: HCA rate 128, so boundaries at 64, 192, ... end inside an HCA window
    ids, full, _ = small_pass
    cuts, at = [], 0
    for s in steps:
        at += 64 * s
        if at < len(ids):
            cuts.append(at)
    state, got = None, []
    for lo, hi in zip([0] + cuts, cuts + [len(ids)]):
        logits, state = small.prefill(ids[lo:hi], state)
        got.append(logits)
    assert float((torch.cat(got) - full).abs().max()) <= CHUNK_TOL


@settings(max_examples=5, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=5))
def test_chunks_at_any_boundary(tiny, sizes):
    # any split: inside CSA windows (rate 4), HCA windows (rate 16) and the sliding window
    ids = _ids(260, seed=9)
    full, _ = tiny.prefill(ids)
    state, got, at = None, [], 0
    for s in sizes + [len(ids)]:
        hi = min(len(ids), at + s)
        if hi == at:
            break
        logits, state = tiny.prefill(ids[at:hi], state)
        got.append(logits)
        at = hi
    assert float((torch.cat(got) - full[:at]).abs().max()) <= CHUNK_TOL


def test_hit_inside_hca_window_then_decode(small, small_pass):
    ids, full, _ = small_pass
    first, state = small.prefill(ids[:192])          # 192 = 128 + 64: HCA tail of 64 tokens
    assert state.boundary_state.layers[3].compressor.kv.shape[0] == 64
    rest, state = small.prefill(ids[192:], state)
    assert float((torch.cat([first, rest]) - full).abs().max()) <= CHUNK_TOL
    seq, logits = ids.clone(), rest[-1]
    for _ in range(6):                                # greedy decode after the chunked prefill
        tok = int(logits.argmax())
        seq = torch.cat([seq, torch.tensor([tok])])
        logits, state = small.decode(tok, state)
    want, _ = small.prefill(seq)
    assert float((logits - want[-1]).abs().max()) <= CHUNK_TOL


# ---- state at a boundary -------------------------------------------------------------------
def test_capture_pages_and_restore(small, small_pass):
    ids, full, end = small_pass
    _, _, caps = small.prefill_capture(ids[:256], capture=(64, 128, 192, 256))
    assert sorted(caps) == [64, 128, 192, 256]
    # the cache pages the compressed entries per block and keeps boundary states separately
    pages = [end.compressed.slice(lo, lo + 64) for lo in range(0, 320, 64)]
    for b in (64, 128, 192, 256):
        entries = V4CompressedEntries.concat(pages[: b // 64])
        assert entries.boundary == b
        for li, m in enumerate(entries.rates):
            if m:
                assert entries.kv[li].shape[0] == b // m
        logits, _ = small.prefill(ids[b:], restore(entries, caps[b].boundary_state))
        assert float((logits - full[b:]).abs().max()) <= CHUNK_TOL, b


def test_restore_refuses_entries_short_of_the_boundary(small, small_pass):
    ids, _, end = small_pass
    _, _, caps = small.prefill_capture(ids[:128], capture=(128,))
    with pytest.raises(ValueError, match="before the boundary 128"):
        restore(end.compressed.upto(64), caps[128].boundary_state)
    with pytest.raises(ValueError, match="capture boundary 500 outside"):
        small.prefill_capture(ids[:64], capture=(500,))
    with pytest.raises(ValueError, match="compressed entries end at 320"):
        small.prefill(ids[:4], dataclasses.replace(end, boundary_state=caps[128].boundary_state))
    short = end.compressed.clone()
    short.index[2] = short.index[2][:-1]
    with pytest.raises(ValueError, match="layer 2 has 79 indexer entries, expected 80"):
        small.prefill(ids[:4], dataclasses.replace(end, compressed=short))


@pytest.mark.parametrize("h", [64, 128, 192, 256])
def test_recompute_cone_restore(small, small_pass, h):
    ids, full, end = small_pass
    cone = recompute_cone_tokens(small.config, h)
    # only the cone's tokens are given: the rest must come from the compressed entries
    bs = small.recompute_boundary(ids[h - cone: h], end.compressed, h)
    logits, _ = small.prefill(ids[h:], restore(end.compressed, bs))
    assert float((logits - full[h:]).abs().max()) <= CHUNK_TOL
    with pytest.raises(ValueError, match=f"needs the last {cone} tokens"):
        small.recompute_boundary(ids[h - cone + 1: h], end.compressed, h)


def test_cone_lengths():
    tiny, small = V4Config.preset("v4-tiny"), V4Config.preset("v4-small")
    assert recompute_cone_tokens(tiny, 1024) == 6 * 15                # L·(W−1)
    assert recompute_cone_tokens(small, 1024) == 8 * 31
    # h = 1088: HCA tail of 64 rows > W−1 on the last layer extends the cone
    assert recompute_cone_rows(small, 1088)[-1] == 64
    assert recompute_cone_tokens(small, 1088) == 64 + 7 * 31
    assert recompute_cone_tokens(small, 100) == 100                   # clipped at h
    from transformers import DeepseekV4Config
    flash = V4Config.from_hf(DeepseekV4Config())                      # V4-Flash shapes
    assert flash.num_hidden_layers == 43 and flash.sliding_window == 128
    for h in (8192, 8192 + 64):
        assert recompute_cone_tokens(flash, h) == 43 * 127 < 128 * 43


def test_state_byte_sizes(small, small_pass):
    _, _, end = small_pass
    cfg = small.config
    sizes = small.boundary_state_nbytes(320)
    assert end.boundary_state.window_nbytes == sizes["window"] == 8 * 31 * cfg.head_dim * 4
    assert end.boundary_state.tail_nbytes == sizes["tail"]
    groups = end.compressed.group_nbytes(cfg.layer_types)
    assert groups["csa"] == 3 * 80 * (cfg.head_dim + cfg.index_head_dim) * 4
    assert groups["hca"] == 3 * 2 * cfg.head_dim * 4
    assert end.nbytes == end.compressed.nbytes + end.boundary_state.nbytes


def test_routing_margins():
    cfg = dataclasses.replace(V4Config.preset("v4-tiny"), mlp_layer_types=("hash_moe",) * 6)
    model = V4Model(cfg).init_random(6)            # hash routing only: just the indexer's choice
    mg = model.routing_margins(_ids(120, seed=10))
    first = (cfg.index_topk + 1) * cfg.csa_rate - 1  # first query seeing more than index_topk entries
    assert torch.isinf(mg[:first]).all()
    assert torch.isfinite(mg[first:]).float().mean() > 0.9 and (mg[first:] > 0).all()
    routed = V4Model.from_preset("v4-tiny", seed=1).routing_margins(_ids(40, seed=10))
    assert torch.isfinite(routed).all() and (routed > 0).all()   # routed MoE decides every token
