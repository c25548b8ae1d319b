"""Step planning: which tokens of which request run in the next step (DESIGN §3, §7).

The scheduler never branches on a model type; it asks the request's capture
plan (made from the coordinator's match and the policy) where steps must end.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.cache.config import CacheConfig
from hybridkv.cache.coordinator import LEAD, MatchResult
from hybridkv.engine.request import Request, Status

HOST = "host"
"""Label of a capture for the lower tiers only (``CacheConfig.host_interval``): never published
on the device."""


@dataclass(slots=True)
class Chunk:
    """Tokens ``[start, end)`` of ``request`` in this step; ``capture`` in ``(start, end]``."""

    request: Request
    start: int
    end: int
    capture: list[int]


def plan_captures(config: CacheConfig, match: MatchResult, prompt_len: int,
                  hints: tuple[int, ...] = (), remote_branch: int | None = None) -> dict[int, str]:
    """Checkpoint boundaries to create for one request, boundary -> policy name.

    Only unit-aligned boundaries in ``(match.hit, prompt_len]`` qualify. ``tail``
    claims ``T`` aligned down to ``tail_alignment`` (a continuation reuses it) and
    ``T - 1`` aligned down (an identical resend reuses at most ``T - 1``,
    :func:`~hybridkv.cache.groups.reuse_cap`): one boundary unless ``T`` is itself
    aligned, then two. When
    two policies claim one boundary, the first of branch, tail, interval, hint
    is credited. ``remote_branch`` is a lower tier's missing branching
    boundary; it counts as a branch boundary. ``config.host_interval`` boundaries no policy
    claimed are labelled :data:`HOST`: captured for the write-through lower tiers only.
    """
    g, p = config.prefix_match_unit, config.policy
    lo, hi = match.hit, prompt_len
    plan: dict[int, str] = {}

    def claim(b: int, name: str) -> None:
        if lo < b <= hi and b % g == 0 and b not in plan:
            plan[b] = name

    if p.branch:
        for b in (match.branching_boundary, remote_branch):
            if b is not None:
                claim(b, "branch")
    if p.tail:
        a = config.tail_alignment
        claim(hi // a * a, "tail")           # what a continuation of the prompt reuses
        claim((hi - 1) // a * a, "tail")     # what an identical resend reuses (reuse stops at T - 1)
    if p.interval:
        for b in range(p.interval, hi + 1, p.interval):
            claim(b, "interval")
    if p.hint:
        for b in hints:
            claim(b, "hint")
    if match.lead is not None:           # the utility order's lead checkpoint (MatchResult.lead)
        claim(match.lead, LEAD)
    if config.host_interval:
        for b in range(config.host_interval, hi + 1, config.host_interval):
            claim(b, HOST)
    return plan


def schedule(config: CacheConfig, running: list[Request]) -> list[Chunk]:
    """Chunks for one step within ``max_num_batched_tokens``.

    Decoding requests get one token each first; prefills follow in admission
    order. Where a prefill chunk ends is the mechanism's choice
    (:meth:`~hybridkv.cache.config.Mechanism.chunk`): ``SPLIT`` ends it at the next
    planned capture boundary, ``EXTRACT`` runs it to the budget.
    """
    budget = config.max_num_batched_tokens
    chunks: list[Chunk] = []
    for r in running:
        if r.status == Status.DECODE and budget > 0:
            pos = r.position
            chunks.append(Chunk(r, pos, pos + 1, []))
            budget -= 1
    for r in running:
        if r.status != Status.PREFILL or budget <= 0:
            continue
        start = r.computed
        end = min(r.prompt_len, start + budget)
        end, inside = config.mechanism.chunk(start, end, sorted(b for b in r.capture if start < b <= end))
        chunks.append(Chunk(r, start, end, inside))
        budget -= end - start
    return chunks
