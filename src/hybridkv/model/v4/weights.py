"""DeepSeek-V4 tensor names: the published checkpoint layout (``layers.N.attn.wq_a``, per-expert
``ffn.experts.E.w1/w2/w3``, ...; what ``transformers`` ``save_pretrained`` writes, with a
``model.`` prefix) mapped to and from this package's module names (transformers' in-memory
names: ``self_attn.q_a_proj``, stacked ``mlp.experts.gate_up_proj``, ...). Multi-token-prediction
tensors (``mtp.*``) are ignored; FP8-quantised checkpoints (``*.scale``/``*scale_inv``) are refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from hybridkv.model.weights import read_tensors, write_tensors

# published -> ours, applied in order to layer tensor names (mirrors the published layout).
_TO_OURS = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"), (r"\.hc_attn_base$", ".attn_hc.base"), (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"), (r"\.hc_ffn_base$", ".ffn_hc.base"), (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
# ours -> published, applied in order.
_TO_PUBLISHED = [
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.fn$", ".hc_attn_fn"), (r"\.attn_hc\.base$", ".hc_attn_base"), (r"\.attn_hc\.scale$", ".hc_attn_scale"),
    (r"\.ffn_hc\.fn$", ".hc_ffn_fn"), (r"\.ffn_hc\.base$", ".hc_ffn_base"), (r"\.ffn_hc\.scale$", ".hc_ffn_scale"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.q_a_norm\.", ".q_norm."), (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_b_proj\.", ".wq_b."), (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
]
_TOP = {"embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale", "hc_head.hc_fn": "model.hc_head.hc_fn",
        "hc_head.hc_base": "model.hc_head.hc_base", "hc_head.hc_scale": "model.hc_head.hc_scale"}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


def _ours(name: str) -> str | None:
    bare = name[len("model."):] if name.startswith("model.") else name
    bare = bare.replace(".block_sparse_moe.", ".mlp.")   # read_tensors' Kimi alias, undone
    if bare.startswith("mtp.") or ".mtp." in bare:
        return None
    if bare.endswith("scale_inv") or (bare.endswith(".scale") and not bare.endswith("_hc.scale")):
        raise ValueError(f"tensor {name!r}: FP8-quantised DeepSeek-V4 checkpoints are not supported; "
                         "dequantise to bf16/fp32 first")
    if bare in _TOP:
        return _TOP[bare]
    if not bare.startswith("layers."):
        raise ValueError(f"unexpected tensor {name!r} in a DeepSeek-V4 checkpoint")
    out = "." + bare
    for pat, rep in _TO_OURS:
        out = re.sub(pat, rep, out)
    return "model" + out


def read_v4_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a DeepSeek-V4 checkpoint directory (single or sharded safetensors) under
    this package's names, per-expert matrices stacked into ``gate_up_proj``/``down_proj``.

    Raises:
        FileNotFoundError: no checkpoint file or a missing shard.
        ValueError: an unreadable file, an unknown or doubly-stored tensor, an FP8 tensor, or
            an incomplete expert set (named).
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in read_tensors(directory).items():
        ours = _ours(name)
        if ours is None:
            continue
        m = _EXPERT.match(ours)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            continue
        if ours in out:
            raise ValueError(f"tensor {name!r} is stored twice (as {ours!r})")
        out[ours] = t
    for prefix, per in experts.items():
        n = max(per) + 1
        for e in range(n):
            got = per.get(e, {})
            for w in ("w1", "w2", "w3"):
                if w not in got:
                    raise ValueError(f"checkpoint is missing tensor {prefix}.{e}.{w}.weight")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per[e]["w1"], per[e]["w3"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([per[e]["w2"] for e in range(n)])
    return out


def published_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This package's state dict in the layout ``transformers`` ``save_pretrained`` writes
    (layer tensors under published names with a ``model.`` prefix, experts one by one)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            out["head.weight"] = t
            continue
        if not name.startswith("model.layers."):
            out[name] = t
            continue
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            base = name.rsplit(".", 1)[0].replace(".mlp.", ".ffn.")
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = w1, w3
                else:
                    out[f"{base}.{e}.w2.weight"] = t[e]
            continue
        pub = name[len("model"):]
        for pat, rep in _TO_PUBLISHED:
            pub = re.sub(pat, rep, pub)
        out["model" + pub] = t
    return out


def write_v4_tensors(directory: str | Path, state: dict[str, torch.Tensor],
                     max_shard_bytes: int | None = None) -> None:
    """Write ``state`` (this package's names) in the published layout, one file or shards."""
    write_tensors(directory, published_state(state), max_shard_bytes)
