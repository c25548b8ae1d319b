"""What ``hybridkv router`` knows of its workers: health, cache views from their events, load.

One :class:`WorkerState` per ``--worker`` URL. :class:`Workers` refreshes them from a background
task: ``GET /health`` every ``health_every`` polls (and on every poll while a worker is out of
rotation), and ``GET /v1/cache/events`` pages on every poll of a healthy worker. A worker enters
rotation once ``/health`` answers 200 and its ``/v1/cache/info`` names the same cache identity as
the fleet's (the first worker seen sets it); it leaves rotation, its view cleared, when a check or
a proxied connection fails. A new epoch (a restart, a purge) or a gap in the events replaces its
view with an empty one. Logs name workers by URL only, never prompts, ids or hashes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from hybridkv.cache.namespace import CacheIdentity, bind_namespace, chained_block_hashes
from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView
from hybridkv.fleet.routers import InstanceLoad

log = logging.getLogger("hybridkv.serve.router")

MAX_PAGES_PER_POLL = 16
"""Event pages read from one worker per poll (the rest waits for the next poll)."""


class FleetMismatch(ValueError):
    """A worker whose cache identity or units differ from the fleet's (it is kept out of rotation)."""


@dataclass(frozen=True, slots=True)
class FleetIdentity:
    """How every worker of the fleet hashes prompts (from ``/v1/cache/info``; units in tokens)."""

    identity: tuple[tuple[str, str], ...]
    binding: bytes
    unit: int
    block_size: int
    vocab_size: int

    @classmethod
    def from_info(cls, info: dict) -> FleetIdentity:
        """From a ``/v1/cache/info`` body. Raises ``KeyError`` / ``ValueError`` on a malformed one."""
        return cls(tuple(sorted((str(k), str(v)) for k, v in info["identity"].items())),
                   bytes.fromhex(info["binding"]), int(info["prefix_match_unit"]), int(info["block_size"]),
                   int(info["vocab_size"]))

    def hashes(self, ids: list[int], tenant: str, salt: str) -> list[bytes]:
        """Chained unit hashes of prompt ``ids`` for ``tenant`` / ``salt``, as the workers compute them."""
        ns = CacheIdentity(**dict(self.identity), tenant=tenant, cache_salt=salt).digest()
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
        events_applied, views_dropped, failures: counters.
        last_error: why it last left rotation (no prompt content).
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
    last_error: str = ""

    def stats(self) -> dict:
        """JSON-ready counters (key counts, never keys)."""
        ld = self.load
        return {"url": self.url, "healthy": self.healthy, "epoch": self.epoch, "routed": ld.routed,
                "in_flight": ld.in_flight, "outstanding_tokens": ld.outstanding_tokens,
                "kv_keys": len(self.view.kv), "checkpoint_keys": len(self.view.checkpoints),
                "events_applied": self.events_applied, "views_dropped": self.views_dropped,
                "failures": self.failures, "predicted_hit_tokens_routed": self.hit_tokens_routed,
                "last_error": self.last_error}


class Workers:
    """The workers, their views and the fleet identity, refreshed by :meth:`poll_forever`.

    Args:
        urls: worker base URLs.
        client: the HTTP client for checks (its timeout bounds each).
        health_every: polls between two ``/health`` checks of a healthy worker (>= 1).

    Raises:
        ValueError: no URL, or a duplicate (named).
    """

    def __init__(self, urls: list[str], client: httpx.AsyncClient, health_every: int = 5) -> None:
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("at least one --worker URL is needed")
        dup = next((u for u in urls if urls.count(u) > 1), None)
        if dup is not None:
            raise ValueError(f"--worker {dup} is given twice")
        self.states = [WorkerState(u) for u in urls]
        self.client = client
        self.health_every = max(1, health_every)
        self.fleet: FleetIdentity | None = None
        self._polls = 0

    def healthy(self, exclude: set[int] = frozenset()) -> list[int]:
        """Indices of the workers in rotation, less ``exclude``."""
        return [i for i, w in enumerate(self.states) if w.healthy and i not in exclude]

    def take_out(self, w: WorkerState, why: str) -> None:
        """Take ``w`` out of rotation and forget its cache (``why``: a short reason, logged)."""
        if w.healthy:
            log.warning("worker %s out of rotation: %s", w.url, why)
        w.healthy, w.epoch, w.after, w.last_error = False, None, -1, why
        w.failures += 1
        w.view = InstanceView(self.fleet.unit if self.fleet else 1)

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

    async def _poll(self, w: WorkerState, due: bool) -> None:
        try:
            if due or not w.healthy:
                await self._check(w)
            if w.healthy:
                await self._pull(w)
        except FleetMismatch as exc:
            self.take_out(w, str(exc))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.take_out(w, f"{type(exc).__name__}: {exc}"[:200])

    async def _check(self, w: WorkerState) -> None:
        r = await self.client.get(f"{w.url}/health")
        if r.status_code != 200:
            raise ValueError(f"/health answered {r.status_code}")
        if w.healthy:
            return
        r = await self.client.get(f"{w.url}/v1/cache/info")
        r.raise_for_status()
        info = r.json()
        fleet = FleetIdentity.from_info(info)
        if self.fleet is None:
            self.fleet = fleet
        elif fleet != self.fleet:
            raise FleetMismatch(f"worker {w.url} hashes prompts differently from the fleet "
                                "(another model, weights, tokenizer or prefix_match_unit)")
        w.view, w.epoch, w.after, w.healthy = InstanceView(fleet.unit), int(info["epoch"]), -1, True
        log.info("worker %s in rotation (epoch %d)", w.url, w.epoch)

    async def _pull(self, w: WorkerState) -> None:
        for _ in range(MAX_PAGES_PER_POLL):
            r = await self.client.get(f"{w.url}/v1/cache/events",
                                      params={"epoch": w.epoch if w.epoch is not None else -1, "after": w.after})
            r.raise_for_status()
            page = r.json()
            if page["epoch"] != w.epoch or page["gap"]:
                w.view, w.epoch, w.after = InstanceView(self.fleet.unit), int(page["epoch"]), -1
                w.views_dropped += 1
            for e in page["events"]:
                w.view.apply(CacheEvent(0, 0, int(e["seq"]), EventKind(e["kind"]),
                                        tuple(bytes.fromhex(k) for k in e["keys"])))
                w.events_applied += 1
            w.after = int(page["next"]) - 1
            if not page["more"]:
                return
