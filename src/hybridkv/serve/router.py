"""``hybridkv router``: an HTTP router in front of several ``hybridkv serve`` workers.

Each completion or chat request is tokenized as the workers do it (the same
:mod:`hybridkv.serve.tokenizer` code and chat template, the same namespace with tenant and
``cache_salt``), hashed per ``prefix_match_unit``, and handed to the fleet replay's routers
(:func:`~hybridkv.fleet.routers.make_router`) with one view per worker built from that worker's
cache events (:mod:`hybridkv.serve.fleet_view`) and the load this router put on it. The request
body is forwarded unchanged and the answer, SSE included, streamed back unchanged. A request whose
connection to a worker fails is retried once on another worker (that worker leaves rotation).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (passed
through), ``GET /health`` (200 while a worker is in rotation), ``GET /router/stats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hybridkv.cache.groups import reuse_cap
from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.fleet.routers import FleetState, RouteRequest, Router, RouterConfig, make_router
from hybridkv.serve.fleet_view import Workers, WorkerState
from hybridkv.serve.protocol import APIError, parse_generation, parse_prompts
from hybridkv.serve.tokenizer import Codec

log = logging.getLogger("hybridkv.serve.router")

FORWARDED_HEADERS = ("content-type", "x-tenant", "authorization", "accept")
"""Request headers passed to the worker (the rest, Host and Content-Length included, are not)."""


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """What ``hybridkv router`` was started with (seconds as named).

    Attributes:
        policy: a :data:`~hybridkv.fleet.routers.ROUTER_NAMES` name.
        cost: prices prefill for ``hybrid`` (queue and saved seconds).
        poll_interval_s: seconds between two event polls of every worker.
        health_every: polls between two ``/health`` checks of a worker in rotation.
        connect_timeout_s: connecting to a worker; longer counts as a failed connection.
        default_max_tokens: output tokens assumed when a request leaves ``max_tokens`` out.
    """

    policy: str
    cost: StepCostModel
    poll_interval_s: float = 0.2
    health_every: int = 5
    connect_timeout_s: float = 2.0
    default_max_tokens: int = 16


class _Ticket:
    """One proxied request's share of a worker's load, returned exactly once per part."""

    def __init__(self, w: WorkerState, tokens: int, output: int, seconds: float) -> None:
        self.w, self.tokens, self.output, self.seconds = w, tokens, output, seconds
        self.waiting, self.closed = True, False
        ld = w.load
        ld.outstanding_tokens += tokens
        ld.queued_seconds += seconds
        ld.in_flight += 1
        ld.in_flight_tokens += tokens + output
        ld.routed += 1

    def first_byte(self) -> None:
        if self.waiting:
            self.waiting = False
            self.w.load.outstanding_tokens -= self.tokens
            self.w.load.queued_seconds = max(0.0, self.w.load.queued_seconds - self.seconds)

    def done(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.first_byte()
        self.w.load.in_flight -= 1
        self.w.load.in_flight_tokens -= self.tokens + self.output


class RouterService:
    """The router's state and handlers.

    Args:
        urls: worker base URLs.
        codec: the workers' tokenizer (``load_codec`` of the same ``--model``).
        settings: policy and timings.

    Raises:
        ValueError: an unknown policy, no worker or a duplicate (named).
    """

    def __init__(self, urls: list[str], codec: Codec, settings: RouterSettings) -> None:
        self.codec, self.settings = codec, settings
        self.control = httpx.AsyncClient(timeout=httpx.Timeout(5.0, connect=settings.connect_timeout_s))
        self.proxy = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=settings.connect_timeout_s))
        self.workers = Workers(urls, self.control, settings.health_every)
        self._routers: dict[tuple[int, ...], Router] = {}
        self.retries = 0
        self.unroutable = 0
        self._config(1, 1)                     # an unknown policy fails now, not at the first request
        self._task: asyncio.Task | None = None

    def _config(self, unit: int, block_size: int) -> RouterConfig:
        cfg = RouterConfig(name=self.settings.policy, unit=unit, block_size=block_size, cost=self.settings.cost)
        make_router(cfg)
        return cfg

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """First health round, then the background poll task."""
        await self.workers.poll_once()
        self._task = asyncio.create_task(self.workers.poll_forever(self.settings.poll_interval_s))

    async def stop(self) -> None:
        """Stop polling and close the HTTP clients."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.control.aclose()
        await self.proxy.aclose()

    # -- routing ---------------------------------------------------------------------
    def route_request(self, body: dict | None, headers, chat: bool) -> RouteRequest:
        """What the routers see of a request: its first prompt's unit hashes under the request's
        tenant and salt. A body the workers will reject (or no fleet identity yet) gives an empty
        request, routed on load alone; the worker then answers the error."""
        fleet = self.workers.fleet
        if fleet is None or not isinstance(body, dict):
            return RouteRequest([], 0, 0, self.settings.default_max_tokens)
        try:
            gen = parse_generation(body, headers.get("x-tenant"), self.settings.default_max_tokens, fleet.unit)
            ids = self.codec.chat(body.get("messages")) if chat else parse_prompts(body.get("prompt"),
                                                                                   self.codec.encode)[0]
        except (APIError, ValueError, TypeError):
            return RouteRequest([], 0, 0, self.settings.default_max_tokens)
        return RouteRequest(fleet.hashes(ids, gen.tenant, gen.cache_salt), len(ids),
                            reuse_cap(len(ids), fleet.unit), gen.max_tokens)

    def pick(self, req: RouteRequest, exclude: set[int]) -> int | None:
        """The worker for ``req`` among those in rotation less ``exclude`` (``None``: none left).
        Each set of workers in rotation has its own router, so a router's own state (round-robin
        turn, ``prefix`` trees) stays indexed consistently while a worker is away."""
        live = self.workers.healthy(exclude)
        if not live:
            return None
        key = tuple(live)
        router = self._routers.get(key)
        if router is None:
            fleet = self.workers.fleet
            router = self._routers[key] = make_router(self._config(fleet.unit if fleet else 1,
                                                                    fleet.block_size if fleet else 1))
        states = [self.workers.states[i] for i in live]
        j = router.route(req, FleetState([w.view for w in states], [w.load for w in states]))
        w = states[j]
        w.hit_tokens_routed += w.view.match(req.hashes, req.limit).hit if req.hashes else 0
        return live[j]

    # -- handlers --------------------------------------------------------------------
    async def completions(self, request: Request):
        """``POST /v1/completions``, routed and proxied."""
        return await self._proxy(request, "/v1/completions", chat=False)

    async def chat(self, request: Request):
        """``POST /v1/chat/completions``, routed and proxied."""
        return await self._proxy(request, "/v1/chat/completions", chat=True)

    async def _proxy(self, request: Request, path: str, chat: bool):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            body = None                                    # the worker answers the 400
        req = self.route_request(body, request.headers, chat)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        seconds = self.settings.cost.prefill_seconds(0, req.prompt_tokens) if req.prompt_tokens else 0.0
        tried: set[int] = set()
        for _attempt in range(2):
            i = self.pick(req, tried)
            if i is None:
                break
            w = self.workers.states[i]
            ticket = _Ticket(w, req.prompt_tokens, req.output_tokens, seconds)
            try:
                upstream = await self.proxy.send(self.proxy.build_request("POST", w.url + path, content=raw,
                                                                          headers=headers), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                ticket.done()
                self.workers.take_out(w, f"connection failed: {type(exc).__name__}")
                tried.add(i)
                self.retries += 1
                continue
            except httpx.HTTPError as exc:
                ticket.done()
                return _error(502, f"worker {w.url} failed: {type(exc).__name__}", "bad_gateway")
            return _ProxiedResponse(upstream, ticket)
        self.unroutable += 1
        return _error(503, "no worker is in rotation; retry shortly", "no_healthy_worker")

    async def models(self):
        """``GET /v1/models`` from a worker in rotation (the next one if it cannot be reached)."""
        for i in self.workers.healthy():
            w = self.workers.states[i]
            try:
                r = await self.control.get(f"{w.url}/v1/models")
            except httpx.HTTPError as exc:
                self.workers.take_out(w, f"/v1/models failed: {type(exc).__name__}")
                continue
            return JSONResponse(r.json(), status_code=r.status_code)
        return _error(503, "no worker is in rotation; retry shortly", "no_healthy_worker")

    async def health(self):
        """``GET /health``: 200 while at least one worker is in rotation, else 503."""
        n = len(self.workers.healthy())
        return JSONResponse({"status": "ok" if n else "no worker in rotation", "workers_in_rotation": n},
                            status_code=200 if n else 503)

    async def stats(self) -> dict:
        """``GET /router/stats``: the policy, per-worker counters, retries."""
        return {"policy": self.settings.policy, "retries": self.retries, "unroutable": self.unroutable,
                "workers": [w.stats() for w in self.workers.states]}


class _ProxiedResponse(StreamingResponse):
    """The worker's answer streamed through; its load and connection are returned however the
    response ends (a client gone before the first chunk included, when the body iterator never
    starts and so never runs its own cleanup)."""

    def __init__(self, upstream: httpx.Response, ticket: _Ticket) -> None:
        super().__init__(_relay(upstream, ticket), status_code=upstream.status_code,
                         media_type=upstream.headers.get("content-type"))
        self._upstream, self._ticket = upstream, ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ticket.done()
            await self._upstream.aclose()


async def _relay(upstream: httpx.Response, ticket: _Ticket):
    """The worker's answer, bytes unchanged; the ticket's load returned as it goes."""
    try:
        async for chunk in upstream.aiter_raw():
            ticket.first_byte()
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("worker %s broke off an answer: %s", ticket.w.url, type(exc).__name__)
    finally:
        ticket.done()
        await upstream.aclose()


def _error(status: int, message: str, code: str) -> JSONResponse:
    body = APIError(status, message, None, code, "server_error").body()
    return JSONResponse(body, status_code=status, headers={"Retry-After": "1"} if status == 503 else None)


def create_router_app(service: RouterService) -> FastAPI:
    """The router's FastAPI app; its lifespan starts and stops the poll task (uvicorn ``lifespan="on"``)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="hybridkv router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.post("/v1/completions")(service.completions)
    app.post("/v1/chat/completions")(service.chat)
    app.get("/v1/models")(service.models)
    app.get("/health")(service.health)
    app.get("/router/stats")(service.stats)
    return app
