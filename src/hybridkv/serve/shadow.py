"""Online shadow verification: a sampled share of served cache hits recomputed without the cache.

``hybridkv serve --shadow-verify RATE`` samples each request with probability ``RATE`` when it
enters the engine (its logits are then recorded at every computed position: the sampled request
itself pays for the output projection over all its rows, not only the last). When a sampled
request ends having reused cached tokens (``cached_tokens > 0``), a :class:`ShadowCheck` goes on a
bounded queue (:data:`SHADOW_QUEUE` checks and :data:`SHADOW_QUEUE_BYTES` of recorded logits; a
check that finds it full is dropped and counted).
The engine thread works the queue only in its idle slot: when no request runs or waits and no
invalidation is pending, it runs one chunk of :data:`SHADOW_CHUNK_TOKENS` tokens of a no-cache
prefill of ``prompt + output[:-1]`` with the model's own forward (nothing read from or written to
any cache tier), then looks at its inbox again: for Kimi Linear a private KV page and KDA state
(:meth:`HybridModel.forward_paged`); for DeepSeek-V4 the model's own chunked prefill from the
empty state (:meth:`~hybridkv.model.v4.model.V4Model.prefill`: compressed entries, windows and
compressor tails of the chunk before, never the cache's pages or ``swa`` states), whichever
``--swa-recovery`` strategy restored the served hit. So a foreground request that arrives while a
check runs waits at most one chunk's forward; a busy engine never runs a check (they wait or are
dropped).

The last chunk's logits are compared with the request's by
:func:`~hybridkv.replay.soak_check.compare_logits`, the soak's comparison: every computed row
within the family's tolerance (:data:`~hybridkv.replay.soak_check.TOLERANCE` for Kimi Linear,
:data:`V4_TOLERANCE` for DeepSeek-V4) and the same greedy tokens, with the routing
and argmax tie rules (a tie is counted, never quarantined). On a mismatch :func:`quarantine`
removes the entries the request reused and everything derived from them, in every cache group
(Kimi Linear's ``full`` pages and ``kda`` checkpoints; DeepSeek-V4's ``csa``/``hca`` pages and
``swa`` states) and every tier (manifest first in a store), emits their removals on the cache
event feed with their ``group`` (routers drop them), one log line (figures only: no prompt text,
token ids or keys) is written, and serving goes on.

Only on a row that differs by more than the tolerance does a check run one more forward, up to
the first differing position, for the routing margin there (:meth:`HybridModel.routing_margins`;
for DeepSeek-V4 :meth:`~hybridkv.model.v4.model.V4Model.routing_margins`, which also counts the
CSA indexer's top-k).
"""

from __future__ import annotations

import collections
import logging
import random
import time
from dataclasses import dataclass, field

import numpy as np

from hybridkv._torch import torch
from hybridkv.cache.coordinator import EvictedEntry
from hybridkv.engine.build import EngineHandle
from hybridkv.replay.soak_check import TOLERANCE, Check, compare_logits

log = logging.getLogger("hybridkv.serve.shadow")

DEFAULT_SHADOW_RATE = 0.01
"""Share of requests ``hybridkv serve`` samples for shadow verification unless told otherwise."""

SHADOW_QUEUE = 16
"""Sampled hits waiting for a check at most; one more is dropped (``hybridkv_shadow_dropped_total``)."""

SHADOW_QUEUE_BYTES = 256 << 20
"""Bytes of recorded logits the waiting checks hold at most (positions x vocabulary x 4 bytes
each); a sampled hit that would pass it is dropped and counted, as when the queue is full."""

V4_TOLERANCE = TOLERANCE
"""Largest accepted absolute logit difference between a DeepSeek-V4 request's recorded logits and
the check's recomputation (logit units): the soak's 1e-4. Both sides run the float32 model in
different chunkings (the engine's steps over paged entries and a restored boundary state; the
check's :data:`SHADOW_CHUNK_TOKENS`-token chunks from the empty state); on ``v4-tiny`` 64-token
chunks against one whole prefill of 301 tokens differ by at most 2.4e-6
(tests/serve/test_shadow_v4.py checks chunks against the whole forward within this)."""

SHADOW_CHUNK_TOKENS = 64
"""Tokens of the no-cache recomputation run in one idle slot: the most a foreground request that
arrives during a check waits for is one forward of this many tokens."""


