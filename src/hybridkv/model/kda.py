"""Kimi Delta Attention (KDA) recurrence: token-by-token oracle and chunked form.

The recurrence, per head (DESIGN §9), with the state ``S`` in math layout
``[K, V]``::

    S <- diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

The functions here are the pure recurrence: ``q`` is used as given (the model
L2-normalises q and k and scales q by ``K**-0.5`` before calling), ``g`` is the
per-channel log-decay (``<= 0``) and ``beta`` the write strength in ``[0, 1]``.

Shapes: ``q, k: [T, H, K]`` or ``[B, T, H, K]``; ``v: [.., T, H, V]``;
``g: [.., T, H, K]``; ``beta: [.., T, H]``; states ``[.., H, K, V]`` float32.
All arithmetic is float32; outputs are float32.

:func:`kda_chunked` is the chunked WY/UT form. Chunks are aligned to absolute
64-token positions (``align_offset``) and additionally cut at every requested
boundary, so the state at any requested boundary is an exact chunk-end state,
and a computation split at a 64-aligned boundary performs bitwise the same
chunk arithmetic as the unsplit one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

#: Kernel chunk in tokens (DESIGN §1).
CHUNK = 64
_SUB = 8  # sub-block of the intra-chunk decay products (fastest on CPU)
_GROUP_BYTES = 64 << 20  # bound on the intra-chunk temporaries


def _batched(*xs: torch.Tensor, state: torch.Tensor | None, nd: int):
    """Add a batch dim to ``[T, ...]`` inputs; returns (tensors, state, squeezed)."""
    squeeze = xs[0].dim() == nd
    if squeeze:
        xs = tuple(x.unsqueeze(0) for x in xs)
        if state is not None:
            state = state.unsqueeze(0)
    return tuple(x.float() for x in xs), state, squeeze


def _check(q, k, v, g, beta) -> None:
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [T, H, K] or [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must match q {tuple(q.shape)}")
    if v.shape[:-1] != q.shape[:-1] or beta.shape != q.shape[:-1]:
        raise ValueError(f"v {tuple(v.shape)} / beta {tuple(beta.shape)} do not match q {tuple(q.shape)}")


def _init_state(state, B, H, K, V, device) -> torch.Tensor:
    if state is None:
        return torch.zeros(B, H, K, V, dtype=torch.float32, device=device)
    if tuple(state.shape) != (B, H, K, V):
        raise ValueError(f"initial_state shape {tuple(state.shape)} != {(B, H, K, V)}")
    return state.float().clone()


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                  use_fla: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA (the oracle, and the decode path).

    Args:
        q, k: ``[T, H, K]`` or ``[B, T, H, K]``; q already scaled.
        v: ``[.., T, H, V]``.  g: ``[.., T, H, K]`` log-decay.  beta: ``[.., T, H]``.
        initial_state: ``[.., H, K, V]`` float32 or ``None`` (zeros); not modified.
        use_fla: on CUDA with ``fla`` installed, run ``fused_recurrent_kda`` (the
            decode path uses this; the default keeps the pure-torch oracle).

    Returns:
        ``(o, final_state)``: ``o`` float32 ``[.., T, H, V]``, state float32 ``[.., H, K, V]``.

    Raises:
        ValueError: mismatched shapes.
    """
    _check(q, k, v, g, beta)
    if use_fla and q.is_cuda:
        from hybridkv.model import kda_fla
        if kda_fla.available():
            return kda_fla.recurrent(q, k, v, g, beta, initial_state)
    (q, k, v, g, beta), state, squeeze = _batched(q, k, v, g, beta, state=initial_state, nd=3)
    B, T, H, K = q.shape
    S = _init_state(state, B, H, K, v.shape[-1], q.device)
    out = []
    decay = g.exp()
    for t in range(T):
        S = S * decay[:, t, :, :, None]
        kv = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - kv))[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(out, dim=1) if out else v.new_zeros(v.shape)
    if squeeze:
        return o[0], S[0]
    return o, S


def chunk_segments(T: int, boundaries: Iterable[int] = (), align_offset: int = 0,
                   chunk_size: int = CHUNK) -> list[tuple[int, int]]:
    """Chunk segments ``[(s, e)]`` covering ``[0, T)``.

    Cuts at every local index ``i`` with ``(align_offset + i) % chunk_size == 0``
    and at every boundary; each segment is at most ``chunk_size`` long.
    """
    first = (-align_offset) % chunk_size
    cuts = set(range(first, T, chunk_size)) | {0, T}
    cuts |= {int(b) for b in boundaries}
    cuts = sorted(c for c in cuts if 0 <= c <= T)
    return list(itertools.pairwise(cuts))


def _intra_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor):
    """Intra-chunk decayed products.

    For ``x: [N, C, K]`` and inclusive cumulative log-decay ``G: [N, C, K]``::

        Aqk[i, j] = sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])   (j <= i)
        Akk[i, j] = sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])   (j <  i)

    Diagonal sub-blocks use the explicit ``[s, s, K]`` decay tensor; blocks below
    factor the decay through the last position ``r`` before the row block, so
    both factors ``exp(G_i - G_r)`` and ``exp(G_r - G_j)`` are ``<= 1`` (no
    overflow; an underflow only drops a contribution already below 1e-38).
    """
    N, C, _ = q.shape
    Aqk = q.new_zeros(N, C, C)
    Akk = q.new_zeros(N, C, C)
    for s0 in range(0, C, _SUB):
        s1 = min(s0 + _SUB, C)
        Gi = G[:, s0:s1]
        # exp(G_i - G_j) for j <= i; entries j > i are clamped to finite junk and dropped
        decay = (Gi[:, :, None, :] - Gi[:, None, :, :]).clamp_(max=0.0).exp_()
        kj_decay = decay.mul_(k[:, None, s0:s1, :])  # [N, i, j, K]
        Aqk[:, s0:s1, s0:s1] = torch.matmul(kj_decay, q[:, s0:s1, :, None])[..., 0].tril_()
        Akk[:, s0:s1, s0:s1] = torch.matmul(kj_decay, k[:, s0:s1, :, None])[..., 0].tril_(-1)
        if s0:
            Gr = G[:, s0 - 1:s0]
            row = torch.exp(Gi - Gr)
            col = (k[:, :s0] * torch.exp(Gr - G[:, :s0])).transpose(1, 2)
            Aqk[:, s0:s1, :s0] = torch.bmm(q[:, s0:s1] * row, col)
            Akk[:, s0:s1, :s0] = torch.bmm(k[:, s0:s1] * row, col)
    return Aqk, Akk


