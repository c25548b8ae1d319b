"""What ``hybridkv router`` knows of its workers: health, cache views from their events, load,
and the shared store they write to.

One :class:`WorkerState` per ``--worker`` URL. :class:`Workers` refreshes them from a background
task: ``GET /health`` every ``health_every`` polls (and on every poll while a worker is out of
rotation), and ``GET /v1/cache/events`` pages on every poll of a healthy worker; with
:meth:`Workers.follow_forever` each healthy worker is also long-polled (``wait=S``), so a new
event reaches the view as soon as the worker publishes it and the periodic poll is the fallback.
A worker enters rotation once ``/health`` answers 200 and its ``/v1/cache/info`` names the same
cache identity as the fleet's (the first worker seen sets it); it leaves rotation, its view
cleared, when a check or a proxied connection fails. A new epoch (a restart, a purge) or a gap
in the events replaces its view with an empty one.

Events with ``medium: store`` describe a shared store tier (``/v1/cache/info`` names it by an id
and gives its entry alignment): every worker's store events feed one :class:`SharedStoreView`
per store id, which outlives worker restarts and epochs (the store does), and is forgotten only
on a store ``all_cleared`` (a purge). Logs name workers by URL only, never prompts, ids or hashes.

Views follow the workers' model family: ``/v1/cache/info`` lists its cache groups
(:func:`family_from_groups`; a worker that lists none is Kimi Linear), every event names the
group it concerns (``group``), and a view's hit is the family's joint-hit rule
(:func:`~hybridkv.cache.groups.joint_hit`), so a DeepSeek-V4 fleet is routed by its ``csa``,
``hca`` and ``swa`` groups under the workers' SWA recovery strategy.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from hybridkv.cache.groups import (BOUNDARY, KIMI_LINEAR, PREFIX, SAVED_AT_HIT, BoundaryList, EntryPresence, Family,
                                   GroupSpec, JointHit, RecomputeCone, SavedEvery, joint_hit)
from hybridkv.cache.namespace import CacheIdentity, bind_namespace, chained_block_hashes
from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView
from hybridkv.fleet.routers import InstanceLoad
from hybridkv.serve.cache_events import SNAPSHOT_PAGE_MAX

log = logging.getLogger("hybridkv.serve.router")

MAX_PAGES_PER_POLL = 16
"""Event pages read from one worker per poll (the rest waits for the next poll)."""
SNAPSHOT_RESTARTS = 3
"""Reads of a worker's paged ``/v1/cache/snapshot`` tried when it changes under the router (a
new epoch while paging); after that its view starts empty and fills from its events."""


def family_from_groups(groups: list[dict] | None) -> Family:
    """The model family a worker's ``/v1/cache/info`` ``groups`` describe
    (:func:`~hybridkv.serve.cache_events.group_info`: name, kind ``paged`` / ``state``, unit in
    tokens, and a state group's ``restore``), without entry layouts; ``None`` or ``[]`` (a worker
    that lists none): Kimi Linear.

    Raises:
        ValueError / KeyError / TypeError: a malformed list (a worker with it is kept out of rotation).
    """
    if not groups:
        return KIMI_LINEAR
    specs, restore = [], {}
    for g in groups:
        kind = g["kind"]
        if kind not in ("paged", "state"):
            raise ValueError(f"cache group {g['name']!r} has kind {kind!r}, not paged or state")
        specs.append(GroupSpec(str(g["name"]), PREFIX if kind == "paged" else BOUNDARY, int(g["unit"])))
        if kind == "state":
            how = g.get("restore") or {"kind": "saved_at_hit"}
            restore[specs[-1].name] = (SavedEvery(int(how["period"])) if how["kind"] == "saved_every" else
                                       RecomputeCone(int(how["tokens"])) if how["kind"] == "recompute_cone" else
                                       SAVED_AT_HIT if how["kind"] == "saved_at_hit" else None)
            if restore[specs[-1].name] is None:
                raise ValueError(f"cache group {g['name']!r}: unknown restore {how['kind']!r}")
    family = Family("+".join(s.name for s in specs), tuple(specs), restore)
    same_as_kimi = (family.prefix_names, family.boundary) == (KIMI_LINEAR.prefix_names, KIMI_LINEAR.boundary)
    return KIMI_LINEAR if same_as_kimi else family


class SharedStoreView(InstanceView):
    """Entries of one shared store, from every worker's ``medium: store`` events.

    Per cache group of ``family`` the chained hashes of its entries: a paged group's (each the
    segment ``[b - alignment, b)`` of the prefix ending at an aligned boundary ``b``; ``kv`` is
    the first paged group's), a state group's (``checkpoints``: the first one's). A prefix is
    held up to the deepest aligned boundary whose page entries from token 0 are all present, and
    the hit follows the family's rule over that run (the store tier's own lookup rule,
    :meth:`~hybridkv.tiers.base.Tier.lookup`).

    Args:
        unit: ``prefix_match_unit`` in tokens.
        alignment: tokens per store entry (a positive multiple of ``unit``).
        family: the workers' cache groups (default Kimi Linear: ``full`` + ``kda``).

    Raises:
        ValueError: ``alignment`` not a positive multiple of ``unit`` (named).
    """

    def __init__(self, unit: int, alignment: int, family: Family = KIMI_LINEAR) -> None:
        if alignment <= 0 or alignment % unit:
            raise ValueError(f"store alignment {alignment} is not a positive multiple of the unit {unit}")
        super().__init__(unit, family)
        self.alignment = alignment
        self.events_applied = 0
        self._pages = tuple(self.held[n] for n in family.prefix_names)
        self._flags = {**{n: "has_kv" for n in family.prefix_names}, **{b: "has_checkpoint" for b, _ in family.boundary}}

    def apply(self, event: CacheEvent) -> None:
        """Add or remove entries of the group the event names; ``all_cleared`` forgets them all.
        Epochs do not apply: the store outlives the workers that wrote to it."""
        kind, keys = event.kind, event.keys
        if kind is EventKind.ALL_CLEARED:
            self._clear()
        else:
            for held in self.group_sets(kind, event.group):
                if kind in (EventKind.BLOCKS_STORED, EventKind.CHECKPOINTS_STORED):
                    held.update(keys)
                else:
                    held.difference_update(keys)
        self.events_applied += 1

    def _presence(self, hashes: list[bytes], limit: int) -> list[EntryPresence]:
        g, a, pages, ck = self.unit, self.alignment, self._pages, self.checkpoints
        out = []
        for end in range(a, min(limit, len(hashes) * g) + 1, a):
            key = hashes[end // g - 1]
            if not all(key in held for held in pages):
                break
            out.append(EntryPresence(end, True, key in ck))
        return out

    def kv_run(self, hashes: list[bytes], limit: int) -> int:
        """Contiguous page entries from token 0 over ``hashes``, at most ``limit`` tokens (aligned)."""
        bounds = self._presence(hashes, limit)
        return bounds[-1].end if bounds else 0

    def match(self, hashes: list[bytes], limit: int) -> JointHit:
        """The joint hit the store would give a prompt with unit hashes ``hashes`` under ``limit``."""
        return joint_hit(self.family, BoundaryList(self._presence(hashes, limit), self._flags), limit)


class FleetMismatch(ValueError):
    """A worker whose cache identity or units differ from the fleet's (it is kept out of rotation)."""