@dataclass(slots=True, eq=False)
class ShadowCheck:
    """One served hit waiting for (or under) recomputation (lengths in tokens).

    Attributes:
        ids: ``int64[n]`` the tokens whose logits were computed: ``prompt + output[:-1]``.
        prompt_len: prompt tokens.
        reused: prompt tokens the request took from the cache (> 0).
        logits: position -> ``float32[vocab]`` the request computed, positions ``[reused, n)``.
        served: the greedy token at each generating position (the output of a greedy request,
            the argmax of its recorded rows for a sampled one).
        namespace: the request's namespace digest (the owner of what it cached).
        hashes: chained unit hashes of the prompt under ``namespace`` (one per whole
            ``prefix_match_unit``).
        nbytes: bytes of ``logits``.
        enqueued: ``time.monotonic()`` when the request ended (seconds).
        done: tokens recomputed so far; parts: their logits, ``float32[k, vocab]`` per chunk;
            pool, state: the recomputation's private state at ``done`` (``None`` before the first
            chunk and after the last): Kimi Linear's KV pool and KDA state; DeepSeek-V4's
            :class:`~hybridkv.model.v4.state.V4State` (``pool`` unused).
    """

    ids: np.ndarray
    prompt_len: int
    reused: int
    logits: dict
    served: list[int]
    namespace: bytes | None
    hashes: list[bytes]
    nbytes: int = 0
    enqueued: float = field(default_factory=time.monotonic)
    done: int = 0
    parts: list = field(default_factory=list)
    pool: object = None
    state: object = None


@dataclass(slots=True)
class QuarantineCounts:
    """What :func:`quarantine` removed: ``device_nodes`` (index nodes, one per
    ``prefix_match_unit`` tokens), ``tier_entries`` (tier name -> entries; ``-1``: unreachable)."""

    device_nodes: int = 0
    tier_entries: dict[str, int] = field(default_factory=dict)


def quarantine(handle: EngineHandle, hashes: list[bytes], owner: bytes | None) -> QuarantineCounts:
    """Remove a prompt's cached prefix and everything derived from it, in every tier. Call on the
    engine thread.

    Device: the index node of the prompt's first unit (under ``owner``'s chained hashes) and its
    whole subtree: every entry the request could have reused, and every entry computed on top of
    one (a running reader keeps its private copy, as in :func:`~hybridkv.cache.purge.purge_device`).
    Their removals go to the engine's cache listener (``blocks_removed`` events: routers forget
    them). Host tier and store: the entries at every boundary of the prompt and of the removed
    nodes, manifest first (:meth:`~hybridkv.tiers.base.Tier.purge_chains`: the tier's page entry and
    state entry at each, ``full`` / ``kda`` for Kimi Linear, ``csa-hca`` / ``swa`` for DeepSeek-V4;
    the store tier reports its removals to its observer, the event feed). Prefetches in flight and queued store writes
    land first, so nothing removed is written back afterwards.

    Args:
        handle: the engine and its tiers.
        hashes: chained unit hashes of the prompt (32-byte digests).
        owner: the request namespace digest the entries were cached under (``None``: the engine's).

    Returns:
        The counts (never keys).
    """
    engine = handle.engine
    out = QuarantineCounts()
    if engine.connector is not None:
        engine.connector.drain(timeout_s=30.0)
    if handle.store_tier is not None:
        handle.store_tier.submit(lambda: None).result()
    cache = engine.cache
    unit = engine.config.prefix_match_unit
    chains: dict[tuple[bytes, bytes | None], int] = {(h, owner): (i + 1) * unit for i, h in enumerate(hashes)}
    path = cache.index.walk(hashes[:1])
    if path:
        sub, i = [path[0]], 0
        while i < len(sub):
            sub.extend(sub[i].children.values())
            i += 1
        gone = [EvictedEntry(n.key, None, n.end, n.page, None, n.owner) for n in sub]
        for n in sub:
            chains.setdefault((n.key, n.owner), n.end)
        if engine.listener is not None:
            engine.listener.evicted(gone)
        out.device_nodes = cache.index.remove_subtree(path[0])
    triples = [(h, end, o) for (h, o), end in chains.items()]
    for tier in (handle.host_tier, handle.store_tier):
        if tier is not None:
            out.tier_entries[tier.name] = tier.purge_chains(triples).entries
    return out


