"""Depthwise causal short convolution with an explicit conv window (DESIGN §2).

The window ``W`` is the last ``kernel - 1`` *pre-convolution* rows before the
first computed position, stored channel-major ``[C, kernel - 1]`` (time oldest
first), exactly as :class:`~hybridkv.model.state.KDACheckpoint` holds it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


def short_conv(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None = None,
               boundaries: Iterable[int] = (),
               ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Causal depthwise conv + SiLU of one sequence, continuing from ``window``.

    ``y[t, c] = silu(sum_i weight[c, i] * xx[t + i, c])`` with ``xx = [window^T; x]``.

    Args:
        x: ``[T, C]`` pre-conv rows (any float dtype); ``T >= 1``.
        weight: ``[C, kernel]`` conv taps (``conv1d.weight[:, 0, :]``).
        window: ``[C, kernel - 1]`` previous pre-conv rows, or ``None`` (zeros).
        boundaries: local token counts ``b`` in ``[1, T]`` whose window is returned.

    Returns:
        ``(y, end_window, windows)``: ``y [T, C]`` in ``x.dtype``; windows
        ``[C, kernel - 1]`` in ``x.dtype`` with their own storage.

    Raises:
        ValueError: shape mismatch or a boundary outside ``[1, T]``.
    """
    T, C = x.shape
    kernel = weight.shape[-1]
    if weight.shape != (C, kernel):
        raise ValueError(f"conv weight {tuple(weight.shape)} does not match {C} channels")
    if window is None:
        window = x.new_zeros(C, kernel - 1)
    if tuple(window.shape) != (C, kernel - 1):
        raise ValueError(f"conv window shape {tuple(window.shape)} != {(C, kernel - 1)}")
    xx = torch.cat([window.t().to(x.dtype), x], dim=0)  # [kernel-1+T, C]
    w = weight.to(x.dtype)
    acc = xx[0:T] * w[:, 0]
    for i in range(1, kernel):
        acc.addcmul_(xx[i:i + T], w[:, i])
    y = F.silu(acc, inplace=True)
    windows = {}
    for b in boundaries:
        b = int(b)
        if not 1 <= b <= T:
            raise ValueError(f"conv boundary {b} outside [1, {T}]")
        windows[b] = xx[b:b + kernel - 1].t().clone()
    return y, xx[T:T + kernel - 1].t().clone(), windows
