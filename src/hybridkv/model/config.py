"""Typed, validated model configuration (DESIGN §9).

:class:`HybridConfig` is built once from a Kimi-Linear ``config.json`` (or a
``transformers.KimiLinearConfig``) and handed to every model part as plain
values. Layer indices here are **0-based**; ``config.json`` lists them 1-based in
``linear_attn_config.{kda_layers, full_attn_layers}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.model.config_schema import (
    NESTED,
    SCHEMA,
    TOKEN_ID,
    Field,
    bad_value,
    json_type,
    layer_list,
    layers_problem,
)

_FP32_BYTES = 4

#: Names of the bundled presets (``src/hybridkv/model/presets/<name>.json``).
PRESETS = ("tiny", "small", "kimi-linear-48b-a3b")

MODEL_TYPE = "kimi_linear"
"""``model_type`` of a Kimi Linear ``config.json`` (transformers' ``KimiLinearConfig``)."""


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """Kimi-Linear architecture hyper-parameters.

    Attributes (units: counts unless noted):
        vocab_size, hidden_size, num_hidden_layers: model size.
        kda_layers / mla_layers: 0-based layer indices of KDA / MLA layers;
            together they cover ``range(num_hidden_layers)`` exactly once.
        kda_num_heads, kda_head_dim: KDA heads ``H`` and head dim ``K`` (= ``V``).
        conv_kernel_size: short-conv kernel width (4 in published models).
        kv_lora_rank, q_lora_rank (always ``None``), qk_nope_head_dim,
        qk_rope_head_dim, v_head_dim, num_attention_heads: MLA shapes.
        num_experts, num_experts_per_token, num_shared_experts,
        moe_intermediate_size, intermediate_size, first_k_dense_replace,
        mlp_layer_types (``"dense"``/``"sparse"`` per layer),
        routed_scaling_factor, num_expert_group, topk_group, moe_renormalize: MoE.
        rms_norm_eps: epsilon of every RMSNorm.
        pad_token_id, bos_token_id, eos_token_id: special ids (inside the vocab).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    mlp_layer_types: tuple[str, ...]
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    rms_norm_eps: float
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    q_lora_rank: None = None

    def __post_init__(self) -> None:
        for f in SCHEMA:
            f.check(f.attr, getattr(self, f.attr))
        if self.q_lora_rank is not None:
            raise bad_value("q_lora_rank", self.q_lora_rank, "only None (no query LoRA) is supported")
        n = self.num_hidden_layers
        problem = layers_problem(self.kda_layers, self.mla_layers, n, first=0)
        if problem:
            raise bad_value("kda_layers/mla_layers", (self.kda_layers, self.mla_layers), problem)
        if len(self.mlp_layer_types) != n or any(t not in ("dense", "sparse") for t in self.mlp_layer_types):
            raise bad_value("mlp_layer_types", self.mlp_layer_types, f"need {n} entries of 'dense'/'sparse'")
        if self.num_experts_per_token > self.num_experts:
            raise bad_value("num_experts_per_token", self.num_experts_per_token,
                       f"more than num_experts={self.num_experts}")
        if self.num_experts % self.num_expert_group:
            raise bad_value("num_expert_group", self.num_expert_group,
                       f"does not divide num_experts={self.num_experts}")
        if self.num_expert_group > 1 and self.num_experts // self.num_expert_group < 2:
            raise bad_value("num_expert_group", self.num_expert_group, "groups need >= 2 experts each")
        if self.topk_group > self.num_expert_group:
            raise bad_value("topk_group", self.topk_group, f"more than num_expert_group={self.num_expert_group}")
        if self.num_experts_per_token > self.topk_group * (self.num_experts // self.num_expert_group):
            raise bad_value("num_experts_per_token", self.num_experts_per_token,
                       "more than the experts in topk_group groups")
        if not self.rms_norm_eps > 0:
            raise bad_value("rms_norm_eps", self.rms_norm_eps, "must be > 0")
        if not self.routed_scaling_factor > 0:
            raise bad_value("routed_scaling_factor", self.routed_scaling_factor, "must be > 0")
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, key)
            if value is not None and not TOKEN_ID.check(key, value) < self.vocab_size:
                raise bad_value(key, value, f"outside the vocab [0, {self.vocab_size})")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def num_kda_layers(self) -> int:
        """Number of KDA layers ``L_kda``."""
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        """Number of MLA (full attention) layers."""
        return len(self.mla_layers)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Per layer ``"kda"`` or ``"mla"`` (0-based order)."""
        kda = set(self.kda_layers)
        return tuple("kda" if i in kda else "mla" for i in range(self.num_hidden_layers))

    @property
    def kv_latent_dim(self) -> int:
        """Per-token, per-MLA-layer latent width: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def conv_dim(self) -> int:
        """Short-conv channels of one KDA layer: ``3 * H * K`` (q|k|v)."""
        return 3 * self.kda_num_heads * self.kda_head_dim

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int, int]:
        """``KDACheckpoint.recurrent`` shape ``[L_kda, H, K, V]``."""
        return (self.num_kda_layers, self.kda_num_heads, self.kda_head_dim, self.kda_head_dim)

    @property
    def conv_state_shape(self) -> tuple[int, int, int]:
        """``KDACheckpoint.conv`` shape ``[L_kda, 3*H*K, kernel_size - 1]``."""
        return (self.num_kda_layers, self.conv_dim, self.conv_kernel_size - 1)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one whole :class:`KDACheckpoint` with both parts in fp32."""
        rec = self.num_kda_layers * self.kda_num_heads * self.kda_head_dim * self.kda_head_dim
        conv = self.num_kda_layers * self.conv_dim * (self.conv_kernel_size - 1)
        return (rec + conv) * _FP32_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of MLA latent KV per token over all MLA layers, in fp32.

        Scale by ``element_size / 4`` for other pool dtypes (bf16: half).
        """
        return self.num_mla_layers * self.kv_latent_dim * _FP32_BYTES

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: Any) -> HybridConfig:
        """Build from a ``transformers.KimiLinearConfig``, a ``config.json`` dict,
        a path to ``config.json`` or a directory holding one.

        Raises:
            ValueError: a missing or invalid key (the message names key and value), a
                ``model_type`` other than ``kimi_linear``, or a file that is not a JSON
                object (the message names the file).
            FileNotFoundError: the path has no ``config.json``.
        """
        if isinstance(source, (str, Path)):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from None
            if not isinstance(data, Mapping):
                raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not an object")  # noqa: TRY004 - callers catch ValueError for any bad file
            try:
                return cls._from_dict(dict(data))
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
        if isinstance(source, Mapping):
            return cls._from_dict(dict(source))
        if hasattr(source, "to_dict"):
            d = source.to_dict()
            # transformers keeps these as attributes, not always in to_dict()
            d.setdefault("layer_types", getattr(source, "layer_types", None))
            d.setdefault("mlp_layer_types", getattr(source, "mlp_layer_types", None))
            lac = dict(d.get("linear_attn_config") or {})
            lac.setdefault("num_heads", getattr(source, "linear_num_heads", None))
            lac.setdefault("head_dim", getattr(source, "linear_head_dim", None))
            lac.setdefault("short_conv_kernel_size", getattr(source, "linear_conv_kernel_dim", None))
            d["linear_attn_config"] = lac
            return cls._from_dict(d)
        raise TypeError(f"cannot build HybridConfig from {type(source).__name__}")

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        """Read ``d`` (a ``config.json`` object) through :data:`SCHEMA`: every size an integer in
        range, layer lists 1-based; errors name the file's key and value as written there."""
        model_type = d.get("model_type")
        if model_type is not None and model_type != MODEL_TYPE:
            raise bad_value("model_type", model_type, f"not a Kimi Linear model (expected {MODEL_TYPE!r})")
        lac = d.get("linear_attn_config") or {}
        if not isinstance(lac, Mapping):
            raise bad_value("linear_attn_config", lac, f"must be an object, not {json_type(lac)}")
        values = {f.attr: f.read(d, lac) for f in SCHEMA}
        n = values["num_hidden_layers"]
        kda_key, mla_key = NESTED + "kda_layers", NESTED + "full_attn_layers"
        if lac.get("full_attn_layers") is not None:
            mla = layer_list(mla_key, lac["full_attn_layers"])
            if lac.get("kda_layers") is not None:
                kda = layer_list(kda_key, lac["kda_layers"])
            else:
                kda = tuple(i for i in range(n) if i not in mla)
            problem = layers_problem(kda, mla, n, first=1)
            if problem:
                raise bad_value(f"{kda_key}/full_attn_layers", (lac.get("kda_layers"), lac["full_attn_layers"]), problem)
        elif d.get("layer_types") is not None:
            lt = d["layer_types"]
            if not isinstance(lt, list) or len(lt) != n or \
                    any(t not in ("linear_attention", "full_attention") for t in lt):
                raise bad_value("layer_types", lt, f"must be an array of {n} entries linear_attention/full_attention")
            kda = tuple(i for i, t in enumerate(lt) if t == "linear_attention")
            mla = tuple(i for i, t in enumerate(lt) if t == "full_attention")
        else:
            raise bad_value("linear_attn_config", lac, "needs kda_layers and full_attn_layers")
        if d.get("layer_types") is not None:
            want = ["linear_attention" if i in kda else "full_attention" for i in range(n)]
            if list(d["layer_types"]) != want:
                raise bad_value("layer_types", d["layer_types"], "disagrees with linear_attn_config")
        mlt = d.get("mlp_layer_types")
        if mlt is not None and not isinstance(mlt, list):
            raise bad_value("mlp_layer_types", mlt, f"must be an array of {n} entries 'dense'/'sparse'")
        fkd = values["first_k_dense_replace"]
        mlp_types = tuple(mlt) if mlt is not None else tuple(
            "dense" if i < fkd else "sparse" for i in range(n))
        if d.get("moe_layer_freq", 1) != 1:
            raise bad_value("moe_layer_freq", d["moe_layer_freq"], "only 1 is supported")
        if d.get("hidden_act", "silu") not in ("silu", None):
            raise bad_value("hidden_act", d["hidden_act"], "only 'silu' is supported")
        if d.get("mla_use_nope", True) is not True and d.get("mla_use_nope") is not None:
            raise bad_value("mla_use_nope", d["mla_use_nope"], "only true is supported (rotary MLA is not)")
        if d.get("moe_router_activation_func", "sigmoid") not in ("sigmoid", None):
            raise bad_value("moe_router_activation_func", d["moe_router_activation_func"],
                       "only 'sigmoid' is supported")
        heads = values["num_attention_heads"]
        kv_heads = Field("num_key_value_heads", ("num_key_value_heads",), default=heads).read(d, lac)
        if kv_heads != heads:
            raise bad_value("num_key_value_heads", kv_heads, f"must equal num_attention_heads={heads}")
        eos = d.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(**values, kda_layers=kda, mla_layers=mla, mlp_layer_types=mlp_types,
                   pad_token_id=d.get("pad_token_id"), bos_token_id=d.get("bos_token_id"),
                   eos_token_id=eos, q_lora_rank=d.get("q_lora_rank"))

    @classmethod
    def preset(cls, name: str) -> HybridConfig:
        """Load a bundled preset: one of :data:`PRESETS`.

        Raises:
            ValueError: unknown preset name.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {PRESETS}")
        text = resources.files("hybridkv.model").joinpath("presets", f"{name}.json").read_text()
        return cls.from_hf(json.loads(text))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Kimi-Linear ``config.json`` dict (published key names, 1-based layer lists)
        that both :meth:`from_hf` and ``transformers.KimiLinearConfig(**d)`` accept."""
        d = asdict(self)
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": None,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_kernel_size,
            },
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "mlp_layer_types": list(d["mlp_layer_types"]),
            "moe_layer_freq": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": False,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