class ShadowVerifier:
    """Samples requests, queues their checks and runs them in the engine's idle slot (see the
    module docstring). Everything but :meth:`sample` runs on the engine thread.

    Args:
        handle: the engine (its ``model`` recomputes; it must have one, not a simulation).
        rate: share of requests sampled, in [0, 1] (0: none, 1: every one).
        metrics: counters and the latency histogram (:class:`~hybridkv.serve.metrics.ServeMetrics`),
            or ``None``.
        queue_size: checks waiting at most (default :data:`SHADOW_QUEUE`).
        queue_bytes: bytes of recorded logits the waiting checks hold at most (default
            :data:`SHADOW_QUEUE_BYTES`).
        chunk_tokens: tokens recomputed per idle slot (default :data:`SHADOW_CHUNK_TOKENS`).
        tol: logit tolerance (``None``: the family's, :data:`~hybridkv.replay.soak_check.TOLERANCE`
            for Kimi Linear, :data:`V4_TOLERANCE` for DeepSeek-V4).
        seed: seed of the sampling (``None``: from the system).

    Attributes:
        checks, mismatches, ties, dropped: counts since start (``ties``: routing and argmax).
        chunks: recomputation chunks run since start (one per idle slot used).

    Raises:
        ValueError: ``rate`` outside [0, 1], ``queue_size`` or ``chunk_tokens`` < 1, or a handle
            without a model (a simulation; named).
    """

    def __init__(self, handle: EngineHandle, rate: float, metrics=None, queue_size: int = SHADOW_QUEUE,
                 chunk_tokens: int = SHADOW_CHUNK_TOKENS, tol: float | None = None, seed: int | None = None,
                 queue_bytes: int = SHADOW_QUEUE_BYTES) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"--shadow-verify {rate!r} must be a fraction in [0, 1]")
        if queue_size < 1 or chunk_tokens < 1:
            raise ValueError(f"shadow queue_size={queue_size} and chunk_tokens={chunk_tokens} must be >= 1")
        family = _family(handle)
        if family is None:
            raise ValueError(f"--shadow-verify {rate:g}: shadow verification recomputes with the model's weights "
                             "(this engine is a simulation, without a model); pass --shadow-verify 0")
        self.v4 = family == "v4"
        if tol is None:
            tol = V4_TOLERANCE if self.v4 else TOLERANCE
        self.handle, self.rate, self.metrics = handle, rate, metrics
        self.queue_size, self.chunk_tokens, self.tol = queue_size, chunk_tokens, tol
        self.queue_bytes = queue_bytes
        self._held_bytes = 0                   # recorded logits of the waiting checks
        self._random = random.Random(seed)
        self._queue: collections.deque[ShadowCheck] = collections.deque()
        self.checks = self.mismatches = self.ties = self.dropped = self.chunks = 0

    # -- sampling (any thread) ---------------------------------------------------------
    def sample(self) -> bool:
        """Whether the next request is verified if it turns out to be a hit (probability ``rate``)."""
        return self.rate > 0.0 and (self.rate >= 1.0 or self._random.random() < self.rate)

    # -- the engine thread ---------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """A check is waiting or under way."""
        return bool(self._queue)

    def offer(self, req, greedy: bool) -> bool:
        """Queue a check of the finished request ``req`` (a :class:`~hybridkv.engine.request.Request`
        with recorded logits) if it reused cached tokens; ``greedy``: its tokens were the argmax.
        Returns whether it was queued (``False``: not a hit, or dropped: the queue was full)."""
        if req.reused <= 0 or not req.logits or not req.output:
            return False
        nbytes = sum(row.numel() * row.element_size() for row in req.logits.values())
        if len(self._queue) >= self.queue_size or self._held_bytes + nbytes > self.queue_bytes:
            self.dropped += 1
            if self.metrics is not None:
                self.metrics.shadow_dropped.inc()
            return False
        ids = np.concatenate([req.prompt, np.asarray(req.output[:-1], dtype=np.int64)])
        p = req.prompt_len
        served = (list(req.output) if greedy
                  else [int(req.logits[pos].argmax()) if pos in req.logits else -1 for pos in range(p - 1, len(ids))])
        self._queue.append(ShadowCheck(ids, p, req.reused, dict(req.logits), served, req.namespace,
                                       list(req.hashes or []), nbytes=nbytes))
        self._held_bytes += nbytes
        return True

    def step(self) -> Check | None:
        """Recompute one chunk of the oldest check; after its last chunk, compare, count and (on a
        mismatch) quarantine. Returns the finished check's outcome, or ``None`` (not finished)."""
        if not self._queue:
            return None
        head = self._queue[0]
        try:
            return self._step()
        except Exception as exc:  # noqa: BLE001 - a failed check must not stop serving
            if self._queue and self._queue[0] is head:
                self._pop()
            self.dropped += 1
            if self.metrics is not None:
                self.metrics.shadow_dropped.inc()
            log.error("shadow check failed (%s); dropped it and serving goes on", type(exc).__name__)
            return None

    def _step(self) -> Check | None:
        c = self._queue[0]
        model = self.handle.model
        n = int(c.ids.shape[0])
        end = min(c.done + self.chunk_tokens, n)
        logits, c.state = (recompute_v4_chunk if self.v4 else self._kimi_chunk)(model, c, end)
        self.chunks += 1
        c.parts.append(logits)
        c.done = end
        if c.done < n:
            return None
        self._pop()
        full = torch.cat(c.parts)
        c.parts, c.pool, c.state = [], None, None

        def margin(pos: int) -> float:
            return float(model.routing_margins(torch.from_numpy(c.ids[:pos + 1].copy()))[pos])

        check = compare_logits(full, c.logits, c.reused, c.prompt_len, c.served, margin, self.tol)
        self._count(c, check)
        return check

    @staticmethod
    def _kimi_chunk(model, c: ShadowCheck, end: int):
        """Kimi Linear: positions ``[c.done, end)`` through a private KV page of ``n`` tokens and the
        KDA state at ``c.done``; returns ``(float32[end − done, vocab], state at end)``."""
        if c.pool is None:
            c.pool = model.new_kv_pool(1, int(c.ids.shape[0]))     # one page of n tokens: private, no cache
        from hybridkv.model.state import ForwardRequest
        req = ForwardRequest(torch.from_numpy(c.ids[c.done:end].copy()), c.done, torch.tensor([0]),
                             initial_state=c.state, all_logits=True)
        res = model.forward_paged([req], c.pool)[0]
        return res.logits, res.end_state

    def _pop(self) -> ShadowCheck:
        c = self._queue.popleft()
        self._held_bytes -= c.nbytes
        return c

    def _count(self, c: ShadowCheck, check: Check) -> None:
        self.checks += 1
        m = self.metrics
        if m is not None:
            m.shadow_checks.inc()
            m.shadow_check_seconds.observe(time.monotonic() - c.enqueued)
        if check.is_tie:
            self.ties += 1
            if m is not None:
                m.shadow_ties.labels("routing" if check.tie is not None else "argmax").inc()
            return
        if check.problem is None:
            return
        self.mismatches += 1
        if m is not None:
            m.shadow_mismatches.inc()
        counts = quarantine(self.handle, c.hashes, c.namespace)
        # one line, figures only: no prompt text, token ids or keys
        log.warning("shadow check: mismatch on a hit that reused %d of %d prompt tokens (max |dlogit| %.3g, "
                    "tolerance %g); quarantined %d device entries, tier entries %s", c.reused, c.prompt_len,
                    check.diff, self.tol, counts.device_nodes, counts.tier_entries)


