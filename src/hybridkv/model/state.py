"""Data passed across the model's forward contract (DESIGN §2, §3, §9).

These types are the only thing the cache and engine know about the model's
state: a :class:`KDACheckpoint` is the whole per-boundary state of every KDA
layer, a :class:`ForwardRequest` is one sequence's slice of a batched forward
and a :class:`ForwardResult` is what comes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv._torch import torch


@dataclass(slots=True)
class KDACheckpoint:
    """Checkpoint ``C(P_t)``: recurrent state and conv window of every KDA layer at ``t``.

    A checkpoint is usable only whole (DESIGN §2): recurrent state without the
    conv window cannot continue the computation.

    Attributes:
        recurrent: ``float32[L_kda, H, K, V]`` — ``S_l(t)`` in math layout
            ``[heads, d_k, d_v]`` for the KDA layers in model order.
        conv: ``[L_kda, 3 * H * K, kernel_size - 1]`` in the model's compute
            dtype — the last ``kernel_size - 1`` *pre-convolution* q|k|v
            projection rows before ``t`` (channel order q, k, v; time oldest
            first; zero rows where ``t < kernel_size - 1``).
        boundary: ``t`` in tokens.
    """

    recurrent: torch.Tensor
    conv: torch.Tensor
    boundary: int

    def clone(self) -> KDACheckpoint:
        """Deep copy (new storage) of both components."""
        return KDACheckpoint(self.recurrent.clone(), self.conv.clone(), self.boundary)

    def components(self) -> dict[str, torch.Tensor]:
        """The ``kda`` group's entry components (views, no copy): ``recurrent`` and the q | k | v
        thirds of the conv window, ``conv.q`` / ``conv.k`` / ``conv.v`` each ``[L_kda, H*K, width]``
        (names and shapes: :meth:`hybridkv.cache.groups.KDASpec.entry_shape`)."""
        q, k, v = self.conv.chunk(3, dim=1)
        return {"recurrent": self.recurrent, "conv.q": q, "conv.k": k, "conv.v": v}

    @classmethod
    def from_components(cls, parts: dict[str, torch.Tensor], boundary: int) -> KDACheckpoint:
        """Inverse of :meth:`components`: ``C(P_boundary)`` (the conv thirds joined in a new tensor)."""
        conv = torch.cat([parts["conv.q"], parts["conv.k"], parts["conv.v"]], dim=1)
        return cls(parts["recurrent"], conv, boundary)

    @property
    def nbytes(self) -> int:
        """Size of both components in bytes."""
        return (self.recurrent.numel() * self.recurrent.element_size()
                + self.conv.numel() * self.conv.element_size())


@dataclass(slots=True)
class ForwardRequest:
    """One sequence's part of a batched paged forward.

    Attributes:
        token_ids: ``int64[n]`` ids of positions ``[start, start + n)``; ``n >= 1``.
        start: first position computed (tokens already in the KV pages and in
            ``initial_state``).
        page_table: ``int64[num_pages]`` page ids; page ``i`` holds positions
            ``[i * block_size, (i + 1) * block_size)``. Must cover ``end``.
            Latents of positions ``[0, start)`` must already be in these pages;
            the forward writes positions ``[start, end)``.
        initial_state: KDA state at ``start`` (``None`` means zeros and is only
            allowed when ``start == 0``). Never modified by the forward.
        capture: boundaries in ``(start, end]`` whose checkpoints are returned.
        all_logits: return logits for every computed position instead of only
            the last one.
    """

    token_ids: torch.Tensor
    start: int
    page_table: torch.Tensor
    initial_state: KDACheckpoint | None = None
    capture: Sequence[int] = ()
    all_logits: bool = False

    @property
    def end(self) -> int:
        """One past the last computed position (tokens)."""
        return self.start + int(self.token_ids.numel())


@dataclass(slots=True)
class ForwardResult:
    """What the forward hands back for one :class:`ForwardRequest`.

    Attributes:
        logits: ``float32[1, vocab]`` (last position) or ``float32[n, vocab]``
            when ``all_logits`` was requested.
        checkpoints: boundary -> checkpoint, for every requested capture
            boundary; each owns its storage.
        end_state: checkpoint at ``end`` (owns its storage).
    """

    logits: torch.Tensor
    end_state: KDACheckpoint
    checkpoints: dict[int, KDACheckpoint] = field(default_factory=dict)
