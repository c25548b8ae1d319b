"""Request state inside the engine."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybridkv._torch import torch
from hybridkv.cache.coordinator import Allocation, MatchResult


REJECT_POOL_TOO_SMALL = "needs more KV pages than the pool has, even without reuse"
""":attr:`Request.reject_code` of a request whose prompt plus output does not fit the engine's
whole KV page pool (``num_kv_pages``)."""


class Status(enum.Enum):
    """Lifecycle: WAITING -> PREFILL -> DECODE -> FINISHED, or CANCELLED / REJECTED."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


@dataclass(slots=True, eq=False)
class Request:
    """One generation request.

    Attributes:
        request_id: caller's id (never logged together with tokens).
        prompt: ``int64[T]`` prompt token ids.
        max_output_tokens: tokens to generate greedily (>= 1).
        hints: caller-supplied checkpoint boundaries (tokens; policy ``hint``).
        record_logits: keep logits of every computed position (verification).
        status: lifecycle state (owned by the engine).
        match: lookup result at admission.
        alloc: pages and working state while running.
        computed: prompt tokens whose state is in ``alloc`` (starts at the hit).
        output: generated token ids.
        capture: boundary -> policy name, planned at admission.
        logits: position -> ``float32[vocab]`` when ``record_logits``.
        reject_reason: why admission failed, with this request's figures (pages, tokens).
        reject_code: the kind of refusal as a fixed text (e.g. :data:`REJECT_POOL_TOO_SMALL`), a
            key for counting refusals by kind; ``""`` until refused.
        admission_failures: admission attempts that found no room.
        namespace: namespace digest of this request (tenant / adapter); ``None``
            means the engine's.
        sampler: picks each generated token from the last position's logits
            (``float32[vocab]`` -> token id); ``None``: greedy (the backend's argmax).
        hashes: chained unit hashes of the prompt (32-byte digests, one per whole
            ``prefix_match_unit``), from the engine cache's ``hash_prompt`` or ``chain_units``
            under the request's namespace; ``None``: the engine hashes the prompt at its first
            lookup and keeps them here (so a request is hashed once however often it is looked up).
        publish: ``False``: the request publishes nothing it computes (no index entries, no
            checkpoints, no tier writes, no cache events) and still reads its hit and generates
            as before; a server sets it for a request whose scope was invalidated while it was
            queued or running, so nothing of that scope is cached after the invalidation.
    """

    request_id: str
    prompt: np.ndarray
    max_output_tokens: int = 1
    hints: tuple[int, ...] = ()
    record_logits: bool = False
    status: Status = Status.WAITING
    match: MatchResult | None = None
    alloc: Allocation | None = None
    computed: int = 0
    output: list[int] = field(default_factory=list)
    capture: dict[int, str] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    reject_reason: str = ""
    reject_code: str = ""
    namespace: bytes | None = None
    admission_failures: int = 0
    sampler: Callable[[torch.Tensor], int] | None = None
    hashes: list[bytes] | None = field(default=None, repr=False)
    publish: bool = True

    @property
    def prompt_len(self) -> int:
        """``T`` in tokens."""
        return int(self.prompt.shape[0])

    @property
    def reused(self) -> int:
        """Tokens taken from the cache (the joint hit)."""
        return self.match.hit if self.match is not None else 0

    @property
    def done(self) -> bool:
        """Finished, cancelled or rejected."""
        return self.status in (Status.FINISHED, Status.CANCELLED, Status.REJECTED)

    @property
    def position(self) -> int:
        """Next position to compute (prompt, then generated tokens)."""
        if self.status == Status.DECODE:
            return self.prompt_len + len(self.output) - 1
        return self.computed
