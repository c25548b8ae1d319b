"""A worker's cache events over HTTP: what ``hybridkv router`` builds its views from.

:class:`EventFeed` is the engine's :class:`~hybridkv.engine.engine.CacheListener`: each call
(on the engine thread) goes through the fleet's :class:`~hybridkv.fleet.events.EventPublisher`
and the events it produced are moved, under a lock, into a bounded buffer that the event loop
pages through for ``GET /v1/cache/events?epoch=E&after=SEQ&limit=N[&wait=S]``. Attached to the
worker's shared store tier (:meth:`EventFeed.watch_store`, a
:class:`~hybridkv.tiers.base.TierObserver`) it also publishes the store's committed entries and
removals, in the same sequence, with ``medium: "store"`` (as vLLM's KV events name the medium a
block lives on); the worker's own device cache is ``medium: "device"``. The answer::

    {"epoch": E', "events": [{"seq", "kind", "medium", "group", "keys": [hex, ...]}, ...], "next": S,
     "gap": bool, "more": bool}

``E'`` is the worker's epoch: a fresh one at every start (``time.time_ns()``) and after every
purge (``POST /admin/cache/invalidate``), so a reader that sees another epoch than it asked
for drops its view (the page then starts at the new epoch's first event still buffered).
``gap`` says events the reader had not seen fell out of the buffer (it should drop its view
too); ``next`` is the ``after`` of the next call plus one. With ``wait=S`` (seconds) a reader
that is up to date is answered as soon as a new event arrives, or empty after ``S`` seconds
(a long poll: :meth:`EventFeed.wait`).

Events are per cache group of the served model's family
(:class:`~hybridkv.cache.groups.Family`): a paged (prefix-closed) group's units are
``blocks_stored`` / ``blocks_removed``, a boundary-state group's are ``checkpoints_stored`` /
``checkpoints_removed``, and every such event names its group in ``group`` (``full`` / ``kda``
for Kimi Linear; ``csa``, ``hca`` / ``swa`` for DeepSeek-V4, whose two paged groups share a
page, so each page event comes once per paged group with the same keys). A reader of a worker
that sends no ``group`` takes ``full`` for blocks and ``kda`` for checkpoints. Store events
carry the store entry's chained hash at an ``alignment`` boundary, ``all_cleared`` follows a
purge that removed entries it cannot name. Keys are chained hashes, never token ids; nothing
here logs them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import secrets
import threading
import time
from collections import deque

from hybridkv.cache.groups import KIMI_LINEAR, Family, RecomputeCone, SavedEvery, nbytes
from hybridkv.fleet.events import CacheEvent, EventKind, EventPublisher

EVENT_BUFFER = 65536
"""Events a worker keeps for readers (oldest dropped first)."""
EVENT_PAGE_MAX = 1024
"""Most events one ``GET /v1/cache/events`` answers."""
MAX_WAIT_S = 30.0
"""Longest long poll (``wait``) one ``GET /v1/cache/events`` may ask for, seconds."""
DEVICE, STORE = "device", "store"
"""The ``medium`` of an event: the worker's own cache (device pools), or its shared store tier."""
PAGED, STATE = "paged", "state"
"""The ``kind`` of a cache group in ``/server_info`` and ``/v1/cache/info``: prefix-closed entries
in pages (``blocks_*`` events), or a boundary state (``checkpoints_*`` events)."""
_BLOCK_KINDS = (EventKind.BLOCKS_STORED, EventKind.BLOCKS_REMOVED)


def group_info(family: Family, tokens: int | None = None) -> list[dict]:
    """The cache groups of ``family`` as ``/server_info`` reports them: per group ``{"name",
    "kind"}`` (:data:`PAGED` / :data:`STATE`), ``"unit"`` (tokens: what one paged entry
    summarises, the spacing of a state's boundaries; :attr:`~hybridkv.cache.groups.GroupSpec.granularity`)
    and ``"entry_bytes"``: one entry's payload (:attr:`~hybridkv.cache.groups.GroupSpec.bytes_per_entry`),
    or with ``tokens`` (a store's alignment) a paged group's entries of ``tokens`` tokens; ``null``
    for a family without a layout. A state group also has ``"restore"``, how a hit restores it
    (:func:`restore_info`), so a reader can apply the family's joint-hit rule.

    Raises:
        ValueError: ``tokens`` not a multiple of a paged group's unit (naming both).
    """
    restore = dict(family.boundary)
    out = []
    for g in family.groups:
        size = None
        if g.components:
            size = (g.bytes_per_entry if tokens is None or not g.prefix_closed
                    else sum(nbytes(d, s) for d, s in g.entry_shape(tokens).values()))
        info = {"name": g.name, "kind": PAGED if g.prefix_closed else STATE, "unit": g.granularity,
                "entry_bytes": size}
        if not g.prefix_closed:
            info["restore"] = restore_info(restore[g.name])
        out.append(info)
    return out


