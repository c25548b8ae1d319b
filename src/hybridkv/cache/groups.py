"""Cache groups: one spec and one hit rule per kind of per-layer state (DESIGN §1, §4).

A group answers one question: given the matched path of index nodes and an
upper limit, what is the longest boundary this group can serve? Attention KV is
prefix-closed (left to right); KDA checkpoints are sparse (right to left, the
deepest node with a checkpoint). The coordinator loops groups to agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.cache.index import BlockNode


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Spec of the ``full`` group: paged MLA latents.

    Attributes:
        block_size: tokens per page.
        num_layers: MLA layers.
        latent_dim: ``kv_lora_rank + qk_rope_head_dim`` values per token per layer.
        dtype_bytes: bytes per value.
    """

    block_size: int
    num_layers: int
    latent_dim: int
    dtype_bytes: int = 4

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all MLA layers."""
        return self.num_layers * self.latent_dim * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page over all MLA layers."""
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True, slots=True)
class KDASpec:
    """Spec of the ``kda`` group: whole-model checkpoints.

    Attributes:
        num_layers: KDA layers.
        num_heads, head_dim: per layer; recurrent state ``float32[H, K, K]``.
        conv_dim: ``3 * H * K`` channels of the conv window.
        conv_width: ``kernel_size - 1`` rows of the conv window.
        conv_dtype_bytes: bytes per conv value.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    conv_dim: int
    conv_width: int
    conv_dtype_bytes: int = 4

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one checkpoint (every KDA layer: recurrent fp32 + conv)."""
        rec = self.num_heads * self.head_dim * self.head_dim * 4
        conv = self.conv_dim * self.conv_width * self.conv_dtype_bytes
        return self.num_layers * (rec + conv)


class CacheGroup:
    """Base class: a named group that serves some boundaries of a matched path."""

    name = "group"

    def find_hit(self, path: list[BlockNode], limit: int) -> int:
        """Longest boundary ``<= limit`` (tokens) this group can serve on ``path``."""
        raise NotImplementedError


class FullAttentionGroup(CacheGroup):
    """Prefix-closed: every node on the path has its page, so any boundary up to the path end."""

    name = "full"

    def find_hit(self, path: list[BlockNode], limit: int) -> int:
        end = path[-1].end if path else 0
        return min(end, limit)


class KDAGroup(CacheGroup):
    """Sparse: the deepest node at or below ``limit`` that holds a checkpoint (0 = zero state)."""

    name = "kda"

    def find_hit(self, path: list[BlockNode], limit: int) -> int:
        for node in reversed(path):
            if node.end <= limit and node.checkpoint is not None:
                return node.end
        return 0