def failure_text(exc: Exception) -> str:
    """One line (at most 200 characters) saying why a read of a worker failed: the exception's
    type and text (``no detail`` where it has none: an httpx timeout may carry none) and, for an
    httpx request error, the method and URL path it was making, so an operator's log says which
    call failed."""
    text = str(exc) or "no detail"
    if isinstance(exc, httpx.RequestError):
        try:
            req = exc.request
            text = f"{text} ({req.method} {req.url.path})"
        except RuntimeError:                       # an error raised without its request
            pass
    return f"{type(exc).__name__}: {text}"[:200]

@dataclass(frozen=True, slots=True)
class FleetIdentity:
    """How every worker of the fleet hashes prompts (from ``/v1/cache/info``; units in tokens)."""

    identity: tuple[tuple[str, str], ...]
    binding: bytes
    unit: int
    block_size: int
    vocab_size: int
    family: Family = KIMI_LINEAR

    @classmethod
    def from_info(cls, info: dict) -> FleetIdentity:
        """From a ``/v1/cache/info`` body (``family`` from its ``groups``: :func:`family_from_groups`).
        Raises ``KeyError`` / ``ValueError`` / ``TypeError`` on a malformed one."""
        return cls(tuple(sorted((str(k), str(v)) for k, v in info["identity"].items())),
                   bytes.fromhex(info["binding"]), int(info["prefix_match_unit"]), int(info["block_size"]),
                   int(info["vocab_size"]), family_from_groups(info.get("groups")))

    def view(self) -> InstanceView:
        """An empty view of one worker of this fleet (its unit and family)."""
        return InstanceView(self.unit, self.family)

    def hashes(self, ids: list[int], tenant: str, salt: str, adapter: str = "",
               adapter_version: str = "") -> list[bytes]:
        """Chained unit hashes (32 bytes each, one per ``prefix_match_unit`` tokens) of prompt
        ``ids`` for ``tenant`` / ``salt`` / ``adapter`` at ``adapter_version`` (``""``: none), as
        the workers compute them."""
        ns = CacheIdentity(**dict(self.identity), adapter_id=adapter, adapter_version=adapter_version,
                           tenant=tenant, cache_salt=salt).digest()
        return chained_block_hashes(bind_namespace(ns, self.binding), ids, self.unit)


