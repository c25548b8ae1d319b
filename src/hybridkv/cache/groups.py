"""Cache groups: one spec, one entry shape and one hit rule per kind of per-layer state
(DESIGN §1, §4). Everything that decides what is reusable lives here, once:

* the group names (``full``, ``kda``) used from the config to the object keys;
* :func:`reuse_cap`: at most ``T - 1`` tokens of a ``T``-token prompt are reused;
* the hit rules: attention KV is prefix-closed (contiguous from the left),
  KDA checkpoints are sparse (the deepest one at or below a limit);
* :func:`joint_hit`: groups looped to agreement, giving the joint hit and the
  branching boundary. The device coordinator applies it to its matched index
  path, a lower tier to the boundaries whose entries it holds;
* the specs (:class:`FullAttentionSpec`, :class:`KDASpec`) and the entry shapes
  they imply (:func:`entry_shapes`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

FULL = "full"
"""Group of the full-attention (MLA) layers: paged KV latents."""
KDA = "kda"
"""Group of the linear-attention (KDA) layers: whole-model checkpoints."""
GROUP_NAMES = (FULL, KDA)

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per value of each dtype an entry component may have."""


def reuse_cap(num_tokens: int, unit: int) -> int:
    """Most tokens of a ``num_tokens`` prompt that may be reused: ``T - 1`` rounded down to ``unit``.

    The last prompt position is always computed, so the request has logits to
    sample its first token from (tokens).
    """
    return max(num_tokens - 1, 0) // unit * unit


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` (a :data:`DTYPE_BYTES` name) and ``shape``.

    Raises:
        KeyError: ``dtype`` is not one of :data:`DTYPE_BYTES`.
    """
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Spec of the ``full`` group: paged MLA latents.

    Attributes:
        block_size: tokens per page.
        num_layers: MLA layers.
        latent_dim: ``kv_lora_rank + qk_rope_head_dim`` values per token per layer.
        dtype_bytes: bytes per value in the device pool (entries are float32).
    """

    block_size: int
    num_layers: int
    latent_dim: int
    dtype_bytes: int = 4

    @classmethod
    def for_model(cls, config, block_size: int, dtype_bytes: int = 4) -> FullAttentionSpec:
        """Spec of a :class:`~hybridkv.model.config.HybridConfig` with pages of ``block_size`` tokens."""
        return cls(block_size, config.num_mla_layers, config.kv_latent_dim, dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all MLA layers."""
        return self.num_layers * self.latent_dim * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page over all MLA layers."""
        return self.block_size * self.bytes_per_token

    def entry_shape(self, segment: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Components of a ``full`` entry of ``segment`` tokens: ``latents`` ``float32[L_mla, segment, D]``."""
        return {"latents": ("float32", (self.num_layers, segment, self.latent_dim))}


@dataclass(frozen=True, slots=True)
class KDASpec:
    """Spec of the ``kda`` group: whole-model checkpoints.

    Attributes:
        num_layers: KDA layers.
        num_heads, head_dim: per layer; recurrent state ``float32[H, K, K]``.
        conv_dim: ``3 * H * K`` channels of the conv window.
        conv_width: ``kernel_size - 1`` rows of the conv window.
        conv_dtype: dtype name of the conv window (the model's compute dtype).
    """

    num_layers: int
    num_heads: int
    head_dim: int
    conv_dim: int
    conv_width: int
    conv_dtype: str = "float32"

    @classmethod
    def for_model(cls, config, conv_dtype: str = "float32") -> KDASpec:
        """Spec of a :class:`~hybridkv.model.config.HybridConfig` whose compute dtype is ``conv_dtype``."""
        return cls(config.num_kda_layers, config.kda_num_heads, config.kda_head_dim, config.conv_dim,
                   config.conv_kernel_size - 1, conv_dtype)

    def entry_shape(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Components of a ``kda`` entry: ``recurrent`` ``float32[L_kda, H, K, K]`` and the q | k | v
        thirds of the conv window, ``conv.q`` / ``conv.k`` / ``conv.v`` each ``[L_kda, H*K, width]``."""
        third = (self.num_layers, self.conv_dim // 3, self.conv_width)
        return {"recurrent": ("float32", (self.num_layers, self.num_heads, self.head_dim, self.head_dim)),
                "conv.q": (self.conv_dtype, third), "conv.k": (self.conv_dtype, third),
                "conv.v": (self.conv_dtype, third)}

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one checkpoint (every KDA layer: recurrent fp32 + conv)."""
        return sum(nbytes(dtype, shape) for dtype, shape in self.entry_shape().values())


def entry_shapes(full: FullAttentionSpec, kda: KDASpec, segment: int) -> dict[str, dict]:
    """group -> component -> ``(dtype name, shape)`` of this model's lower-tier entries, whose
    ``full`` entries hold ``segment`` tokens (the tier's alignment)."""
    return {FULL: full.entry_shape(segment), KDA: kda.entry_shape()}


class Boundary(Protocol):
    """What a hit rule reads of one boundary (an index node or a lower tier's entry pair).

    Attributes:
        end: the boundary in tokens.
        has_kv: the KV of the segment ending here is available.
        has_checkpoint: ``C(P_end)`` is available.
    """

    end: int
    has_kv: bool
    has_checkpoint: bool


@dataclass(frozen=True, slots=True)
class EntryPresence:
    """A :class:`Boundary` whose availability a lower tier reported (tokens, flags)."""

    end: int
    has_kv: bool
    has_checkpoint: bool


class CacheGroup(ABC):
    """A named group that serves some boundaries of a matched path."""

    name: str

    @abstractmethod
    def find_hit(self, boundaries: Sequence[Boundary], limit: int) -> int:
        """Longest boundary ``<= limit`` (tokens) this group can serve.

        ``boundaries`` are consecutive and ascending: each one's segment starts
        where the previous one ends, the first one starts at token 0.
        """


class FullAttentionGroup(CacheGroup):
    """Prefix-closed: the end of the run of boundaries with KV that starts at token 0."""

    name = FULL

    def find_hit(self, boundaries: Sequence[Boundary], limit: int) -> int:
        hit = 0
        for b in boundaries:
            if b.end > limit or not b.has_kv:
                break
            hit = b.end
        return hit


class KDAGroup(CacheGroup):
    """Sparse: the deepest boundary at or below ``limit`` that holds a checkpoint (0 = zero state)."""

    name = KDA

    def find_hit(self, boundaries: Sequence[Boundary], limit: int) -> int:
        for b in reversed(boundaries):
            if b.end <= limit and b.has_checkpoint:
                return b.end
        return 0


GROUPS: tuple[CacheGroup, ...] = (FullAttentionGroup(), KDAGroup())
"""The groups of a hybrid MLA + KDA model, in the order reports list them."""


@dataclass(frozen=True, slots=True)
class JointHit:
    """What every group agrees can be reused (tokens).

    Attributes:
        hit: joint hit: the deepest boundary every group serves.
        per_group: group name -> its own hit under the same limit.
    """

    hit: int
    per_group: dict[str, int]

    @property
    def kv_hit(self) -> int:
        """Contiguous KV from token 0 (the ``full`` group's hit)."""
        return self.per_group[FULL]

    @property
    def branching_boundary(self) -> int | None:
        """``kv_hit`` when it exceeds the joint hit (KV there, no checkpoint), else ``None``."""
        return self.kv_hit if self.kv_hit > self.hit else None


def joint_hit(boundaries: Sequence[Boundary], limit: int,
              groups: Sequence[CacheGroup] = GROUPS) -> JointHit:
    """The joint-hit rule: each group's hit at ``limit``, then the groups looped to agreement.

    Args:
        boundaries: consecutive ascending boundaries (see :meth:`CacheGroup.find_hit`).
        limit: most tokens reusable (usually :func:`reuse_cap`).
        groups: the model's cache groups.
    """
    per_group = {g.name: g.find_hit(boundaries, limit) for g in groups}
    hit = min(per_group.values())
    while True:
        agreed = min(g.find_hit(boundaries, hit) for g in groups)
        if agreed == hit:
            return JointHit(hit, per_group)
        hit = agreed
