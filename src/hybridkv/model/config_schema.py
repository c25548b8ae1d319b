"""The schema of a Kimi-Linear model config: each field's ``config.json`` keys, type and range.

One table (:data:`SCHEMA`) serves both readers of a config: :meth:`HybridConfig.from_hf
<hybridkv.model.config.HybridConfig.from_hf>` reading ``config.json`` (errors name the file's key,
layers numbered 1-based as the file has them) and :class:`~hybridkv.model.config.HybridConfig`
checking its attributes on construction (errors name the attribute, layers 0-based). A size is a
JSON integer: a bool, a fraction (``64.5``, even ``64.0``) or a string (``"64"``) is refused, never
converted.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def bad_value(key: str, value: Any, why: str) -> ValueError:
    """The error for ``key`` holding ``value``, shown as JSON (as ``config.json`` has it) where it can be."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return ValueError(f"invalid model config: {key}={shown}: {why}")


MAX_SIZE = 2**31 - 1
"""Largest value of any size or count in a model config: the int32 range (published models stay
far below it; above it a size is a typo, not a model)."""

_REQUIRED = object()
NESTED = "linear_attn_config."          # prefix of a key inside that nested object
_JSON_TYPE = {bool: "true/false", int: "an integer", float: "a number with a fraction or exponent", str: "a string",
              list: "an array", tuple: "an array", dict: "an object", type(None): "null"}


@dataclass(frozen=True, slots=True)
class Field:
    """One entry of the schema: a :class:`~hybridkv.model.config.HybridConfig` attribute, the ``config.json``
    keys that may hold it (the published name first, then aliases; ``linear_attn_config.X`` is a key
    of that nested object), its type and range, and its default (``_REQUIRED``: none)."""

    attr: str
    keys: tuple[str, ...]
    kind: type = int
    low: int = 1
    default: Any = _REQUIRED

    def check(self, name: str, value: Any) -> Any:
        """``value`` if it has this field's type and range; a float field takes an integer as a float.

        Raises:
            ValueError: wrong JSON type (a bool, a fraction or a string for an integer), or out of
                range; the message names ``name`` and the value.
        """
        if self.kind is bool:
            if not isinstance(value, bool):
                raise bad_value(name, value, f"must be true or false, not {json_type(value)}")
            return value
        wanted = (int, float) if self.kind is float else int
        if isinstance(value, bool) or not isinstance(value, wanted):
            what = "a number" if self.kind is float else "an integer"
            raise bad_value(name, value, f"must be {what}, not {json_type(value)}")
        if self.kind is float:
            if not (math.isfinite(value) and value > 0):
                raise bad_value(name, value, "must be a finite number > 0")
            return float(value)
        if value < self.low:
            raise bad_value(name, value, f"must be >= {self.low}")
        if value > MAX_SIZE:
            raise bad_value(name, value, f"must be <= {MAX_SIZE}")
        return value

    def read(self, d: Mapping[str, Any], lac: Mapping[str, Any]) -> Any:
        """The checked value of the first of :attr:`keys` present (not null) in ``d`` (``lac``: its
        ``linear_attn_config``), else the default. Raises ``ValueError`` (missing or invalid; named)."""
        for key in self.keys:
            nested = key.startswith(NESTED)
            value = lac.get(key[len(NESTED):]) if nested else d.get(key)
            if value is not None:
                return self.check(key, value)
        if self.default is _REQUIRED:
            raise bad_value(self.keys[0], None, "missing")
        return self.default


def json_type(value: Any) -> str:
    return _JSON_TYPE.get(type(value), type(value).__name__)


SCHEMA = (
    Field("vocab_size", ("vocab_size",)),
    Field("hidden_size", ("hidden_size",)),
    Field("num_hidden_layers", ("num_hidden_layers",)),
    Field("kda_num_heads", ("linear_attn_config.num_heads", "linear_num_heads")),
    Field("kda_head_dim", ("linear_attn_config.head_dim", "linear_head_dim")),
    Field("conv_kernel_size", ("linear_attn_config.short_conv_kernel_size", "linear_conv_kernel_dim"), default=4),
    Field("kv_lora_rank", ("kv_lora_rank",)),
    Field("qk_nope_head_dim", ("qk_nope_head_dim",)),
    Field("qk_rope_head_dim", ("qk_rope_head_dim",), low=0),
    Field("v_head_dim", ("v_head_dim",)),
    Field("num_attention_heads", ("num_attention_heads",)),
    Field("num_experts", ("num_experts", "num_local_experts")),
    Field("num_experts_per_token", ("num_experts_per_token", "num_experts_per_tok")),
    Field("num_shared_experts", ("num_shared_experts", "n_shared_experts"), low=0, default=0),
    Field("moe_intermediate_size", ("moe_intermediate_size",)),
    Field("intermediate_size", ("intermediate_size",)),
    Field("first_k_dense_replace", ("first_k_dense_replace",), low=0, default=0),
    Field("num_expert_group", ("num_expert_group", "n_group"), default=1),
    Field("topk_group", ("topk_group",), default=1),
    Field("routed_scaling_factor", ("routed_scaling_factor",), kind=float, default=1.0),
    Field("moe_renormalize", ("moe_renormalize", "norm_topk_prob"), kind=bool, default=True),
    Field("rms_norm_eps", ("rms_norm_eps",), kind=float, default=1e-5),
)
"""The typed, range-checked fields of a model config: what :meth:`HybridConfig.from_hf` reads from
``config.json`` (errors name the file's key) and what :class:`HybridConfig` checks on construction
(errors name the attribute)."""

TOKEN_ID = Field("token_id", (), low=0)


def layers_problem(kda: tuple[int, ...], mla: tuple[int, ...], n: int, first: int) -> str | None:
    """Why 0-based layer lists ``kda`` and ``mla`` do not partition ``range(n)``, with layer numbers
    shown from ``first`` (1 for ``config.json``'s 1-based lists), or ``None``."""
    outside = [i + first for i in kda + mla if not 0 <= i < n]
    if outside:
        return f"layer {outside[0]} outside {first}..{n - 1 + first} (num_hidden_layers={n})"
    count = Counter(kda + mla)
    twice = sorted(i + first for i, c in count.items() if c > 1)
    if twice:
        return f"layer {twice[0]} listed twice (each layer is KDA or MLA exactly once)"
    # the lowest layer in neither list: at most len(count) + 1 steps (a huge num_hidden_layers
    # with short lists hung here, listing every missing layer)
    missing = next((i for i in range(n) if i not in count), None)
    if missing is not None:
        return (f"layer {missing + first} in neither list (each of the num_hidden_layers={n} layers is KDA or "
                "MLA exactly once)")
    return None


def layer_list(key: str, value: Any) -> tuple[int, ...]:
    """A ``config.json`` 1-based layer list as sorted 0-based indices (range checked by the caller)."""
    if not isinstance(value, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise bad_value(key, value, "must be an array of 1-based layer numbers (integers)")
    return tuple(sorted(i - 1 for i in value))
