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

_FP32_BYTES = 4

#: Names of the bundled presets (``src/hybridkv/model/presets/<name>.json``).
PRESETS = ("tiny", "small", "kimi-linear-48b-a3b")

MODEL_TYPE = "kimi_linear"
"""``model_type`` of a Kimi Linear ``config.json`` (transformers' ``KimiLinearConfig``)."""


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"invalid model config: {key}={value!r}: {why}")


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
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads",
                    "kda_head_dim", "conv_kernel_size", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "num_attention_heads", "num_experts",
                    "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
                    "intermediate_size", "num_expert_group", "topk_group"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise _bad(key, value, "must be an int")
            if value < 1 and key not in ("num_shared_experts", "qk_rope_head_dim"):
                raise _bad(key, value, "must be >= 1")
            if value < 0:
                raise _bad(key, value, "must be >= 0")
        if self.q_lora_rank is not None:
            raise _bad("q_lora_rank", self.q_lora_rank, "only None (no query LoRA) is supported")
        n = self.num_hidden_layers
        for key in ("kda_layers", "mla_layers"):
            for i in getattr(self, key):
                if not 0 <= i < n:
                    raise _bad(key, getattr(self, key), f"layer {i} outside [0, {n})")
        if sorted(self.kda_layers + self.mla_layers) != list(range(n)):
            raise _bad("kda_layers/mla_layers", (self.kda_layers, self.mla_layers),
                       f"must partition range({n}) (each layer exactly once)")
        if len(self.mlp_layer_types) != n or any(t not in ("dense", "sparse") for t in self.mlp_layer_types):
            raise _bad("mlp_layer_types", self.mlp_layer_types, f"need {n} entries of 'dense'/'sparse'")
        if self.num_experts_per_token > self.num_experts:
            raise _bad("num_experts_per_token", self.num_experts_per_token,
                       f"more than num_experts={self.num_experts}")
        if self.num_experts % self.num_expert_group:
            raise _bad("num_expert_group", self.num_expert_group,
                       f"does not divide num_experts={self.num_experts}")
        if self.num_expert_group > 1 and self.num_experts // self.num_expert_group < 2:
            raise _bad("num_expert_group", self.num_expert_group, "groups need >= 2 experts each")
        if self.topk_group > self.num_expert_group:
            raise _bad("topk_group", self.topk_group, f"more than num_expert_group={self.num_expert_group}")
        if self.num_experts_per_token > self.topk_group * (self.num_experts // self.num_expert_group):
            raise _bad("num_experts_per_token", self.num_experts_per_token,
                       "more than the experts in topk_group groups")
        if not self.rms_norm_eps > 0:
            raise _bad("rms_norm_eps", self.rms_norm_eps, "must be > 0")
        if not self.routed_scaling_factor > 0:
            raise _bad("routed_scaling_factor", self.routed_scaling_factor, "must be > 0")
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.vocab_size:
                raise _bad(key, value, f"outside the vocab [0, {self.vocab_size})")

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
        def get(key: str, *aliases: str, default: Any = KeyError) -> Any:
            for k in (key, *aliases):
                if k in d and d[k] is not None:
                    return d[k]
            if default is KeyError:
                raise _bad(key, None, "missing")
            return default

        model_type = d.get("model_type")
        if model_type is not None and model_type != MODEL_TYPE:
            raise _bad("model_type", model_type, f"not a Kimi Linear model (expected {MODEL_TYPE!r})")
        n = int(get("num_hidden_layers"))
        lac = d.get("linear_attn_config") or {}
        if lac.get("kda_layers") is not None and lac.get("full_attn_layers") is not None:
            kda = tuple(sorted(int(i) - 1 for i in lac["kda_layers"]))
            mla = tuple(sorted(int(i) - 1 for i in lac["full_attn_layers"]))
            if min(kda + mla, default=0) < 0:
                raise _bad("linear_attn_config.kda_layers", lac["kda_layers"], "layers are 1-based")
        elif lac.get("full_attn_layers") is not None:
            mla = tuple(sorted(int(i) - 1 for i in lac["full_attn_layers"]))
            kda = tuple(i for i in range(n) if i not in mla)
        elif d.get("layer_types") is not None:
            lt = list(d["layer_types"])
            kda = tuple(i for i, t in enumerate(lt) if t == "linear_attention")
            mla = tuple(i for i, t in enumerate(lt) if t == "full_attention")
            if len(kda) + len(mla) != len(lt):
                raise _bad("layer_types", lt, "entries must be linear_attention/full_attention")
        else:
            raise _bad("linear_attn_config", lac, "needs kda_layers and full_attn_layers")
        if d.get("layer_types") is not None:
            want = ["linear_attention" if i in kda else "full_attention" for i in range(n)]
            if list(d["layer_types"]) != want:
                raise _bad("layer_types", d["layer_types"], "disagrees with linear_attn_config")
        fkd = int(get("first_k_dense_replace", default=0))
        mlt = d.get("mlp_layer_types")
        mlp_types = tuple(mlt) if mlt is not None else tuple(
            "dense" if i < fkd else "sparse" for i in range(n))
        if get("moe_layer_freq", default=1) != 1:
            raise _bad("moe_layer_freq", d["moe_layer_freq"], "only 1 is supported")
        if get("hidden_act", default="silu") != "silu":
            raise _bad("hidden_act", d["hidden_act"], "only 'silu' is supported")
        if not get("mla_use_nope", default=True):
            raise _bad("mla_use_nope", d["mla_use_nope"], "rotary MLA is not supported")
        if get("moe_router_activation_func", default="sigmoid") != "sigmoid":
            raise _bad("moe_router_activation_func", d["moe_router_activation_func"],
                       "only 'sigmoid' is supported")
        heads = int(get("num_attention_heads"))
        if int(get("num_key_value_heads", default=heads)) != heads:
            raise _bad("num_key_value_heads", d["num_key_value_heads"], "must equal num_attention_heads")
        eos = d.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            num_hidden_layers=n,
            kda_layers=kda,
            mla_layers=mla,
            kda_num_heads=int(lac.get("num_heads") or get("linear_num_heads")),
            kda_head_dim=int(lac.get("head_dim") or get("linear_head_dim")),
            conv_kernel_size=int(lac.get("short_conv_kernel_size") or get("linear_conv_kernel_dim", default=4)),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            num_attention_heads=heads,
            num_experts=int(get("num_experts", "num_local_experts")),
            num_experts_per_token=int(get("num_experts_per_token", "num_experts_per_tok")),
            num_shared_experts=int(get("num_shared_experts", "n_shared_experts", default=0)),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            intermediate_size=int(get("intermediate_size")),
            first_k_dense_replace=fkd,
            mlp_layer_types=mlp_types,
            routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
            num_expert_group=int(get("num_expert_group", "n_group", default=1)),
            topk_group=int(get("topk_group", default=1)),
            moe_renormalize=bool(get("moe_renormalize", "norm_topk_prob", default=True)),
            rms_norm_eps=float(get("rms_norm_eps", default=1e-5)),
            pad_token_id=d.get("pad_token_id"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            q_lora_rank=d.get("q_lora_rank"),
        )

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
