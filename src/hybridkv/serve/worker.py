"""The engine thread: one background thread owns the engine; the server talks to it through a
thread-safe inbox and hears back through a per-job callback.

Every engine object (requests, cache, tiers, the :class:`NamespaceLedger`) is touched by this
thread only. The server thread calls :meth:`EngineWorker.submit`, :meth:`~EngineWorker.cancel`
and :meth:`~EngineWorker.invalidate`, which only enqueue; the worker calls each job's ``emit``
from its own thread with events:

* ``("token", token_id)`` for every generated token, in order;
* ``("done", finish_reason)`` once (``"length"`` or ``"stop"``), after the last token;
* ``("error", message)`` once, when the engine rejected the request.

An invalidation runs between two engine steps, without waiting for running requests: the purge
detaches what a running request reads (it finishes from its own pages, untorn), and every job of
the purged scope already submitted stops publishing (``Request.publish``), so nothing of that
scope is cached once the invalidation has answered. Other jobs run and enter as before.

Admission: :meth:`EngineWorker.submit_all` accepts jobs while those without a running slot stay
within ``max_waiting``: up to the free slots (``max_num_seqs`` less the admitted jobs) plus
``max_waiting`` at once.

With a shadow verifier (:mod:`hybridkv.serve.shadow`) the thread also recomputes sampled hits
without the cache, one chunk at a time, only when it has no request to run and none in its inbox.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from hybridkv.engine.build import EngineHandle
from hybridkv.engine.request import Request, Status
from hybridkv.serve.purge import NamespaceLedger, PurgeCounts, purge

log = logging.getLogger("hybridkv.serve.worker")


@dataclass(slots=True, eq=False)
class Job:
    """One prompt to generate for (lengths in tokens).

    Attributes:
        prompt: ``int64[T]`` token ids, already validated against the vocabulary.
        max_tokens: tokens to generate at most (>= 1).
        namespace: the request's namespace digest (tenant, salt, tokenizer, model).
        owner: ``(tenant, salt, adapter, adapter_version)`` the namespace was made from (for
            invalidation; ``""``: none).
        emit: called on the engine thread with each event (see the module docstring).
        hints: checkpoint boundaries (multiples of ``prefix_match_unit``).
        sampler: ``float32[vocab]`` logits -> token id; ``None``: greedy.
        stop: called on the engine thread with each generated id, in order (once per id);
            ``True`` ends the job with ``finish_reason="stop"`` (EOS, a stop string).
        submitted: ``time.monotonic()`` at submission (seconds).
        request: the engine's request once submitted (engine thread only).
    """

    prompt: np.ndarray
    max_tokens: int
    namespace: bytes
    owner: tuple[str, ...]
    emit: Callable[[tuple], None]
    hints: tuple[int, ...] = ()
    sampler: Callable | None = None
    stop: Callable[[int], bool] | None = None
    submitted: float = field(default_factory=time.monotonic)
    request: Request | None = None
    sent: int = 0
    admitted: bool = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens reused from the cache (0 before admission)."""
        return self.request.reused if self.request is not None else 0


@dataclass(slots=True)
class JobStats:
    """What the worker measured of one finished job (seconds, tokens), handed to ``on_finish``."""

    prompt_tokens: int
    cached_tokens: int
    queue_seconds: float