def restore_info(how) -> dict:
    """A boundary group's restore strategy as JSON: ``{"kind": "saved_at_hit"}`` (the state saved at
    the hit), ``{"kind": "saved_every", "period": P}`` (the nearest state saved at or below it, ``P``
    tokens apart) or ``{"kind": "recompute_cone", "tokens": N}`` (nothing saved; the last ``N``
    tokens before the hit recomputed); see :mod:`hybridkv.cache.groups`."""
    if isinstance(how, SavedEvery):
        return {"kind": "saved_every", "period": how.period}
    if isinstance(how, RecomputeCone):
        return {"kind": "recompute_cone", "tokens": how.tokens}
    return {"kind": "saved_at_hit"}


class EventFeed:
    """Thread-safe hand-off of the engine's (and its store tier's) cache events to HTTP readers.

    Sequence numbers are the feed's own, one series per epoch over both media.

    Args:
        capacity: events kept (oldest dropped first; a reader that falls behind gets ``gap``).
        family: the served model's cache groups (:meth:`use_family` sets it once the engine is
            built); events of a paged group name it, one event per paged group.

    Raises:
        ValueError: ``capacity`` < 1 (named).
    """

    def __init__(self, capacity: int = EVENT_BUFFER, family: Family = KIMI_LINEAR) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be an integer >= 1 (events)")
        self.use_family(family)
        self._publisher = EventPublisher(0)
        self._publisher.epoch = time.time_ns()
        self._lock = threading.Lock()
        self._events: deque[tuple[str, str | None, CacheEvent]] = deque(maxlen=capacity)   # medium, group, event
        self._next = 0                         # seq of the next event of this epoch
        self._store: dict | None = None        # what /v1/cache/info says of the store tier
        self._store_groups: tuple[str, str] = ("", "")   # the store tier's page and state entry kinds
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def use_family(self, family: Family) -> None:
        """Name events by ``family``'s groups (its paged groups for ``blocks_*``, its boundary group
        for ``checkpoints_*``; the store's entries by the same names).

        Raises:
            ValueError: a family with other than one boundary group (naming it).
        """
        bnames = [name for name, _ in family.boundary]
        if len(bnames) != 1:
            raise ValueError(f"family {family.name!r}: the event feed names one boundary group, it has {bnames}")
        self.family = family
        self._paged, self._state = family.prefix_names, bnames[0]

    @property
    def epoch(self) -> int:
        """The current epoch (nanoseconds since the epoch at start, then +1 per purge)."""
        with self._lock:
            return self._publisher.epoch

    # -- the shared store -----------------------------------------------------------
    def watch_store(self, tier, url: str) -> None:
        """Publish ``tier``'s committed entries and removals as ``medium: store`` events.

        Args:
            tier: the worker's :class:`~hybridkv.tiers.store_tier.StoreTier` (its ``observer``
                becomes this feed).
            url: the store URL the worker was started with; only its SHA-256 (first 16 hex
                digits) is published, as the store's ``id``: workers with the same id share it.
        """
        self._store = {"id": hashlib.sha256(url.encode()).hexdigest()[:16], "alignment": tier.alignment,
                       "kv_bytes_per_token": tier.entry_nbytes(tier.page_group) // tier.alignment,
                       "checkpoint_bytes": tier.entry_nbytes(tier.state_group),
                       "groups": group_info(tier.family, tier.alignment)}
        self._store_groups = (tier.page_group, tier.state_group)
        tier.observer = self

    def store_info(self) -> dict | None:
        """``{"id", "alignment" (tokens), "kv_bytes_per_token", "checkpoint_bytes", "groups"}`` of the
        watched store, or ``None`` (no store tier): bytes per token of a page entry (every paged
        group), bytes of one state entry, and :func:`group_info` of its family with each paged
        group's bytes per ``alignment`` tokens."""
        if self._store is None:
            return None
        return {**self._store, "groups": [dict(g) for g in self._store["groups"]]}

    def entries_saved(self, tier: str, entries: list[tuple[bytes, str]]) -> None:
        """Store entries committed (:class:`~hybridkv.tiers.base.TierObserver`)."""
        self._store_event(EventKind.BLOCKS_STORED, EventKind.CHECKPOINTS_STORED, entries)

    def entries_removed(self, tier: str, entries: list[tuple[bytes, str]]) -> None:
        """Store entries removed (:class:`~hybridkv.tiers.base.TierObserver`)."""
        self._store_event(EventKind.BLOCKS_REMOVED, EventKind.CHECKPOINTS_REMOVED, entries)

    def entries_purged(self, tier: str) -> None:
        """A purge removed store entries it does not name: readers forget the store view."""
        with self._lock:
            self._append(STORE, EventKind.ALL_CLEARED, ())

    def _store_event(self, kv_kind: EventKind, ck_kind: EventKind, entries: list[tuple[bytes, str]]) -> None:
        page, state = self._store_groups          # a page entry holds every paged group of its segment
        kv = [h for h, grp in entries if grp == page]
        ck = [h for h, grp in entries if grp == state]
        with self._lock:
            if kv:
                for g in self._paged:
                    self._append(STORE, kv_kind, kv, g)
            if ck:
                self._append(STORE, ck_kind, ck, self._state)

    # -- the engine thread (CacheListener) ------------------------------------------
    def stored(self, unit_keys: list[bytes], checkpoint_keys: list[bytes], retired_keys: list[bytes],
               checkpoint_boundaries: list[int] = (), first_unit: int | None = None) -> None:
        """KV units cached, checkpoints published and retired (see ``EventPublisher.stored``)."""
        with self._lock:
            self._publisher.stored(unit_keys, checkpoint_keys, retired_keys, checkpoint_boundaries, first_unit)
            self._take()

    def evicted(self, entries) -> None:
        """Entries about to be evicted (see ``EventPublisher.evicted``)."""
        with self._lock:
            self._publisher.evicted(entries)
            self._take()

    def _take(self) -> None:
        for e in self._publisher.drain():
            if e.kind in _BLOCK_KINDS:
                for g in self._paged:
                    self._append(DEVICE, e.kind, e.keys, g)
            else:
                self._append(DEVICE, e.kind, e.keys, None if e.kind is EventKind.ALL_CLEARED else self._state)

    def _append(self, medium: str, kind: EventKind, keys, group: str | None = None) -> None:
        """Buffer one event (of cache group ``group``; ``None``: ``all_cleared``) under the lock and
        wake every long poll."""
        self._events.append((medium, group, CacheEvent(0, self._publisher.epoch, self._next, kind, tuple(keys))))
        self._next += 1
        for loop, ev in self._waiters:
            loop.call_soon_threadsafe(ev.set)

    # -- any thread -----------------------------------------------------------------
    def reset(self) -> None:
        """Start a new epoch (after a purge: readers drop what they knew and rebuild)."""
        with self._lock:
            self._publisher.restart()
            self._events.clear()
            self._next = 0
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
            first = self._events[0][2].seq if self._events else self._next
            i = max(start - first, 0)
            page = list(itertools.islice(self._events, i, i + limit))
            nxt = page[-1][2].seq + 1 if page else max(start, first)
            more = nxt < self._next
        return {"epoch": current, "next": nxt, "gap": start < first, "more": more,
                "events": [{"seq": e.seq, "kind": e.kind.value, "medium": m, **({"group": g} if g else {}),
                            "keys": [k.hex() for k in e.keys]} for m, g, e in page]}

    async def wait(self, epoch: int | None, after: int, limit: int = EVENT_PAGE_MAX, wait_s: float = 0.0) -> dict:
        """:meth:`page`, but when it would be empty for a reader that is up to date (same
        ``epoch``, nothing after ``after``), wait up to ``wait_s`` seconds for the next event (or
        a new epoch) first. Call on the event loop.

        Raises:
            ValueError: as :meth:`page`, or ``wait_s`` outside [0, MAX_WAIT_S] (named).
        """
        if not 0.0 <= wait_s <= MAX_WAIT_S:
            raise ValueError(f"wait={wait_s} must be in [0, {MAX_WAIT_S}] seconds")
        ready = asyncio.Event()
        waiter = (asyncio.get_running_loop(), ready)
        with self._lock:
            self._waiters.add(waiter)
        try:
            answer = self.page(epoch, after, limit)
            if answer["events"] or answer["epoch"] != epoch or answer["gap"] or wait_s == 0.0:
                return answer
            try:
                await asyncio.wait_for(ready.wait(), timeout=wait_s)
            except TimeoutError:
                pass
            return self.page(epoch, after, limit)
        finally:
            with self._lock:
                self._waiters.discard(waiter)


