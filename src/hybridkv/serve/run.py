"""One HTTP request's generations on the event loop: submit a job per prompt to the engine thread,
gather their events through an ``asyncio.Queue`` and turn tokens into text deltas.

The worker calls each job's ``emit`` on the engine thread; ``emit`` hands the event to the loop
with ``loop.call_soon_threadsafe``. Leaving :meth:`Run.events` early (the client went away, the
task was cancelled) cancels every job not yet done, which releases its cache references.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from hybridkv.serve.metrics import ServeMetrics
from hybridkv.serve.protocol import APIError, Generation, make_sampler
from hybridkv.serve.tokenizer import Codec, TextStream
from hybridkv.serve.worker import EngineWorker, Job


def hand_to_loop(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: tuple) -> bool:
    """Put ``item`` on ``queue`` from the engine thread, through ``loop``.

    A server stopping with a prefill step still running closes its event loop before that step
    ends (the shutdown has already answered the request: an error chunk or a 503); the engine
    thread's last events for the request then have no reader and are dropped, instead of raising
    ``RuntimeError: Event loop is closed`` out of the engine thread.

    Returns:
        True when the item was handed over, False when the loop was already closed.
    """
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:
        if not loop.is_closed():
            raise
        return False
    return True


class StopScan:
    """Finds the first stop string in a text that arrives in pieces.

    Each :meth:`feed` searches only the new piece and the ``len(longest stop) - 1`` characters
    before it (a stop string that starts earlier would have been found already), so a text of
    ``n`` characters costs O(n) in all.

    Args:
        stops: the stop strings (non-empty).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.keep = max(len(x) for x in stops) - 1
        self.tail = ""                    # the last ``keep`` characters seen
        self.seen = 0                     # characters fed so far
        self.found: int | None = None     # where the first stop string found starts (characters)

    def feed(self, piece: str) -> int | None:
        """Add ``piece``; the index (characters from the start of the text) where the first stop
        string starts once one has been met, else ``None``."""
        if self.found is None and piece:
            window = self.tail + piece
            hits = [i for i in (window.find(x) for x in self.stops) if i >= 0]
            if hits:
                self.found = self.seen - len(self.tail) + min(hits)
            self.tail = window[len(window) - self.keep:] if self.keep else ""
        self.seen += len(piece)
        return self.found


@dataclass(slots=True, eq=False)
class Choice:
    """What one prompt produced so far.

    Attributes:
        ids: generated token ids.
        parts: text released so far (to the client when streaming), in pieces.
        pending: decoded text not released yet: the tail that may begin a stop string, or what
            follows a stop string once one was met.
        released: characters released.
        finish_reason: ``"length"`` or ``"stop"``, ``None`` while running.
        stream: the incremental decoder of ``ids``; scan: the stop-string search, or ``None``.
    """

    stream: TextStream
    scan: StopScan | None
    ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    pending: str = ""
    released: int = 0
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        """The text released so far: up to the first stop string once ``finish_reason`` is set."""
        return "".join(self.parts)


