"""A naive token-by-token DeepSeek-V4 oracle: ground truth for :class:`V4Model` in tests.

It shares only the weights (and the rotary frequencies) with the model and writes every
formula again in the plainest form: one token at a time, the full history of every layer kept
(K=V rows and the compressors' raw projections), each compressed entry recomputed from the raw
projections of its window when the window closes (no tail or overlap buffers), RoPE as a
complex rotation, the indexer's top-k as a Python sort over the visible entries
(score descending, then entry index), attention with the sink written out as
``exp(l − M) / (Σ exp(l − M) + exp(sink − M))``, and the MoE as a loop over chosen experts.
Slow (``O(T·L)`` small ops); use only on tiny configs.
"""

from __future__ import annotations

import math

import torch

from hybridkv.model.v4.model import V4Model


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _rotate(x: torch.Tensor, freqs: torch.Tensor, p: float, scale: float) -> torch.Tensor:
    """Rotate the trailing ``2·len(freqs)`` channels of ``x`` (``[..., D]``) by angle ``p·freqs``
    (pairs as complex numbers ``x[2i] + i·x[2i+1]``)."""
    rd = 2 * freqs.numel()
    head, tail = x[..., :-rd], x[..., -rd:]
    z = torch.view_as_complex(tail.reshape(*tail.shape[:-1], rd // 2, 2).contiguous())
    rot = torch.polar(torch.full_like(freqs, scale), freqs * p)
    return torch.cat([head, torch.view_as_real(z * rot).reshape(tail.shape)], dim=-1)


class NaiveV4:
    """Token-by-token reference over a :class:`V4Model`'s weights.

    Args:
        model: the model whose weights (fp32) are used.
    """

    def __init__(self, model: V4Model) -> None:
        self.m = model
        self.c = model.config

    @torch.no_grad()
    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``float32 [T, vocab]`` logits of every position of ``token_ids`` (``int64 [T]``)."""
        c = self.c
        L = c.num_hidden_layers
        kv_hist: list[list[torch.Tensor]] = [[] for _ in range(L)]
        raw: list[dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] = [{"c": [], "i": []} for _ in range(L)]
        entries: list[dict[str, list[torch.Tensor]]] = [{"c": [], "i": []} for _ in range(L)]
        out = []
        for i, tok in enumerate(token_ids.reshape(-1).tolist()):
            x = self.m.model.embed_tokens.weight[tok].float()
            x = torch.stack([x] * c.hc_mult)                         # [N, D]
            for li, layer in enumerate(self.m.model.layers):
                post, comb, col = self._hc(layer.attn_hc, x)
                a = _rms(col, layer.input_layernorm.weight, c.rms_norm_eps)
                y = self._attention(li, layer.self_attn, a, i, kv_hist[li], raw[li], entries[li])
                x = self._merge(post, comb, y, x)
                post, comb, col = self._hc(layer.ffn_hc, x)
                f = self._moe(layer.mlp, _rms(col, layer.post_attention_layernorm.weight, c.rms_norm_eps), tok)
                x = self._merge(post, comb, f, x)
            hh = self.m.model.hc_head
            flat = _rms(x.reshape(-1), None, c.rms_norm_eps)
            pre = torch.sigmoid((hh.hc_fn @ flat) * hh.hc_scale + hh.hc_base) + c.hc_eps
            y = (pre[:, None] * x).sum(0)
            out.append(self.m.lm_head.weight @ _rms(y, self.m.model.norm.weight, c.rms_norm_eps))
        return torch.stack(out).float()

    # ---- pieces ---------------------------------------------------------------------
    def _hc(self, hc, x: torch.Tensor):
        c, N = self.c, self.c.hc_mult
        flat = _rms(x.reshape(-1), None, c.rms_norm_eps)
        mix = hc.fn @ flat
        pre = torch.sigmoid(mix[:N] * hc.scale[0] + hc.base[:N]) + c.hc_eps
        post = 2 * torch.sigmoid(mix[N:2 * N] * hc.scale[1] + hc.base[N:2 * N])
        logit = (mix[2 * N:] * hc.scale[2] + hc.base[2 * N:]).reshape(N, N)
        comb = torch.exp(logit - logit.max(dim=1, keepdim=True).values)
        comb = comb / comb.sum(dim=1, keepdim=True) + c.hc_eps
        comb = comb / (comb.sum(dim=0, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(dim=0, keepdim=True) + c.hc_eps)
        return post, comb, (pre[:, None] * x).sum(0)

    @staticmethod
    def _merge(post, comb, y, x):
        N = x.shape[0]
        return torch.stack([post[k] * y + sum(comb[j, k] * x[j] for j in range(N)) for k in range(N)])

    def _entry(self, comp, hist: list[tuple[torch.Tensor, torch.Tensor]], w: int) -> torch.Tensor:
        """Entry ``w`` of a compressor from the raw projections of its source tokens."""
        c, m, d = self.c, comp.rate, comp.dim
        vals, gates = [], []
        if comp.overlap:
            if w > 0:                                   # Ca half of the previous window
                for j in range(m):
                    kv, g = hist[(w - 1) * m + j]
                    vals.append(kv[:d])
                    gates.append(g[:d] + comp.position_bias[j, :d])
            for j in range(m):                          # Cb half of this window
                kv, g = hist[w * m + j]
                vals.append(kv[d:])
                gates.append(g[d:] + comp.position_bias[j, d:])
        else:
            for j in range(m):
                kv, g = hist[w * m + j]
                vals.append(kv)
                gates.append(g + comp.position_bias[j])
        G = torch.stack(gates)
        P = torch.exp(G - G.max(dim=0).values) / torch.exp(G - G.max(dim=0).values).sum(dim=0)
        pooled = (P * torch.stack(vals)).sum(0)
        e = _rms(pooled, comp.kv_norm.weight, c.rms_norm_eps)
        return _rotate(e, self.m._freqs["compress"], w * m, c.rope_compress.attention_factor)

    def _attention(self, li, attn, a, i, kv_hist, raw, entries):
        c = self.c
        H, D = c.num_attention_heads, c.head_dim
        key = "main" if attn.kind == "sliding" else "compress"
        spec = c.rope_main if attn.kind == "sliding" else c.rope_compress
        fr, sc = self.m._freqs[key], spec.attention_factor
        q_res = _rms(attn.q_a_proj.weight @ a, attn.q_a_norm.weight, c.rms_norm_eps)
        q = _rms((attn.q_b_proj.weight @ q_res).reshape(H, D), None, c.rms_norm_eps)
        q = _rotate(q, fr, i, sc)
        kv = _rotate(_rms(attn.kv_proj.weight @ a, attn.kv_norm.weight, c.rms_norm_eps), fr, i, sc)
        kv_hist.append(kv)
        keys = kv_hist[max(0, i - c.sliding_window + 1): i + 1]
        comp = attn.compressor
        if comp is not None:
            raw["c"].append((comp.kv_proj.weight @ a, comp.gate_proj.weight @ a))
            if (i + 1) % comp.rate == 0:
                entries["c"].append(self._entry(comp, raw["c"], (i + 1) // comp.rate - 1))
            visible = list(range(len(entries["c"])))
            if attn.kind == "csa":
                ix = comp.indexer
                raw["i"].append((ix.kv_proj.weight @ a, ix.gate_proj.weight @ a))
                if (i + 1) % ix.rate == 0:
                    entries["i"].append(self._entry(ix, raw["i"], (i + 1) // ix.rate - 1))
                qi = (ix.q_b_proj.weight @ q_res).reshape(c.index_n_heads, c.index_head_dim)
                qi = _rotate(qi, self.m._freqs["compress"], i, c.rope_compress.attention_factor)
                wts = (ix.scorer.weights_proj.weight @ a) / math.sqrt(c.index_n_heads)
                score = {}
                for e in visible:
                    s = torch.relu(qi @ entries["i"][e]) / math.sqrt(c.index_head_dim)
                    score[e] = float((s * wts).sum())
                visible = sorted(visible, key=lambda e: (-score[e], e))[: c.index_topk]
            keys = keys + [entries["c"][e] for e in visible]
        K = torch.stack(keys)                                      # [k, D]
        o = torch.empty(H, D)
        for h in range(H):
            lg = (K @ q[h]) / math.sqrt(D)
            M = max(float(lg.max()), float(attn.sinks[h]))
            p = torch.exp(lg - M)
            p = p / (p.sum() + math.exp(float(attn.sinks[h]) - M))
            o[h] = p @ K
        o = _rotate(o, fr, -i, sc)                                 # undo the value's rotation
        flat = o.reshape(-1)
        g, R = c.o_groups, c.o_lora_rank
        gin = flat.numel() // g
        parts = [attn.o_a_proj.weight[k * R:(k + 1) * R] @ flat[k * gin:(k + 1) * gin] for k in range(g)]
        return attn.o_b_proj.weight @ torch.cat(parts)

    def _moe(self, block, x, tok):
        c = self.c
        lg = block.gate.weight @ x
        if c.scoring_func == "sqrtsoftplus":
            s = torch.sqrt(torch.log1p(torch.exp(-lg.abs())) + lg.clamp(min=0))
        elif c.scoring_func == "softmax":
            s = torch.exp(lg - lg.max()) / torch.exp(lg - lg.max()).sum()
        else:
            s = 1 / (1 + torch.exp(-lg))
        if block.gate.hashed:
            chosen = block.gate.tid2eid[tok].tolist()
        else:
            biased = (s + block.gate.e_score_correction_bias).tolist()
            chosen = sorted(range(len(biased)), key=lambda e: -biased[e])[: c.num_experts_per_tok]
        ws = torch.stack([s[e] for e in chosen])
        ws = ws / (ws.sum() + 1e-20) * c.routed_scaling_factor
        lim = c.swiglu_limit
        out = torch.zeros_like(x)
        I = c.moe_intermediate_size
        for w, e in zip(ws, chosen):
            gu = block.experts.gate_up_proj[e] @ x
            h = torch.nn.functional.silu(gu[:I].clamp(max=lim)) * gu[I:].clamp(-lim, lim)
            out = out + w * (block.experts.down_proj[e] @ h)
        sh = block.shared_experts
        h = torch.nn.functional.silu((sh.gate_proj.weight @ x).clamp(max=lim)) * (sh.up_proj.weight @ x).clamp(-lim, lim)
        return out + sh.down_proj.weight @ h
