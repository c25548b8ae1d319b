"""Paged pool of MLA latent KV (DESIGN §1, §9).

Per token and MLA layer the pool holds ``kv_latent_dim`` values:
``kv_a_layernorm(kv_nope)`` (``kv_lora_rank``) followed by the raw ``k_rot``
(``qk_rope_head_dim``). Page ``p`` holds ``block_size`` consecutive positions of
one sequence; which positions is the page table's business (see
:class:`~hybridkv.model.state.ForwardRequest`).
"""

from __future__ import annotations

import torch

from hybridkv.model.config import HybridConfig


class PagedKVPool:
    """Latent KV pages for every MLA layer.

    Attributes:
        latents: ``[num_mla_layers, num_pages, block_size, kv_latent_dim]`` in
            ``dtype`` on ``device``; written only by the model's forward and by
            :meth:`copy_page`.
        block_size: tokens per page.  num_pages: pages in the pool.
    """

    def __init__(self, config: HybridConfig, num_pages: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        """Allocate a zeroed pool.

        Raises:
            ValueError: ``num_pages < 1`` or ``block_size < 1``.
        """
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.config = config
        self.num_pages = int(num_pages)
        self.block_size = int(block_size)
        self.latents = torch.zeros(config.num_mla_layers, self.num_pages, self.block_size,
                                   config.kv_latent_dim, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        """Element dtype of :attr:`latents`."""
        return self.latents.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page over all MLA layers."""
        return (self.config.num_mla_layers * self.block_size * self.config.kv_latent_dim
                * self.latents.element_size())

    def _check_page(self, page: int, what: str) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"{what} page {page} outside [0, {self.num_pages})")

    def copy_page(self, src: int, dst: int, num_tokens: int | None = None) -> None:
        """Copy the first ``num_tokens`` slots (default: all) of page ``src`` into ``dst``,
        for every MLA layer (copy-on-write of a partially filled page).

        Raises:
            ValueError: a page id outside the pool or ``num_tokens`` outside ``[0, block_size]``.
        """
        self._check_page(src, "source")
        self._check_page(dst, "destination")
        n = self.block_size if num_tokens is None else int(num_tokens)
        if not 0 <= n <= self.block_size:
            raise ValueError(f"num_tokens={n} outside [0, {self.block_size}]")
        if src != dst and n:
            self.latents[:, dst, :n].copy_(self.latents[:, src, :n])

    def slots(self, page_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat slot ids (``page * block_size + offset``) of positions ``[start, end)``.

        Returns ``int64[end - start]`` on the pool's device.

        Raises:
            ValueError: the page table does not cover ``end`` or names a page outside the pool.
        """
        pt = torch.as_tensor(page_table, dtype=torch.long).reshape(-1)
        need = -(-end // self.block_size)
        if pt.numel() < need:
            raise ValueError(f"page_table has {pt.numel()} pages but end={end} needs {need} "
                             f"(block_size={self.block_size})")
        used = pt[:need]
        if need and (int(used.min()) < 0 or int(used.max()) >= self.num_pages):
            bad = next(int(p) for p in used if not 0 <= int(p) < self.num_pages)
            raise ValueError(f"page_table names page {bad} outside [0, {self.num_pages})")
        pos = torch.arange(start, end)
        return (used[pos // self.block_size] * self.block_size + pos % self.block_size).to(
            self.latents.device)

    def write(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values [n, kv_latent_dim]`` of MLA layer ``layer`` (0-based among MLA
        layers) at flat ``slots [n]``."""
        flat = self.latents[layer].view(-1, self.latents.shape[-1])
        flat.index_copy_(0, slots, values.to(self.latents.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Latents ``[n, kv_latent_dim]`` (pool dtype) of MLA layer ``layer`` at ``slots``."""
        return self.latents[layer].view(-1, self.latents.shape[-1]).index_select(0, slots)
