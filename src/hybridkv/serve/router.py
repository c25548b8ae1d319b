"""``hybridkv router``: an HTTP router in front of several ``hybridkv serve`` workers.

Each completion or chat request is tokenized as the workers do it (the same
:mod:`hybridkv.serve.tokenizer` code and chat template, the same namespace with tenant and
``cache_salt``), hashed per ``prefix_match_unit``, and handed to the fleet replay's routers
(:func:`~hybridkv.fleet.routers.make_router`) with one view per worker built from that worker's
cache events (:mod:`hybridkv.serve.fleet_view`), the load this router put on it, and, when the
workers share a store tier, one view of that store built from all their ``medium: store`` events
(so ``hybrid`` prices a store hit on any worker at its transfer cost, as the fleet replay does).
The request body is forwarded unchanged and the answer, SSE included, streamed back unchanged. A
completion whose ``prompt`` is a batch is split: each prompt is routed on its own and sent as a
one-prompt request, and the answers are put back together in order (``choices[i].index`` = ``i``,
``usage`` summed; streamed chunks are merged as they come, indexes rewritten). A request whose
connection to a worker fails is retried once on another worker (that worker leaves rotation).

A purge (``POST /admin/cache/invalidate``, ``POST /flush_cache``) is checked by the workers'
rules (a key bound to a tenant purges that tenant's entries only), sent to every worker, and
answered with the counts summed and each worker's own answer; a worker that cannot be reached,
does not answer within ``--purge-timeout`` or refuses makes it a 502 naming that worker (a
tenant's answer names no worker and lists no per-worker answers). Each worker that purged has
its view read again (its new epoch, from its ``/v1/cache/snapshot``) before the answer, so no
later request is routed for entries it no longer holds.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (passed
through), ``GET /health`` (200 while a worker is in rotation), ``GET /router/stats``,
``POST /admin/cache/invalidate``, ``POST /flush_cache``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridkv.cache.groups import reuse_cap
from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.fleet.routers import (
    FleetState,
    HybridOptions,
    InstanceLoad,
    PrefixOptions,
    Router,
    RouterConfig,
    RouteRequest,
    kv_admission,
    make_router,
    priced_prefill,
)
from hybridkv.fleet.store import (
    MOONCAKE_GET_LATENCY_S,
    MOONCAKE_LOAD_BYTES_PER_S,
    StoreCost,
)
from hybridkv.serve.auth import (
    AuthMiddleware,
    KeyRing,
    forwarded_headers,
    invalidate_scope,
    principal_of,
    router_route_kind,
)
from hybridkv.serve.cache_events import SNAPSHOT_PAGE_MAX
from hybridkv.serve.fleet_view import Workers, WorkerState
from hybridkv.serve.protocol import (
    APIError,
    check_fields,
    json_object,
    parse_generation,
    parse_prompts,
    read_body,
    tenant_header,
)
from hybridkv.serve.tokenizer import Codec

log = logging.getLogger("hybridkv.serve.router")

DEFAULT_MAX_TREE_TOKENS = 1 << 22
"""``--max-tree-tokens`` default: 4,194,304 tokens per worker's ``prefix`` tree (65,536 nodes at a
64-token ``prefix_match_unit``; SGLang's router bounds each tree at 2**26 characters, about
2**24 tokens)."""

PROXY_KEEPALIVE_S = 2.0
"""Seconds an idle connection to a worker stays pooled: below uvicorn's default keep-alive
timeout (5 s) that ``hybridkv serve`` runs with, so the router drops it before the worker does."""

PURGE_TIMEOUT_S = 10.0
"""Seconds the router waits for each worker's whole purge answer by default (``--purge-timeout``;
``RouterSettings.purge_timeout_s``): a purge first lets the worker's prefetches in flight end and
its queued store writes land, which takes well under a second unless a store is slow. A worker
past it (hung, stopped, or behind a slow store) is reported as failed; its purge may still
complete there, and sending the purge again is harmless."""

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
        follow_wait_s: seconds of each long poll of a worker's events (``wait``), so events
            arrive as they are published; 0 turns long polling off (periodic polls only).
        store_bytes_per_s, store_latency_s: the shared store's load bandwidth (bytes/s) and
            seconds per object for ``hybrid``'s transfer cost (default: the Mooncake figures
            measured in docs/results/store.md); ``store_bytes_per_s`` 0: ignore the store.
        hybrid: ``hybrid``'s options (:class:`~hybridkv.fleet.routers.HybridOptions`).
        max_tree_tokens: ``prefix`` / ``prefix-smg``: tokens each worker's tree keeps, least
            recently used leaves evicted past it (:class:`~hybridkv.fleet.routers.PrefixOptions`).
        keys: the keys clients must send (:class:`~hybridkv.serve.auth.KeyRing`; a key bound to a
            tenant makes its requests that tenant's, passed on in ``X-Tenant``); ``None``: open.
        worker_key: the key sent to every worker (their admin key; never shown by ``repr``);
            ``None``: a client's ``Authorization`` header is forwarded as it came.
        snapshot_page: entries asked for per page of a worker's ``/v1/cache/snapshot`` (1 to
            :data:`~hybridkv.serve.cache_events.SNAPSHOT_PAGE_MAX`).
        purge_timeout_s: seconds the router waits for each worker's whole answer to a purge
            (:data:`PURGE_TIMEOUT_S`); a worker past it is reported as failed.
    """

    policy: str
    cost: StepCostModel
    poll_interval_s: float = 0.2
    health_every: int = 5
    connect_timeout_s: float = 2.0
    default_max_tokens: int = 16
    follow_wait_s: float = 2.0
    store_bytes_per_s: float = MOONCAKE_LOAD_BYTES_PER_S
    store_latency_s: float = MOONCAKE_GET_LATENCY_S
    hybrid: HybridOptions = HybridOptions()
    max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS
    keys: KeyRing | None = None
    worker_key: str | None = field(default=None, repr=False)
    snapshot_page: int = SNAPSHOT_PAGE_MAX
    purge_timeout_s: float = PURGE_TIMEOUT_S


