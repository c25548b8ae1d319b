"""Multi-head latent attention (MLA, no rotary embedding) over a paged latent pool.

Per token the layer writes ``[kv_a_layernorm(kv_nope) | k_rot]`` into the pool,
then attends over every position of the sequence read back from the pool, so a
resumed computation sees exactly the bytes a one-shot computation saw.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.model.config import HybridConfig
from hybridkv.model.kv_pool import PagedKVPool
from hybridkv.model.ops import rms_norm

_Q_ALIGN = 64  # query rows per attention call (aligned to absolute positions)
_ABSORB_MAX_ROWS = 16  # decode-sized requests attend in latent space (no per-key expansion)


class NormWeight(nn.Module):
    """Holder of an RMSNorm ``weight [D]`` (published name ``<norm>.weight``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))


@dataclass(slots=True)
class MLASeq:
    """One sequence's view for an MLA layer.

    Attributes:
        rows: slice of the packed token rows.  start: absolute first position.
        new_slots: ``int64[n]`` pool slots of positions ``[start, end)``.
        all_slots: ``int64[end]`` pool slots of positions ``[0, end)``.
    """

    rows: slice
    start: int
    new_slots: torch.Tensor
    all_slots: torch.Tensor


class MLAttention(nn.Module):
    """MLA layer; parameters use the published names (``q_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = config
        self.heads = c.num_attention_heads
        self.nope, self.rope, self.vdim, self.rank = (c.qk_nope_head_dim, c.qk_rope_head_dim,
                                                      c.v_head_dim, c.kv_lora_rank)
        self.eps = c.rms_norm_eps
        self.scaling = (self.nope + self.rope) ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, self.heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = NormWeight(self.rank)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.vdim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.vdim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, seqs: list[MLASeq], pool: PagedKVPool, layer: int) -> torch.Tensor:
        """``x: [N, D]`` packed rows -> ``[N, D]``; writes this layer's latents of every
        sequence's new positions into ``pool`` (MLA layer index ``layer``) first."""
        N = x.shape[0]
        q = self.q_proj(x).view(N, self.heads, self.nope + self.rope)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = torch.cat([rms_norm(kv_nope, self.kv_a_layernorm.weight, self.eps), k_rot], dim=-1)
        for s in seqs:
            pool.write(layer, s.new_slots, latent[s.rows])
        out = []
        for s in seqs:
            attend = self._attend_absorbed if s.rows.stop - s.rows.start <= _ABSORB_MAX_ROWS else self._attend
            out.append(attend(q[s.rows], pool.read(layer, s.all_slots).to(x.dtype), s.start))
        o = torch.cat(out, dim=0).reshape(N, self.heads * self.vdim)
        return self.o_proj(o)

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, start: int) -> torch.Tensor:
        """Causal attention of ``q [n, heads, nope+rope]`` at positions ``[start, start+n)``
        over ``latent [end, rank+rope]``; returns ``[n, heads, v_head_dim]``."""
        end = latent.shape[0]
        n = q.shape[0]
        kv = self.kv_b_proj(latent[:, :self.rank]).view(end, self.heads, self.nope + self.vdim)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        k_rot = latent[:, None, self.rank:].expand(end, self.heads, self.rope)
        key = torch.cat([k_nope, k_rot], dim=-1).transpose(0, 1)  # [heads, end, d]
        v = v.transpose(0, 1)
        qh = q.transpose(0, 1)  # [heads, n, d]
        # Query blocks aligned to absolute multiples of _Q_ALIGN, each over keys
        # [0, block end): a block does the same arithmetic whether or not the
        # sequence was split at an aligned position before it.
        cuts = sorted({start, start + n} | set(range(-(-start // _Q_ALIGN) * _Q_ALIGN, start + n, _Q_ALIGN)))
        tri = torch.full((_Q_ALIGN, _Q_ALIGN), float("-inf"), dtype=torch.float32, device=q.device).triu_(1)
        outs = []
        for a, b in itertools.pairwise(cuts):
            scores = torch.matmul(qh[:, a - start:b - start], key[:, :b].transpose(1, 2)).float()
            scores.mul_(self.scaling)
            scores[:, :, a:b] += tri[:b - a, :b - a]
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            outs.append(torch.matmul(probs, v[:, :b]))
        return torch.cat(outs, dim=1).transpose(0, 1)

    def _attend_absorbed(self, q: torch.Tensor, latent: torch.Tensor, start: int) -> torch.Tensor:
        """Same result as :meth:`_attend` with ``kv_b_proj`` folded into the query and the
        output (``q_nope W_uk · c`` and ``(p · c) W_uv``): per key it costs
        ``heads * (2 * rank + rope)`` instead of expanding every key. Used for
        decode-sized requests; returns ``[n, heads, v_head_dim]``."""
        end, n = latent.shape[0], q.shape[0]
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.vdim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        c, r = latent[:, :self.rank], latent[:, self.rank:]
        qh = q.transpose(0, 1)  # [heads, n, nope+rope]
        q_lat = torch.matmul(qh[..., :self.nope], w_uk)  # [heads, n, rank]
        scores = (torch.matmul(q_lat, c.t()) + torch.matmul(qh[..., self.nope:], r.t())).float()
        scores.mul_(self.scaling)
        if n > 1:
            qpos = torch.arange(start, start + n, device=q.device)
            kpos = torch.arange(end, device=q.device)
            scores.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(c.dtype)
        ctx = torch.matmul(probs, c)  # [heads, n, rank]
        return torch.matmul(ctx, w_uv.transpose(1, 2)).transpose(0, 1)
