"""The OpenAI-compatible HTTP API over one engine thread (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /admin/cache/invalidate``, and for ``hybridkv router``
``GET /v1/cache/info``, ``GET /v1/cache/events`` and ``GET /v1/cache/snapshot`` (in pages)
(:mod:`hybridkv.serve.cache_events`), and SGLang's
``/server_info``, ``/model_info``, ``/get_load`` and ``/flush_cache`` (:mod:`hybridkv.serve.compat`). Errors answer with the
OpenAI body ``{"error": {"message", "type", "param", "code"}}``; see docs/how-to/serve.md.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import weakref
from dataclasses import asdict, dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.build import EngineHandle
from hybridkv.serve.auth import AuthMiddleware, KeyRing, invalidate_scope, principal_of, request_tenant, serve_route_kind
from hybridkv.serve.cache_events import (
    EVENT_PAGE_MAX,
    SNAPSHOT_KEEP,
    SNAPSHOT_PAGE_MAX,
    EventFeed,
    SnapshotGone,
    SnapshotPages,
    group_info,
)
from hybridkv.serve.compat import add_compat_routes
from hybridkv.serve.metrics import ServeMetrics, engine_snapshot
from hybridkv.serve.protocol import (
    APIError,
    check_fields,
    check_ids,
    json_object,
    parse_generation,
    parse_prompts,
    read_body,
    tenant_header,
)
from hybridkv.serve.run import Run
from hybridkv.serve.tokenizer import Codec
from hybridkv.serve.worker import EngineWorker


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """What the HTTP layer needs to know (lengths in tokens).

    Attributes:
        model_name: the name clients pass as ``model`` (the preset or directory given).
        max_model_len: prompt plus generated tokens allowed per request.
        default_max_tokens: ``max_tokens`` when a request leaves it out.
        snapshot_readers: device-index snapshots held at once for readers paging through
            ``GET /v1/cache/snapshot`` (:class:`~hybridkv.serve.cache_events.SnapshotPages` ``keep``).
    """

    model_name: str
    max_model_len: int
    default_max_tokens: int = 16
    snapshot_readers: int = SNAPSHOT_KEEP


class Server:
    """Routes bound to one engine thread, its tokenizer and metrics.

    Args:
        handle: the engine (run by ``worker``).
        worker: the started :class:`~hybridkv.serve.worker.EngineWorker`.
        codec: the tokenizer.
        settings: names and limits.
        metrics: the server's metrics (observed by ``worker`` callbacks too).
        events: the engine's cache-event listener, or ``None`` (no ``/v1/cache/*`` routes).
    """

    def __init__(self, handle: EngineHandle, worker: EngineWorker, codec: Codec, settings: ServeSettings,
                 metrics: ServeMetrics, events: EventFeed | None = None) -> None:
        self.handle, self.worker, self.codec, self.settings, self.metrics = handle, worker, codec, settings, metrics
        self.events = events
        # device-index snapshots being paged (GET /v1/cache/snapshot); the cursor tag's key is a random
        # secret of this process (the namespace is public: a key derived from it lets anyone make a
        # cursor that passes the tag), so a cursor of an earlier process is made up to this one (400)
        self.snapshots = SnapshotPages(settings.snapshot_readers, key=secrets.token_bytes(32))
        handle.engine.set_timings(metrics)    # lookup / load / transfer / install / saved-prefill histograms
        self.vocab_size = handle.backend.vocab_size
        self.unit = handle.engine.config.prefix_match_unit
        self._weights = handle.model.weight_digest() if handle.model is not None else "simulated"
        self.created = int(time.time())
        self._runs: weakref.WeakSet[Run] = weakref.WeakSet()       # requests started (a finished one is kept
                                                                   # until collected; ending it is harmless)

    def end_running(self, reason: str) -> int:
        """End every request still generating (on the event loop, when the server stops): a
        stream gets an error chunk with ``reason`` (code ``server_shutdown``) and ``[DONE]``, a
        non-streaming request a 503; their jobs are cancelled, which releases their cache
        references. Returns how many requests were ended."""
        running = [run for run in self._runs if run.running]
        for run in running:
            run.end(reason)
        return len(running)

    # -- helpers ------------------------------------------------------------------
    async def _body(self, request: Request, route: str) -> dict:
        """The JSON body of a ``route`` (``completions`` / ``chat``) request, its field names
        checked (:func:`~hybridkv.serve.protocol.check_fields`) and its ``model`` this server's.

        Raises:
            APIError: 400 for a bad body or field (named), 404 for another model.
        """
        body = json_object(await read_body(request))
        check_fields(body, route)
        model = body["model"]
        if model != self.settings.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.settings.model_name!r}", "model", "model_not_found", "not_found_error")
        return body

    def identity(self) -> dict[str, str]:
        """The :class:`CacheIdentity` fields every request shares (all but tenant and salt)."""
        tok, template = self.codec.identity
        return {"model_repo": self.settings.model_name, "weight_digest": self._weights,
                "tokenizer_version": tok, "chat_template_version": template}

    def namespace(self, tenant: str, salt: str, adapter: str = "", adapter_version: str = "") -> bytes:
        """The namespace digest of a request of ``tenant`` with ``salt`` and ``adapter`` at
        ``adapter_version`` (``""``: none) (32 bytes)."""
        return CacheIdentity(**self.identity(), adapter_id=adapter, adapter_version=adapter_version,
                             tenant=tenant, cache_salt=salt).digest()

    def _start(self, body: dict, request: Request, prompts: list[list[int]], arrived: float):
        self._check_alive()
        tenant = request_tenant(principal_of(request), request.headers, body)     # a key's own tenant, if bound
        gen = parse_generation(body, tenant, self.settings.default_max_tokens, self.unit)
        for i, ids in enumerate(prompts):
            check_ids(ids, i, self.vocab_size, self.settings.max_model_len, gen.max_tokens)
        run = Run(self.worker, self.codec, gen, prompts,
                  self.namespace(gen.tenant, gen.cache_salt, gen.adapter, gen.adapter_version), self.metrics, arrived)
        self._runs.add(run)
        return run

    def _check_alive(self) -> None:
        if not self.worker.alive:
            raise APIError(503, "the engine thread has stopped; see the server log", None, "engine_stopped",
                           "server_error")

    def _head(self, kind: str) -> dict:
        return {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}",
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.settings.model_name}

    # -- generation routes --------------------------------------------------------
    async def completions(self, request: Request):
        """``POST /v1/completions``."""
        arrived = time.monotonic()
        body = await self._body(request, "completions")
        if body.get("prompt") is None:
            raise APIError(400, "prompt is required", "prompt")
        run = self._start(body, request, parse_prompts(body["prompt"], self.codec.encode), arrived)
        head = self._head("text")
        if run.gen.stream:
            return self._sse(self._completion_chunks(run, head))
        choices = await _collect_while_connected(run, request)
        out = [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
               | ({"token_ids": c.ids} if run.gen.return_token_ids else {}) for i, c in enumerate(choices)]
        return {**head, "choices": out, "usage": run.usage()}

    async def chat(self, request: Request):
        """``POST /v1/chat/completions``."""
        arrived = time.monotonic()
        body = await self._body(request, "chat")
        try:
            prompt = self.codec.chat(body.get("messages"))
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        run = self._start(body, request, [prompt], arrived)
        head = self._head("chat")
        if run.gen.stream:
            return self._sse(self._chat_chunks(run, {**head, "object": "chat.completion.chunk"}))
        (c,) = await _collect_while_connected(run, request)
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                  "finish_reason": c.finish_reason} | ({"token_ids": c.ids} if run.gen.return_token_ids else {})
        return {**head, "choices": [choice], "usage": run.usage()}

    # -- streaming ----------------------------------------------------------------
    @staticmethod
    def _sse(chunks) -> StreamingResponse:
        async def frames():
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(frames(), media_type="text/event-stream")

    async def _stream(self, run: Run, head: dict, make_choice):
        try:
            async for i, delta, finish in run.events():
                yield {**head, "choices": [make_choice(i, delta, finish, run)]}
        except APIError as exc:
            yield exc.body()
            return
        if run.gen.include_usage:
            yield {**head, "choices": [], "usage": run.usage()}

    def _completion_chunks(self, run: Run, head: dict):
        def choice(i, delta, finish, run):
            extra = {"token_ids": run.choices[i].ids} if finish and run.gen.return_token_ids else {}
            return {"index": i, "text": delta, "logprobs": None, "finish_reason": finish} | extra
        return self._stream(run, head, choice)

    async def _chat_chunks(self, run: Run, head: dict):
        yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}

        def choice(i, delta, finish, run):
            return {"index": i, "delta": {"content": delta} if delta else {}, "logprobs": None,
                    "finish_reason": finish}
        async for chunk in self._stream(run, head, choice):
            yield chunk

    # -- the rest -----------------------------------------------------------------
    async def models(self) -> dict:
        """``GET /v1/models``: the one model served."""
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model",
                                            "created": self.created, "owned_by": "hybridkv",
                                            "max_model_len": self.settings.max_model_len,
                                            "vocab_size": self.vocab_size}]}

    async def health(self):
        """``GET /health``: 200 while the engine thread runs, else 503."""
        if self.worker.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    async def metrics_text(self) -> Response:
        """``GET /metrics``: Prometheus text format (engine figures read on the engine thread)."""
        if self.worker.alive:                 # a stopped engine thread keeps its last figures
            fut = self.worker.call(lambda h: engine_snapshot(h, self.worker.queue_depth))
            self.metrics.set_snapshot(await asyncio.wait_for(asyncio.wrap_future(fut), timeout=30.0))
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def invalidate(self, request: Request) -> dict:
        """``POST /admin/cache/invalidate`` with ``{"tenant": T}`` (narrowed by ``cache_salt``,
        ``adapter`` and ``adapter_version`` when given), ``{"all": true}`` or ``{"abi_version": N}``
        (an older cache ABI's store objects: :func:`hybridkv.serve.purge.purge`); answers the
        counts removed per tier.

        A request of a key bound to a tenant, or with an ``X-Tenant`` header, is confined to that
        tenant (the scope when the body names none; a ``cache_salt`` narrows it), and its counts
        are that tenant's.

        Raises:
            APIError: 400 for an unknown field, a field of the wrong type, an empty ``tenant`` or not
                exactly one scope; 403 when a bound key's or an ``X-Tenant`` request names another
                tenant, ``all`` or ``abi_version``, or a bound key's ``X-Tenant`` header names another.
        """
        body = json_object(await read_body(request) or b"{}")
        scope, _ = invalidate_scope(body, principal_of(request), request.headers)
        tenant, salt, abi = scope.get("tenant"), scope.get("cache_salt"), scope.get("abi_version")
        adapter, version = scope.get("adapter"), scope.get("adapter_version")
        everything = scope.get("all", False)
        self._check_alive()
        # The scope's own namespace (its salt and adapter, none when not named), which a restarted
        # server's ledger does not know yet.
        known = (frozenset({self.namespace(tenant, salt or "", adapter or "", version or "")})
                 if tenant is not None else frozenset())
        counts = await asyncio.wrap_future(self.worker.invalidate(tenant, salt, everything, abi, known,
                                                                  adapter, version))
        return asdict(counts)                 # the engine thread started the feed's new epoch (on_purge)

    async def cache_info(self) -> dict:
        """``GET /v1/cache/info``: what a router needs to hash prompts as this server does (the
        namespace fields, the backend binding, units in tokens), the event epoch, the model's cache
        groups (:func:`~hybridkv.serve.cache_events.group_info`: the ``group`` of its events) and the
        shared store's ``{id, alignment, kv_bytes_per_token, checkpoint_bytes, groups}`` (``null``: none)."""
        cfg = self.handle.engine.config
        return {"model": self.settings.model_name, "epoch": self.events.epoch, "identity": self.identity(),
                "binding": self.handle.backend.cache_binding().hex(), "prefix_match_unit": cfg.prefix_match_unit,
                "block_size": cfg.block_size, "vocab_size": self.vocab_size,
                "groups": group_info(self.handle.backend.tier_family), "store": self.events.store_info()}

    async def cache_events(self, request: Request, after: int = -1, epoch: int | None = None,
                           limit: int = EVENT_PAGE_MAX, wait: float = 0.0) -> dict:
        """``GET /v1/cache/events?epoch=E&after=SEQ&limit=N&wait=S`` (see :meth:`EventFeed.wait`;
        ``wait`` seconds of long poll, 0: answer at once).

        Raises:
            APIError: 403 for a request with an ``X-Tenant`` header: the feed holds every
                tenant's entry keys (for ``hybridkv router``, which sends none).
        """
        if tenant_header(request.headers) is not None:
            raise APIError(403, "a request with the X-Tenant header may not read the cache event feed (every "
                                "tenant's entry keys)", None, "tenant_scope", "permission_error")
        try:
            return await self.events.wait(epoch, after, limit, wait)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    async def cache_snapshot(self, request: Request, cursor: str | None = None,
                             limit: int = SNAPSHOT_PAGE_MAX) -> dict:
        """``GET /v1/cache/snapshot?limit=N`` then ``?cursor=C&limit=N``: every entry the device
        cache holds, named as the event feed names them, in pages of at most ``limit`` entries
        (1 to :data:`~hybridkv.serve.cache_events.SNAPSHOT_PAGE_MAX`)::

            {"epoch": E, "generation": G, "total": N, "kv": [hex, ...], "checkpoints": [hex, ...],
             "next_cursor": C or null}

        ``kv``: the chained hash of each cached ``prefix_match_unit``; ``checkpoints``: those of
        this page's units with a published checkpoint (never token ids). The first page (no
        ``cursor``) reads the index on the engine thread between two steps; the next pages come
        from that same read (:class:`~hybridkv.serve.cache_events.SnapshotPages`), so every page
        of generation ``G`` is one consistent cut, whatever the cache did meanwhile. The events of
        epoch ``E`` applied over it, from its first, give the cache as it is when they were
        published: ``hybridkv router`` resyncs from it when a purge or restart starts a new epoch,
        so the entries that survived keep their affinity.

        Raises:
            APIError: 403 for a request with an ``X-Tenant`` header (every tenant's entry keys, as
                the event feed); 400 naming ``limit`` or ``cursor`` (out of range, not a cursor of
                this server); 410 (``snapshot_gone``) for a cursor whose snapshot is no longer
                held (a purge or restart started a new epoch, idle past its time, or replaced):
                read it again from the first page; 404 when the device cache has no prefix index.
        """
        if tenant_header(request.headers) is not None:
            raise APIError(403, "a request with the X-Tenant header may not read the cache snapshot (every "
                                "tenant's entry keys)", None, "tenant_scope", "permission_error")
        if not 1 <= limit <= SNAPSHOT_PAGE_MAX:
            raise APIError(400, f"limit={limit} must be in [1, {SNAPSHOT_PAGE_MAX}] (entries per page)", "limit")
        events = self.events
        if cursor is not None:
            try:
                return self.snapshots.resume(cursor, limit, events.epoch)
            except SnapshotGone as exc:
                raise APIError(410, str(exc), "cursor", "snapshot_gone") from None
            except ValueError as exc:
                raise APIError(400, str(exc), "cursor") from None
        self._check_alive()

        def read(handle: EngineHandle) -> tuple[int, list[bytes], bytearray] | None:
            index = getattr(handle.engine.cache, "index", None)
            root = getattr(index, "root", None)
            if root is None:
                return None
            keys, flags, stack = [], bytearray(), list(root.children.values())
            while stack:
                node = stack.pop()
                keys.append(node.key)
                flags.append(node.checkpoint is not None)
                stack.extend(node.children.values())
            return events.epoch, keys, flags

        got = await asyncio.wrap_future(self.worker.call(read))
        if got is None:
            raise APIError(404, "this worker's device cache has no prefix index to snapshot", None, "not_found",
                           "invalid_request_error")
        return self.snapshots.first(*got, limit)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the server reports ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_while_connected(run: Run, request: Request):
    """``run.collect()``, cancelled (its jobs with it) if the client disconnects first; then a
    499 :class:`APIError` nobody reads."""
    collect = asyncio.ensure_future(run.collect())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    if collect.done():
        gone.cancel()
        return collect.result()
    collect.cancel()
    await asyncio.gather(collect, return_exceptions=True)
    raise APIError(499, "the client closed the connection", None, "client_closed")


def _shown(value: object) -> str:
    """``repr(value)``, shortened to 60 characters (a huge header or field is not echoed whole)."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _error_response(exc: APIError, metrics: ServeMetrics) -> JSONResponse:
    metrics.http_errors.labels(str(exc.status)).inc()
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def create_app(server: Server, auth: KeyRing | None = None) -> FastAPI:
    """The FastAPI application of ``server`` (routes and OpenAI-style error handlers); with
    ``auth``, every request's key is checked first (:class:`~hybridkv.serve.auth.AuthMiddleware`:
    401 / 403 answers, a key's bound tenant)."""
    app = FastAPI(title="hybridkv", docs_url=None, redoc_url=None, openapi_url=None)
    if auth is not None:
        app.add_middleware(AuthMiddleware, ring=auth, route_kind=serve_route_kind,
                           on_refusal=lambda status: server.metrics.http_errors.labels(str(status)).inc())
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_text)
    app.post("/admin/cache/invalidate")(server.invalidate)
    if server.events is not None:
        app.get("/v1/cache/info")(server.cache_info)
        app.get("/v1/cache/events")(server.cache_events)
        app.get("/v1/cache/snapshot")(server.cache_snapshot)
    add_compat_routes(app, server)

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return _error_response(exc, server.metrics)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("query", "path", "body")]
        name = loc[-1] if loc else None
        msg = first.get("msg", "invalid request")
        message = f"{name}={_shown(first.get('input'))}: {msg}" if name else str(msg)
        return _error_response(APIError(400, message, name), server.metrics)

    @app.exception_handler(HTTPException)
    async def _http_error(_request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), kind=kind), server.metrics)

    return app