# -- the device cache's snapshot, in pages --------------------------------------------------------

SNAPSHOT_PAGE_MAX = 4096
"""Most entries one ``GET /v1/cache/snapshot`` page answers (about 280 KB of JSON: 64 hex digits
and 4 characters of JSON per entry, up to twice that when every entry has a checkpoint); also its
default ``limit``."""
SNAPSHOT_KEEP = 16
"""Snapshots a worker holds for readers paging through them at once, by default (``hybridkv serve
--snapshot-readers``; the least recently read is dropped first): one per router resyncing from
it at the same time. A held snapshot costs about 75 bytes per cached unit at most (a reference
and a flag per entry, and the 32-byte keys of entries evicted since it was read)."""
CURSOR_TAG_BYTES = 8
"""Bytes of the HMAC-SHA256 tag a snapshot ``generation`` ends with (16 hex digits after 16 random
ones): it tells a cursor this worker gave (410 once its snapshot is dropped) from a made-up one (400)."""
SNAPSHOT_TTL_S = 60.0
"""Seconds a held snapshot outlives its last page read."""


class SnapshotGone(LookupError):
    """A cursor's snapshot is no longer held: dropped after :data:`SNAPSHOT_TTL_S` idle, for newer
    ones, or because a purge or restart started a new epoch; the reader starts again."""