def recompute_v4_chunk(model, c: ShadowCheck, end: int):
    """DeepSeek-V4: positions ``[c.done, end)`` of ``c.ids`` by the model's own chunked prefill
    (:meth:`~hybridkv.model.v4.model.V4Model.prefill`) from ``c.state``, the
    :class:`~hybridkv.model.v4.state.V4State` at ``c.done`` the previous chunk returned (``None``:
    the empty state at 0). Nothing comes from the cache: the compressed entries, windows and
    compressor tails are the recomputation's own, the same under every ``--swa-recovery`` strategy.

    Returns:
        ``(logits float32[end − c.done, vocab], V4State at end)``.
    """
    ids = torch.from_numpy(np.ascontiguousarray(c.ids[c.done:end], dtype=np.int64))
    with torch.no_grad():
        return model.prefill(ids, c.state)


def _family(handle: EngineHandle) -> str | None:
    """The family a check recomputes with: ``"kimi"`` (a Kimi Linear model), ``"v4"`` (a
    DeepSeek-V4 model) or ``None`` (no model: a simulation)."""
    from hybridkv.model.model import HybridModel           # here: they import torch
    from hybridkv.model.v4.model import V4Model
    if isinstance(handle.model, HybridModel):
        return "kimi"
    if isinstance(handle.model, V4Model):
        return "v4"
    return None


def make_verifier(handle: EngineHandle, rate: float | None, metrics=None) -> ShadowVerifier | None:
    """The verifier ``hybridkv serve`` runs: ``rate`` ``None`` means :data:`DEFAULT_SHADOW_RATE` on a
    model it can recompute with (Kimi Linear or DeepSeek-V4; off on a simulation); 0 means off
    (``None`` returned).

    Raises:
        ValueError: ``rate`` outside [0, 1], or > 0 given for a model it cannot recompute with (named).
    """
    if rate is None:
        if _family(handle) is None:
            return None
        rate = DEFAULT_SHADOW_RATE
    if rate == 0.0:
        return None
    return ShadowVerifier(handle, rate, metrics)

