"""The engine loop: admit -> lookup -> schedule -> run -> publish -> decode -> finish (DESIGN §7).

Collaborators are passed in: a backend (real model or simulation) and a
validated :class:`~hybridkv.cache.config.CacheConfig`. The engine never looks
at tensors beyond handing them between the backend and the cache.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hybridkv._torch import torch
from hybridkv.cache.config import CacheConfig
from hybridkv.cache.coordinator import EvictedEntry, HybridCacheCoordinator
from hybridkv.engine.backend import StepItem
from hybridkv.engine.request import REJECT_POOL_TOO_SMALL, Request, Status
from hybridkv.engine.scheduler import HOST, plan_captures, schedule
from hybridkv.tiers.connector import ComputeRate, TierConnector, TimingSink


@dataclass(slots=True)
class EngineStats:
    """Counters over all admitted requests (tokens unless named otherwise)."""

    requests: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    reused_tokens: int = 0
    kv_hit_tokens: int = 0
    requests_with_hit: int = 0
    branch_recompute_tokens: int = 0
    restore_recompute_tokens: int = 0
    checkpoints_created: dict[str, int] = field(default_factory=dict)
    checkpoints_skipped: int = 0
    checkpoints_retired: int = 0
    rejected: int = 0
    cancelled: int = 0
    steps: int = 0


class CacheListener(Protocol):
    """Hears what an engine's cache makes reusable and what it drops, by chained unit hash.

    The engine calls it from its cache seams: after each
    :meth:`~hybridkv.cache.coordinator.HybridCacheCoordinator.publish`, after each install of
    entries loaded from a lower tier (host or store: :meth:`stored` with no retired keys, exactly
    as for computed entries) and from the coordinator's ``on_evict`` callback. Keys are chained hashes of ``[0, end)`` (one per
    ``prefix_match_unit``); they identify prefixes, never carry token ids, and must not be
    logged. :mod:`hybridkv.fleet.events` turns these calls into router events.
    """

    def stored(self, unit_keys: list[bytes], checkpoint_keys: list[bytes], retired_keys: list[bytes],
               checkpoint_boundaries: list[int] = (), first_unit: int | None = None) -> None:
        """Units whose KV is now cached, boundaries whose checkpoint was published, and
        boundaries whose checkpoint was retired (``supersede``), in that order of effect;
        ``checkpoint_boundaries`` gives each published checkpoint's boundary in tokens and
        ``first_unit`` the index in the prompt of the first unit of ``unit_keys`` (consecutive)."""

    def evicted(self, entries: list[EvictedEntry]) -> None:
        """Entries about to be evicted (KV with its subtree, or a checkpoint alone)."""


class Engine:
    """A small continuous-batching engine over the hybrid prefix cache.

    Args:
        config: validated cache / scheduler config.
        backend: :class:`~hybridkv.engine.backend.TorchBackend` or
            :class:`~hybridkv.engine.backend.SimulatedBackend`.
        namespace: namespace digest (:meth:`CacheIdentity.digest`).
        tiers: lower tiers (:class:`~hybridkv.tiers.host.HostTier`,
            :class:`~hybridkv.tiers.store_tier.StoreTier`), nearest first.
        prefetch: start store loads for waiting requests in the background
            (:meth:`prefetch`); ``False`` loads only at admission.
        listener: told of every publication, install from a lower tier and eviction
            (:class:`CacheListener`); ``None``: nobody listens.

    Raises:
        ValueError: ``config.host_interval`` is set but no tier writes checkpoints through (its
            captures would go nowhere).

    Attributes:
        compute_rate: the measured compute seconds per token (every step noted; shared with the
            connector, which weighs loads against it).
        timings: told each lookup, load, transfer and install time and each request's saved
            prefill seconds (:class:`~hybridkv.tiers.connector.TimingSink`; set with
            :meth:`set_timings`), or ``None``.
    """

    def __init__(self, config: CacheConfig, backend, namespace: bytes, tiers=(), prefetch: bool = True,
                 listener: CacheListener | None = None) -> None:
        tiers = list(tiers)
        if config.host_interval and not any(t.writes_through(t.state_group) for t in tiers):
            raise ValueError(f"host_interval={config.host_interval} captures checkpoints for lower tiers that "
                             "write checkpoints through, and this engine has none (it needs a host tier)")
        self.config = config
        self.prefetch_enabled = prefetch
        self.backend = backend
        pool = backend.new_checkpoint_pool(config.num_checkpoint_slots, config.eviction)
        self._writes_back = any(t.write_back for t in tiers)
        self.listener = listener
        self.cache = HybridCacheCoordinator(config, namespace, pool,
                                            page_bytes=backend.page_bytes,
                                            copy_page=backend.copy_page,
                                            on_evict=self._on_evict if self._writes_back or listener else None,
                                            binding=backend.cache_binding(), family=backend.family)
        self.cache.lower_tiers = self._writes_back
        self.compute_rate = ComputeRate()
        self.timings: TimingSink | None = None
        self.connector = TierConnector(self.cache, backend, tiers, compute=self.compute_rate) if tiers else None
        if self.connector is not None and listener is not None:
            self.connector.on_install = self._tell_installed     # installs are announced like computed entries
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.detached: list[Request] = []     # decoding outside the schedule, pages held (:meth:`detach`)
        self.stats = EngineStats(checkpoints_created={n: 0 for n in config.policy.names()})

    def set_timings(self, sink: TimingSink | None) -> None:
        """Report operation times to ``sink`` from now on (the engine's and its connector's);
        ``None`` stops it. See :data:`~hybridkv.tiers.connector.TIMING_KINDS`."""
        self.timings = sink
        if self.connector is not None:
            self.connector.timings = sink

    # -- requests --------------------------------------------------------
    def add_request(self, req: Request) -> Request:
        """Queue a request after validating it.

        Raises:
            ValueError: naming the request and the value: already submitted,
                empty or non-integer prompt, a token id outside the vocabulary,
                ``max_output_tokens`` not an integer >= 1, a namespace that is
                not bytes, a hint that is not a positive multiple of
                ``prefix_match_unit``, or ``hashes`` that are not one per whole unit
                of the prompt. Nothing is queued then.
        """
        rid = req.request_id
        if req.status != Status.WAITING or req.alloc is not None or req in self.waiting:
            raise ValueError(f"request {rid}: already submitted (status {req.status.value})")
        prompt = np.asarray(req.prompt)
        if prompt.ndim != 1 or prompt.shape[0] == 0:
            raise ValueError(f"request {rid}: prompt must be a non-empty 1-D id list, got shape {prompt.shape}")
        if prompt.dtype.kind not in "iu":
            raise ValueError(f"request {rid}: token ids must be integers, got dtype {prompt.dtype}")
        vocab = getattr(self.backend, "vocab_size", None)
        lo, hi = int(prompt.min()), int(prompt.max())
        if lo < 0 or (vocab is not None and hi >= vocab):
            bad = lo if lo < 0 else hi
            raise ValueError(f"request {rid}: token id {bad} outside [0, {vocab if vocab is not None else 'inf'})")
        if prompt.dtype != np.int64 or prompt.flags.writeable:
            prompt = prompt.astype(np.int64)  # a private copy: the caller may change its array later
        req.prompt = prompt                   # a read-only int64 array is kept (a simulated replay's
        #                                       placeholder prompts: views of one zero buffer)
        if not isinstance(req.max_output_tokens, int) or isinstance(req.max_output_tokens, bool) \
                or req.max_output_tokens < 1:
            raise ValueError(f"request {rid}: max_output_tokens={req.max_output_tokens!r} must be an integer >= 1")
        if req.namespace is not None and not isinstance(req.namespace, bytes):
            raise ValueError(f"request {rid}: namespace must be a digest (bytes), got {type(req.namespace).__name__}")
        g = self.config.prefix_match_unit
        for h in req.hints:
            if not isinstance(h, (int, np.integer)) or isinstance(h, bool) or h <= 0 or h % g:
                raise ValueError(f"request {rid}: hint {h!r} is not a positive multiple of {g}")
        req.hints = tuple(int(h) for h in req.hints)
        if req.hashes is not None and len(req.hashes) != prompt.shape[0] // g:
            raise ValueError(f"request {rid}: {len(req.hashes)} unit hashes given for a prompt of "
                             f"{prompt.shape[0]} tokens ({prompt.shape[0] // g} whole units of {g})")
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Cancel at any point; every reference the request holds is released."""
        if req.done:
            return
        if req.status == Status.WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.cache.release(req.alloc)
        self._forget(req)
        req.status = Status.CANCELLED
        self.stats.cancelled += 1

    def finish(self, req: Request) -> None:
        """Finish a decoding request before ``max_output_tokens`` (a stop sequence was met);
        its references are released and it counts as finished, not cancelled.

        Raises:
            ValueError: the request is not decoding (naming its status).
        """
        if req.status != Status.DECODE:
            raise ValueError(f"request {req.request_id}: only a decoding request can finish early, "
                             f"status is {req.status.value}")
        self._finish(req)

    def detach(self, req: Request) -> None:
        """Take a decoding request out of the schedule while it keeps its pages: the caller
        models the rest of its decode (the fleet simulator) and ends it with
        :meth:`finish_detached`. Admission still counts its pages as ones that will be freed.

        Raises:
            ValueError: the request is not decoding (naming its status).
        """
        if req.status != Status.DECODE:
            raise ValueError(f"request {req.request_id}: only a decoding request can be detached, "
                             f"status is {req.status.value}")
        self.running.remove(req)
        self.detached.append(req)

    def finish_detached(self, req: Request) -> None:
        """End a request :meth:`detach` took out: its pages are released, it counts as finished.

        Raises:
            ValueError: the request was not detached (naming it).
        """
        if req not in self.detached:
            raise ValueError(f"request {req.request_id} is not detached")
        self.detached.remove(req)
        self.cache.release(req.alloc)
        self._forget(req)
        req.status = Status.FINISHED

    @property
    def has_work(self) -> bool:
        """Requests are waiting or running."""
        return bool(self.waiting or self.running)

    def run_until_done(self) -> None:
        """Step until every queued request is finished, cancelled or rejected."""
        while self.has_work:
            self.step()

    # -- the step --------------------------------------------------------
    def _forget(self, req: Request) -> None:
        if self.connector is not None:
            self.connector.forget(req)

    def _on_evict(self, evicted) -> None:
        """The coordinator's eviction callback: tell the listener, hand the entries to the write-back tiers."""
        if self.listener is not None:
            self.listener.evicted(evicted)
        if self._writes_back:
            self.connector.write_back(evicted)

    def _tell_stored(self, r: Request, start: int, end: int, published) -> None:
        """Tell the listener what one prefill chunk ``[start, end)`` of ``r`` published."""
        g, hashes = self.config.prefix_match_unit, r.match.hashes
        created = [b for b, _ in published.created]
        self.listener.stored(hashes[start // g: min(len(hashes), end // g)],
                             [hashes[b // g - 1] for b in created],
                             [hashes[b // g - 1] for b in published.retired], created, start // g)

    def _tell_installed(self, hashes: list[bytes], kv_start: int, kv_end: int, state: int) -> None:
        """Tell the listener what one install from a lower tier put on the device (the connector's
        ``on_install``): the units of ``[kv_start, kv_end)`` and the checkpoint at ``state``
        (tokens; 0: none), as :meth:`_tell_stored` tells what a prefill computed, so a router's
        view holds what the instance can serve whether it computed or loaded it."""
        g = self.config.prefix_match_unit
        self.listener.stored(hashes[kv_start // g: kv_end // g], [hashes[state // g - 1]] if state else [], [],
                             [state] if state else [], kv_start // g)

    def prefetch(self) -> None:
        """Start background loads from lower tiers for the next ``max_num_seqs`` waiting requests
        (:meth:`TierConnector.prefetch`, once per request); they overlap this step's compute."""
        if self.connector is None or not self.prefetch_enabled:
            return
        for req in itertools.islice(self.waiting, self.config.max_num_seqs):
            self.connector.prefetch(req, req.prompt, req.namespace, hashes=req.hashes)

    def admit(self) -> None:
        """Admit waiting requests in order while sequences and pages allow (lookup + acquire)."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            t = req.prompt_len
            if req.hashes is None:
                req.hashes = self.cache.hash_prompt(req.prompt, req.namespace)
            t0 = time.perf_counter()
            match = self.cache.lookup(req.prompt, req.namespace, hashes=req.hashes)
            if self.timings is not None:
                self.timings.observe("lookup", time.perf_counter() - t0, "device")
            busy = self.running or self.detached     # requests that will free pages
            if busy and not self.cache.could_fit(match, t + req.max_output_tokens - 1):
                req.admission_failures += 1
                return                        # wait for pages; loading now would be evicted before it ran
            remote_branch, fetched = None, None
            if self.connector is not None:
                fetched = self.connector.fetch(req, req.prompt, match, req.namespace)
                match, remote_branch = fetched.match, fetched.missing_branching_boundary
            need = t + req.max_output_tokens - 1
            alloc = self.cache.acquire(match, need)
            if alloc is None and not busy:              # nothing will free pages: reuse less before refusing
                for shorter in self.cache.shorter_hits(match):
                    alloc = self.cache.acquire(shorter, need)
                    if alloc is not None:
                        match = shorter
                        break
            if alloc is None:
                req.admission_failures += 1
                if busy:
                    return                    # wait for running requests to free pages
                self.waiting.popleft()
                self._forget(req)
                req.status = Status.REJECTED
                req.reject_reason = (f"needs {-(-need // self.config.block_size)} pages "
                                     f"({need} tokens of KV) even without reuse; the pool has "
                                     f"{self.config.num_kv_pages}")
                req.reject_code = REJECT_POOL_TOO_SMALL
                self.stats.rejected += 1
                continue
            self.waiting.popleft()
            if match.restart < match.hit:     # the hit's boundary state is rebuilt from the restart point
                alloc.state = self.backend.rebuild(req.prompt, alloc.block_table, match.restart, match.hit,
                                                   alloc.state)
                self.stats.restore_recompute_tokens += match.hit - match.restart
            if self.connector is not None:             # each tier credited with what it supplied of the hit
                self.connector.admitted(req, match, t, fetched.credit(match.hit) if fetched else {})
            req.match, req.alloc, req.computed = match, alloc, match.hit
            req.capture = plan_captures(self.config, match, t, req.hints, remote_branch)
            req.status = Status.PREFILL
            self.running.append(req)
            s = self.stats
            s.requests += 1
            s.prompt_tokens += t
            s.reused_tokens += match.hit
            s.computed_prompt_tokens += t - match.hit
            s.kv_hit_tokens += match.kv_hit
            s.requests_with_hit += match.hit > 0
            s.branch_recompute_tokens += match.kv_hit - match.hit
            per_token = self.compute_rate.seconds_per_token
            if self.timings is not None and match.hit > 0 and per_token is not None:
                self.timings.observe("saved_prefill", match.hit * per_token)

    def step(self) -> list[Request]:
        """Run one engine step; returns the requests that finished in it."""
        self.admit()
        self.prefetch()                       # loads for the next waiting requests overlap this step
        chunks = schedule(self.config, self.running)
        if not chunks:
            return []
        mechanism = self.config.mechanism
        tensors = self.backend.tensors          # else the ids stay numpy (a simulation imports no torch)
        items = []
        for c in chunks:
            r = c.request
            if r.status == Status.DECODE:
                ids = (torch.tensor([r.output[-1]], dtype=torch.long) if tensors
                       else np.array([r.output[-1]], dtype=np.int64))
            else:
                ids = r.prompt[c.start:c.end]
                if tensors:
                    # torch wants a writable array: a read-only prompt (kept uncopied) is copied per chunk
                    ids = torch.from_numpy(ids if ids.flags.writeable else ids.copy())
            items.append(StepItem(ids, c.start, r.alloc.block_table, r.alloc.state,
                                  mechanism.backend_captures(c.capture), r.record_logits))
        t0 = time.perf_counter()
        outs = self.backend.run(items)
        # the rate a load is weighed against, and that prices a hit's saved prefill
        self.compute_rate.note(sum(len(it.token_ids) for it in items), time.perf_counter() - t0)
        self.stats.steps += 1
        finished = []
        for c, out in zip(chunks, outs):
            r = c.request
            r.alloc.state = out.end_state
            if r.record_logits and out.logits is not None:
                for i, pos in enumerate(range(c.end - out.logits.shape[0], c.end)):
                    r.logits[pos] = out.logits[i]
            if r.status == Status.PREFILL:
                r.computed = c.end
                if r.publish:                 # else its scope was invalidated: it caches nothing
                    self._publish(r, c, out)
                if c.end < r.prompt_len:
                    continue
                r.status = Status.DECODE
            sample = r.sampler is not None and out.logits is not None
            r.output.append(int(r.sampler(out.logits[-1])) if sample else out.next_token)
            if len(r.output) >= r.max_output_tokens:
                self._finish(r)
                finished.append(r)
        return finished

    def _publish(self, r: Request, c, out) -> None:
        """Publish what prefill chunk ``c`` of ``r`` computed (``out``: its step output): units and
        checkpoints to the device index, the listener, and the write-through tiers."""
        made = {b: self.config.mechanism.checkpoint(b, c.end, out.end_state, out.checkpoints) for b in c.capture}
        published = self.cache.publish(r.alloc, r.match.hashes, c.end,
                                       {b: (ckpt, r.capture[b]) for b, ckpt in made.items()
                                        if r.capture[b] != HOST})       # host-only captures: tiers
        for _, label in published.created:
            self.stats.checkpoints_created[label] = self.stats.checkpoints_created.get(label, 0) + 1
        self.stats.checkpoints_skipped += len(published.skipped)
        self.stats.checkpoints_retired += published.superseded
        if self.listener is not None:
            self._tell_stored(r, c.start, c.end, published)
        if self.connector is not None:
            self.connector.upload(r, r.alloc, c.end, made)

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req.alloc)
        self._forget(req)
        req.status = Status.FINISHED
