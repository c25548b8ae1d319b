"""DeepSeek-V4 building blocks: parameter modules named as transformers names them, and the
token-wise math (norms, interleaved partial RoPE, mHC, MoE, compressor pooling).

Formulas follow the DeepSeek-V4 report and transformers' ``modeling_deepseek_v4`` (the parity
reference): RMSNorm ``w · x / sqrt(mean(x²) + eps)``; RoPE on the trailing
``qk_rope_head_dim`` channels with consecutive channel pairs rotated together; compressor
entry ``norm(Σ_j softmax_j(Z_j + B_j) ⊙ C_j)`` over a window (CSA: ``Ca`` of the previous window
and ``Cb`` of this one, ``2m`` slots), RoPE'd at the window's first position; mHC weights
``pre = σ(·) + ε``, ``post = 2σ(·)``, ``comb`` = Sinkhorn-Knopp of a softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.model.v4.config import RopeSpec, V4Config


# ---- parameter modules (names = transformers' DeepseekV4 state-dict names) ---------------
class Norm(nn.Module):
    """A weighted RMSNorm's ``weight`` (``[dim]``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Compressor(nn.Module):
    """A CSA / HCA / indexer compressor: ``kv_proj``, ``gate_proj`` (``hidden → width``),
    ``position_bias`` ``[m, width]`` and ``kv_norm`` (``[width / 2]`` when overlapping, else
    ``[width]``)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.rate, self.dim, self.overlap = rate, dim, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = Norm(dim)


class Scorer(nn.Module):
    """The indexer's per-head weights ``weights_proj`` (``hidden → index_n_heads``)."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)


class Indexer(Compressor):
    """Lightning Indexer: its own overlapping compressor at ``index_head_dim``, a query
    projection ``q_b_proj`` (``q_lora_rank → index_n_heads·index_head_dim``) and the scorer."""

    def __init__(self, config: V4Config) -> None:
        super().__init__(config.hidden_size, config.index_head_dim, config.csa_rate, True)
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, bias=False)
        self.scorer = Scorer(config)


class CSACompressor(Compressor):
    """CSA compressor (overlapping windows of ``2·csa_rate``) with its indexer."""

    def __init__(self, config: V4Config) -> None:
        super().__init__(config.hidden_size, config.head_dim, config.csa_rate, True)
        self.indexer = Indexer(config)


class Attention(nn.Module):
    """Shared K=V MQA with partial RoPE, attention sink and grouped output projection;
    ``compressor`` is a :class:`CSACompressor`, an HCA :class:`Compressor` or ``None``."""

    def __init__(self, config: V4Config, index: int) -> None:
        super().__init__()
        c = config
        self.kind = c.layer_types[index]
        self.sinks = nn.Parameter(torch.zeros(c.num_attention_heads))
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = Norm(c.q_lora_rank)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = Norm(c.head_dim)
        self.o_a_proj = nn.Linear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank,
                                  bias=False)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.compressor: Compressor | None = (
            CSACompressor(c) if self.kind == "csa"
            else Compressor(c.hidden_size, c.head_dim, c.hca_rate, False) if self.kind == "hca" else None)


class HyperConnection(nn.Module):
    """mHC mixing weights: ``fn`` ``[(2+N)·N, N·hidden]``, ``base`` ``[(2+N)·N]``, ``scale`` ``[3]``."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        n = config.hc_mult
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))


class HyperHead(nn.Module):
    """Final stream collapse: ``hc_fn`` ``[N, N·hidden]``, ``hc_base`` ``[N]``, ``hc_scale`` ``[1]``."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))


class Gate(nn.Module):
    """Router: ``weight`` ``[E, hidden]`` plus ``tid2eid`` ``int64[vocab, k]`` (hash routing) or
    ``e_score_correction_bias`` ``float32[E]`` (top-k routing), both persistent buffers."""

    def __init__(self, config: V4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed = hashed
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, config.num_experts_per_tok,
                                                        dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))