class EngineWorker:
    """Runs ``handle.engine`` on one background thread.

    Args:
        handle: the engine and its tiers (:func:`~hybridkv.engine.build.build_engine`).
        max_waiting: jobs submitted that :meth:`submit` accepts beyond the free running slots
            (``max_num_seqs`` of the engine's config less the jobs admitted and not ended); beyond
            it :meth:`submit` returns ``False`` (the server answers 503).
        on_step: called on the engine thread after every step with its duration (seconds).
        on_admit: called on the engine thread with :class:`JobStats` when a job is admitted.
        on_purge: called on the engine thread after each round of invalidations, before the
            engine steps again (a server starts its event feed's new epoch there).
        shadow: the :class:`~hybridkv.serve.shadow.ShadowVerifier` (``None``: no shadow
            verification): it samples jobs as they enter, takes the sampled hits as they finish and
            runs one chunk of a check whenever the engine has nothing else to do.
    """

    def __init__(self, handle: EngineHandle, max_waiting: int = 64,
                 on_step: Callable[[float], None] | None = None,
                 on_admit: Callable[[JobStats], None] | None = None,
                 on_purge: Callable[[], None] | None = None, shadow=None) -> None:
        self.handle = handle
        self.shadow = shadow
        self.max_waiting = max_waiting
        self.ledger = NamespaceLedger()
        self._on_step = on_step
        self._on_admit = on_admit
        self._on_purge = on_purge
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0                     # jobs submitted, not yet admitted (guarded by _lock)
        self._active: set[Job] = set()        # jobs submitted and not yet ended (guarded by _lock)
        self._jobs: list[Job] = []            # engine thread: jobs in the engine
        self._purges: list[tuple[Future, tuple]] = []
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._closed = False                  # the engine thread has ended (guarded by _lock)
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self.error: BaseException | None = None

    # -- the server's side (any thread) ------------------------------------------
    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    @property
    def max_running(self) -> int:
        """Running slots: the engine's ``max_num_seqs`` (requests)."""
        return self.handle.engine.config.max_num_seqs

    @property
    def queue_depth(self) -> int:
        """Jobs submitted and not yet admitted by the engine."""
        return self._waiting

    @property
    def alive(self) -> bool:
        """The engine thread runs and has not failed."""
        return self._thread.is_alive() and self.error is None

    def submit(self, job: Job) -> bool:
        """Queue ``job``; ``False`` (nothing queued) when ``max_waiting`` jobs already wait beyond the
        free running slots. Once the engine thread has ended, ``job`` gets an ``("error", ...)``
        event instead."""
        return self.submit_all([job])

    def submit_all(self, jobs: list[Job]) -> bool:
        """Queue every job of ``jobs`` (one request's prompts), or none: ``False`` when the jobs
        not yet admitted would then exceed the free running slots plus ``max_waiting`` (a job
        counts as waiting only while no slot is free for it). All or none, so a refused batch never
        leaves jobs to cancel (a refusal is not a cancellation). Once the engine thread has ended,
        each job gets an ``("error", ...)`` event instead."""
        with self._lock:
            if not self._closed:
                running = len(self._active) - self._waiting           # admitted, not ended
                if self._waiting + len(jobs) > self.max_waiting + max(self.max_running - running, 0):
                    return False
                self._waiting += len(jobs)
                self._active.update(jobs)
        for job in jobs:
            self._put("submit", job)
        return True

    def load(self, tenant: str | None = None) -> dict[str, int]:
        """What this worker has to do, read without waiting for the engine thread.

        Args:
            tenant: count only the jobs of this tenant (``None``: every job, whoever sent it).

        Returns:
            ``num_reqs``: jobs submitted and not ended (requests); ``num_waiting_reqs``: those not
            yet admitted by the engine; ``num_tokens``: prompt tokens of every such job plus the
            tokens generated so far by the admitted ones (tokens); ``num_waiting_tokens``: prompt
            tokens of the jobs not yet admitted; ``num_decode_tokens``: tokens the jobs may still
            generate (``max_tokens`` less those sent; a stop may end them sooner). A job's figures
            may lag the engine thread by one step.
        """
        with self._lock:
            jobs = list(self._active)
        if tenant is not None:
            jobs = [j for j in jobs if j.owner[0] == tenant]
        waiting = [j for j in jobs if not j.admitted]
        tokens = sum(len(j.prompt) + j.sent for j in jobs)
        return {"num_reqs": len(jobs), "num_waiting_reqs": len(waiting), "num_tokens": tokens,
                "num_waiting_tokens": sum(len(j.prompt) for j in waiting),
                "num_decode_tokens": sum(max(j.max_tokens - j.sent, 0) for j in jobs)}

    def cancel(self, job: Job) -> None:
        """Cancel ``job`` wherever it is; its cache references are released."""
        self._put("cancel", job)

    def invalidate(self, tenant: str | None, salt: str | None, everything: bool,
                   abi_version: int | None = None, known: frozenset[bytes] = frozenset(),
                   adapter: str | None = None, adapter_version: str | None = None) -> Future:
        """Purge entries (see :func:`~hybridkv.serve.purge.purge`; ``known``: namespaces of the scope
        the caller computed, selected whether or not the ledger saw them; ``adapter``,
        ``adapter_version``: narrow the scope to that adapter, ``None``: any); a future of
        :class:`PurgeCounts` (a ``RuntimeError`` once the engine thread has ended)."""
        fut: Future = Future()
        self._put("purge", (fut, (tenant, salt, everything, abi_version, known, adapter, adapter_version)))
        return fut

    def call(self, fn: Callable[[EngineHandle], object]) -> Future:
        """Run ``fn(handle)`` on the engine thread between steps (a consistent read); a future (a
        ``RuntimeError`` once the engine thread has ended)."""
        fut: Future = Future()
        self._put("call", (fut, fn))
        return fut

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (running jobs end with an error event) and wait up to ``timeout_s``."""
        self._stop.set()
        self._put("wake", None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        engine = self.handle.engine
        try:
            while not self._stop.is_set():
                shadow = self.shadow is not None and self.shadow.pending
                self._drain_inbox(block=not engine.has_work and not self._purges and not shadow)
                if self._purges:
                    self._run_purges()        # between two steps: running requests are not waited for
                if engine.has_work:
                    t0 = time.perf_counter()
                    engine.step()
                    if self._on_step is not None:
                        self._on_step(time.perf_counter() - t0)
                    self._deliver()
                elif shadow and not self._purges and self._inbox.empty():
                    self.shadow.step()        # the idle slot: one chunk, then the inbox again
        except BaseException as exc:          # reported to every waiting client
            self.error = exc
            log.exception("engine thread failed")
        finally:
            message = "the engine stopped" if self.error is None else f"engine failure: {self.error}"
            with self._lock:                  # nothing enters the inbox from now on (see _put)
                self._closed = True
            while True:
                try:
                    self._refuse(*self._inbox.get_nowait(), message)
                except queue.Empty:
                    break
            self._abort_all(message)

    def _put(self, kind: str, payload) -> None:
        """Hand an item to the engine thread, or refuse it at once if that thread has ended (so no
        caller waits on an inbox nobody reads)."""
        with self._lock:
            if not self._closed:
                self._inbox.put((kind, payload))
                return
        self._refuse(kind, payload, "the engine stopped" if self.error is None else f"engine failure: {self.error}")

    def _refuse(self, kind: str, payload, message: str) -> None:
        if kind == "submit":
            self._retire(payload)
            payload.emit(("error", message))
        elif kind in ("purge", "call"):
            payload[0].set_exception(RuntimeError(message))

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload) -> None:
        if kind == "submit":
            if self._purges:                  # queued after an invalidation: runs after it
                self._run_purges()
            self._enter(payload)
        elif kind == "cancel":
            self._cancel(payload)
        elif kind == "purge":
            self._purges.append(payload)
        elif kind == "call":
            fut, fn = payload
            try:
                fut.set_result(fn(self.handle))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def _enter(self, job: Job) -> None:
        job.request = Request(f"s{next(self._ids)}", job.prompt, job.max_tokens, hints=job.hints,
                              namespace=job.namespace, sampler=job.sampler,
                              record_logits=self.shadow is not None and self.shadow.sample())
        try:
            self.handle.engine.add_request(job.request)
        except ValueError as exc:
            self._admitted(job)
            self._retire(job)
            job.emit(("error", str(exc)))
            return
        self._jobs.append(job)

    def _retire(self, job: Job) -> None:
        """``job`` has ended (finished, refused, failed or cancelled): it no longer counts as load."""
        with self._lock:
            self._active.discard(job)

    def _cancel(self, job: Job) -> None:
        if job in self._jobs:
            self._jobs.remove(job)
            if not job.admitted:              # before it is retired: never counted as running
                self._admitted(job)
            self.handle.engine.cancel(job.request)
        self._retire(job)

    def _admitted(self, job: Job) -> None:
        job.admitted = True
        with self._lock:
            self._waiting -= 1

    def _deliver(self) -> None:
        """Hand new tokens to their jobs; end the jobs that finished, stopped or were rejected."""
        engine = self.handle.engine
        for job in list(self._jobs):
            r = job.request
            if not job.admitted and r.status != Status.WAITING:
                self._admitted(job)
                if r.match is not None:
                    self.ledger.record(job.namespace, job.owner)
                    if self._on_admit is not None:
                        self._on_admit(JobStats(r.prompt_len, r.reused, time.monotonic() - job.submitted))
            if r.status == Status.REJECTED:
                self._jobs.remove(job)
                self._retire(job)
                job.emit(("error", r.reject_reason))
                continue
            stopped = False
            while job.sent < len(r.output) and not stopped:
                job.sent += 1
                job.emit(("token", r.output[job.sent - 1]))
                stopped = job.stop is not None and job.stop(r.output[job.sent - 1])
            if stopped and r.status == Status.DECODE:
                engine.finish(r)
            if stopped or r.status == Status.FINISHED:
                self._jobs.remove(job)
                self._retire(job)
                job.emit(("done", "stop" if stopped else "length"))
                if r.record_logits and self.shadow is not None:
                    self.shadow.offer(r, greedy=job.sampler is None)

    def _run_purges(self) -> None:
        purges, self._purges = self._purges, []
        for fut, (tenant, salt, everything, abi_version, known, adapter, version) in purges:
            if abi_version is None:           # jobs of the scope already submitted cache nothing more
                for job in self._jobs:
                    if everything or all(w is None or w == have for w, have in
                                         zip((tenant, salt, adapter, version), (*job.owner, "", "")[:4])):
                        job.request.publish = False
            try:
                counts: PurgeCounts = purge(self.handle, self.ledger, tenant, salt, everything, abi_version, known,
                                            adapter, version)
                fut.set_result(counts)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
        if purges and self._on_purge is not None:
            self._on_purge()                  # before a later job enters or the engine steps again

    def _abort_all(self, message: str) -> None:
        for job in self._jobs:
            self._retire(job)
            job.emit(("error", message))
        for fut, _ in self._purges:
            fut.set_exception(RuntimeError(message))
        self._jobs, self._purges = [], []
