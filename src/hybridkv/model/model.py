"""The Kimi-Linear-architecture model runner (DESIGN §2, §3, §9).

:class:`HybridModel` runs batched paged forwards: the tokens of all requests are
packed into one ``[N, hidden]`` tensor for the token-wise parts (projections,
norms, MoE, lm_head); only the KDA scan and MLA attention loop per sequence.
KDA layers start from a :class:`KDACheckpoint` and hand back exact checkpoints
at requested boundaries; MLA layers read and write a :class:`PagedKVPool`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from hybridkv.model.config import HybridConfig
from hybridkv.model.kda_layer import KDASeq, KDAttention
from hybridkv.model.kv_pool import PagedKVPool
from hybridkv.model.mla import MLASeq, MLAttention, NormWeight
from hybridkv.model.moe import DenseMLP, Router, SparseMoE
from hybridkv.model.ops import rms_norm
from hybridkv.model.state import ForwardRequest, ForwardResult, KDACheckpoint
from hybridkv.model.weights import load_into, read_tensors, write_tensors


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h += attn(norm(h)); h += ffn(norm(h))``."""

    def __init__(self, config: HybridConfig, index: int) -> None:
        super().__init__()
        self.is_kda = config.layer_types[index] == "kda"
        self.eps = config.rms_norm_eps
        self.input_layernorm = NormWeight(config.hidden_size)
        self.post_attention_layernorm = NormWeight(config.hidden_size)
        self.self_attn = KDAttention(config) if self.is_kda else MLAttention(config)
        self.block_sparse_moe = (SparseMoE(config) if config.mlp_layer_types[index] == "sparse"
                                 else DenseMLP(config.hidden_size, config.intermediate_size))