class Experts(nn.Module):
    """Routed experts: ``gate_up_proj`` ``[E, 2I, hidden]`` (gate rows first), ``down_proj`` ``[E, hidden, I]``."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))


class SharedMLP(nn.Module):
    """The shared expert: SwiGLU of width ``moe_intermediate_size``."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class MoE(nn.Module):
    """``gate`` + ``experts`` + ``shared_experts``."""

    def __init__(self, config: V4Config, index: int) -> None:
        super().__init__()
        self.gate = Gate(config, config.mlp_layer_types[index] == "hash_moe")
        self.experts = Experts(config)
        self.shared_experts = SharedMLP(config)


class DecoderLayer(nn.Module):
    """One block: ``attn_hc``/``self_attn``/``input_layernorm`` then ``ffn_hc``/``mlp``/``post_attention_layernorm``."""

    def __init__(self, config: V4Config, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, index)
        self.mlp = MoE(config, index)
        self.input_layernorm = Norm(config.hidden_size)
        self.post_attention_layernorm = Norm(config.hidden_size)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)


class Backbone(nn.Module):
    """``embed_tokens``, ``layers``, ``norm``, ``hc_head`` (state-dict prefix ``model.``)."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Norm(config.hidden_size)
        self.hc_head = HyperHead(config)


# ---- math ---------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight · x / sqrt(mean(x², -1) + eps)`` (no weight: unweighted), computed in fp32."""
    y = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return (y if weight is None else weight * y).to(x.dtype)


def inv_freq(spec: RopeSpec, dim: int) -> torch.Tensor:
    """``float32[dim / 2]`` inverse frequencies of a rotary table over ``dim`` channels
    (YaRN: Peng et al. 2023, the ramp between ``beta_fast`` and ``beta_slow`` rotations)."""
    base = spec.theta
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if spec.kind == "default":
        return 1.0 / pos

    def corr(rot: float) -> float:
        return dim * math.log(spec.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr(spec.beta_fast), corr(spec.beta_slow)
    if spec.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extra = 1 - ramp
    return (1.0 / (spec.factor * pos)) * (1 - extra) + (1.0 / pos) * extra


def rope_table(spec: RopeSpec, freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``float32[n, dim / 2]`` at int ``positions`` (scaled by the attention factor)."""
    ang = positions.float()[:, None] * freqs.to(positions.device)[None, :]
    return ang.cos() * spec.attention_factor, ang.sin() * spec.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2·cos.shape[-1]`` channels of ``x`` (``[n, ..., D]``), channel
    pairs ``(2i, 2i+1)`` together; ``cos``/``sin`` are ``[n, rd/2]``."""
    rd = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
    c = cos.repeat_interleave(2, dim=-1).reshape(shape)
    s = sin.repeat_interleave(2, dim=-1).reshape(shape)
    nope, rope = x[..., :-rd], x[..., -rd:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * c + rot.float() * s).to(x.dtype)], dim=-1)


