"""The KDA attention layer: projections, short conv, gates, recurrence, gated norm.

Parameter names are the published ones (``q_proj``, ``q_conv1d.weight [H*K, 1, k]``,
``A_log [1, 1, H, 1]``, ``dt_bias [H*K]``, ``f_a_proj``, ``f_b_proj``, ``b_proj``,
``g_a_proj``, ``g_b_proj``, ``o_norm.weight [K]``, ``o_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hybridkv.model.config import HybridConfig
from hybridkv.model.conv import short_conv
from hybridkv.model.kda import kda_chunked, kda_recurrent
from hybridkv.model.mla import NormWeight
from hybridkv.model.ops import gated_rms_norm, kda_log_decay, l2_normalize


class ConvWeight(nn.Module):
    """Holder of a depthwise conv ``weight [C, 1, kernel]`` (published ``*_conv1d.weight``)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


@dataclass(slots=True)
class KDASeq:
    """One sequence's view for a KDA layer; the layer fills the outputs.

    Attributes:
        rows: slice of the packed token rows.  start: absolute first position.
        state: ``float32 [H, K, V]`` state at ``start`` (``None``: zeros).
        window: ``[3HK, kernel-1]`` conv window at ``start`` (``None``: zeros).
        capture: local token counts in ``[1, n]`` whose state is wanted.
        end_state / end_window / states / windows: outputs (own storage).
    """

    rows: slice
    start: int
    state: torch.Tensor | None
    window: torch.Tensor | None
    capture: tuple[int, ...]
    end_state: torch.Tensor | None = None
    end_window: torch.Tensor | None = None
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)


class KDAttention(nn.Module):
    """Kimi Delta Attention layer over packed token rows."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        c = config
        H, K, D = c.kda_num_heads, c.kda_head_dim, c.hidden_size
        self.H, self.K, self.eps = H, K, c.rms_norm_eps
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.q_conv1d = ConvWeight(H * K, c.conv_kernel_size)
        self.k_conv1d = ConvWeight(H * K, c.conv_kernel_size)
        self.v_conv1d = ConvWeight(H * K, c.conv_kernel_size)
        self.A_log = nn.Parameter(torch.empty(1, 1, H, 1, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(H * K, dtype=torch.float32))
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_a_proj = nn.Linear(D, K, bias=False)
        self.g_b_proj = nn.Linear(K, H * K, bias=False)
        self.o_norm = NormWeight(K)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def conv_weight(self) -> torch.Tensor:
        """Concatenated q|k|v conv taps ``[3HK, kernel]``."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]

    def forward(self, x: torch.Tensor, seqs: list[KDASeq]) -> torch.Tensor:
        """``x: [N, D]`` packed rows -> ``[N, D]``; fills each ``KDASeq``'s outputs.

        Single-token sequences use the token recurrence; longer ones the chunked
        form aligned to absolute 64-token positions.
        """
        N = x.shape[0]
        H, K = self.H, self.K
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = kda_log_decay(self.f_b_proj(self.f_a_proj(x)).view(N, H, K), self.dt_bias, self.A_log)
        beta = torch.sigmoid(self.b_proj(x).float())
        gate = self.g_b_proj(self.g_a_proj(x)).view(N, H, K)
        conv_w = self.conv_weight()
        outs = []
        for s in seqs:
            n = s.rows.stop - s.rows.start
            y, s.end_window, s.windows = short_conv(mixed[s.rows], conv_w, s.window, s.capture)
            qc, kc, vc = y.view(n, 3, H, K).unbind(1)
            q = l2_normalize(qc) * (K ** -0.5)
            k = l2_normalize(kc)
            args = (q, k, vc.float(), g[s.rows], beta[s.rows])
            if n == 1:
                o, s.end_state = kda_recurrent(*args, initial_state=s.state, use_fla=True)
                s.states = {1: s.end_state.clone()} if s.capture else {}
            else:
                o, s.end_state, s.states = kda_chunked(*args, initial_state=s.state,
                                                       boundaries=s.capture, align_offset=s.start)
            outs.append(o)
        o = torch.cat(outs, dim=0)
        o = gated_rms_norm(o, gate, self.o_norm.weight, self.eps, x.dtype).reshape(N, H * K)
        return self.o_proj(o)