class Backbone(nn.Module):
    """``embed_tokens``, ``layers``, ``norm`` (published prefix ``model.``)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = NormWeight(config.hidden_size)


def check_weight_memory(config: HybridConfig, parameters: int, device: str | torch.device = "cpu") -> None:
    """Refuse a model whose fp32 weights (``parameters`` x 4 bytes) exceed this machine's memory,
    before they are allocated (a config within the schema's bounds, e.g. ``hidden_size`` 2^31 - 1,
    failed in torch's allocator with a traceback). Only checked for CPU weights.

    Raises:
        ValueError: naming the GiB needed, the config's main sizes and the machine's memory.
    """
    if torch.device(device).type != "cpu":
        return
    need = parameters * 4                                                      # bytes (fp32)
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")           # bytes
    if need > have:
        raise ValueError(f"the model's weights need {need / 2**30:.1f} GiB ({parameters} parameters from "
                         f"hidden_size={config.hidden_size}, vocab_size={config.vocab_size}, "
                         f"intermediate_size={config.intermediate_size}, "
                         f"num_hidden_layers={config.num_hidden_layers}, num_experts={config.num_experts}) "
                         f"but this machine has {have / 2**30:.1f} GiB of memory")


class HybridModel(nn.Module):
    """Kimi-Linear model (KDA + MLA + MoE) in pure torch.

    Args:
        config: the architecture.
        dtype: compute/parameter dtype (router, ``A_log`` and ``dt_bias`` stay fp32;
            KDA recurrence, norms and routing always compute in fp32).
        device: where parameters live.

    Parameters are created uninitialised; use :meth:`from_preset`,
    :meth:`from_pretrained` or :meth:`init_random`.
    """

    _FP32_SUFFIXES = ("A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias")

    def __init__(self, config: HybridConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.model = Backbone(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        check_weight_memory(config, sum(p.numel() for p in self.parameters()), device)
        self.to_empty(device=device)
        for name, p in self.named_parameters():
            if not name.endswith(self._FP32_SUFFIXES):
                p.data = p.data.to(dtype)
        self.dtype = dtype
        self._digest: str | None = None
        self.eval()

    # ---- construction / persistence -----------------------------------------------
    @torch.no_grad()
    def init_random(self, seed: int = 0) -> HybridModel:
        """Deterministic random weights from ``seed`` (independent of the global RNG).

        Linear weights ~ N(0, 1/fan_in); embeddings ~ N(0, 1); norms 1; conv taps
        ~ N(0, 1/kernel); ``A_log = log U(1, 16)``; ``dt_bias`` = inverse softplus
        of ``exp(U(log 1e-3, log 1e-1))``; score-correction bias ~ N(0, 0.01).
        """
        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            shape, out = p.shape, None
            if name.endswith("A_log"):
                out = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
                out = dt + torch.log(-torch.expm1(-dt))
            elif name.endswith("e_score_correction_bias"):
                out = torch.randn(shape, generator=gen) * 0.01
            elif "norm" in name.rsplit(".", 2)[-2]:
                out = torch.ones(shape)
            elif "conv1d" in name:
                out = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            elif "embed_tokens" in name:
                out = torch.randn(shape, generator=gen)
            else:
                out = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            p.copy_(out)
        self._digest = None
        return self

    @classmethod
    def from_preset(cls, name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> HybridModel:
        """Bundled preset (``tiny``, ``small``, ...) with deterministic random weights."""
        return cls(HybridConfig.preset(name), dtype, device).init_random(seed)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> HybridModel:
        """Load ``config.json`` and safetensors weights (single or sharded) from ``directory``.

        Raises:
            ValueError: invalid config, or a missing, extra or misshaped tensor (named).
            FileNotFoundError: no config or weights.
        """
        model = cls(HybridConfig.from_hf(Path(directory)), dtype, device)
        load_into(model, read_tensors(directory))
        model._digest = None
        return model

    def save_pretrained(self, directory: str | Path, max_shard_bytes: int | None = None) -> None:
        """Write ``config.json`` and the weights under the published tensor names
        (sharded with an index when larger than ``max_shard_bytes``)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config.to_hf_dict(), indent=2))
        write_tensors(directory, self.state_dict(), max_shard_bytes)

    def weight_digest(self, refresh: bool = False) -> str:
        """Hex sha256 over every tensor's name, dtype, shape and bytes (sorted by name).

        Cached after the first call; pass ``refresh=True`` after modifying weights in place.
        """
        if self._digest is None or refresh:
            h = hashlib.sha256()
            for name, t in sorted(self.state_dict().items()):
                t = t.detach().contiguous().cpu()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    # ---- state helpers --------------------------------------------------------------
    def zero_checkpoint(self) -> KDACheckpoint:
        """The checkpoint at boundary 0: zero recurrent state (fp32) and zero conv window
        (compute dtype), shapes ``config.recurrent_state_shape`` / ``conv_state_shape``."""
        dev = self.lm_head.weight.device
        return KDACheckpoint(torch.zeros(self.config.recurrent_state_shape, device=dev),
                             torch.zeros(self.config.conv_state_shape, dtype=self.dtype, device=dev), 0)

    def new_kv_pool(self, num_pages: int, block_size: int) -> PagedKVPool:
        """A zeroed :class:`PagedKVPool` for this model (compute dtype, same device)."""
        return PagedKVPool(self.config, num_pages, block_size, self.dtype, self.lm_head.weight.device)

    # ---- forward --------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without a cache.

        Args:
            input_ids: ``int64 [B, T]``.

        Returns:
            ``float32 [B, T, vocab]`` logits.

        Raises:
            ValueError: empty input or ids outside the vocab.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        pool = self.new_kv_pool(B, T)
        reqs = [ForwardRequest(input_ids[b], 0, torch.tensor([b]), all_logits=True) for b in range(B)]
        return torch.stack([r.logits for r in self.forward_paged(reqs, pool)])

    @torch.no_grad()
    def routing_margins(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Per position, the smallest MoE routing margin over every sparse layer of a plain forward.

        Args:
            input_ids: ``int64 [T]``.

        Returns:
            ``float32 [T]``: :meth:`Router.decision_margin` of each position, minimised over the
            layers (``inf`` for a model without sparse layers).

        Raises:
            ValueError: as :meth:`forward`.
        """
        margin = torch.full((int(input_ids.numel()),), float("inf"))
        routers = [layer.block_sparse_moe.gate for layer in self.model.layers
                   if isinstance(layer.block_sparse_moe, SparseMoE)]

        def record(router: Router, args: tuple) -> None:
            nonlocal margin
            margin = torch.minimum(margin, router.decision_margin(args[0]).reshape(-1).cpu())

        hooks = [r.register_forward_pre_hook(record) for r in routers]
        try:
            self.forward(input_ids.reshape(1, -1))
        finally:
            for h in hooks:
                h.remove()
        return margin

    def _validate(self, req: ForwardRequest) -> tuple[int, ...]:
        ids = req.token_ids
        n = int(ids.numel())
        if n == 0:
            raise ValueError("token_ids is empty: a request needs n >= 1 tokens")
        if ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D int64[n], got shape {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} outside the vocab [0, {self.config.vocab_size})")
        if req.start < 0:
            raise ValueError(f"start={req.start} must be >= 0")
        st = req.initial_state
        if st is None and req.start > 0:
            raise ValueError(f"initial_state is None but start={req.start} > 0")
        if st is not None:
            if st.boundary != req.start:
                raise ValueError(f"initial_state.boundary={st.boundary} != start={req.start}")
            if tuple(st.recurrent.shape) != self.config.recurrent_state_shape:
                raise ValueError(f"initial_state.recurrent shape {tuple(st.recurrent.shape)} != "
                                 f"{self.config.recurrent_state_shape}")
            if tuple(st.conv.shape) != self.config.conv_state_shape:
                raise ValueError(f"initial_state.conv shape {tuple(st.conv.shape)} != "
                                 f"{self.config.conv_state_shape}")
        cap = tuple(sorted({int(b) for b in req.capture}))
        for b in cap:
            if not req.start < b <= req.end:
                raise ValueError(f"capture boundary {b} outside (start={req.start}, end={req.end}]")
        return cap

    @torch.no_grad()
    def forward_paged(self, requests: list[ForwardRequest], kv_pool: PagedKVPool) -> list[ForwardResult]:
        """One batched forward over several sequences' new tokens.

        Each request computes positions ``[start, end)`` of its sequence: KDA layers
        continue from ``initial_state``; MLA layers write the new latents into the
        request's pages of ``kv_pool`` and attend over positions ``[0, end)``.

        Returns:
            One :class:`ForwardResult` per request, in order: logits float32
            (``[1, vocab]`` or ``[n, vocab]`` with ``all_logits``), the checkpoint at
            ``end`` and one per capture boundary (all with their own storage).

        Raises:
            ValueError: empty request list or token ids, an id outside the vocab, a
                capture boundary outside ``(start, end]``, a page table not covering
                ``end``, ``start > 0`` without ``initial_state``, mismatched state
                shapes, or a pool built for another config.
        """
        if not requests:
            raise ValueError("requests is empty")
        cfg = self.config
        if (kv_pool.latents.shape[0] != cfg.num_mla_layers
                or kv_pool.latents.shape[-1] != cfg.kv_latent_dim):
            raise ValueError(f"kv_pool latents {tuple(kv_pool.latents.shape)} do not fit this model "
                             f"({cfg.num_mla_layers} MLA layers x {cfg.kv_latent_dim})")
        caps = [self._validate(r) for r in requests]
        dev = self.lm_head.weight.device
        rows, at = [], 0
        for r in requests:
            rows.append(slice(at, at + int(r.token_ids.numel())))
            at += int(r.token_ids.numel())
        mla_seqs = []
        for r, sl in zip(requests, rows):
            all_slots = kv_pool.slots(r.page_table, 0, r.end)
            mla_seqs.append(MLASeq(sl, r.start, all_slots[r.start:], all_slots))
        kda_inputs = []
        for r, cap in zip(requests, caps):
            st = r.initial_state
            rec = st.recurrent.to(dev, torch.float32) if st is not None else None
            conv = st.conv.to(dev, self.dtype) if st is not None else None
            kda_inputs.append((rec, conv, tuple(b - r.start for b in cap)))

        ids = torch.cat([r.token_ids.reshape(-1) for r in requests]).to(dev)
        h = self.model.embed_tokens(ids)
        kda_out: list[list[KDASeq]] = []  # per KDA layer, per request
        mla_index = 0
        for layer in self.model.layers:
            x = rms_norm(h, layer.input_layernorm.weight, layer.eps)
            if layer.is_kda:
                li = len(kda_out)
                seqs = [KDASeq(sl, r.start, None if rec is None else rec[li],
                               None if conv is None else conv[li], cap)
                        for r, sl, (rec, conv, cap) in zip(requests, rows, kda_inputs)]
                h = h + layer.self_attn(x, seqs)
                kda_out.append(seqs)
            else:
                h = h + layer.self_attn(x, mla_seqs, kv_pool, mla_index)
                mla_index += 1
            x = rms_norm(h, layer.post_attention_layernorm.weight, layer.eps)
            h = h + layer.block_sparse_moe(x)

        pick = torch.cat([torch.arange(sl.start, sl.stop) if r.all_logits else torch.tensor([sl.stop - 1])
                          for r, sl in zip(requests, rows)]).to(dev)
        hn = rms_norm(h.index_select(0, pick), self.model.norm.weight, cfg.rms_norm_eps)
        logits = self.lm_head(hn).float()

        results, at = [], 0
        for i, (r, (_, _, cap)) in enumerate(zip(requests, kda_inputs)):
            k = int(r.token_ids.numel()) if r.all_logits else 1
            lg = logits[at:at + k]
            at += k
            per_layer = [layer_seqs[i] for layer_seqs in kda_out]
            end_state = self._checkpoint(per_layer, None, r.end)
            cps = {r.start + b: self._checkpoint(per_layer, b, r.start + b) for b in cap}
            results.append(ForwardResult(lg, end_state, cps))
        return results

    def _checkpoint(self, seqs: list[KDASeq], b: int | None, boundary: int) -> KDACheckpoint:
        cfg = self.config
        dev = self.lm_head.weight.device
        if not seqs:
            return KDACheckpoint(torch.zeros(cfg.recurrent_state_shape, device=dev),
                                 torch.zeros(cfg.conv_state_shape, dtype=self.dtype, device=dev), boundary)
        if b is None:
            rec = torch.stack([s.end_state for s in seqs])
            conv = torch.stack([s.end_window for s in seqs])
        else:
            rec = torch.stack([s.states[b] for s in seqs])
            conv = torch.stack([s.windows[b] for s in seqs])
        return KDACheckpoint(rec.float(), conv.to(self.dtype), boundary)