@dataclass(slots=True, eq=False)
class WorkerState:
    """One worker as the router sees it.

    Attributes:
        url: base URL (``http://HOST:PORT``).
        healthy: in rotation.
        view: its cache from its events (empty while out of rotation).
        epoch: the epoch ``view`` follows (``None``: none yet).
        after: last event seq applied in ``epoch`` (-1: none).
        load: requests and prompt tokens in flight through this router.
        events_applied, views_dropped: counters.
        failures: times it left rotation (in rotation, then found down); the checks that fail
            before it first enters rotation (start-up) or while it is out do not count. Also the
            generation :meth:`Workers._pull` compares to drop an answer read across a take-out.
        store_id: the shared store it writes to (``/v1/cache/info``), or ``None``.
        store_events_applied: its ``medium: store`` events applied to that store's view.
        hit_tokens_routed: the local joint hits it was predicted to give the requests routed to it.
        store_hit_tokens_routed: tokens of the store's hit beyond that local hit, likewise.
        last_error: why it is out of rotation, or why it last left it (no prompt content);
            cleared when it first enters rotation (the start-up checks' connection errors).
        slots, page_size, pool_tokens: its ``max_running_requests`` (sequence slots), KV
            ``page_size`` and KV pool (``max_total_tokens``, tokens) from ``/server_info`` when it
            entered rotation (``None``: a worker without that route).
        snapshots: times its view was rebuilt from its ``/v1/cache/snapshot``; ``synced``: the
            view of this epoch started from one (its events from the first are applied over it);
            ``snapshot_restarts``: reads of its paged snapshot begun again because it changed
            while being paged (a purge or restart).
        reported: its last ``/get_load`` entry (requests and tokens it has to do, whoever sent
            them; ``None``: not read yet, or a worker without that route); ``own_at_report``:
            this router's ``(in_flight, waiting)`` there when that answer arrived.
    """

    url: str
    healthy: bool = False
    view: InstanceView = field(default_factory=lambda: InstanceView(1))
    epoch: int | None = None
    after: int = -1
    load: InstanceLoad = field(default_factory=InstanceLoad)
    events_applied: int = 0
    views_dropped: int = 0
    failures: int = 0
    hit_tokens_routed: int = 0
    store_id: str | None = None
    store_events_applied: int = 0
    store_hit_tokens_routed: int = 0
    last_error: str = ""
    slots: int | None = None
    page_size: int | None = None
    pool_tokens: int | None = None
    reported: dict | None = None
    own_at_report: tuple[int, int] = (0, 0)
    snapshots: int = 0
    snapshot_restarts: int = 0
    synced: bool = False
    pull_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def others(self) -> dict[str, int]:
        """The load others (clients sending to it directly, other routers) put on this worker:
        its last ``/get_load`` less what this router had in flight there when it was read.

        Returns:
            ``reqs`` (requests), ``waiting`` (requests without a first token), ``waiting_tokens``
            (their prompt tokens), ``decode_tokens`` (tokens they may still generate) and
            ``tokens`` (prompt plus generated tokens they hold); the token figures are the
            others' share of the worker's (by request counts). All 0 when nothing is reported.
        """
        rep = self.reported
        zero = {"reqs": 0, "waiting": 0, "waiting_tokens": 0, "decode_tokens": 0, "tokens": 0}
        if not rep or rep.get("num_reqs", 0) <= 0:
            return zero
        own_reqs, own_waiting = self.own_at_report
        total, queued = int(rep["num_reqs"]), int(rep.get("num_waiting_reqs", 0))
        reqs = max(0, total - own_reqs)
        if reqs == 0:
            return zero
        waiting = min(reqs, max(0, queued - own_waiting))
        share = reqs / total
        return {"reqs": reqs, "waiting": waiting,
                "waiting_tokens": round(int(rep.get("num_waiting_tokens", 0)) * waiting / queued) if queued else 0,
                "decode_tokens": round(int(rep.get("num_decode_tokens", 0)) * share),
                "tokens": round(int(rep.get("num_tokens", 0)) * share)}

    def stats(self) -> dict:
        """JSON-ready counters (key counts, never keys)."""
        ld = self.load
        return {"url": self.url, "healthy": self.healthy, "epoch": self.epoch, "routed": ld.routed,
                "in_flight": ld.in_flight, "outstanding_tokens": ld.outstanding_tokens,
                "kv_keys": len(self.view.kv), "checkpoint_keys": len(self.view.checkpoints),
                "events_applied": self.events_applied, "views_dropped": self.views_dropped,
                "failures": self.failures, "predicted_hit_tokens_routed": self.hit_tokens_routed,
                "store_id": self.store_id, "store_events_applied": self.store_events_applied,
                "predicted_store_hit_tokens_routed": self.store_hit_tokens_routed, "last_error": self.last_error,
                "slots": self.slots, "page_size": self.page_size, "pool_tokens": self.pool_tokens,
                "worker_reqs": self.reported.get("num_reqs") if self.reported else None,
                "others_reqs": self.others()["reqs"], "snapshots": self.snapshots,
                "snapshot_restarts": self.snapshot_restarts}