def _prepare_chunks(q, k, v, g, beta):
    """Per-chunk WY quantities for ``[N, C, *]`` chunk tensors (padding is identity)."""
    G = g.cumsum(1)
    Aqk, Akk = _intra_scores(q, k, G)
    eG = G.exp()
    C = q.shape[1]
    L = (torch.eye(C, dtype=q.dtype, device=q.device) + beta[:, :, None] * Akk).contiguous()
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * k * eG], dim=-1)
    sol = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    u, w = sol.split([v.shape[-1], k.shape[-1]], dim=-1)
    Glast = G[:, -1:]
    kd = k * torch.exp(Glast - G)
    return u, w, q * eG, Aqk, kd, Glast[:, 0].exp()


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                chunk_size: int = CHUNK, boundaries: Iterable[int] = (),
                align_offset: int = 0, use_fla: bool = True,
                ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Chunked KDA (WY/UT form) returning the states at requested boundaries.

    Args:
        q, k, v, g, beta, initial_state: as :func:`kda_recurrent`.
        chunk_size: kernel chunk in tokens (64).
        boundaries: local token counts ``b`` in ``[1, T]`` whose state (after the
            first ``b`` tokens of this call) is returned.
        align_offset: absolute position of the first token; chunks are cut where
            ``(align_offset + i) % chunk_size == 0`` so chunking does not depend
            on where a computation was split.
        use_fla: on CUDA with ``fla`` installed, run ``fla.ops.kda`` kernels.

    Returns:
        ``(o, final_state, states)``: ``o`` float32 ``[.., T, H, V]``; final state
        float32 ``[.., H, K, V]``; ``states[b]`` float32 ``[.., H, K, V]`` (own storage).

    Raises:
        ValueError: mismatched shapes, or a boundary outside ``[1, T]``.
    """
    _check(q, k, v, g, beta)
    T = q.shape[-3]
    bset = sorted({int(b) for b in boundaries})
    for b in bset:
        if not 1 <= b <= T:
            raise ValueError(f"boundary {b} outside [1, {T}]")
    if use_fla and q.is_cuda:
        from hybridkv.model import kda_fla
        if kda_fla.available():
            return kda_fla.chunk_with_states(q, k, v, g, beta, initial_state, bset)
    (q, k, v, g, beta), state, squeeze = _batched(q, k, v, g, beta, state=initial_state, nd=3)
    B, _, H, K = q.shape
    V = v.shape[-1]
    S = _init_state(state, B, H, K, V, q.device)
    segs = chunk_segments(T, bset, align_offset, chunk_size)
    NC, C = len(segs), chunk_size
    starts = torch.tensor([s for s, _ in segs], device=q.device)
    lens = torch.tensor([e - s for s, e in segs], device=q.device)
    pos = torch.arange(C, device=q.device)
    valid = pos[None, :] < lens[:, None]  # [NC, C]
    idx = (starts[:, None] + pos[None, :]).clamp(max=max(T - 1, 0))

    per_chunk_bytes = B * H * (C * C * _SUB * 4 + 12 * C * max(K, V) * 4)
    group = max(1, _GROUP_BYTES // per_chunk_bytes)
    states: dict[int, torch.Tensor] = {}
    o_groups = []
    BH = B * H
    for c0 in range(0, NC, group):
        c1 = min(NC, c0 + group)
        n = c1 - c0
        sub_idx, sub_valid = idx[c0:c1], valid[c0:c1]
        parts = []  # chunk-major rows: N = (chunk, batch, head)
        for x in (q, k, v, g):
            y = x[:, sub_idx] * sub_valid.view(1, n, C, 1, 1)  # [B, n, C, H, *]
            parts.append(y.permute(1, 0, 3, 2, 4).reshape(n * BH, C, x.shape[-1]))
        bt = (beta[:, sub_idx] * sub_valid.view(1, n, C, 1)).permute(1, 0, 3, 2).reshape(n * BH, C)
        u, w, qg, Aqk, kd, dlast = _prepare_chunks(*parts, bt)
        # chunk transition S' = M S + c with M = diag(exp(G_last)) - kd^T w, c = kd^T u
        kdT = kd.transpose(1, 2)
        M = torch.bmm(kdT, w).neg_()
        M.diagonal(dim1=1, dim2=2).add_(dlast)
        M = M.view(n, BH, K, K)
        c = torch.bmm(kdT, u).view(n, BH, K, V)
        S_starts = []
        S = S.reshape(BH, K, V)
        for j in range(n):
            S_starts.append(S)
            S = torch.baddbmm(c[j], M[j], S)
            end = segs[c0 + j][1]
            if end in bset:
                states[end] = S.view(B, H, K, V)
        S0 = torch.stack(S_starts).view(n * BH, K, V)
        U = u - torch.bmm(w, S0)
        o_groups.append(torch.baddbmm(torch.bmm(qg, S0), Aqk, U).view(n, B, H, C, V))
        S = S.view(B, H, K, V)
    o = torch.cat(o_groups).permute(1, 0, 3, 2, 4).reshape(B, NC * C, H, V)
    o = o[:, valid.reshape(-1)]
    if T in states:
        states[T] = S.clone()
    if squeeze:
        return o[0], S[0], {b: s[0] for b, s in states.items()}
    return o, S, states
