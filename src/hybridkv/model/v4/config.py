"""Typed, validated DeepSeek-V4 configuration (DESIGN §12).

:class:`V4Config` is built once from a DeepSeek-V4 ``config.json`` (``model_type``
``deepseek_v4``, as ``transformers.DeepseekV4Config`` writes it, or the legacy keys the
published checkpoints ship: ``compress_ratios``, ``compress_rate_csa/hca``,
``num_hash_layers``, ``qk_rope_head_dim``) and handed to every model part as plain values.
Layer kinds use short names: ``"sliding"``, ``"csa"`` (compressed sparse attention, rate
``csa_rate``), ``"hca"`` (heavily compressed attention, rate ``hca_rate``); every layer has a
sliding-window branch of ``sliding_window`` tokens (the query's own included).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.model.config_schema import Field

#: Names of the bundled DeepSeek-V4 presets (``src/hybridkv/model/presets/<name>.json``).
V4_PRESETS = ("v4-tiny", "v4-small", "deepseek-v4-flash")

#: Presets of published sizes that only ``--simulate`` runs (no weights are built for them):
#: ``deepseek-v4-flash`` has DeepSeek-V4-Flash's published shapes (284B parameters; sources in
#: :func:`hybridkv.fleet.costmodel.v4_flash_config`).
V4_SIMULATE_ONLY = ("deepseek-v4-flash",)

MODEL_TYPE = "deepseek_v4"
"""``model_type`` of a DeepSeek-V4 ``config.json``."""

LAYER_KINDS = ("sliding", "csa", "hca")
_HF_LAYER_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                   "heavily_compressed_attention": "hca"}
_KIND_TO_HF = {v: k for k, v in _HF_LAYER_TYPES.items()}
_RATIO_TO_KIND = {0: "sliding", 4: "csa", 128: "hca"}
MLP_KINDS = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"invalid DeepSeek-V4 model config: {key}={value!r}: {why}")


V4_SCHEMA = tuple(Field(k, (k,)) for k in (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "csa_rate", "hca_rate", "index_n_heads",
    "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "max_position_embeddings")) + tuple(
    Field(k, (k,), kind=float) for k in ("rms_norm_eps", "hc_eps", "routed_scaling_factor", "swiglu_limit"))
"""The typed, range-checked sizes (JSON integers >= 1, at most
:data:`~hybridkv.model.config_schema.MAX_SIZE`) and positive finite numbers of a
:class:`V4Config`, checked by the shared :class:`~hybridkv.model.config_schema.Field` as the Kimi
Linear schema checks its own (a bool, a fraction or a string is refused, never converted)."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One rotary table (V4 has two: ``main`` for sliding layers, ``compress`` for CSA/HCA).

    Attributes:
        theta: base wavelength.
        kind: ``"default"`` or ``"yarn"``.
        factor, original_max_position_embeddings, beta_fast, beta_slow, truncate: YaRN
            parameters (unused for ``default``).
        attention_factor: multiplier of cos/sin (1.0 unless a YaRN config says otherwise).
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def to_hf(self, partial_rotary_factor: float) -> dict[str, Any]:
        """The ``rope_parameters[main|compress]`` dict transformers reads."""
        d: dict[str, Any] = {"rope_type": self.kind, "rope_theta": self.theta,
                             "partial_rotary_factor": partial_rotary_factor}
        if self.kind == "yarn":
            d.update(factor=self.factor, original_max_position_embeddings=self.original_max_position_embeddings,
                     beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
                     attention_factor=self.attention_factor)
        return d


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 · mscale · ln(scale) + 1`` (Peng et al. 2023, eq. 21); 1 for ``scale <= 1``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_spec(label: str, d: Mapping[str, Any], max_pos: int) -> RopeSpec:
    kind = d.get("rope_type", d.get("type", "default"))
    theta = d.get("rope_theta")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 1:
        raise _bad(f"rope_parameters.{label}.rope_theta", theta, "must be a number > 1")
    if kind == "default":
        return RopeSpec(float(theta))
    if kind != "yarn":
        raise _bad(f"rope_parameters.{label}.rope_type", kind, "only 'default' and 'yarn' are supported")
    omax = d.get("original_max_position_embeddings")
    factor = d.get("factor")
    if factor is None and omax:
        factor = max_pos / omax
    if not isinstance(factor, (int, float)) or not factor > 0:
        raise _bad(f"rope_parameters.{label}.factor", factor, "YaRN needs a factor > 0")
    if not isinstance(omax, int) or omax < 1:
        raise _bad(f"rope_parameters.{label}.original_max_position_embeddings", omax, "YaRN needs an int >= 1")
    att = d.get("attention_factor")
    if att is None:
        ms, msa = d.get("mscale"), d.get("mscale_all_dim")
        att = _yarn_mscale(factor, ms) / _yarn_mscale(factor, msa) if ms and msa else _yarn_mscale(factor)
    return RopeSpec(float(theta), "yarn", float(factor), int(omax), float(d.get("beta_fast") or 32),
                    float(d.get("beta_slow") or 1), bool(d.get("truncate", True)), float(att))