def _check_worker_url(url: str) -> None:
    """Raise ``ValueError`` naming ``url`` unless it is ``http(s)://HOST[:PORT]`` (a path is kept)."""
    try:
        parsed = httpx.URL(url)
        parsed.port                                   # noqa: B018 - raises for a port that is not a number
    except (httpx.InvalidURL, ValueError) as exc:
        raise ValueError(f"--worker {url!r} is not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--worker {url!r} must be http://HOST:PORT (or https://)")



def _cursor_refused(r: httpx.Response) -> bool:
    """A ``400`` whose OpenAI error body names the ``cursor`` param (a cursor the worker did not give)."""
    if r.status_code != 400:
        return False
    try:
        error = r.json().get("error")
    except ValueError:
        return False
    return isinstance(error, dict) and error.get("param") == "cursor"

class Workers:
    """The workers, their views and the fleet identity, refreshed by :meth:`poll_forever`.

    Args:
        urls: worker base URLs.
        client: the HTTP client for checks (its timeout bounds each).
        health_every: polls between two ``/health`` checks of a healthy worker (>= 1).
        snapshot_page: entries asked for per ``/v1/cache/snapshot`` page (1 to
            :data:`~hybridkv.serve.cache_events.SNAPSHOT_PAGE_MAX`).

    Raises:
        ValueError: no URL, a duplicate, one that is not ``http(s)://HOST[:PORT]``, or a
            ``snapshot_page`` out of range (named).
    """

    def __init__(self, urls: list[str], client: httpx.AsyncClient, health_every: int = 5,
                 snapshot_page: int = SNAPSHOT_PAGE_MAX) -> None:
        for u in urls:
            _check_worker_url(u)
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("at least one --worker URL is needed")
        dup = next((u for u in urls if urls.count(u) > 1), None)
        if dup is not None:
            raise ValueError(f"--worker {dup} is given twice")
        self.states = [WorkerState(u) for u in urls]
        self.client = client
        self.health_every = max(1, health_every)
        if not 1 <= snapshot_page <= SNAPSHOT_PAGE_MAX:
            raise ValueError(f"snapshot_page={snapshot_page} must be in [1, {SNAPSHOT_PAGE_MAX}] (entries)")
        self.snapshot_page = snapshot_page
        self.fleet: FleetIdentity | None = None
        self.stores: dict[str, SharedStoreView] = {}
        self.store_info: dict[str, dict] = {}
        self._polls = 0

    def healthy(self, exclude: set[int] = frozenset()) -> list[int]:
        """Indices of the workers in rotation, less ``exclude``."""
        return [i for i, w in enumerate(self.states) if w.healthy and i not in exclude]

    def shared_store(self, among: list[int]) -> tuple[SharedStoreView, dict] | None:
        """The store every worker of ``among`` writes to (its view and ``/v1/cache/info`` store
        entry), or ``None`` when they do not all share one."""
        ids = {self.states[i].store_id for i in among}
        if len(ids) != 1 or None in ids:
            return None
        (sid,) = ids
        return self.stores[sid], self.store_info[sid]

    def take_out(self, w: WorkerState, why: str) -> None:
        """Take ``w`` out of rotation and forget its cache (``why``: a short reason, logged)."""
        if w.healthy:
            log.warning("worker %s out of rotation: %s", w.url, why)
        elif why != w.last_error:          # never in rotation yet: each new reason once (e.g. a wrong --worker-key)
            log.warning("worker %s not in rotation: %s", w.url, why)
        if w.healthy:                      # a departure; the failed checks of a worker out of rotation
            w.failures += 1                # (start-up included) are no failures of a worker in rotation
        w.healthy, w.epoch, w.after, w.last_error, w.reported, w.synced = False, None, -1, why, None, False
        w.view = self.fleet.view() if self.fleet else InstanceView(1)

    async def poll_once(self) -> None:
        """One round over every worker (concurrently): health when due, then events."""
        due = self._polls % self.health_every == 0
        self._polls += 1
        await asyncio.gather(*(self._poll(w, due) for w in self.states))

    async def poll_forever(self, interval_s: float) -> None:
        """:meth:`poll_once` every ``interval_s`` seconds until cancelled."""
        while True:
            await self.poll_once()
            await asyncio.sleep(interval_s)

    async def follow_forever(self, wait_s: float, idle_s: float) -> None:
        """Long-poll every healthy worker's events (``wait=wait_s`` seconds) until cancelled, so
        an event reaches its view as soon as the worker publishes it; a worker out of rotation
        is looked at again every ``idle_s`` seconds (the periodic poll brings it back)."""
        await asyncio.gather(*(self._follow(w, wait_s, idle_s) for w in self.states))

    async def _follow(self, w: WorkerState, wait_s: float, idle_s: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not w.healthy:
                await asyncio.sleep(idle_s)
                continue
            began = loop.time()
            try:
                got = await self._pull(w, wait_s)
            except FleetMismatch as exc:
                self.take_out(w, str(exc))
                continue
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                self.take_out(w, failure_text(exc))
                continue
            if not got and loop.time() - began < wait_s / 2:
                await asyncio.sleep(idle_s)        # a worker that answers at once (no long poll)

    async def _poll(self, w: WorkerState, due: bool) -> None:
        try:
            if due or not w.healthy:
                await self._check(w)
            if w.healthy and not w.pull_lock.locked():     # locked: a long poll is reading it
                await self._pull(w)
            if w.healthy:
                await self._read_load(w)
        except FleetMismatch as exc:
            self.take_out(w, str(exc))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.take_out(w, failure_text(exc))

    async def _read_load(self, w: WorkerState) -> None:
        """``w``'s ``/get_load`` (rank 0) into :attr:`WorkerState.reported`; a worker without the
        route (404) reports nothing."""
        outs = w.failures
        r = await self.client.get(f"{w.url}/get_load")
        if not w.healthy or w.failures != outs:
            return
        if r.status_code != 200:
            w.reported = None
            return
        ranks = r.json()
        if not isinstance(ranks, list) or not ranks or not isinstance(ranks[0], dict):
            raise ValueError("/get_load answered no rank")
        w.reported = {k: sum(int(x.get(k, 0)) for x in ranks)
                      for k in ("num_reqs", "num_waiting_reqs", "num_tokens", "num_waiting_tokens", "num_decode_tokens")}
        w.own_at_report = (w.load.in_flight, w.load.waiting)

    async def _server_info(self, w: WorkerState, fleet: FleetIdentity) -> None:
        """Slot count, page size and pool size from ``w``'s ``/server_info`` (left ``None`` for a
        worker without the route).

        Raises:
            FleetMismatch: its page size is not the ``block_size`` of its ``/v1/cache/info``.
        """
        r = await self.client.get(f"{w.url}/server_info")
        if r.status_code != 200:
            w.slots = w.page_size = w.pool_tokens = None
            return
        info = r.json()
        slots, page, pool = info.get("max_running_requests"), info.get("page_size"), info.get("max_total_tokens")
        w.slots = int(slots) if isinstance(slots, int) and slots >= 1 else None
        w.page_size = int(page) if isinstance(page, int) and page >= 1 else None
        w.pool_tokens = int(pool) if isinstance(pool, int) and pool >= 1 else None
        if w.page_size is not None and w.page_size != fleet.block_size:
            raise FleetMismatch(f"worker {w.url}: /server_info page_size {w.page_size} differs from its "
                                f"/v1/cache/info block_size {fleet.block_size}")

    async def _check(self, w: WorkerState) -> None:
        r = await self.client.get(f"{w.url}/health")
        if r.status_code != 200:
            raise ValueError(f"/health answered {r.status_code}")
        if w.healthy:
            return
        r = await self.client.get(f"{w.url}/v1/cache/info")
        if r.status_code in (401, 403):
            raise ValueError(f"its /v1/cache/info answered {r.status_code}: the router needs the worker's admin key "
                             "(--worker-key or $HYBRIDKV_WORKER_KEY)")
        r.raise_for_status()
        info = r.json()
        fleet = FleetIdentity.from_info(info)
        if self.fleet is None:
            self.fleet = fleet
        elif fleet != self.fleet:
            raise FleetMismatch(f"worker {w.url} hashes prompts differently from the fleet "
                                "(another model, weights, tokenizer, prefix_match_unit or cache groups)")
        store = info.get("store")
        if store is not None:
            sid = str(store["id"])
            if sid not in self.stores:
                self.stores[sid] = SharedStoreView(fleet.unit, int(store["alignment"]), fleet.family)
                self.store_info[sid] = {k: int(store[k]) for k in ("alignment", "kv_bytes_per_token",
                                                                   "checkpoint_bytes")}
            elif int(store["alignment"]) != self.stores[sid].alignment:
                raise FleetMismatch(f"worker {w.url} writes store entries of {store['alignment']} tokens to a "
                                    f"store other workers write {self.stores[sid].alignment}-token entries to")
            w.store_id = sid
        else:
            w.store_id = None
        await self._server_info(w, fleet)
        if w.failures == 0:                # never left rotation: the errors are those of its start-up
            w.last_error = ""
        w.reported = None
        w.view, w.epoch, w.after, w.healthy = fleet.view(), int(info["epoch"]), -1, True
        await self._snapshot(w)            # what it cached before this router saw its events
        log.info("worker %s in rotation (epoch %d)", w.url, w.epoch)

    async def _snapshot(self, w: WorkerState) -> bool:
        """Replace ``w``'s view with its ``/v1/cache/snapshot`` (every entry its device cache holds
        now, read page by page: :attr:`snapshot_page` entries each, following ``next_cursor``) and
        follow that snapshot's epoch from its first event; ``False`` (the view left as it is) for
        a worker without the route, or whose snapshot changed under every one of
        :data:`SNAPSHOT_RESTARTS` tries. Every page must carry the first page's ``generation``
        and ``epoch``; a page of another one, a ``410`` (the worker dropped the snapshot: a
        purge started a new epoch), or a ``400`` naming the ``cursor`` (a worker restarted at the
        same URL: its cursors are keyed by a per-process secret, so one of its earlier process is
        not its own) restarts the read from its first page
        (``snapshot_restarts`` counts these). The epoch's events applied over the snapshot give
        the cache as it is (:meth:`_pull`): an event before the snapshot was taken repeats what
        the snapshot holds, or is undone by a later one, as the cache did."""
        outs = w.failures
        for _try in range(SNAPSHOT_RESTARTS):
            kv: list[bytes] = []                               # as bytes: half the size of the hex
            checkpoints: list[bytes] = []
            params: dict = {"limit": self.snapshot_page}
            first = None                                        # (generation, epoch) of the first page
            while True:
                r = await self.client.get(f"{w.url}/v1/cache/snapshot", params=params)
                if not w.healthy or w.failures != outs:
                    return False
                if first is not None and (r.status_code == 410 or _cursor_refused(r)):
                    break          # dropped under us, or a restarted worker never gave it: start again
                if r.status_code != 200:
                    return False
                snap = r.json()
                mark = (snap.get("generation"), int(snap["epoch"]))
                if first is None:
                    first = mark
                elif mark != first:
                    break
                kv.extend(map(bytes.fromhex, snap["kv"]))
                checkpoints.extend(map(bytes.fromhex, snap["checkpoints"]))
                cursor = snap.get("next_cursor")
                if not cursor:
                    self._install_snapshot(w, first[1], kv, checkpoints)
                    return True
                params = {"cursor": cursor, "limit": self.snapshot_page}
            w.snapshot_restarts += 1
        log.warning("worker %s: its cache snapshot changed during each of %d reads; its view starts empty",
                    w.url, SNAPSHOT_RESTARTS)
        return False

    def _install_snapshot(self, w: WorkerState, epoch: int, kv: list[bytes], checkpoints: list[bytes]) -> None:
        """``w``'s view rebuilt from a whole snapshot of ``epoch`` (its units' and checkpoints' keys)."""
        view = self.fleet.view()
        view.epoch = 0                # the epoch _pull's events carry: the first one must not clear the snapshot
        for name in view.family.prefix_names:                   # a page holds every paged group
            view.held[name].update(kv)
        view.checkpoints.update(k for k in checkpoints if k in view.kv)
        w.view, w.epoch, w.after, w.synced = view, epoch, -1, True
        w.snapshots += 1

    async def _pull(self, w: WorkerState, wait_s: float = 0.0) -> int:
        """Read ``w``'s new events into its view and the store's (the first page may wait up to
        ``wait_s`` seconds for one); returns events applied."""
        applied = 0
        outs = w.failures                              # a take_out in the meantime makes this answer stale
        async with w.pull_lock:
            for page_no in range(MAX_PAGES_PER_POLL):
                params = {"epoch": w.epoch if w.epoch is not None else -1, "after": w.after}
                timeout = self.client.timeout
                if wait_s > 0 and page_no == 0:
                    params["wait"] = wait_s       # the worker may hold the answer that long: read longer
                    timeout = httpx.Timeout(timeout.read + wait_s if timeout.read is not None else None,
                                            connect=timeout.connect)
                r = await self.client.get(f"{w.url}/v1/cache/events", params=params, timeout=timeout)
                r.raise_for_status()
                page = r.json()
                if not w.healthy or w.failures != outs:   # taken out while the answer was on its way
                    return applied
                if page["epoch"] != w.epoch or (page["gap"] and not (w.synced and w.after < 0)):
                    # a purge or restart started a new epoch, or events were missed: what survives
                    # comes from a snapshot (a purge of one tenant keeps the others' entries), then
                    # this epoch's events from its first are read again over it
                    w.views_dropped += 1
                    if await self._snapshot(w):
                        continue
                    w.view, w.epoch, w.after, w.synced = self.fleet.view(), int(page["epoch"]), -1, False
                store = self.stores.get(w.store_id) if w.store_id is not None else None
                for e in page["events"]:
                    event = CacheEvent(0, 0, int(e["seq"]), EventKind(e["kind"]),
                                       tuple(bytes.fromhex(k) for k in e["keys"]), group=e.get("group"))
                    if e.get("medium", "device") == "store":
                        if store is not None:
                            store.apply(event)
                            w.store_events_applied += 1
                    elif event.kind is EventKind.ALL_CLEARED and w.synced:
                        pass                  # the epoch's start, which the snapshot already shows
                    else:
                        w.view.apply(event)
                        w.events_applied += 1
                    applied += 1
                w.after = int(page["next"]) - 1
                if not page["more"]:
                    break
        return applied
