"""The chunked KDA form against the token-by-token oracle, and the conv helper."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.model.conv import short_conv
from hybridkv.model.kda import chunk_segments, kda_chunked, kda_recurrent

TOL = 2e-5


def _inputs(B, T, H, K, V, seed, decay=2.0):
    gen = torch.Generator().manual_seed(seed)
    shape = (B, T, H) if B else (T, H)
    q = F.normalize(torch.randn(*shape, K, generator=gen), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(*shape, K, generator=gen), dim=-1)
    v = torch.randn(*shape, V, generator=gen)
    g = -torch.rand(*shape, K, generator=gen) * decay
    beta = torch.rand(*shape, generator=gen)
    s0 = torch.randn(*((B,) if B else ()), H, K, V, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("B,T,H,K,V", [(0, 1, 1, 8, 8), (0, 130, 2, 16, 8), (2, 200, 3, 32, 16),
                                       (1, 257, 2, 64, 64)])
def test_chunked_equals_recurrent(B, T, H, K, V):
    q, k, v, g, beta, s0 = _inputs(B, T, H, K, V, seed=T)
    o1, s1 = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2, states = kda_chunked(q, k, v, g, beta, s0, boundaries=[1, T // 2 + 1, T], align_offset=7)
    assert o2.shape == o1.shape and s2.shape == s1.shape
    assert (o1 - o2).abs().max().item() <= TOL
    assert (s1 - s2).abs().max().item() <= TOL
    for b, s in states.items():
        _, sb = kda_recurrent(q[..., :b, :, :], k[..., :b, :, :], v[..., :b, :, :], g[..., :b, :, :],
                              beta[..., :b, :], s0)
        assert (s - sb).abs().max().item() <= TOL, b
    assert torch.equal(states[T], s2) and states[T].data_ptr() != s2.data_ptr()


def test_strong_decay_does_not_overflow():
    """Log-decay of -30 per token (cumulative -1900 per chunk) stays finite and exact."""
    q, k, v, g, beta, s0 = _inputs(0, 150, 2, 16, 16, seed=3, decay=60.0)
    o1, _s1 = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2, _ = kda_chunked(q, k, v, g, beta, s0)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert (o1 - o2).abs().max().item() <= TOL


def test_initial_state_not_modified():
    q, k, v, g, beta, s0 = _inputs(0, 70, 2, 8, 8, seed=4)
    before = s0.clone()
    kda_chunked(q, k, v, g, beta, s0)
    kda_recurrent(q, k, v, g, beta, s0)
    assert torch.equal(before, s0)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 200), offset=st.integers(0, 200), H=st.integers(1, 3),
       K=st.sampled_from([4, 8, 16]), cuts=st.lists(st.integers(1, 200), max_size=4),
       seed=st.integers(0, 2**16))
def test_chunked_equals_recurrent_hypothesis(T, offset, H, K, cuts, seed):
    q, k, v, g, beta, s0 = _inputs(0, T, H, K, K, seed)
    bounds = sorted({c for c in cuts if c <= T})
    o1, s1 = kda_recurrent(q, k, v, g, beta, s0)
    o2, s2, states = kda_chunked(q, k, v, g, beta, s0, boundaries=bounds, align_offset=offset)
    assert (o1 - o2).abs().max().item() <= TOL
    assert (s1 - s2).abs().max().item() <= TOL
    assert sorted(states) == bounds


def test_chunk_segments_align_to_absolute_positions():
    assert chunk_segments(200, (), align_offset=0) == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert chunk_segments(100, (), align_offset=60) == [(0, 4), (4, 68), (68, 100)]
    assert chunk_segments(100, (10, 4), align_offset=60) == [(0, 4), (4, 10), (10, 68), (68, 100)]


def test_boundary_outside_range_raises():
    q, k, v, g, beta, _ = _inputs(0, 10, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match="boundary 11"):
        kda_chunked(q, k, v, g, beta, boundaries=[11])
    with pytest.raises(ValueError, match="boundary 0"):
        kda_chunked(q, k, v, g, beta, boundaries=[0])


CONV_SPLIT_TOL = 1e-6
"""fp32 short conv continued from a window vs one pass: the same sums in another order."""


def test_short_conv_matches_conv1d_and_continues_from_window():
    gen = torch.Generator().manual_seed(0)
    T, C, W = 50, 12, 4
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, W, generator=gen)
    ref = F.silu(F.conv1d(x.t()[None], w[:, None], padding=W - 1, groups=C)[0, :, :T].t())
    y, end, wins = short_conv(x, w, None, boundaries=[2, 20])
    assert (y - ref).abs().max().item() <= 1e-6
    assert torch.equal(end, x[-3:].t())
    assert torch.equal(wins[20], x[17:20].t())
    assert torch.equal(wins[2][:, 1:], x[:2].t()) and torch.equal(wins[2][:, 0], torch.zeros(C))
    y1, w1, _ = short_conv(x[:20], w)
    y2, _, _ = short_conv(x[20:], w, w1)
    assert (torch.cat([y1, y2]) - y).abs().max().item() <= CONV_SPLIT_TOL   # two code paths: not bit-equal


@pytest.mark.gpu
def test_fla_path_matches_torch_path():
    pytest.importorskip("fla")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, g, beta, s0 = _inputs(1, 300, 4, 64, 64, seed=5)
    cpu = kda_chunked(q, k, v, g, beta, s0, boundaries=[64, 100, 300])
    dev = [x.cuda() for x in (q, k, v, g, beta, s0)]
    gpu = kda_chunked(*dev[:5], dev[5], boundaries=[64, 100, 300])
    assert (cpu[0] - gpu[0].cpu()).abs().max().item() <= 1e-3
    assert (cpu[1] - gpu[1].cpu()).abs().max().item() <= 1e-3
    for b in (64, 100, 300):
        assert (cpu[2][b] - gpu[2][b].cpu()).abs().max().item() <= 1e-3
    o_cpu, s_cpu = kda_recurrent(*(x[:, :5] for x in (q, k, v, g, beta)), s0)
    o_fla, s_fla = kda_recurrent(*(x[:, :5] for x in dev[:5]), dev[5], use_fla=True)
    assert (o_cpu - o_fla.cpu()).abs().max().item() <= 1e-4
    assert (s_cpu - s_fla.cpu()).abs().max().item() <= 1e-4
