"""Exactness of one finished soak request: its logits against a full prefill, and the routing-tie
rule (docs/how-to/soak.md, "Routing ties").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hybridkv._torch import torch
from hybridkv.engine.request import Request

if TYPE_CHECKING:                 # imported where a model is loaded: it imports torch
    from hybridkv.model.model import HybridModel

TOLERANCE = 1e-4
"""Largest accepted absolute logit difference against a full prefill."""

ROUTER_TIE_MARGIN = 1e-5
"""A routing decision closer than this (score units, :meth:`Router.decision_margin`) is a tie.

Measured: a chunked prefill continued from a checkpoint reaches the first MoE router with
inputs within about 2e-6 of a whole prefill's (seed 5, round 100 of the soak), so scores
within 1e-5 of each other may order either way in two exact computations.
"""


class Reference:
    """No-cache forwards of the model, remembered for identical sequences (resends)."""

    def __init__(self, model: HybridModel, keep: int = 64) -> None:
        self.model = model
        self.keep = keep
        self._memo: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.forwards = 0

    def logits(self, ids: np.ndarray) -> torch.Tensor:
        """``float32[len(ids), vocab]`` of a full prefill of ``ids`` (no autograd)."""
        key = ids.tobytes()
        out = self._memo.get(key)
        if out is None:
            with torch.no_grad():
                out = self.model(torch.from_numpy(ids)[None])[0]
            self.forwards += 1
            self._memo[key] = out
            if len(self._memo) > self.keep:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        return out


@dataclass(slots=True)
class Check:
    """The outcome of comparing one finished request with a full prefill.

    Attributes:
        diff: largest absolute logit difference over the computed positions.
        problem: what differs (``None`` when exact or a routing tie).
        tie: the first differing position when the full prefill's MoE routing there is within
            :data:`ROUTER_TIE_MARGIN` of choosing other experts (``None`` otherwise).
    """

    diff: float
    problem: str | None = None
    tie: int | None = None


def check_request(ref: Reference, req: Request, tol: float = TOLERANCE) -> Check:
    """Compare a finished request (recorded logits) with a full prefill of ``prompt + output[:-1]``.

    A difference is a *problem* when the positions computed are not exactly ``[reused, len)``, a
    logit row differs by more than ``tol``, or the greedy tokens differ. It is a *tie*, not a
    problem, when every row before the first differing position ``p`` agrees and the full
    prefill's routing at ``p`` has a margin below :data:`ROUTER_TIE_MARGIN`
    (:meth:`HybridModel.routing_margins`): two exact computations that round differently
    (a chunked prefill continued from a checkpoint against a whole one) can then pick other
    experts at ``p``, with or without a cache.
    """
    ids = np.concatenate([req.prompt, np.asarray(req.output[:-1], dtype=np.int64)])
    full = ref.logits(ids)
    positions = sorted(req.logits)
    row_diff = {pos: float((row - full[pos]).abs().max()) for pos, row in req.logits.items()}
    diff = max(row_diff.values(), default=0.0)
    if positions != list(range(req.reused, len(ids))):
        return Check(diff, f"computed positions {positions[:1]}..{positions[-1:]} ({len(positions)}) are not "
                           f"[{req.reused}, {len(ids)})")
    greedy = full[req.prompt_len - 1:].argmax(-1).tolist()
    if diff <= tol and greedy == req.output:
        return Check(diff)
    first = next((p for p in positions if row_diff[p] > tol), None)
    if first is not None:
        margin = float(ref.model.routing_margins(torch.from_numpy(ids[:first + 1]))[first])
        if margin < ROUTER_TIE_MARGIN:
            return Check(diff, tie=first)
        worst = max(positions, key=row_diff.__getitem__)
        return Check(diff, f"max abs logit diff {diff:.3g} > {tol:g} at position {worst} (reused {req.reused}; "
                           f"first at {first}, routing margin there {margin:.2g})")
    return Check(diff, f"greedy tokens {req.output} != full prefill {greedy}")