@dataclass(frozen=True, slots=True)
class V4Config:
    """DeepSeek-V4 architecture hyper-parameters (counts unless noted).

    Attributes:
        vocab_size, hidden_size, num_hidden_layers: model size.
        num_attention_heads, head_dim: query heads; one shared K=V head of ``head_dim``.
        qk_rope_head_dim: trailing channels of each head that get (interleaved) RoPE.
        q_lora_rank: width of the query down-projection (also the indexer's query input).
        o_groups, o_lora_rank: grouped output projection (``g`` groups to ``d_g`` each).
        sliding_window: ``n_win``: a query sees the ``n_win`` latest tokens (itself included);
            the window state at a boundary is the last ``n_win - 1`` K=V rows.
        layer_types: per layer ``"sliding"`` / ``"csa"`` / ``"hca"``.
        csa_rate, hca_rate: tokens per compressed entry (``m``, ``m'``).
        index_n_heads, index_head_dim, index_topk: the Lightning Indexer.
        hc_mult, hc_sinkhorn_iters, hc_eps: manifold-constrained hyper-connections.
        mlp_layer_types: per layer ``"hash_moe"`` (expert ids from a token-id table) or ``"moe"``.
        n_routed_experts, num_experts_per_tok, moe_intermediate_size (also the shared expert's
        width), scoring_func, routed_scaling_factor, swiglu_limit: MoE.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_main, rope_compress: the two rotary tables.
        max_position_embeddings: longest position (tokens).
        pad_token_id, bos_token_id, eos_token_id: special ids (inside the vocab).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_main: RopeSpec
    rope_compress: RopeSpec
    max_position_embeddings: int = 1 << 20
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for f in V4_SCHEMA:
            f.check(f.attr, getattr(self, f.attr))
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise _bad("qk_rope_head_dim", self.qk_rope_head_dim,
                       f"must be even and <= head_dim={self.head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise _bad("index_head_dim", self.index_head_dim,
                       f"must be >= qk_rope_head_dim={self.qk_rope_head_dim} (the indexer's RoPE slice)")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise _bad("o_groups", self.o_groups,
                       f"must divide num_attention_heads*head_dim={self.num_attention_heads * self.head_dim}")
        if self.sliding_window < 2:
            raise _bad("sliding_window", self.sliding_window, "must be >= 2")
        if self.csa_rate < 2 or self.hca_rate < 2:
            raise _bad("compress_rates", (self.csa_rate, self.hca_rate), "rates must be >= 2")
        n = self.num_hidden_layers
        if len(self.layer_types) != n or any(t not in LAYER_KINDS for t in self.layer_types):
            raise _bad("layer_types", self.layer_types, f"need {n} entries of {LAYER_KINDS}")
        if len(self.mlp_layer_types) != n or any(t not in MLP_KINDS for t in self.mlp_layer_types):
            raise _bad("mlp_layer_types", self.mlp_layer_types, f"need {n} entries of {MLP_KINDS}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise _bad("num_experts_per_tok", self.num_experts_per_tok,
                       f"more than n_routed_experts={self.n_routed_experts}")
        if self.scoring_func not in SCORING_FUNCS:
            raise _bad("scoring_func", self.scoring_func, f"must be one of {SCORING_FUNCS}")
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.vocab_size:
                raise _bad(key, value, f"outside the vocab [0, {self.vocab_size})")

    # ---- derived ------------------------------------------------------------------
    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer`` (0 for a sliding layer)."""
        kind = self.layer_types[layer]
        return 0 if kind == "sliding" else self.csa_rate if kind == "csa" else self.hca_rate

    @property
    def csa_layers(self) -> tuple[int, ...]:
        """0-based indices of the CSA layers."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == "csa")

    @property
    def hca_layers(self) -> tuple[int, ...]:
        """0-based indices of the HCA layers."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == "hca")

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: Any) -> V4Config:
        """Build from a ``transformers.DeepseekV4Config``, a ``config.json`` dict, a path to
        ``config.json`` or a directory holding one.

        Raises:
            ValueError: a missing or invalid key (named with its value), a ``model_type``
                other than ``deepseek_v4``, or a file that is not a JSON object (named).
            FileNotFoundError: the path has no ``config.json``.
        """
        if isinstance(source, (str, Path)):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.exists():
                raise FileNotFoundError(f"no config.json at {path}")
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from None
            if not isinstance(data, dict):
                raise ValueError(f"{path}: config.json must hold a JSON object")
        elif isinstance(source, Mapping):
            data = dict(source)
        elif hasattr(source, "to_dict"):
            data = source.to_dict()
        else:
            raise TypeError(f"cannot build a V4Config from {type(source).__name__}")
        return cls._from_dict(data)

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> V4Config:
        mt = d.get("model_type", MODEL_TYPE)
        if mt != MODEL_TYPE:
            raise _bad("model_type", mt, f"expected {MODEL_TYPE!r}")

        def get(key: str, default: Any = KeyError) -> Any:
            if key in d and d[key] is not None:
                return d[key]
            if default is KeyError:
                raise _bad(key, None, "required key is missing")
            return default

        def number(key: str, default: float) -> float:
            """A finite number > 0, checked as the Kimi schema checks its floats (a bool or a string
            is refused, not converted)."""
            return Field(key, (key,), kind=float, default=default).read(d, {})

        n = Field("num_hidden_layers", ("num_hidden_layers",), default=43).read(d, {})   # lists are cut to it
        rates = dict(get("compress_rates", {}) or {})
        csa = d.get("compress_rate_csa") or rates.get("compressed_sparse_attention", 4)
        hca = d.get("compress_rate_hca") or rates.get("heavily_compressed_attention", 128)
        lt = d.get("layer_types")
        if lt is None and d.get("compress_ratios") is not None:
            ratios = list(d["compress_ratios"])[:n]
            bad = [r for r in ratios if r not in _RATIO_TO_KIND]
            if bad:
                raise _bad("compress_ratios", d["compress_ratios"], f"entries must be in {sorted(_RATIO_TO_KIND)}")
            kinds = [_RATIO_TO_KIND[r] for r in ratios]
        elif lt is None:
            kinds = ["hca"] * min(n, 2) + ["csa" if i % 2 else "hca" for i in range(max(n - 2, 0))]
        else:
            if not isinstance(lt, (list, tuple)) or any(t not in _HF_LAYER_TYPES for t in lt):
                raise _bad("layer_types", lt, f"entries must be one of {tuple(_HF_LAYER_TYPES)}")
            kinds = [_HF_LAYER_TYPES[t] for t in lt]
        mlp = d.get("mlp_layer_types")
        if mlp is None:
            nh = Field("num_hash_layers", ("num_hash_layers",), low=0, default=3).read(d, {})
            mlp = ["hash_moe"] * min(n, nh) + ["moe"] * max(0, n - nh)
        head_dim = Field("head_dim", ("head_dim",), default=512).read(d, {})     # the RoPE width derives from it
        prf = d.get("partial_rotary_factor")
        rope_dim = d.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(head_dim * prf) if prf is not None else 64 * head_dim // 512
        kv_heads = get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise _bad("num_key_value_heads", kv_heads, "DeepSeek-V4 has one shared K=V head")
        act = get("hidden_act", "silu")
        if act != "silu":
            raise _bad("hidden_act", act, "only 'silu' is supported")
        if get("tie_word_embeddings", False):
            raise _bad("tie_word_embeddings", True, "DeepSeek-V4 has an untied lm_head")
        max_pos = get("max_position_embeddings", 1 << 20)
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
            main, comp = dict(rp["main"]), dict(rp["compress"])
        else:
            flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            main = {"rope_type": "default", "rope_theta": get("rope_theta", 10000.0)}
            comp = {**flat, "rope_theta": get("compress_rope_theta", 160000.0)}
            comp.setdefault("rope_type", "default")
            if comp["rope_type"] == "yarn":
                comp.setdefault("attention_factor", 1.0)
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_hidden_layers=n,
            num_attention_heads=get("num_attention_heads"), head_dim=head_dim, qk_rope_head_dim=rope_dim,
            q_lora_rank=get("q_lora_rank"), o_groups=get("o_groups"), o_lora_rank=get("o_lora_rank"),
            sliding_window=get("sliding_window", 128), layer_types=tuple(kinds),
            csa_rate=csa, hca_rate=hca, index_n_heads=get("index_n_heads"),
            index_head_dim=get("index_head_dim"), index_topk=get("index_topk"),
            hc_mult=get("hc_mult", 4), hc_sinkhorn_iters=get("hc_sinkhorn_iters", 20),
            hc_eps=number("hc_eps", 1e-6), mlp_layer_types=tuple(list(mlp)[:n]),
            n_routed_experts=get("n_routed_experts"), num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"), scoring_func=get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=number("routed_scaling_factor", 1.5),
            swiglu_limit=number("swiglu_limit", 10.0), rms_norm_eps=number("rms_norm_eps", 1e-6),
            rope_main=_rope_spec("main", main, max_pos), rope_compress=_rope_spec("compress", comp, max_pos),
            max_position_embeddings=max_pos, pad_token_id=d.get("pad_token_id"),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos,
        )

    @classmethod
    def preset(cls, name: str) -> V4Config:
        """Load a bundled preset: one of :data:`V4_PRESETS`.

        Raises:
            ValueError: unknown preset name.
        """
        if name not in V4_PRESETS:
            raise ValueError(f"unknown DeepSeek-V4 preset {name!r}; choose one of {V4_PRESETS}")
        text = resources.files("hybridkv.model").joinpath("presets", f"{name}.json").read_text()
        return cls.from_hf(json.loads(text))

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that both :meth:`from_hf` and
        ``transformers.DeepseekV4Config(**d)`` accept (equal architecture)."""
        d = asdict(self)
        prf = self.qk_rope_head_dim / self.head_dim
        return {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "partial_rotary_factor": prf,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": [_KIND_TO_HF[k] for k in self.layer_types],
            "compress_rates": {"compressed_sparse_attention": self.csa_rate,
                               "heavily_compressed_attention": self.hca_rate},
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "mlp_layer_types": list(d["mlp_layer_types"]), "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": 1, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size, "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor, "swiglu_limit": self.swiglu_limit,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_main.theta,
            "compress_rope_theta": self.rope_compress.theta,
            "rope_parameters": {"main": self.rope_main.to_hf(prf), "compress": self.rope_compress.to_hf(prf)},
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "tie_word_embeddings": False, "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
        }