class _Ticket:
    """One proxied request's share of a worker's load, returned exactly once per part: waiting
    (``InstanceLoad.waiting``, ``outstanding_tokens``, ``queued_seconds``) until its first byte,
    and its ``output - 1`` tokens after the first (``decode_tokens``) until it is done (the
    router does not count streamed tokens, so a decode counts whole until it ends); ``pages``
    (:func:`~hybridkv.fleet.routers.kv_admission`) are held until it is done, their prefill
    tokens until its first byte."""

    def __init__(self, w: WorkerState, tokens: int, output: int, seconds: float,
                 pages: tuple = ((), False, 0)) -> None:
        self.w, self.tokens, self.output, self.seconds, self.pages = w, tokens, output, seconds, pages
        self.waiting, self.closed = True, False
        ld = w.load
        ld.hold(*pages)
        ld.outstanding_tokens += tokens
        ld.queued_seconds += seconds
        ld.in_flight += 1
        ld.in_flight_tokens += tokens + output
        ld.routed += 1
        ld.waiting += 1
        ld.decode_tokens += max(output - 1, 0)

    def first_byte(self) -> None:
        if self.waiting:
            self.waiting = False
            self.w.load.outstanding_tokens -= self.tokens
            self.w.load.queued_seconds = max(0.0, self.w.load.queued_seconds - self.seconds)
            self.w.load.waiting -= 1
            self.w.load.prefill_tokens -= self.pages[2]

    def done(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.first_byte()
        self.w.load.in_flight -= 1
        self.w.load.in_flight_tokens -= self.tokens + self.output
        self.w.load.decode_tokens -= max(self.output - 1, 0)
        self.w.load.release(self.pages[0], self.pages[1])


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
        auth = {"Authorization": f"Bearer {settings.worker_key}"} if settings.worker_key else None
        self.control = httpx.AsyncClient(timeout=httpx.Timeout(5.0, connect=settings.connect_timeout_s), headers=auth)
        # idle pooled connections are dropped after 2 s, before a uvicorn worker's 5 s keep-alive
        # closes them: httpx's default (5 s) races the worker's close, and a request sent on a
        # connection the worker is closing fails after connecting (a 502, not a retried refusal)
        self.proxy = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=settings.connect_timeout_s),
                                       limits=httpx.Limits(keepalive_expiry=PROXY_KEEPALIVE_S), headers=auth)
        self.workers = Workers(urls, self.control, settings.health_every, settings.snapshot_page)
        self._routers: dict[tuple[int, ...], Router] = {}
        self._store_costs: dict[tuple[int, ...], StoreCost | None] = {}     # the same keys: each router's store
        self.retries = 0
        self.unroutable = 0
        self.split_batches = 0
        # an unknown policy fails now, not at the first request; kv-overlap's page counts are kept only for it
        self._uses_pages = make_router(self._config(1, 1)).uses_pages
        self._tasks: list[asyncio.Task] = []
        self.stopping = _Stopping()

    def _config(self, unit: int, block_size: int, store: dict | None = None, slots: int = 1) -> RouterConfig:
        """The fleet router's config: units from ``/v1/cache/info``, ``max_num_seqs`` the workers'
        slot count (``/server_info`` ``max_running_requests``), the store's transfer cost."""
        cost = None
        if store is not None and self.settings.store_bytes_per_s > 0:
            cost = StoreCost(bytes_per_s=self.settings.store_bytes_per_s, latency_s=self.settings.store_latency_s,
                             alignment=store["alignment"], kv_bytes_per_token=store["kv_bytes_per_token"],
                             checkpoint_bytes=store["checkpoint_bytes"])
        cfg = RouterConfig(name=self.settings.policy, unit=unit, block_size=block_size, cost=self.settings.cost,
                           store=cost, hybrid=self.settings.hybrid, max_num_seqs=slots,
                           prefix=PrefixOptions(max_tree_tokens=self.settings.max_tree_tokens))
        make_router(cfg)
        return cfg

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """First health round, then the background poll task (and the long polls, if on)."""
        await self.workers.poll_once()
        s = self.settings
        self._tasks = [asyncio.create_task(self.workers.poll_forever(s.poll_interval_s))]
        if s.follow_wait_s > 0:
            self._tasks.append(asyncio.create_task(self.workers.follow_forever(s.follow_wait_s,
                                                                               min(s.poll_interval_s, 1.0))))

    def end_running(self, reason: str) -> int:
        """End every answer still being relayed (on the event loop, when the router stops): a
        stream gets an error chunk with ``reason`` (code ``server_shutdown``) and ``[DONE]``, and
        its worker connection is closed (the worker then cancels the generation). Returns how
        many answers were ended."""
        return self.stopping.end(reason)

    async def stop(self) -> None:
        """Stop polling and close the HTTP clients."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.control.aclose()
        await self.proxy.aclose()

    # -- routing ---------------------------------------------------------------------
    def route_request(self, body: dict | None, headers, chat: bool) -> RouteRequest:
        """What the routers see of a request: its (first) prompt's unit hashes under the request's
        tenant and salt. A body the workers will reject (or no fleet identity yet) gives an empty
        request, routed on load alone; the worker then answers the error."""
        return self.route_requests(body, headers, chat)[0]

    def route_requests(self, body: dict | None, headers, chat: bool) -> list[RouteRequest]:
        """One :class:`RouteRequest` per prompt of the request (a completion's batch gives
        several; a chat one); one empty request when the body will be rejected."""
        fleet = self.workers.fleet
        empty = [RouteRequest([], 0, 0, self.settings.default_max_tokens)]
        if fleet is None or not isinstance(body, dict):
            return empty
        try:
            gen = parse_generation(body, headers.get("x-tenant"), self.settings.default_max_tokens, fleet.unit)
            batch = [self.codec.chat(body.get("messages"))] if chat else parse_prompts(body.get("prompt"),
                                                                                      self.codec.encode)
        except (APIError, ValueError, TypeError):
            return empty
        return [RouteRequest(fleet.hashes(ids, gen.tenant, gen.cache_salt, gen.adapter, gen.adapter_version), len(ids),
                             reuse_cap(len(ids), fleet.unit), gen.max_tokens) for ids in batch]

    def pick(self, req: RouteRequest, exclude: set[int]) -> int | None:
        """The worker for ``req`` among those in rotation less ``exclude`` (``None``: none left).
        Each set of workers in rotation (with or without a store they all share) has its own
        router, so a router's own state (round-robin turn, ``prefix`` trees) stays indexed
        consistently while a worker is away."""
        picked = self._pick(req, exclude)
        return None if picked is None else picked[0]

    def _pick(self, req: RouteRequest, exclude: set[int]) -> tuple[int, float] | None:
        """:meth:`pick`, with the seconds of prefill the request will queue on the worker (its
        ``queued_seconds`` share): the router's own price
        (:meth:`~hybridkv.fleet.routers.Router.expected_seconds`), else the prefill past the
        worker's joint hit, or past the shared store's plus its load when that lies deeper
        (:func:`~hybridkv.fleet.routers.priced_prefill`)."""
        live = self.workers.healthy(exclude)
        if not live:
            return None
        shared = self.workers.shared_store(live) if self.settings.store_bytes_per_s > 0 else None
        store_view, store_info = shared if shared is not None else (None, None)
        states = [self.workers.states[i] for i in live]
        # the fewest slots any of them has (a worker that does not say: one, as before it is known)
        slots = min(w.slots or 1 for w in states)
        key = (tuple(live), self.workers.states[live[0]].store_id if shared is not None else None, slots)
        router = self._routers.get(key)
        if router is None:
            fleet = self.workers.fleet
            cfg = self._config(fleet.unit if fleet else 1, fleet.block_size if fleet else 1, store_info, slots)
            router = self._routers[key] = make_router(cfg)
            self._store_costs[key] = cfg.store
        j = router.route(req, FleetState([w.view for w in states], [self._fleet_load(w) for w in states],
                                         store_view))
        w = states[j]
        seconds = router.expected_seconds()
        if req.hashes:
            kv_hit, local = w.view.hits(req.hashes, req.limit)
            w.hit_tokens_routed += local
            store_hit = store_view.match(req.hashes, req.limit).hit if store_view is not None else 0
            w.store_hit_tokens_routed += max(0, store_hit - local)
            if seconds is None:
                seconds = priced_prefill(self.settings.cost, self._store_costs[key], req.prompt_tokens, kv_hit, local,
                                         store_hit)[0]
        elif seconds is None:
            seconds = self.settings.cost.prefill_seconds(0, req.prompt_tokens) if req.prompt_tokens else 0.0
        return live[j], seconds

    def _fleet_load(self, w: WorkerState) -> InstanceLoad:
        """What the routers see of ``w``'s load: what this router has in flight there
        (:class:`_Ticket`), plus what others put on it (:meth:`WorkerState.others`, from its
        ``/get_load``): their requests in flight and waiting, the prompt tokens of those waiting
        (outstanding and prefill tokens, and their prefill seconds at the cost model), the
        tokens they may still generate, and the KV pages their tokens hold."""
        ext = w.others()
        if not ext["reqs"]:
            return w.load
        ld = copy.copy(w.load)             # the page counts are shared, read only
        ld.in_flight += ext["reqs"]
        ld.waiting += ext["waiting"]
        ld.outstanding_tokens += ext["waiting_tokens"]
        ld.prefill_tokens += ext["waiting_tokens"]
        if ext["waiting_tokens"]:
            ld.queued_seconds += self.settings.cost.prefill_seconds(0, ext["waiting_tokens"])
        ld.decode_tokens += ext["decode_tokens"]
        ld.in_flight_tokens += ext["tokens"] + ext["decode_tokens"]
        page = w.page_size or (self.workers.fleet.block_size if self.workers.fleet else 1)
        ld.partial_pages += -(-ext["tokens"] // page)
        return ld

    # -- handlers --------------------------------------------------------------------
    async def completions(self, request: Request):
        """``POST /v1/completions``, routed and proxied."""
        return await self._proxy(request, "/v1/completions", chat=False)

    async def chat(self, request: Request):
        """``POST /v1/chat/completions``, routed and proxied."""
        return await self._proxy(request, "/v1/chat/completions", chat=True)

    async def _proxy(self, request: Request, path: str, chat: bool):
        try:
            tenant_header(request.headers)                 # two would hash under one, reach the worker as another
            raw = await read_body(request)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            body = None                                    # the worker answers the 400
        if isinstance(body, dict):
            try:                                           # the workers' field schema: the same 400s, and
                check_fields(body, "chat" if chat else "completions")    # without a worker in rotation
            except APIError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
        try:                                               # the tenant a client's key is bound to goes on
            headers = forwarded_headers(request, body, FORWARDED_HEADERS, self.settings.worker_key)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        reqs = self.route_requests(body, headers, chat)
        if len(reqs) > 1:
            return await self._split(body, reqs, path, headers)
        sent = await self._send(reqs[0], path, raw, headers)
        return sent if isinstance(sent, JSONResponse) else _ProxiedResponse(sent, self.stopping)

    async def _send(self, req: RouteRequest, path: str, raw: bytes, headers: dict) -> _Upstream | JSONResponse:
        """Route ``req`` and send ``raw`` to its worker: the worker's answer up to its first chunk
        (:class:`_Upstream`, with the request's load ticket), or the error answer (502, 503) for
        the client.

        Nothing has reached the client yet, so a worker that refuses the connection (it then
        leaves rotation) or fails before its first chunk (it died or dropped the connection
        mid-prefill; a non-streamed answer's first chunk is the whole answer) is retried once on
        another worker. Once bytes went to the client nothing is retried (:func:`_relay`)."""
        tried: set[int] = set()
        failed = None                                      # (url, error) of a worker that failed before its first byte
        for _attempt in range(2):
            picked = self._pick(req, tried)
            if picked is None:
                break
            i, seconds = picked
            w = self.workers.states[i]
            fleet = self.workers.fleet
            pages = (kv_admission(w.view, req.hashes, req.prompt_tokens, fleet.block_size)
                     if req.hashes and fleet is not None and self._uses_pages else ((), False, 0))
            ticket = _Ticket(w, req.prompt_tokens, req.output_tokens, seconds, pages)
            try:
                upstream = await self._send_unless_stopping(self.proxy.build_request(
                    "POST", w.url + path, content=raw, headers=headers), ticket)
                if upstream is None:                       # the router stopped before the worker answered
                    ticket.done()
                    return _error(503, self.stopping.reason, "server_shutdown")
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                ticket.done()
                self.workers.take_out(w, f"connection failed: {type(exc).__name__}")
                tried.add(i)
                self.retries += 1
                continue
            except httpx.HTTPError as exc:
                ticket.done()
                log.warning("worker %s failed before its first byte: %s", w.url, type(exc).__name__)
                tried.add(i)
                failed = (w.url, type(exc).__name__)
                if _attempt == 0:
                    self.retries += 1
                    continue
                return _error(502, f"worker {w.url} failed: {type(exc).__name__}", "bad_gateway")
            return upstream
        if failed is not None:                             # no other worker to retry on
            return _error(502, f"worker {failed[0]} failed: {failed[1]}", "bad_gateway")
        self.unroutable += 1
        return _error(503, "no worker is in rotation; retry shortly", "no_healthy_worker")

    async def _send_unless_stopping(self, request: httpx.Request, ticket: _Ticket) -> _Upstream | None:
        """``request`` sent to its worker, streamed: the response once its first chunk arrived
        (:class:`_Upstream`), or ``None`` when the router stops first (the request is then
        cancelled and its connection closed, which cancels the generation on the worker).

        Raises:
            httpx.HTTPError: the worker could not be reached or failed before its first chunk.
        """
        async def first_chunk():
            response = await self.proxy.send(request, stream=True)
            try:
                chunks = response.aiter_raw().__aiter__()
                first = await _next_or_none(chunks)
            except BaseException:
                await response.aclose()
                raise
            return _Upstream(response, chunks, first, ticket)

        send = asyncio.ensure_future(first_chunk())
        stop = asyncio.ensure_future(self.stopping.event.wait())
        self.stopping.active += 1
        try:
            await asyncio.wait({send, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stopping.active -= 1
            stop.cancel()
            stopped = not send.done()
            if stopped:
                send.cancel()
        if stopped:
            await asyncio.gather(send, return_exceptions=True)
            return None
        return send.result()

    async def _split(self, body: dict, reqs: list[RouteRequest], path: str, headers: dict):
        """A completion batch: each prompt routed and sent on its own, the answers put back
        together in prompt order. The first error any part answers (a non-200 status, or no
        worker) is the client's answer and the other parts are dropped."""
        self.split_batches += 1
        parts = [json.dumps({**body, "prompt": p}).encode() for p in body["prompt"]]
        sent = await asyncio.gather(*(self._send(r, path, raw, headers) for r, raw in zip(reqs, parts, strict=True)))
        ok = [x for x in sent if not isinstance(x, JSONResponse)]
        failed = next((x for x in sent if isinstance(x, JSONResponse)), None)
        if failed is None:
            bad = next(((i, x) for i, x in enumerate(sent) if x.response.status_code != 200), None)
            if bad is not None:
                i, up = bad
                try:
                    content = await up.body()
                except httpx.HTTPError as exc:
                    failed = _worker_failed(up, exc, 502)
                else:
                    failed = Response(_renumbered(content, i), status_code=up.response.status_code,
                                      media_type=up.response.headers.get("content-type"))
        if failed is not None:
            await _release(ok)
            return failed
        if body.get("stream") is True:
            return _MergedResponse(ok, self.stopping)
        try:
            answers = [json.loads(await up.body()) for up in ok]
        except httpx.HTTPError as exc:               # a part's worker broke off: the whole request failed
            bad = next(up for up in ok if not up.complete)
            return _worker_failed(bad, exc, 502)
        finally:
            await _release(ok)
        choices = [{**c, "index": i} for i, a in enumerate(answers) for c in a["choices"]]
        return JSONResponse({**answers[0], "choices": choices, "usage": _sum_usage([a.get("usage") for a in answers])})

    async def invalidate(self, request: Request):
        """``POST /admin/cache/invalidate`` on every worker: the body and scope rules of a worker's
        route (:func:`~hybridkv.serve.auth.invalidate_scope`: ``tenant`` and/or ``cache_salt``,
        ``all`` or ``abi_version``; a key bound to a tenant, or an ``X-Tenant`` header, confines
        it to that tenant), checked here before any worker is asked; see :meth:`_fan_out` for
        the answer."""
        try:
            tenant_header(request.headers)
            raw = await read_body(request)
            body = json_object(raw or b"{}")
            scope, tenant = invalidate_scope(body, principal_of(request), request.headers)
            content = json.dumps(scope, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return JSONResponse(APIError(400, "the request body has a string with a lone surrogate, which is not "
                                              "Unicode text").body(), status_code=400)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        headers = {"content-type": "application/json"}
        if tenant is not None:
            headers["x-tenant"] = tenant                   # the workers confine it too
        principal = principal_of(request)
        operator = tenant is None or (principal is not None and principal.admin)
        return await self._fan_out(request, "/admin/cache/invalidate", content, headers, operator)

    async def flush_cache(self, request: Request):
        """``POST /flush_cache`` on every worker (each drops its device entries; admin only, never
        with an ``X-Tenant`` header, as on a worker); see :meth:`_fan_out` for the answer."""
        try:
            if tenant_header(request.headers) is not None:
                raise APIError(403, "a request with the X-Tenant header may not flush every tenant's entries; "
                                    "POST /admin/cache/invalidate purges that tenant's", None, "tenant_scope",
                               "permission_error")
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return await self._fan_out(request, "/flush_cache", b"", {})

    async def _fan_out(self, request: Request, path: str, content: bytes, headers: dict,
                       operator: bool = True) -> JSONResponse:
        """POST ``content`` to ``path`` on every worker (in rotation or not: one out of rotation
        may still hold entries), wait for all, each for at most ``purge_timeout_s`` seconds, then
        read again the view of each that answered 200 (:meth:`_resync`).

        Returns:
            200 with the workers' counts summed (:func:`_sum_counts`; for a tenant's purge,
            ``namespaces`` is the most any worker matched, since every worker counts the same
            scope and a sum would tell the tenant how many workers there are; entries and bytes
            stay summed: the copies of the tenant's own entries removed) and, for an ``operator``
            (the admin key, or a purge not confined to a tenant), ``workers``: per worker its
            ``url`` and ``status`` and its own counts; or, when any worker could not be reached,
            did not answer within ``purge_timeout_s`` or did not answer 200, a 502 (code
            ``purge_incomplete``) with the same counts of those that did, whose message names
            each such worker URL and why for an operator (``success`` false for ``/flush_cache``);
            a 400 (param ``adapter_version``) with the
            counts of those that purged when a worker refused an ``adapter`` without
            ``adapter_version`` it has served no version of (:func:`hybridkv.serve.purge.purge`).
            A tenant's answer names no worker and
            gives no per-worker figures (the fleet's layout is the operator's); the router's log
            names them.
        """
        if self.settings.worker_key is None and "authorization" in request.headers:
            headers = {**headers, "authorization": request.headers["authorization"]}
        limit = self.settings.purge_timeout_s

        async def one(w: WorkerState) -> dict:
            try:
                r = await asyncio.wait_for(
                    self.control.post(w.url + path, content=content, headers=headers,
                                      timeout=httpx.Timeout(limit, connect=min(limit, self.settings.connect_timeout_s))),
                    limit)                                 # the whole answer, however slowly it trickles
            except (TimeoutError, httpx.TimeoutException) as exc:
                if isinstance(exc, httpx.ConnectTimeout):
                    self.workers.take_out(w, "connection failed: ConnectTimeout")
                    return {"url": w.url, "status": None, "error": "cannot be reached (ConnectTimeout)"}
                return {"url": w.url, "status": None,
                        "error": f"did not answer within {limit:g} s (--purge-timeout); it may still purge"}
            except httpx.HTTPError as exc:
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    self.workers.take_out(w, f"connection failed: {type(exc).__name__}")
                return {"url": w.url, "status": None, "error": f"cannot be reached ({type(exc).__name__})"}
            try:
                answer = r.json()
            except ValueError:
                answer = None
            if r.status_code != 200 or not isinstance(answer, dict):
                err = answer.get("error") if isinstance(answer, dict) and isinstance(answer.get("error"), dict) else {}
                message = err.get("message")
                return {"url": w.url, "status": r.status_code,
                        "error": f"answered {r.status_code}" + (f": {message}" if message else ""),
                        "refusal": err if r.status_code == 400 and err.get("param") == "adapter_version" else None}
            return {"url": w.url, "status": 200, **answer}

        results = await asyncio.gather(*(one(w) for w in self.workers.states))
        await asyncio.gather(*(self._resync(w) for w, res in zip(self.workers.states, results, strict=True)
                               if res["status"] == 200))
        done = [r for r in results if r["status"] == 200]
        totals = _sum_counts([{k: v for k, v in r.items() if k not in ("url", "status")} for r in done])
        if not operator and done:              # each worker counts the same scope: a sum would count workers
            totals["namespaces"] = max(r.get("namespaces", 0) for r in done)
        failed = [r for r in results if r["status"] != 200]
        shown = {"workers": [{k: v for k, v in r.items() if k != "refusal"} for r in results]} if operator else {}
        if not failed:
            return JSONResponse({**totals, **shown})
        refusal = failed[0].get("refusal") if all(r.get("refusal") for r in failed) else None
        if refusal is not None:                # the caller's to fix (a worker knows no version of the adapter)
            return JSONResponse({"error": {**refusal, "message": refusal.get("message", "") + (
                " (on at least one worker; the others purged the versions they know)" if done else "")},
                **totals, **shown}, status_code=400)
        for r in failed:
            log.warning("%s on worker %s failed: %s", path, r["url"], r["error"])
        if operator:
            why = "; ".join(f"worker {r['url']}: {r['error']}" for r in failed)
            message = (f"{path} done on {len(done)} of {len(results)} workers; {why}. The workers named may still "
                       "hold the entries: send it again once they are back")
        else:
            message = (f"{path} did not complete on every worker behind this router (its operator sees which); "
                       "your entries may still be held there: send it again later")
        if "success" in totals:                # /flush_cache: not done on every worker
            totals["success"] = False
        err = APIError(502, message, None, "purge_incomplete", "server_error").body()
        return JSONResponse({**err, **totals, **shown}, status_code=502)

    async def _resync(self, w: WorkerState) -> None:
        """Read ``w``'s events now: a purge started a new epoch there, so its view is rebuilt from
        its ``/v1/cache/snapshot`` (or, failing that, starts empty), without the purged entries,
        before the purge is answered. A worker that fails this leaves rotation (its view
        cleared)."""
        if not w.healthy:
            return
        try:
            await self.workers._pull(w)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.workers.take_out(w, f"resync after a purge failed: {type(exc).__name__}")

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
        """``GET /router/stats``: the policy (and ``own_waiting``, ``waiting_weight``, ``tie_kv_run`` and
        ``price_restore`` under ``hybrid``; ``max_tree_tokens``
        and each worker's ``tree_nodes`` under ``prefix`` and ``prefix-smg``), per-worker
        counters, retries, batches split, and per shared store the entries its view holds (counts,
        never keys)."""
        h = self.settings.hybrid
        policy = ({"own_waiting": h.own_waiting, "waiting_weight": h.waiting_weight, "tie_kv_run": h.tie_kv_run,
                   "price_restore": h.price_restore} if self.settings.policy == "hybrid" else {})
        if self.settings.policy in ("prefix", "prefix-smg"):
            nodes = [0] * len(self.workers.states)
            for key, router in self._routers.items():
                for pos, i in enumerate(key[0]):
                    if pos < len(router.trees):
                        nodes[i] = max(nodes[i], len(router.trees[pos].kv))
            policy = {"max_tree_tokens": self.settings.max_tree_tokens, "tree_nodes": nodes}
        return {"policy": self.settings.policy, **policy, "retries": self.retries, "unroutable": self.unroutable,
                "split_batches": self.split_batches, "workers": [w.stats() for w in self.workers.states],
                "stores": {sid: {"kv_entries": len(v.kv), "checkpoint_entries": len(v.checkpoints),
                                 "events_applied": v.events_applied, "alignment": v.alignment}
                           for sid, v in self.workers.stores.items()}}


class _Upstream:
    """A worker's answer as the router holds it once its first chunk arrived: the response, the
    rest of its raw chunks, that first chunk (``None``: an empty body) and the request's load
    ticket (first byte counted)."""

    def __init__(self, response: httpx.Response, chunks, first: bytes | None, ticket: _Ticket) -> None:
        self.response, self.chunks, self.first, self.ticket = response, chunks, first, ticket
        self.complete = first is None
        if first is not None:
            ticket.first_byte()

    async def iter(self):
        """The body's chunks, the first one included (once)."""
        first, self.first = self.first, None
        if first is not None:
            yield first
        while (chunk := await _next_or_none(self.chunks)) is not None:
            yield chunk
        self.complete = True

    async def body(self) -> bytes:
        """The whole body.

        Raises:
            httpx.HTTPError: the worker broke off before its end.
        """
        return b"".join([c async for c in self.iter()])

    async def close(self) -> None:
        """Return the load and close the connection (idempotent)."""
        self.ticket.done()
        await self.response.aclose()


WORKER_FAILED = "worker_failed"
"""The ``error.code`` of an answer a worker broke off (it died, or dropped the connection)."""


def _failure_body(up: _Upstream, exc: BaseException | None) -> dict:
    why = type(exc).__name__ if exc is not None else "the stream ended without [DONE]"
    return APIError(502, f"worker {up.ticket.w.url} failed mid-answer ({why}); the answer is incomplete",
                    None, WORKER_FAILED, "server_error").body()


def _worker_failed(up: _Upstream, exc: BaseException | None, status: int) -> JSONResponse:
    """The client's error answer for a worker that broke off before the router sent a byte."""
    log.warning("worker %s broke off an answer: %s", up.ticket.w.url, type(exc).__name__ if exc else "no [DONE]")
    return JSONResponse(_failure_body(up, exc), status_code=status)


class _ProxiedResponse(StreamingResponse):
    """The worker's answer streamed through; its load and connection are returned however the
    response ends (a client gone before the first chunk included, when the body iterator never
    starts and so never runs its own cleanup)."""

    def __init__(self, up: _Upstream, stopping: _Stopping) -> None:
        super().__init__(_relay(up, stopping), status_code=up.response.status_code,
                         media_type=up.response.headers.get("content-type"))
        self._up = up

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._up.close()


class _Stopping:
    """The router's stop signal to the answers it relays: :meth:`end` wakes every relay, which
    ends its answer (see :meth:`RouterService.end_running`)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason = ""
        self.active = 0                     # answers being relayed

    def end(self, reason: str) -> int:
        self.reason = reason
        self.event.set()
        return self.active

    def frames(self) -> bytes:
        """The SSE ending of a stream cut short: an error chunk naming the reason, then ``[DONE]``."""
        body = APIError(503, self.reason, None, "server_shutdown", "server_error").body()
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def _next_or_none(chunks):
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def _relay(up: _Upstream, stopping: _Stopping):
    """The worker's answer, bytes unchanged; the ticket's load returned as it goes.

    A stream (SSE) is passed on whole frames at a time, so that when the worker breaks off (it
    died, or its connection dropped) or ends without ``data: [DONE]`` the client's stream ends
    with one OpenAI-style error frame (``{"error": {..., "code": "worker_failed"}}``) and no
    ``[DONE]``: a client (the ``openai`` one raises) can tell it from a complete answer. Nothing
    is retried once bytes went to the client. When the router stops, a stream ends with
    :meth:`_Stopping.frames` (another answer just ends)."""
    sse = (up.response.headers.get("content-type") or "").startswith("text/event-stream")
    chunks = up.iter().__aiter__()
    stop = asyncio.ensure_future(stopping.event.wait())
    pending = b""                          # an SSE frame not yet whole
    done = False                           # data: [DONE] seen
    stopping.active += 1
    try:
        while True:
            nxt = asyncio.ensure_future(_next_or_none(chunks))
            await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():               # the router is stopping
                nxt.cancel()
                await asyncio.gather(nxt, return_exceptions=True)
                if sse:
                    yield stopping.frames()
                return
            chunk = nxt.result()
            if chunk is None:
                break
            if not sse:
                yield chunk
                continue
            pending += chunk
            cut = pending.rfind(b"\n\n")
            if cut >= 0:
                frames, pending = pending[:cut + 2], pending[cut + 2:]
                done = done or b"data: [DONE]" in frames
                yield frames
        if sse and (pending.strip() or not done) and up.response.status_code == 200:
            yield b"data: " + json.dumps(_failure_body(up, None)).encode() + b"\n\n"
    except httpx.HTTPError as exc:
        log.warning("worker %s broke off an answer: %s", up.ticket.w.url, type(exc).__name__)
        if sse:
            yield b"data: " + json.dumps(_failure_body(up, exc)).encode() + b"\n\n"
    finally:
        stopping.active -= 1
        stop.cancel()
        await up.close()


def _renumbered(content: bytes, index: int) -> bytes:
    """A split batch part's error body with its ``prompt 0`` (the part's only prompt) named as
    prompt ``index`` of the client's batch; any other body unchanged."""
    try:
        body = json.loads(content)
        message = body["error"]["message"]
    except (ValueError, TypeError, KeyError):
        return content
    if index == 0 or not isinstance(message, str) or not message.startswith("prompt 0"):
        return content
    body["error"]["message"] = f"prompt {index}" + message[len("prompt 0"):]
    return json.dumps(body).encode()


class _MergedResponse(StreamingResponse):
    """The streamed answers of a split batch merged into one SSE stream as chunks arrive:
    ``choices[].index`` set to the part's prompt index, one ``id``, the parts' final ``usage``
    chunks summed into one, one ``[DONE]``. A part that fails (its worker breaks off, ends
    without ``[DONE]``, or sends an error frame) fails the whole request: the merged stream
    ends with that error frame and no ``[DONE]``, and the other parts are cancelled. Every
    part's load and connection are returned however the response ends."""

    def __init__(self, parts: list[_Upstream], stopping: _Stopping) -> None:
        super().__init__(_merge(parts, stopping), status_code=200, media_type="text/event-stream")
        self._parts = parts

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _release(self._parts)


async def _merge(parts: list[_Upstream], stopping: _Stopping):
    queue: asyncio.Queue = asyncio.Queue()
    failed = object()                        # a part's end without its [DONE]

    async def stop_waiter() -> None:
        await stopping.event.wait()
        await queue.put((-1, None))          # the router is stopping: end the merged stream

    async def pump(i: int, up: _Upstream) -> None:
        buf, end = b"", None
        try:
            async for chunk in up.iter():
                buf += chunk
                while b"\n\n" in buf:
                    frame, buf = buf.split(b"\n\n", 1)
                    await queue.put((i, frame))
        except (httpx.HTTPError, httpx.StreamError) as exc:        # StreamError: closed as the client left
            log.warning("worker %s broke off an answer: %s", up.ticket.w.url, type(exc).__name__)
            end = (failed, _failure_body(up, exc))
        finally:
            up.ticket.done()
            await queue.put((i, end or (failed, _failure_body(up, None))))

    tasks = [asyncio.create_task(pump(i, up)) for i, up in enumerate(parts)]
    tasks.append(asyncio.create_task(stop_waiter()))
    usage_chunks: list[dict] = []
    first_id, left, done = None, len(parts), set()
    stopping.active += 1
    try:
        while left:
            i, frame = await queue.get()
            if i < 0:
                yield stopping.frames()
                return
            if isinstance(frame, tuple):          # part i ended
                left -= 1
                if i not in done:                 # without its [DONE]: the request failed
                    yield f"data: {json.dumps(frame[1])}\n\n".encode()
                    return
                continue
            line = frame.decode().strip()
            if not line.startswith("data:"):
                continue
            if line[5:].strip() == "[DONE]":
                done.add(i)
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:                  # a part's error is the whole request's
                yield frame + b"\n\n"
                return
            first_id = first_id or chunk.get("id")
            chunk["id"] = first_id
            if chunk.get("choices"):
                for c in chunk["choices"]:
                    c["index"] = i
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            elif chunk.get("usage") is not None:
                usage_chunks.append(chunk)
        if usage_chunks:
            total = _sum_usage([c["usage"] for c in usage_chunks])
            yield f"data: {json.dumps({**usage_chunks[0], 'id': first_id, 'usage': total})}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        stopping.active -= 1
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _release(parts: list[_Upstream]) -> None:
    """Return every part's load and close its connection (idempotent)."""
    for up in parts:
        await up.close()


def _sum_usage(usages: list[dict | None]) -> dict | None:
    """OpenAI ``usage`` objects summed field by field (nested ones too, e.g.
    ``prompt_tokens_details.cached_tokens``); ``None`` when none was given."""
    usages = [u for u in usages if isinstance(u, dict)]
    if not usages:
        return None
    out: dict = {}
    for u in usages:
        for k, v in u.items():
            if isinstance(v, dict):
                out[k] = _sum_usage([out.get(k), v])
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out


def _sum_counts(answers: list[dict]) -> dict:
    """The purge counts of several workers summed key by key (nested ``tier_entries`` /
    ``tier_bytes`` per tier too): integers added, ``None`` (not known) if any worker's is, ``-1``
    (a tier unreachable) if any worker's is; booleans (``success``) true only if all are, except
    ``earlier_adapters_unreached``, true if any worker's is."""
    out: dict = {}
    for a in answers:
        for k, v in a.items():
            if k not in out:
                out[k] = _sum_counts([v]) if isinstance(v, dict) else v
                continue
            have = out[k]
            if isinstance(v, dict) and isinstance(have, dict):
                out[k] = _sum_counts([have, v])
            elif k == "earlier_adapters_unreached":
                out[k] = bool(have) or bool(v)
            elif isinstance(v, bool) or isinstance(have, bool):
                out[k] = bool(have) and bool(v)
            elif have is None or v is None:
                out[k] = None
            elif isinstance(v, int) and isinstance(have, int):
                out[k] = -1 if have < 0 or v < 0 else have + v
    return out


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
    if service.settings.keys is not None:
        app.add_middleware(AuthMiddleware, ring=service.settings.keys, route_kind=router_route_kind)
    app.post("/v1/completions")(service.completions)
    app.post("/v1/chat/completions")(service.chat)
    app.get("/v1/models")(service.models)
    app.get("/health")(service.health)
    app.get("/router/stats")(service.stats)
    app.post("/admin/cache/invalidate")(service.invalidate)
    app.post("/flush_cache")(service.flush_cache)
    return app
