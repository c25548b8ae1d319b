"""A worker's cache events over HTTP: what ``hybridkv router`` builds its per-worker views from.

:class:`EventFeed` is the engine's :class:`~hybridkv.engine.engine.CacheListener`: each call
(on the engine thread) goes through the fleet's :class:`~hybridkv.fleet.events.EventPublisher`
and the events it produced are moved, under a lock, into a bounded buffer that the event loop
pages through for ``GET /v1/cache/events?epoch=E&after=SEQ&limit=N``. The answer::

    {"epoch": E', "events": [{"seq", "kind", "keys": [hex, ...]}, ...], "next": S, "gap": bool,
     "more": bool}

``E'`` is the worker's epoch: a fresh one at every start (``time.time_ns()``) and after every
purge (``POST /admin/cache/invalidate``), so a reader that sees another epoch than it asked
for drops its view (the page then starts at the new epoch's first event still buffered).
``gap`` says events the reader had not seen fell out of the buffer (it should drop its view
too); ``next`` is the ``after`` of the next call plus one. Keys are chained unit hashes, never
token ids; nothing here logs them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

from hybridkv.fleet.events import CacheEvent, EventPublisher

EVENT_BUFFER = 65536
"""Events a worker keeps for readers (oldest dropped first)."""
EVENT_PAGE_MAX = 1024
"""Most events one ``GET /v1/cache/events`` answers."""


class EventFeed:
    """Thread-safe hand-off of the engine's cache events to HTTP readers.

    Args:
        capacity: events kept (oldest dropped first; a reader that falls behind gets ``gap``).

    Raises:
        ValueError: ``capacity`` < 1 (named).
    """

    def __init__(self, capacity: int = EVENT_BUFFER) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be an integer >= 1 (events)")
        self._publisher = EventPublisher(0)
        self._publisher.epoch = time.time_ns()
        self._lock = threading.Lock()
        self._events: deque[CacheEvent] = deque(maxlen=capacity)
        self._next = 0                         # seq of the next event of this epoch

    @property
    def epoch(self) -> int:
        """The current epoch (nanoseconds since the epoch at start, then +1 per purge)."""
        with self._lock:
            return self._publisher.epoch

    # -- the engine thread (CacheListener) ------------------------------------------
    def stored(self, unit_keys: list[bytes], checkpoint_keys: list[bytes], retired_keys: list[bytes]) -> None:
        """KV units cached, checkpoints published and retired (see ``EventPublisher.stored``)."""
        with self._lock:
            self._publisher.stored(unit_keys, checkpoint_keys, retired_keys)
            self._take()

    def evicted(self, entries) -> None:
        """Entries about to be evicted (see ``EventPublisher.evicted``)."""
        with self._lock:
            self._publisher.evicted(entries)
            self._take()

    def _take(self) -> None:
        new = self._publisher.drain()
        if new:
            self._events.extend(new)
            self._next = new[-1].seq + 1

    # -- any thread -----------------------------------------------------------------
    def reset(self) -> None:
        """Start a new epoch (after a purge: readers drop what they knew and rebuild)."""
        with self._lock:
            self._publisher.restart()
            self._events.clear()
            self._take()

    def page(self, epoch: int | None, after: int, limit: int = EVENT_PAGE_MAX) -> dict:
        """Events after ``after`` of ``epoch`` (all buffered ones of the current epoch if ``epoch``
        is another one or ``None``), at most ``limit`` (JSON-ready, keys in hex).

        Raises:
            ValueError: ``after`` < -1 or ``limit`` outside [1, EVENT_PAGE_MAX] (named).
        """
        if after < -1:
            raise ValueError(f"after={after} must be >= -1")
        if not 1 <= limit <= EVENT_PAGE_MAX:
            raise ValueError(f"limit={limit} must be in [1, {EVENT_PAGE_MAX}]")
        with self._lock:
            current = self._publisher.epoch
            start = after + 1 if epoch == current else 0
            first = self._events[0].seq if self._events else self._next
            i = max(start - first, 0)
            page = list(itertools.islice(self._events, i, i + limit))
            nxt = page[-1].seq + 1 if page else max(start, first)
            more = nxt < self._next
        return {"epoch": current, "next": nxt, "gap": start < first, "more": more,
                "events": [{"seq": e.seq, "kind": e.kind.value, "keys": [k.hex() for k in e.keys]} for e in page]}
