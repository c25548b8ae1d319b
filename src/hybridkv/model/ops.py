"""Small token-wise operators shared by the layers (fp32 internals)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32; returns ``weight * x̂`` in ``x.dtype``.

    ``x: [..., D]``, ``weight: [D]``.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """KDA output norm: ``RMSNorm(x) * weight * sigmoid(gate)`` in fp32, cast to ``out_dtype``.

    ``x, gate: [..., K]``, ``weight: [K]``.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(out_dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, fp32 in and out."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_log_decay(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor) -> torch.Tensor:
    """Per-channel log-decay ``g = -exp(A_log) * softplus(f + dt_bias)`` (fp32).

    Args:
        f: ``[N, H, K]`` forget-gate projection.  dt_bias: ``[H * K]``.
        A_log: any shape with ``H`` elements (published ``[1, 1, H, 1]``).

    Returns:
        ``[N, H, K]`` float32, ``<= 0``. Softplus is ``x`` for ``x > 20``.
    """
    _N, H, K = f.shape
    x = f.float() + dt_bias.float().view(1, H, K)
    sp = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    return -torch.exp(A_log.float().reshape(1, H, 1)) * sp
