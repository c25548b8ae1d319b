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

_ATTENTION = (("wq_a", "q_a_proj"), ("wq_b", "q_b_proj"), ("wkv", "kv_proj"), ("wo_a", "o_a_proj"),
              ("wo_b", "o_b_proj"), ("q_norm", "q_a_norm"), ("norm", "kv_norm"), ("attn_sink", "sinks"))
_COMPRESSOR = (("ape", "position_bias"), ("norm", "kv_norm"), ("wgate", "gate_proj"), ("wkv", "kv_proj"))
_LAYER_NAMES = (
    ("attn", "self_attn"), ("ffn", "mlp"),
    ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
    *((f"hc_{site}_{part}", f"{site}_hc.{part}") for site in ("attn", "ffn") for part in ("fn", "base", "scale")),
    *((f"attn.{pub}", f"self_attn.{ours}") for pub, ours in _ATTENTION),
    ("attn.indexer.compressor", "self_attn.compressor.indexer"),
    *((f"{pub_at}.{pub}", f"{ours_at}.{ours}") for pub_at, ours_at in (
        ("attn.compressor", "self_attn.compressor"), ("attn.indexer.compressor", "self_attn.compressor.indexer"))
      for pub, ours in _COMPRESSOR),
    ("attn.indexer.weights_proj", "self_attn.compressor.indexer.scorer.weights_proj"),
    ("attn.indexer.wq_b", "self_attn.compressor.indexer.q_b_proj"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    *((f"ffn.shared_experts.{pub}", f"mlp.shared_experts.{ours}")
      for pub, ours in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))),
)
"""The one rename table of a layer's tensors: ``(published path, our path)`` after ``layers.N.``
(module paths, or a whole tensor name where only the leaf differs). A name is renamed by its
longest path in the table (whole dotted segments), the rest kept: read left to right it maps a
checkpoint to this package (:data:`_TO_OURS`), right to left back (:data:`_TO_PUBLISHED`)."""
_TO_OURS = dict(_LAYER_NAMES)
_TO_PUBLISHED = {ours: pub for pub, ours in _LAYER_NAMES}


def _rename(path: str, table: dict[str, str]) -> str:
    """``path`` (dotted, after ``layers.N.``) with its longest prefix in ``table`` replaced."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in table:
            return ".".join([table[head], *parts[i:]])
    return path


_LAYER = re.compile(r"^(layers\.\d+)\.(.+)$")
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
    m = _LAYER.match(bare)
    if m is None:
        raise ValueError(f"unexpected tensor {name!r} in a DeepSeek-V4 checkpoint")
    return f"model.{m.group(1)}.{_rename(m.group(2), _TO_OURS)}"


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
        m = _LAYER.match(name[len("model."):])
        out[f"model.{m.group(1)}.{_rename(m.group(2), _TO_PUBLISHED)}"] = t
    return out


def write_v4_tensors(directory: str | Path, state: dict[str, torch.Tensor],
                     max_shard_bytes: int | None = None) -> None:
    """Write ``state`` (this package's names) in the published layout, one file or shards."""
    write_tensors(directory, published_state(state), max_shard_bytes)
