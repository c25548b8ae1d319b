"""Exactness of one finished request: its logits against a full prefill, and the two tie rules
(docs/how-to/soak.md, "Ties"): a routing tie and an argmax tie are neither checks passed nor
mismatches. :func:`compare_logits` is the one comparison the soak (:func:`check_request`) and a
server's shadow verifier (:mod:`hybridkv.serve.shadow`) share.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable
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


ARGMAX_TIE_TOLERANCE = TOLERANCE
"""Two greedy tokens whose full-prefill logits are within this of each other are an argmax tie.

Measured: soak seed 86626, round 1287, request #21: every logit row within 4e-6 of the full
prefill, yet the first generated token differs (411 against 989), because the full prefill's two
top logits there are equal in float32 (2.8822556 both). Rounding inside :data:`TOLERANCE` may
order such tokens either way, so the same tolerance bounds a tie.
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
        problem: what differs (``None`` when exact or a tie).
        tie: the first differing position when the full prefill's MoE routing there is within
            :data:`ROUTER_TIE_MARGIN` of choosing other experts (``None`` otherwise): a routing tie.
        argmax_tie: the first position whose greedy token differs when every logit row agrees
            within the tolerance and, at each position where the tokens differ, the full
            prefill's logit of the served token is within :data:`ARGMAX_TIE_TOLERANCE` of its
            largest (``None`` otherwise): an argmax tie.
    """

    diff: float
    problem: str | None = None
    tie: int | None = None
    argmax_tie: int | None = None

    @property
    def is_tie(self) -> bool:
        """A routing tie or an argmax tie: neither a check passed nor a mismatch."""
        return self.tie is not None or self.argmax_tie is not None


def compare_logits(full: torch.Tensor, recorded: dict[int, torch.Tensor], reused: int, prompt_len: int,
                   served: list[int], routing_margin: Callable[[int], float], tol: float = TOLERANCE,
                   tie_tol: float = ARGMAX_TIE_TOLERANCE) -> Check:
    """Compare what a request computed with a full prefill of the same ``n`` tokens
    (``prompt + output[:-1]``), with the tie rules.

    Args:
        full: ``float32[n, vocab]`` logits of a no-cache prefill of the ``n`` tokens.
        recorded: position -> ``float32[vocab]`` logits the request computed (positions in tokens).
        reused: prompt tokens the request took from the cache; the computed positions must be
            exactly ``[reused, n)``.
        prompt_len: prompt tokens (``n - prompt_len + 1`` tokens were generated).
        served: the greedy token chosen at each generating position ``prompt_len - 1 .. n - 1``
            (the output of a greedy request; the argmax of its recorded rows for a sampled one).
        routing_margin: position -> the full prefill's MoE routing margin there (score units;
            called only when a row differs, at most once).
        tol: largest accepted absolute logit difference.
        tie_tol: the argmax-tie tolerance (logit units).

    Returns:
        A :class:`Check`. A *problem* when the computed positions are not ``[reused, n)``, a row
        differs by more than ``tol`` (unless the first such row is a routing tie: margin below
        :data:`ROUTER_TIE_MARGIN`), or a greedy token differs where the full prefill's logit of
        the served token is more than ``tie_tol`` below its largest. Greedy tokens that differ
        only at near-equal logits are an argmax tie.

    Raises:
        ValueError: ``served`` does not have one token per generating position.
    """
    n = int(full.shape[0])
    if len(served) != n - prompt_len + 1:
        raise ValueError(f"served has {len(served)} tokens; positions {prompt_len - 1}..{n - 1} need "
                         f"{n - prompt_len + 1}")
    positions = sorted(recorded)
    row_diff = {pos: float((row - full[pos]).abs().max()) for pos, row in recorded.items()}
    diff = max(row_diff.values(), default=0.0)
    if positions != list(range(reused, n)):
        return Check(diff, f"computed positions {positions[:1]}..{positions[-1:]} ({len(positions)}) are not "
                           f"[{reused}, {n})")
    rows = full[prompt_len - 1:]
    greedy = rows.argmax(-1).tolist()
    if diff <= tol and greedy == list(served):
        return Check(diff)
    first = next((p for p in positions if row_diff[p] > tol), None)
    if first is not None:
        margin = float(routing_margin(first))
        if margin < ROUTER_TIE_MARGIN:
            return Check(diff, tie=first)
        worst = max(positions, key=row_diff.__getitem__)
        return Check(diff, f"max abs logit diff {diff:.3g} > {tol:g} at position {worst} (reused {reused}; "
                           f"first at {first}, routing margin there {margin:.2g})")
    differ = [i for i, (a, b) in enumerate(zip(served, greedy)) if a != b]
    gaps = [float(rows[i].max() - rows[i][served[i]]) for i in differ]
    if max(gaps) <= tie_tol:
        return Check(diff, argmax_tie=prompt_len - 1 + differ[0])
    return Check(diff, f"greedy tokens {list(served)} != full prefill {greedy} (first at position "
                       f"{prompt_len - 1 + differ[0]}, largest logit gap {max(gaps):.3g} > {tie_tol:g})")


def check_request(ref: Reference, req: Request, tol: float = TOLERANCE) -> Check:
    """Compare a finished request (recorded logits) with a full prefill of ``prompt + output[:-1]``
    (:func:`compare_logits`, its output as the served greedy tokens).

    A difference is a *problem* when the positions computed are not exactly ``[reused, len)``, a
    logit row differs by more than ``tol``, or the greedy tokens differ. It is a *routing tie*, not
    a problem, when every row before the first differing position ``p`` agrees and the full
    prefill's routing at ``p`` has a margin below :data:`ROUTER_TIE_MARGIN`
    (:meth:`HybridModel.routing_margins`): two exact computations that round differently
    (a chunked prefill continued from a checkpoint against a whole one) can then pick other
    experts at ``p``, with or without a cache. It is an *argmax tie* when every row agrees and the
    greedy tokens differ only where the full prefill's logits of the two tokens are within
    :data:`ARGMAX_TIE_TOLERANCE`.
    """
    ids = np.concatenate([req.prompt, np.asarray(req.output[:-1], dtype=np.int64)])
    full = ref.logits(ids)

    def margin(pos: int) -> float:
        return float(ref.model.routing_margins(torch.from_numpy(ids[:pos + 1]))[pos])

    return compare_logits(full, req.logits, req.reused, req.prompt_len, list(req.output), margin, tol)