def hc_weights(hc: HyperConnection, x: torch.Tensor, config: V4Config
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC for streams ``x`` ``[n, N, D]``: returns ``post`` ``[n, N]``, ``comb`` ``[n, N, N]``
    (doubly stochastic after ``hc_sinkhorn_iters`` Sinkhorn-Knopp steps) and the collapsed
    block input ``Σ_j pre_j x_j`` ``[n, D]``."""
    n, N = x.shape[0], config.hc_mult
    flat = rms_norm(x.reshape(n, -1).float(), None, config.rms_norm_eps)
    mix = F.linear(flat, hc.fn.float())
    pre_w, post_w, comb_w = mix.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = hc.base.split([N, N, N * N])
    s_pre, s_post, s_comb = hc.scale.unbind(0)
    eps = config.hc_eps
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(n, N, N) * s_comb + comb_b.view(N, N), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


def hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """New streams ``post_i · out + Σ_j comb[j, i] · x_j`` (``[n, N, D]``)."""
    return post.to(x.dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(x.dtype).transpose(-1, -2), x)


def hc_head(head: HyperHead, x: torch.Tensor, config: V4Config) -> torch.Tensor:
    """Collapse the streams ``[n, N, D]`` to ``[n, D]`` before the final norm."""
    flat = rms_norm(x.flatten(1).float(), None, config.rms_norm_eps)
    mixes = F.linear(flat, head.hc_fn.float())
    pre = torch.sigmoid(mixes * head.hc_scale.float() + head.hc_base.float()) + config.hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe(block: MoE, x: torch.Tensor, ids: torch.Tensor, config: V4Config) -> torch.Tensor:
    """MoE feed-forward of ``x`` ``[n, D]`` (token ids ``ids`` ``int64[n]`` for hash routing):
    routed experts weighted by the normalised scores of the chosen experts times
    ``routed_scaling_factor``, plus the shared expert."""
    gate = block.gate
    logits = F.linear(x, gate.weight)
    f = config.scoring_func
    scores = (F.softplus(logits).sqrt() if f == "sqrtsoftplus"
              else logits.softmax(dim=-1) if f == "softmax" else logits.sigmoid())
    if gate.hashed:
        idx = gate.tid2eid[ids].long()
    else:
        idx = torch.topk(scores + gate.e_score_correction_bias, config.num_experts_per_tok, dim=-1).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * config.routed_scaling_factor
    out = torch.zeros_like(x)
    ex = block.experts
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        g, u = F.linear(x[tok], ex.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(_swiglu(g, u, config.swiglu_limit), ex.down_proj[e]) * w[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    sh = block.shared_experts
    return out + sh.down_proj(_swiglu(sh.gate_proj(x), sh.up_proj(x), config.swiglu_limit))


def pool_windows(comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, prev_ca: tuple | None,
                 first_window: int, eps: float, spec: RopeSpec, freqs: torch.Tensor) -> torch.Tensor:
    """Entries of ``nw`` consecutive closed windows.

    Args:
        comp: the compressor (rate ``m``, ``position_bias``, ``kv_norm``, overlapping or not).
        kv, gate: ``[nw·m, width]`` raw projections of the windows' tokens.
        prev_ca: ``(kv, gate)`` ``[m, width/2]`` raw ``Ca`` half of the window before the first
            one (overlapping compressors; ``None`` = no such window: its slots get weight 0).
        first_window: index of the first window (its entry is RoPE'd at ``first_window·m``).

    Returns:
        ``[nw, dim]`` entries.
    """
    m, d = comp.rate, comp.dim
    nw = kv.shape[0] // m
    if nw == 0:
        return kv.new_zeros((0, d))
    bias = comp.position_bias.to(gate.dtype)
    wkv = kv.reshape(nw, m, -1)
    wg = gate.reshape(nw, m, -1) + bias
    if comp.overlap:
        skv = wkv.new_zeros((nw, 2 * m, d))
        sg = wg.new_full((nw, 2 * m, d), float("-inf"))
        skv[:, m:] = wkv[..., d:]
        sg[:, m:] = wg[..., d:]
        if nw > 1:
            skv[1:, :m] = wkv[:-1, :, :d]
            sg[1:, :m] = wg[:-1, :, :d]
        if prev_ca is not None:
            skv[0, :m] = prev_ca[0]
            sg[0, :m] = prev_ca[1] + bias[:, :d]
        wkv, wg = skv, sg
    pooled = (wkv * wg.softmax(dim=1, dtype=torch.float32).to(wkv.dtype)).sum(dim=1)
    pooled = rms_norm(pooled, comp.kv_norm.weight, eps)
    pos = (torch.arange(nw, device=kv.device) + first_window) * m
    cos, sin = rope_table(spec, freqs, pos)
    return apply_rope(pooled, cos, sin)
