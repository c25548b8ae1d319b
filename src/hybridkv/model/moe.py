"""Feed-forward blocks: dense SwiGLU MLP and the sigmoid-routed MoE with shared experts.

Module and parameter names follow the published Kimi-Linear checkpoints
(``block_sparse_moe.experts.{e}.{w1,w2,w3}``, ``block_sparse_moe.gate.weight``,
``block_sparse_moe.gate.e_score_correction_bias``,
``block_sparse_moe.shared_experts.{gate,up,down}_proj``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.model.config import HybridConfig


def _linear(fan_in: int, fan_out: int) -> nn.Linear:
    return nn.Linear(fan_in, fan_out, bias=False)


class DenseMLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))``; ``x: [N, D] -> [N, D]`` (same dtype)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate)
        self.up_proj = _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One routed expert: ``w2(silu(w1(x)) * w3(x))`` (w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = _linear(hidden, intermediate)
        self.w2 = _linear(intermediate, hidden)
        self.w3 = _linear(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Sigmoid router with score-correction bias and group-limited top-k (fp32).

    Parameters: ``weight [E, D]`` and ``e_score_correction_bias [E]``, both fp32.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_groups = config.num_expert_group
        self.topk_group = config.topk_group
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts, dtype=torch.float32))

    def _choice(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(scores, choice, group_scores)``: sigmoid scores ``float32 [N, E]``, the biased scores
        with experts of unselected groups at ``-inf``, and the group scores ``float32 [N, G]``
        (``None`` without grouping)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        group_scores = None
        if self.num_groups > 1:
            N, E = choice.shape
            grouped = choice.view(N, self.num_groups, E // self.num_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(E // self.num_groups, dim=1), float("-inf"))
        return scores, choice, group_scores

    @staticmethod
    def _gap(values: torch.Tensor, k: int) -> torch.Tensor:
        """Per row, the k-th largest value minus the (k+1)-th (``inf`` when every value is selected)."""
        if k >= values.shape[-1]:
            return torch.full(values.shape[:-1], float("inf"), device=values.device)
        top = values.topk(k + 1, dim=-1).values
        return top[..., k - 1] - top[..., k]

    def decision_margin(self, x: torch.Tensor) -> torch.Tensor:
        """How far each token's routing is from changing: ``float32 [N]``.

        The smallest of two gaps in score units: between the last selected and the first
        unselected group score, and between the last selected and the first unselected
        expert among the selected groups. A margin near float32 rounding (about 1e-6 at
        scores near 1) means two computations of ``x`` that differ only by rounding (a
        chunked prefill against a whole one) may pick different experts; the soak uses
        this to tell such a tie from a cache error.
        """
        _, choice, group_scores = self._choice(x)
        margin = self._gap(choice, self.top_k)
        if group_scores is not None:
            margin = torch.minimum(margin, self._gap(group_scores, self.topk_group))
        return margin

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [N, D]`` -> ``(weights float32 [N, top_k], expert ids int64 [N, top_k])``."""
        scores, choice, _ = self._choice(x)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class SparseMoE(nn.Module):
    """Routed experts plus shared experts; ``x: [N, D] -> [N, D]``.

    Tokens are grouped by expert (stable sort of the flattened choices) and each
    expert that received tokens runs once on its rows.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.top_k = config.num_experts_per_token
        self.experts = nn.ModuleList(Expert(D, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.gate = Router(config)
        self.shared_experts = (DenseMLP(D, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // self.top_k
        w = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        at = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            r = rows[at:at + c]
            y = self.experts[e](x.index_select(0, r)) * w[at:at + c, None]
            out.index_add_(0, r, y.to(out.dtype))
            at += c
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