class Run:
    """The jobs of one request (one per prompt).

    Args:
        worker: the engine thread.
        codec: the tokenizer (decoding and stop strings).
        gen: validated settings.
        prompts: token id lists, already checked against the vocabulary and length limit.
        namespace: the request's namespace digest.
        metrics: where TTFT, latency and reuse are observed.
        arrived: ``time.monotonic()`` when the request arrived (seconds).

    Raises:
        APIError: 400 when the batch has more prompts than the running slots plus the waiting
            queue hold (it could never be admitted); 503 with ``Retry-After`` when they are full.
    """

    def __init__(self, worker: EngineWorker, codec: Codec, gen: Generation, prompts: list[list[int]],
                 namespace: bytes, metrics: ServeMetrics, arrived: float) -> None:
        self.worker, self.codec, self.gen, self.metrics, self.arrived = worker, codec, gen, metrics, arrived
        if len(prompts) > worker.max_waiting + worker.max_running:
            raise APIError(400, f"a batch of {len(prompts)} prompts exceeds this server's limit of "
                                f"{worker.max_running + worker.max_waiting} requests at once ({worker.max_running} "
                                f"running, --max-num-seqs, and {worker.max_waiting} waiting, --max-waiting)", "prompt")
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [Choice(TextStream(codec), StopScan(gen.stop) if gen.stop else None) for _ in prompts]
        self.holdback = max((len(s) for s in gen.stop), default=1) - 1      # characters
        self.first_token_at: float | None = None
        self.jobs = [self._job(i, ids, namespace) for i, ids in enumerate(prompts)]
        if not worker.submit_all(self.jobs):           # all or none: nothing to cancel on a refusal
            raise APIError(503, f"the server is at its limit of {worker.max_waiting} waiting requests beyond "
                                "its free running slots; retry shortly", None, "server_overloaded", "server_error")
        self._open = set(range(len(self.jobs)))

    def _job(self, i: int, ids: list[int], namespace: bytes) -> Job:
        seed = self.gen.seed + i if self.gen.seed is not None else secrets.randbits(63)
        eos = None if self.gen.ignore_eos else self.codec.eos_token_id
        text = TextStream(self.codec)             # the engine thread's own decoder and search
        scan = StopScan(self.gen.stop) if self.gen.stop else None

        def emit(event: tuple) -> None:
            hand_to_loop(self.loop, self.queue, (i, event))

        def stop(token_id: int) -> bool:
            if eos is not None and token_id == eos:
                return True
            return scan is not None and scan.feed(text.push(token_id)) is not None

        hints = tuple(h for h in self.gen.hints if h <= len(ids))
        return Job(np.asarray(ids, dtype=np.int64), self.gen.max_tokens, namespace,
                   (self.gen.tenant, self.gen.cache_salt, self.gen.adapter, self.gen.adapter_version), emit,
                   hints=hints,
                   sampler=make_sampler(self.gen, seed), stop=stop)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of every job."""
        return sum(j.request.prompt_len if j.request is not None else len(j.prompt) for j in self.jobs)

    def usage(self) -> dict:
        """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens`` = tokens the cache supplied."""
        completion = sum(len(c.ids) for c in self.choices)
        prompt = self.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(j.cached_tokens for j in self.jobs)}}

    @property
    def running(self) -> bool:
        """Whether a choice is still being generated."""
        return bool(self._open)

    def end(self, reason: str) -> None:
        """End the request early (the server is stopping; call on the event loop): its
        :meth:`events` raise a 503 :class:`APIError` naming ``reason`` once the events already
        queued are consumed, and its unfinished jobs are cancelled."""
        self.queue.put_nowait((-1, ("end", reason)))

    async def events(self):
        """Yield ``(index, delta_text, finish_reason)`` once per generated token (the delta may be
        empty while text is held back) and once at the end of each choice, which carries its
        finish reason. Leaving early cancels the unfinished jobs.

        Raises:
            APIError: 500 when the engine refused or failed a job (its message); 503
                (``server_shutdown``) when :meth:`end` ended the request.
        """
        try:
            while self._open:
                i, event = await self.queue.get()
                if event[0] == "end":
                    done = sum(len(c.ids) for c in self.choices)
                    raise APIError(503, f"{event[1]}; this request was ended after {done} generated tokens",
                                   None, "server_shutdown", "server_error")
                delta = self._apply(i, event)
                yield i, delta, self.choices[i].finish_reason
        finally:
            for i in self._open:
                self.worker.cancel(self.jobs[i])

    def _apply(self, i: int, event: tuple) -> str:
        kind, value = event
        c = self.choices[i]
        if kind == "error":
            self._open.discard(i)
            raise APIError(500, f"prompt {i}: {value}", None, "engine_error", "server_error")
        if kind == "token":
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
                self.metrics.ttft.observe(self.first_token_at - self.arrived)
            c.ids.append(value)
            piece = c.stream.push(value)
            c.pending += piece
            found = c.scan.feed(piece) if c.scan is not None else None
            ready = found if found is not None else c.released + len(c.pending) - self.holdback
        else:
            self._open.discard(i)
            c.finish_reason = value
            found = c.scan.found if c.scan is not None else None
            ready = found if found is not None else c.released + len(c.pending)
            self.metrics.reused.observe(self.jobs[i].cached_tokens)
            if not self._open:
                self.metrics.e2e.observe(time.monotonic() - self.arrived)
        n = max(0, ready - c.released)
        delta, c.pending = c.pending[:n], c.pending[n:]
        c.released += n
        if delta:
            c.parts.append(delta)
        if c.finish_reason is not None:
            c.pending = ""                    # past the stop string, or an incomplete character
        return delta                          # "" for a token whose text is held back: one chunk per token

    async def collect(self) -> list[Choice]:
        """Wait for every job; the finished choices."""
        async for _ in self.events():
            pass
        return self.choices