class SnapshotPages:
    """Snapshots of the device index held while readers page through them (event loop only).

    A snapshot is read once, on the engine thread between two steps (a consistent cut of the
    index); its pages are then served from that copy, so the cache changing between two pages
    changes nothing in them. Each snapshot has a ``generation`` (random hex) that every page and
    cursor carries; a snapshot whose epoch has ended is dropped, and its cursors then raise
    :class:`SnapshotGone`, so a reader that pages across a purge or restart starts again.

    A generation is 16 random hex digits and a tag of :data:`CURSOR_TAG_BYTES` (HMAC-SHA256 of
    them under ``key``), so a cursor this worker gave is told from a made-up one without
    remembering every generation: a made-up or malformed cursor is a ``ValueError`` (400), a
    genuine one whose snapshot is gone a :class:`SnapshotGone` (410). ``key`` must be secret: a
    server uses a random one per process, so a cursor of its earlier process is made up to it.

    Args:
        keep: snapshots held at once (>= 1; default :data:`SNAPSHOT_KEEP`).
        ttl_s: seconds a snapshot is held after its last page (> 0).
        clock: monotonic seconds (``time.monotonic``).
        key: the tag's HMAC key (bytes, secret: anyone who can derive it can make a cursor that
            passes the tag); ``None``: a random one (cursors of another instance are then made up
            to this one).

    Raises:
        ValueError: ``keep`` < 1 or ``ttl_s`` <= 0 (named).
    """

    def __init__(self, keep: int = SNAPSHOT_KEEP, ttl_s: float = SNAPSHOT_TTL_S, clock=time.monotonic,
                 key: bytes | None = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1 or not ttl_s > 0:
            raise ValueError(f"keep={keep!r} must be an integer >= 1 and ttl_s={ttl_s} > 0 seconds")
        self.keep, self.ttl_s, self.clock = keep, ttl_s, clock
        self._key = key if key is not None else secrets.token_bytes(32)
        self._held: dict[str, tuple[int, list[bytes], bytearray, float]] = {}   # generation -> epoch, keys,
                                                                                 # checkpoint flags, last read

    def _tag(self, nonce: str) -> str:
        return hmac.new(self._key, nonce.encode("ascii"), hashlib.sha256).hexdigest()[:2 * CURSOR_TAG_BYTES]

    def _new_generation(self) -> str:
        nonce = secrets.token_hex(8)
        return nonce + self._tag(nonce)

    def parse_cursor(self, cursor: str) -> tuple[str, int]:
        """``(generation, offset)`` of a ``next_cursor`` this instance (or one with the same key) gave
        (``GENERATION.OFFSET``: 32 lowercase hex digits whose last 16 are the tag, a decimal offset).

        Raises:
            ValueError: anything else, a made-up generation included (naming the cursor, shortened).
        """
        generation, dot, offset = cursor.partition(".")
        n = 16 + 2 * CURSOR_TAG_BYTES
        if not dot or len(generation) != n or not all(c in "0123456789abcdef" for c in generation) \
                or not offset.isascii() or not offset.isdigit() or len(offset) > 19 \
                or not hmac.compare_digest(generation[16:], self._tag(generation[:16])):
            shown = cursor if len(cursor) <= 60 else cursor[:57] + "..."
            raise ValueError(f"cursor={shown!r} is not a cursor this server gave (next_cursor of a previous page)")
        return generation, int(offset)

    def first(self, epoch: int, keys: list[bytes], flags: bytearray, limit: int) -> dict:
        """The first page of a snapshot just read (``keys``: every cached unit's chained hash,
        ``flags[i]`` 1 when ``keys[i]`` has a published checkpoint), held for the next pages when
        it has more than ``limit`` entries."""
        now = self.clock()
        self._expire(now)
        generation = self._new_generation()
        if len(keys) > limit:
            while len(self._held) >= self.keep:             # the least recently read goes
                del self._held[min(self._held, key=lambda g: self._held[g][3])]
            self._held[generation] = (epoch, keys, flags, now)
        return self._page(generation, epoch, keys, flags, 0, limit)

    def resume(self, cursor: str, limit: int, epoch_now: int) -> dict:
        """The page a cursor names, at most ``limit`` entries.

        Raises:
            ValueError: a cursor this server did not give, or past the snapshot's end.
            SnapshotGone: its snapshot is no longer held, or its epoch (``epoch_now`` is the
                current one) has ended.
        """
        generation, offset = self.parse_cursor(cursor)
        now = self.clock()
        self._expire(now)
        held = self._held.get(generation)
        if held is not None and held[0] != epoch_now:       # a purge or restart since: the entries changed
            del self._held[generation]
            held = None
        if held is None:
            raise SnapshotGone(f"snapshot generation {generation} is no longer held (a purge or restart started a "
                               f"new epoch, it was read to its end, it was not read for {self.ttl_s:g} s, or newer snapshots "
                               f"replaced it: this "
                               f"worker holds {self.keep}, --snapshot-readers); "
                               "read the snapshot again from its first page (no cursor)")
        epoch, keys, flags, _ = held
        if offset >= len(keys):
            raise ValueError(f"cursor offset {offset} is past the snapshot's {len(keys)} entries")
        self._held[generation] = (epoch, keys, flags, now)
        return self._page(generation, epoch, keys, flags, offset, limit)

    def _page(self, generation: str, epoch: int, keys: list[bytes], flags: bytearray, offset: int,
              limit: int) -> dict:
        end = min(offset + limit, len(keys))
        if end == len(keys):
            self._held.pop(generation, None)                # read to its end: nothing more to hold
        return {"epoch": epoch, "generation": generation, "total": len(keys),
                "kv": [k.hex() for k in keys[offset:end]],
                "checkpoints": [keys[i].hex() for i in range(offset, end) if flags[i]],
                "next_cursor": f"{generation}.{end}" if end < len(keys) else None}

    def _expire(self, now: float) -> None:
        for g in [g for g, h in self._held.items() if now - h[3] > self.ttl_s]:
            del self._held[g]

    def __len__(self) -> int:
        return len(self._held)
