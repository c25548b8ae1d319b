"""The DeepSeek-V4 model runner (DESIGN §12), pure torch, float32 by default.

:class:`V4Model` computes a chunk of tokens ``[t, t + n)`` of one sequence from the
:class:`~hybridkv.model.v4.state.V4State` at ``t`` (compressed entries of ``[0, t)`` plus the
boundary state) and returns the logits and the state at ``t + n`` (and at any requested
capture boundaries inside the chunk). Chunked prefill, decode and restore from stored parts
all go through :meth:`V4Model.prefill_capture`.

Attention per layer (every layer has the sliding-window branch): query ``i`` sees the K=V rows
of positions ``(i − sliding_window, i]`` and, on a CSA/HCA layer, compressed entries ``e`` with
``(e + 1)·m ≤ i + 1`` (windows closed at or before it). HCA attends to all of those; CSA to the
``index_topk`` of them that the Lightning Indexer scores highest, **among the visible ones
only**, ties broken towards the lower entry index. The selection therefore depends only on the
prefix: a prefix pass equals the same positions of a longer pass. (transformers 5.25 applies
the visibility mask before its ``torch.topk`` too, but ``topk`` breaks ties — frequent, since a
score is a weighted sum of ReLUs that are often all zero — differently for different sequence
lengths, so its logits at a position can change with the length.)
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.model.v4.cone import recompute_cone_rows
from hybridkv.model.v4.config import V4Config
from hybridkv.model.v4.layers import (Attention, Backbone, Compressor, apply_rope, hc_head, hc_merge,
                                      hc_weights, inv_freq, moe, pool_windows, rms_norm, rope_table)
from hybridkv.model.v4.state import (CompressorTail, LayerBoundary, V4BoundaryState, V4CompressedEntries,
                                     V4State)
from hybridkv.model.v4.weights import read_v4_tensors, write_v4_tensors
from hybridkv.model.weights import load_into

#: Queries per attention block (bounds the score matrix to ``QUERY_BLOCK × (W + entries)``).
QUERY_BLOCK = 256


class V4Model(nn.Module):
    """DeepSeek-V4 in pure torch (sliding / CSA / HCA attention, mHC, hash and routed MoE).

    Args:
        config: the architecture.
        dtype: compute/parameter dtype (mHC, sinks, position biases and the router bias stay
            fp32; norms, softmaxes and RoPE compute in fp32).
        device: where parameters live.

    Parameter names equal transformers' ``DeepseekV4ForCausalLM`` state-dict names. Create
    with :meth:`from_preset`, :meth:`from_pretrained` or ``V4Model(cfg).init_random(seed)``.
    """

    _FP32 = ("attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias")

    def __init__(self, config: V4Config, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.model = Backbone(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to_empty(device=device)
        for name, p in self.named_parameters():
            if not any(k in name for k in self._FP32):
                p.data = p.data.to(dtype)
        for name, b in self.named_buffers():
            b.zero_()
        self.dtype = dtype
        rd = config.qk_rope_head_dim
        self._freqs = {"main": inv_freq(config.rope_main, rd).to(device),
                       "compress": inv_freq(config.rope_compress, rd).to(device)}
        self._digest: str | None = None
        self._margins: torch.Tensor | None = None       # set only inside routing_margins()
        self.eval()

    # ---- construction / persistence ---------------------------------------------------
    @torch.no_grad()
    def init_random(self, seed: int = 0) -> V4Model:
        """Deterministic random weights from ``seed`` (independent of the global RNG).

        Linear and expert weights ~ N(0, 1/fan_in); embeddings ~ N(0, 1); norms 1; mHC
        ``fn`` ~ N(0, 0.1²/fan_in), ``base`` 0, ``scale`` 1; sinks and position biases
        ~ N(0, 0.1²); router bias ~ N(0, 0.01²); ``tid2eid`` uniform expert ids (distinct per token).
        """
        gen = torch.Generator().manual_seed(seed)
        cfg = self.config
        for name, p in sorted(self.named_parameters()):
            shape = p.shape
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                out = torch.ones(shape)
            elif "embed_tokens" in name:
                out = torch.randn(shape, generator=gen)
            elif leaf in ("fn", "hc_fn"):
                out = 0.1 * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            elif leaf in ("base", "hc_base"):
                out = torch.zeros(shape)
            elif leaf in ("scale", "hc_scale"):
                out = torch.ones(shape)
            elif leaf in ("sinks", "position_bias"):
                out = 0.1 * torch.randn(shape, generator=gen)
            else:
                out = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            p.copy_(out)
        for name, b in sorted(self.named_buffers()):
            if name.endswith("tid2eid"):
                perm = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen).argsort(dim=-1)
                b.copy_(perm[:, :cfg.num_experts_per_tok])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=gen))
        self._digest = None
        return self

    @classmethod
    def from_preset(cls, name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> V4Model:
        """Bundled preset (``v4-tiny``, ``v4-small``) with deterministic random weights."""
        return cls(V4Config.preset(name), dtype, device).init_random(seed)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> V4Model:
        """Load ``config.json`` and safetensors weights (single or sharded; the published
        DeepSeek-V4 layout that ``transformers`` writes, or this package's names).

        Raises:
            ValueError: invalid config, or a missing, extra or misshaped tensor (named).
            FileNotFoundError: no config or weights.
        """
        model = cls(V4Config.from_hf(Path(directory)), dtype, device)
        load_into(model, read_v4_tensors(directory))
        model._digest = None
        return model

    def save_pretrained(self, directory: str | Path, max_shard_bytes: int | None = None) -> None:
        """Write ``config.json`` and the weights in the published layout (``transformers``
        ``DeepseekV4ForCausalLM.from_pretrained`` reads it), sharded above ``max_shard_bytes``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config.to_hf_dict(), indent=2))
        write_v4_tensors(directory, self.state_dict(), max_shard_bytes)

    def weight_digest(self, refresh: bool = False) -> str:
        """Hex sha256 over every tensor's name, dtype, shape and bytes (sorted by name)."""
        if self._digest is None or refresh:
            h = hashlib.sha256()
            for name, t in sorted(self.state_dict().items()):
                t = t.detach().contiguous().cpu()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    # ---- state ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the parameters live."""
        return self.lm_head.weight.device

    def empty_state(self) -> V4State:
        """The state at boundary 0 (no entries, empty windows and tails)."""
        cfg, dev, dt = self.config, self.device, self.dtype
        z = (lambda *s: torch.zeros(s, dtype=dt, device=dev))
        kv, idx, layers = [], [], []
        for li, kind in enumerate(cfg.layer_types):
            kv.append(None if kind == "sliding" else z(0, cfg.head_dim))
            idx.append(z(0, cfg.index_head_dim) if kind == "csa" else None)
            comp = None if kind == "sliding" else CompressorTail(
                z(0, 2 * cfg.head_dim if kind == "csa" else cfg.head_dim),
                z(0, 2 * cfg.head_dim if kind == "csa" else cfg.head_dim))
            ix = CompressorTail(z(0, 2 * cfg.index_head_dim), z(0, 2 * cfg.index_head_dim)) if kind == "csa" else None
            layers.append(LayerBoundary(z(0, cfg.head_dim), comp, ix))
        rates = tuple(cfg.rate(i) for i in range(cfg.num_hidden_layers))
        return V4State(V4CompressedEntries(0, rates, kv, idx), V4BoundaryState(0, layers))

    def boundary_state_nbytes(self, t: int) -> dict[str, int]:
        """Bytes of the boundary state at ``t`` in this model's dtype: ``{"window", "tail"}``
        (windows of ``min(t, W − 1)`` rows; tails of ``t mod m`` rows; CSA overlaps of ``m`` rows)."""
        cfg, es = self.config, torch.empty((), dtype=self.dtype).element_size()
        win = cfg.num_hidden_layers * min(t, cfg.sliding_window - 1) * cfg.head_dim * es
        tail = 0
        for li, kind in enumerate(cfg.layer_types):
            if kind == "sliding":
                continue
            m = cfg.rate(li)
            widths = [2 * cfg.head_dim, 2 * cfg.index_head_dim] if kind == "csa" else [cfg.head_dim]
            for w in widths:
                tail += 2 * (t % m) * w * es
                if kind == "csa" and t >= m:
                    tail += 2 * m * (w // 2) * es
        return {"window": win, "tail": tail}

    # ---- forward ----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward of whole sequences.

        Args:
            input_ids: ``int64 [B, T]``.

        Returns:
            ``float32 [B, T, vocab]`` logits.

        Raises:
            ValueError: empty input or ids outside the vocab.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
        return torch.stack([self.prefill(row)[0] for row in input_ids])

    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor, state: V4State | None = None) -> tuple[torch.Tensor, V4State]:
        """Compute positions ``[t, t + n)`` from the state at ``t`` (``None``: ``t = 0``).

        Args:
            token_ids: ``int64 [n]``, ``n >= 1``.
            state: the state at ``t`` (never modified).

        Returns:
            ``(logits float32 [n, vocab], state at t + n)``.

        Raises:
            ValueError: as :meth:`prefill_capture`.
        """
        logits, end, _ = self.prefill_capture(token_ids, state)
        return logits, end

    @torch.no_grad()
    def decode(self, token_id: int, state: V4State) -> tuple[torch.Tensor, V4State]:
        """One decode step: ``(logits float32 [vocab], state at t + 1)``."""
        logits, end = self.prefill(torch.tensor([int(token_id)]), state)
        return logits[0], end

    @torch.no_grad()
    def routing_margins(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Per position, how far its discrete choices are from flipping, over a plain prefill.

        Two choices can flip under rounding alone (a chunked prefill against a whole one): the
        routed MoE's top-k (gap between the last chosen and the first unchosen biased expert
        score) and the CSA indexer's top-k (gap between the ``index_topk``-th and the next visible
        score; an exact tie of two all-zero scores is decided by entry index in every
        computation and counts as no risk).

        Args:
            token_ids: ``int64 [T]``.

        Returns:
            ``float32 [T]``: the smallest gap of each position over all routed-MoE and CSA
            layers, in score units (``inf`` where no choice was made).

        Raises:
            ValueError: as :meth:`prefill`.
        """
        self._margins = torch.full((int(token_ids.numel()),), float("inf"))
        try:
            self.prefill(token_ids)
            return self._margins
        finally:
            self._margins = None

    def _record(self, gap: torch.Tensor, start: int) -> None:
        m = self._margins
        seg = m[start: start + gap.numel()]
        m[start: start + gap.numel()] = torch.minimum(seg, gap.float().cpu())

    def _moe_margin(self, block, x: torch.Tensor) -> torch.Tensor:
        """Gap between the k-th and (k+1)-th biased router score of each token (``inf`` if all chosen)."""
        cfg = self.config
        if cfg.num_experts_per_tok >= cfg.n_routed_experts:
            return torch.full((x.shape[0],), float("inf"))
        logits = F.linear(x, block.gate.weight)
        f = cfg.scoring_func
        scores = (F.softplus(logits).sqrt() if f == "sqrtsoftplus"
                  else logits.softmax(dim=-1) if f == "softmax" else logits.sigmoid())
        top = torch.topk(scores + block.gate.e_score_correction_bias, cfg.num_experts_per_tok + 1, dim=-1).values
        return top[:, -2] - top[:, -1]

    def _validate(self, ids: torch.Tensor, state: V4State) -> None:
        cfg = self.config
        if ids.numel() == 0:
            raise ValueError("token_ids is empty: a chunk needs n >= 1 tokens")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} outside the vocab [0, {cfg.vocab_size})")
        t = state.boundary
        if state.compressed.boundary != t:
            raise ValueError(f"state's compressed entries end at {state.compressed.boundary}, its boundary "
                             f"state is at {t} (use restore())")
        if len(state.boundary_state.layers) != cfg.num_hidden_layers:
            raise ValueError(f"state has {len(state.boundary_state.layers)} layers, the model "
                             f"{cfg.num_hidden_layers}")
        for li, lb in enumerate(state.boundary_state.layers):
            want = min(t, cfg.sliding_window - 1)
            if tuple(lb.window.shape) != (want, cfg.head_dim):
                raise ValueError(f"layer {li} window has shape {tuple(lb.window.shape)}, expected "
                                 f"{(want, cfg.head_dim)} at boundary {t}")
            m = cfg.rate(li)
            for name, tail in (("compressor", lb.compressor), ("indexer", lb.indexer)):
                if tail is not None and tail.kv.shape[0] != t % m:
                    raise ValueError(f"layer {li} {name} tail has {tail.kv.shape[0]} rows, expected "
                                     f"{t % m} at boundary {t}")
            for name, ent in (("compressed", state.compressed.kv[li]), ("indexer", state.compressed.index[li])):
                if m and ent is not None and ent.shape[0] != t // m:
                    raise ValueError(f"layer {li} has {ent.shape[0]} {name} entries, expected {t // m} "
                                     f"at boundary {t}")

    @torch.no_grad()
    def prefill_capture(self, token_ids: torch.Tensor, state: V4State | None = None,
                        capture: Iterable[int] = ()) -> tuple[torch.Tensor, V4State, dict[int, V4State]]:
        """:meth:`prefill` that also returns the state at each ``capture`` boundary in
        ``(t, t + n]``, as the cache stores them. Boundary states own their storage; the
        captured compressed entries are views of the end state's (no tensor is ever modified
        in place).

        Returns:
            ``(logits float32 [n, vocab], state at t + n, {b: state at b})``.

        Raises:
            ValueError: empty ids or ids outside the vocab, a capture boundary outside
                ``(t, t + n]``, or a state that does not fit this model or its own boundary.
        """
        st = state if state is not None else self.empty_state()
        ids = token_ids.reshape(-1).to(self.device)
        self._validate(ids, st)
        cfg, eps = self.config, self.config.rms_norm_eps
        t, n = st.boundary, int(ids.numel())
        end = t + n
        caps = sorted({int(b) for b in capture})
        for b in caps:
            if not t < b <= end:
                raise ValueError(f"capture boundary {b} outside (t={t}, t+n={end}]")
        bounds = caps + ([end] if end not in caps else [])
        pos = torch.arange(t, end, device=self.device)
        x = self.model.embed_tokens(ids).unsqueeze(1).expand(n, cfg.hc_mult, cfg.hidden_size).contiguous()
        entries_kv, entries_ix = [], []
        layer_states: list[dict[int, LayerBoundary]] = []
        for li, layer in enumerate(self.model.layers):
            post, comb, col = hc_weights(layer.attn_hc, x, cfg)
            a = rms_norm(col, layer.input_layernorm.weight, eps)
            out, ekv, eix, lbs = self._layer_chunk(li, layer.self_attn, a, pos, st, bounds)
            entries_kv.append(ekv)
            entries_ix.append(eix)
            layer_states.append(lbs)
            x = hc_merge(post, comb, out, x)
            post, comb, col = hc_weights(layer.ffn_hc, x, cfg)
            f_in = rms_norm(col, layer.post_attention_layernorm.weight, eps)
            if self._margins is not None and not layer.mlp.gate.hashed:
                self._record(self._moe_margin(layer.mlp, f_in), 0)
            y = moe(layer.mlp, f_in, ids, cfg)
            x = hc_merge(post, comb, y, x)
        hn = rms_norm(hc_head(self.model.hc_head, x, cfg), self.model.norm.weight, eps)
        logits = self.lm_head(hn).float()
        full = V4CompressedEntries(end, st.compressed.rates, entries_kv, entries_ix)
        states = {b: V4State(full.upto(b) if b != end else full,
                             V4BoundaryState(b, [lbs[b] for lbs in layer_states])) for b in bounds}
        return logits, states[end], {b: states[b] for b in caps}

    # ---- one layer ----------------------------------------------------------------------
    def _rope(self, kind: str, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.config.rope_main if kind == "sliding" else self.config.rope_compress
        return rope_table(spec, self._freqs["main" if kind == "sliding" else "compress"], pos)

    def _project(self, attn: Attention, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [n, H, D], kv [n, D], q_residual [n, q_lora_rank])`` of attention inputs ``a``."""
        cfg, eps = self.config, self.config.rms_norm_eps
        q_res = rms_norm(attn.q_a_proj(a), attn.q_a_norm.weight, eps)
        q = attn.q_b_proj(q_res).view(a.shape[0], cfg.num_attention_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, None, eps), cos, sin)
        kv = apply_rope(rms_norm(attn.kv_proj(a), attn.kv_norm.weight, eps), cos, sin)
        return q, kv, q_res

    def _extend(self, comp: Compressor, a: torch.Tensor, t: int, tail: CompressorTail,
                prev: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """Entries of ``[0, t + n)`` (``prev`` + newly closed windows) and what :meth:`_tail_at` needs."""
        m = comp.rate
        all_kv = torch.cat([tail.kv, comp.kv_proj(a)])
        all_g = torch.cat([tail.gate, comp.gate_proj(a)])
        first = t // m
        nw = all_kv.shape[0] // m
        prev_ca = (tail.overlap_kv, tail.overlap_gate) if tail.overlap_kv is not None else None
        new = pool_windows(comp, all_kv[:nw * m], all_g[:nw * m], prev_ca, first, self.config.rms_norm_eps,
                           self.config.rope_compress, self._freqs["compress"])
        return torch.cat([prev, new]), (all_kv, all_g, first * m, prev_ca)

    @staticmethod
    def _tail_at(comp: Compressor, b: int, raw: tuple) -> CompressorTail:
        """The compressor's boundary state at ``b`` from the raw projections of ``[s0, ...)``."""
        all_kv, all_g, s0, prev_ca = raw
        m, d = comp.rate, comp.dim
        eb = b // m
        kv, g = all_kv[eb * m - s0: b - s0].clone(), all_g[eb * m - s0: b - s0].clone()
        if not comp.overlap or eb == 0:
            return CompressorTail(kv, g)
        lo = (eb - 1) * m - s0
        if lo >= 0:
            return CompressorTail(kv, g, all_kv[lo: lo + m, :d].clone(), all_g[lo: lo + m, :d].clone())
        return CompressorTail(kv, g, prev_ca[0].clone(), prev_ca[1].clone())

    def _select(self, attn: Attention, a: torch.Tensor, q_res: torch.Tensor, pos: torch.Tensor,
                index_entries: torch.Tensor) -> torch.Tensor:
        """Lightning Indexer: ``bool [n, E]``, the ``index_topk`` visible entries each query scores
        highest, ``Σ_h w_h · ReLU(q_h · K_e) / sqrt(c_I)`` with ``w = W·x / sqrt(n_h^I)``
        (report eqs. 13-17), ties to the lower index."""
        cfg = self.config
        idx = attn.compressor.indexer
        cos, sin = self._rope("csa", pos)
        qi = apply_rope(idx.q_b_proj(q_res).view(a.shape[0], cfg.index_n_heads, cfg.index_head_dim), cos, sin)
        n_e = index_entries.shape[0]
        vis = torch.arange(n_e, device=a.device)[None, :] < ((pos + 1) // cfg.csa_rate)[:, None]
        if n_e == 0:
            return vis
        scores = F.relu(torch.matmul(qi.float(), index_entries.float().T)) * cfg.index_head_dim ** -0.5
        w = idx.scorer.weights_proj(a).float() * cfg.index_n_heads ** -0.5
        s = (scores * w.unsqueeze(-1)).sum(dim=1).masked_fill(~vis, float("-inf"))
        k = min(cfg.index_topk, n_e)
        ranked = torch.sort(s, dim=-1, descending=True, stable=True)
        order = ranked.indices[:, :k]
        if self._margins is not None and k < n_e:
            kth, nxt = ranked.values[:, k - 1], ranked.values[:, k]
            gap = torch.where(torch.isinf(nxt) | ((kth == 0) & (nxt == 0)), torch.inf, kth - nxt)
            self._record(gap, int(pos[0]))
        sel = torch.zeros_like(vis).scatter_(1, order, True)
        return sel & vis

    def _attend(self, attn: Attention, q: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, k0: int,
                entries: torch.Tensor | None, ent_mask: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Sink attention of queries ``q`` ``[n, H, D]`` at ``pos`` over window keys (positions
        ``k0 + j``) and the allowed entries; returns the projected output ``[n, hidden]``."""
        cfg = self.config
        kp = torch.arange(k0, k0 + keys.shape[0], device=q.device)
        mask = (kp[None, :] <= pos[:, None]) & (kp[None, :] > pos[:, None] - cfg.sliding_window)
        if entries is not None:
            keys = torch.cat([keys, entries])
            mask = torch.cat([mask, ent_mask], dim=1)
        logits = torch.einsum("nhd,kd->nhk", q, keys) * cfg.head_dim ** -0.5
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        n, H = q.shape[0], cfg.num_attention_heads
        full = torch.cat([logits, attn.sinks.to(logits.dtype).view(1, H, 1).expand(n, H, 1)], dim=-1)
        full = full - full.max(dim=-1, keepdim=True).values
        probs = full.softmax(dim=-1)[..., :-1]
        o = apply_rope(torch.einsum("nhk,kd->nhd", probs, keys), cos, -sin)
        g = cfg.o_groups
        wa = attn.o_a_proj.weight.view(g, cfg.o_lora_rank, -1)
        y = torch.einsum("ngi,gri->ngr", o.reshape(n, g, -1), wa).reshape(n, -1)
        return attn.o_b_proj(y)

    def _blocks(self, attn: Attention, a: torch.Tensor, q: torch.Tensor, q_res: torch.Tensor, pos: torch.Tensor,
                keys: torch.Tensor, k0: int, entries: torch.Tensor | None, index_entries: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output ``[n, hidden]`` for queries at ``pos`` (consecutive), in blocks of
        :data:`QUERY_BLOCK` rows so memory stays ``O(block · (W + entries))``: each block reads only
        the window keys its queries can see and its own entry mask (CSA: the indexer's choice)."""
        outs = []
        w1 = self.config.sliding_window - 1
        for lo in range(0, q.shape[0], QUERY_BLOCK):
            sl = slice(lo, min(q.shape[0], lo + QUERY_BLOCK))
            p = pos[sl]
            first = max(k0, int(p[0]) - w1)
            kb = keys[first - k0: int(p[-1]) + 1 - k0]
            mask = None
            if entries is not None:
                if attn.kind == "csa":
                    mask = self._select(attn, a[sl], q_res[sl], p, index_entries)
                else:
                    mask = (torch.arange(entries.shape[0], device=a.device)[None, :]
                            < ((p + 1) // attn.compressor.rate)[:, None])
            outs.append(self._attend(attn, q[sl], p, kb, first, entries, mask, cos[sl], sin[sl]))
        return torch.cat(outs)

    def _layer_chunk(self, li: int, attn: Attention, a: torch.Tensor, pos: torch.Tensor, st: V4State,
                     bounds: list[int]):
        cfg = self.config
        t = int(pos[0])
        cos, sin = self._rope(attn.kind, pos)
        q, kv, q_res = self._project(attn, a, cos, sin)
        lb = st.boundary_state.layers[li]
        keys = torch.cat([lb.window, kv])
        k0 = t - lb.window.shape[0]
        ekv = eix = None
        comp = attn.compressor
        if comp is not None:
            ekv, raw = self._extend(comp, a, t, lb.compressor, st.compressed.kv[li])
            if attn.kind == "csa":
                eix, raw_ix = self._extend(comp.indexer, a, t, lb.indexer, st.compressed.index[li])
        out = self._blocks(attn, a, q, q_res, pos, keys, k0, ekv, eix, cos, sin)
        w1 = cfg.sliding_window - 1
        lbs = {}
        for b in bounds:
            win = keys[max(0, b - w1) - k0: b - k0].clone()
            c = self._tail_at(comp, b, raw) if comp is not None else None
            ix = self._tail_at(comp.indexer, b, raw_ix) if attn.kind == "csa" else None
            lbs[b] = LayerBoundary(win, c, ix)
        return out, ekv, eix, lbs

    # ---- recompute strategy --------------------------------------------------------------
    @torch.no_grad()
    def recompute_boundary(self, token_ids: torch.Tensor, compressed: V4CompressedEntries,
                           h: int) -> V4BoundaryState:
        """Rebuild the boundary state at ``h`` from the compressed entries of ``[0, h)`` and the
        raw tokens, recomputing only the dependency cone (:func:`recompute_cone_rows`): layer
        ``l`` runs on its last ``R_l`` input rows and emits outputs for the last ``R_{l+1}``.

        Args:
            token_ids: ``int64``, the prefix's tokens: all of ``[0, h)``, or just its last
                ``>= recompute_cone_tokens(config, h)`` tokens.
            compressed: entries of at least ``[0, h)``.
            h: the boundary (tokens).

        Returns:
            The :class:`V4BoundaryState` at ``h`` (combine with :func:`restore`).

        Raises:
            ValueError: entries ending before ``h``, too few tokens, or ids outside the vocab.
        """
        cfg, eps = self.config, self.config.rms_norm_eps
        if compressed.boundary < h:
            raise ValueError(f"compressed entries end at token {compressed.boundary}, before h={h}")
        rows = recompute_cone_rows(cfg, h) + (0,)
        ids = token_ids.reshape(-1).to(self.device)
        if ids.numel() < rows[0]:
            raise ValueError(f"recompute at h={h} needs the last {rows[0]} tokens, got {ids.numel()}")
        if h == 0:
            return self.empty_state().boundary_state
        ids = ids[ids.numel() - rows[0]:]
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError(f"token id outside the vocab [0, {cfg.vocab_size})")
        ent = compressed.upto(h)
        x = self.model.embed_tokens(ids).unsqueeze(1).expand(-1, cfg.hc_mult, cfg.hidden_size).contiguous()
        layers = []
        w1 = cfg.sliding_window - 1
        for li, layer in enumerate(self.model.layers):
            r, r_out = rows[li], rows[li + 1]
            x = x[x.shape[0] - r:]
            pos = torch.arange(h - r, h, device=self.device)
            post, comb, col = hc_weights(layer.attn_hc, x, cfg)
            a = rms_norm(col, layer.input_layernorm.weight, eps)
            attn = layer.self_attn
            cos, sin = self._rope(attn.kind, pos)
            q, kv, q_res = self._project(attn, a, cos, sin)
            comp = attn.compressor
            c = ix = None
            if comp is not None:
                c = self._tail_from_rows(comp, a, h)
                if attn.kind == "csa":
                    ix = self._tail_from_rows(comp.indexer, a, h)
            layers.append(LayerBoundary(kv[r - min(h, w1):].clone(), c, ix))
            if r_out == 0:
                break
            qs = slice(r - r_out, r)
            out = self._blocks(attn, a[qs], q[qs], q_res[qs], pos[qs], kv, h - r, ent.kv[li], ent.index[li],
                               cos[qs], sin[qs])
            xs = x[qs]
            xs = hc_merge(post[qs], comb[qs], out, xs)
            post2, comb2, col2 = hc_weights(layer.ffn_hc, xs, cfg)
            y = moe(layer.mlp, rms_norm(col2, layer.post_attention_layernorm.weight, eps), ids[len(ids) - r_out:], cfg)
            x = hc_merge(post2, comb2, y, xs)
        return V4BoundaryState(h, layers)

    @staticmethod
    def _tail_from_rows(comp: Compressor, a: torch.Tensor, h: int) -> CompressorTail:
        """A compressor's boundary state at ``h`` from attention inputs ``a`` of positions
        ``[h − len(a), h)``."""
        m, d, r = comp.rate, comp.dim, a.shape[0]
        k = h % m
        kv, g = comp.kv_proj(a[r - k: r]), comp.gate_proj(a[r - k: r])
        if not comp.overlap or h < m:
            return CompressorTail(kv, g)
        w = a[r - k - m: r - k]
        return CompressorTail(kv, g, comp.kv_proj(w)[:, :d].contiguous(), comp.gate_proj(w)[:, :d].contiguous())
