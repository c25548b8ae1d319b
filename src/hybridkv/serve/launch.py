"""Start a server: the engine and its thread, the tokenizer, the app, and uvicorn on a socket.

:func:`serve_forever` is what ``hybridkv serve`` runs in the foreground (:func:`run_foreground`,
also ``hybridkv router``'s), :class:`RunningServer` what tests run in a background thread (port 0 =
a free port on 127.0.0.1). Both bind the port first (:func:`bind_listener`: a taken port is a clear
error at once) and stop cleanly (:class:`DrainingUvicorn`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import threading
from dataclasses import dataclass, field
from typing import Self

import torch
import uvicorn

from hybridkv.api import DEFAULT_KV_TOKENS
from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.engine.build import (EngineHandle, build_engine, check_pool_memory, is_v4, load_model,
                                   model_config)
from hybridkv.replay.args import check_swa_period
from hybridkv.serve.app import Server, ServeSettings, create_app
from hybridkv.serve.auth import KeyRing
from hybridkv.serve.cache_events import SNAPSHOT_KEEP, EventFeed
from hybridkv.serve.metrics import ServeMetrics
from hybridkv.serve.shadow import make_verifier
from hybridkv.serve.tokenizer import load_codec
from hybridkv.serve.worker import EngineWorker

log = logging.getLogger("hybridkv.serve")

SHUTDOWN_GRACE_S = 2.0
"""Seconds a stopping server (SIGINT, SIGTERM, :meth:`RunningServer.close`) lets running requests
finish before it ends them: a stream then gets an error chunk (code ``server_shutdown``) and
``[DONE]``, a non-streaming request a 503, and their cache references are released. Without a
bound, shutdown would wait for every generation to reach ``max_tokens``."""

SHUTDOWN_MARGIN_S = 5.0
"""Seconds past :data:`SHUTDOWN_GRACE_S` that uvicorn waits for the ended requests' connections to
close before it cancels what is left (a last resort, e.g. for a client that stopped reading)."""


class PortError(ValueError):
    """The address to listen on cannot be used (taken, not permitted, not this machine's); the
    message names the address and the option that changes it."""


def bind_listener(host: str, port: int, option: str = "--port") -> socket.socket:
    """A TCP socket listening on ``host:port`` (``port`` 0: a free port the system picks; read it
    with ``getsockname()``), bound before anything slow starts so a taken port fails at once.

    Args:
        host: an address or host name of this machine.
        port: TCP port in [0, 65535].
        option: the command-line option that sets ``port``, named in errors.

    Raises:
        PortError: the host does not resolve or is not this machine's, the port is taken by
            another process, or binding it is not permitted (each naming the address and how to
            choose another).
    """
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # restarts reuse a port in TIME_WAIT
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        sock.bind(address)
        sock.listen(2048)              # a port held by a listener that also set SO_REUSEADDR fails here
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortError(f"{option} {port}: {where} is already in use by another process; choose another port "
                            f"with {option} N, or {option} 0 for a free one (printed at start)") from None
        if exc.errno == errno.EACCES:
            raise PortError(f"{option} {port}: listening on {where} is not permitted ({exc.strerror}); ports below "
                            f"1024 need privileges: choose another with {option} N, or {option} 0") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise PortError(f"--host {host!r}: not an address of this machine ({exc.strerror})") from None
        raise PortError(f"{option} {port}: cannot listen on {where}: {exc.strerror or exc}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (the port the system picked for port 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class DrainingUvicorn(uvicorn.Server):
    """uvicorn that stops cleanly: on shutdown it calls ``end_running`` (the app ends its
    running requests, e.g. :meth:`~hybridkv.serve.app.Server.end_running`) after
    :data:`SHUTDOWN_GRACE_S`, so their responses finish and their connections close before
    uvicorn's own deadline (:data:`SHUTDOWN_MARGIN_S` later), and it never cancels a request
    task (whose ASGI ``CancelledError`` traceback it would log).

    In the main thread SIGINT and SIGTERM start that shutdown and are not re-raised afterwards, so
    the process exits normally (0); a second SIGINT ends the running requests at once.

    Args:
        config: the uvicorn config (its ``timeout_graceful_shutdown`` is set here).
        end_running: called on the event loop with the reason; returns how many requests it ended
            (``None``: nothing is ended, uvicorn cancels what still runs after the grace).

    Attributes:
        stop_signal: the name of the signal that stopped the server (``SIGINT``), or ``None``.
        ended: requests ``end_running`` ended.
    """

    def __init__(self, config, end_running=None) -> None:
        config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S + (SHUTDOWN_MARGIN_S if end_running is not None else 0.0)
        super().__init__(config)
        self._end_running, self._ending = end_running, None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stop_signal: str | None = None
        self.ended = 0

    def _end_now(self) -> None:
        if self._ending is not None:
            self._ending.cancel()
            self._ending = None
            reason = "the server is shutting down" + (f" ({self.stop_signal})" if self.stop_signal else "")
            self.ended += self._end_running(reason)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        if self._end_running is not None and self._ending is None:
            self._ending = asyncio.get_running_loop().call_later(SHUTDOWN_GRACE_S, self._end_now)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT / SIGTERM (main thread only) start a clean shutdown; the handlers before are
        restored after it, without re-raising the signal."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        before = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, _frame) -> None:
        if self.should_exit and sig == signal.SIGINT and self._loop is not None:
            self._loop.call_soon_threadsafe(self._end_now)           # a second Ctrl-C: end them now
        self.stop_signal = self.stop_signal or signal.Signals(sig).name
        self.should_exit = True


@dataclass(slots=True)
class ServeOptions:
    """Everything ``hybridkv serve`` takes (tokens, MiB and seconds as named).

    Attributes:
        model: preset (``tiny``, ``small``, ...) or a model directory.
        host, port: where to listen (port 0: a free port).
        store: store URL (``none``, ``disk:///DIR``, ``memory://``, ``mooncake://HOST:PORT``).
        policy: checkpoint policy (``none`` turns reuse off).
        max_model_len: prompt + generated tokens per request; default: the KV pool's tokens.
        max_waiting: submitted, not yet admitted requests before answering 503.
        kv_pages: device KV pages; default enough for 65,536 tokens.
        swa_recovery: DeepSeek-V4 models only: ``window`` (default), ``periodic=P`` or ``recompute``
            (:class:`~hybridkv.cache.swa.SwaRecovery`); refused for a Kimi Linear model.
        shadow_verify: share of requests whose cache hits are recomputed without the cache and
            compared, in [0, 1] (:mod:`hybridkv.serve.shadow`); ``None``: the default
            (:data:`~hybridkv.serve.shadow.DEFAULT_SHADOW_RATE`, Kimi Linear and DeepSeek-V4 alike); 0: off.
        auth: the API and admin keys (:class:`~hybridkv.serve.auth.KeyRing`); ``None``: every
            route open, as with an empty ring (never shown by ``repr``).
        snapshot_readers: cache snapshots held at once for readers paging through
            ``GET /v1/cache/snapshot`` (:data:`~hybridkv.serve.cache_events.SNAPSHOT_KEEP`).
        Others: as ``hybridkv replay`` names them.
    """

    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 8000
    store: str = "none"
    store_alignment: int | None = None
    seed: int = 0
    block_size: int = 64
    prefix_match_unit: int = 64
    policy: str = "branch+tail"
    mechanism: str = "extract"
    kv_pages: int | None = None
    checkpoint_slots: int = 64
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 8192
    host_mib: int = 0
    threads: int | None = None
    max_model_len: int | None = None
    max_waiting: int = 64
    default_max_tokens: int = 16
    swa_recovery: str | None = None
    shadow_verify: float | None = None
    snapshot_readers: int = SNAPSHOT_KEEP
    auth: KeyRing | None = field(default=None, repr=False)


def build_handle(opts: ServeOptions, listener: EventFeed | None = None) -> EngineHandle:
    """The engine for ``opts`` (see :func:`~hybridkv.engine.build.build_engine`); ``listener`` hears
    its cache events.

    Raises:
        ConfigError / ValueError: a bad cache setting or model name (named).
    """
    pages = opts.kv_pages if opts.kv_pages is not None else -(-DEFAULT_KV_TOKENS // opts.block_size)
    config = CacheConfig(block_size=opts.block_size, prefix_match_unit=opts.prefix_match_unit,
                         max_num_batched_tokens=opts.max_num_batched_tokens, num_kv_pages=pages,
                         num_checkpoint_slots=opts.checkpoint_slots, policy=CheckpointPolicy.parse(opts.policy),
                         mechanism=opts.mechanism, max_num_seqs=opts.max_num_seqs,
                         store_alignment=opts.store_alignment)
    sizes = model_config(opts.model)
    if is_v4(opts.model):
        check_v4_options(opts)
        check_swa_period(opts.swa_recovery, opts.prefix_match_unit)    # named as options, not config fields
        from hybridkv.engine.v4backend import pool_sizes
        sizes = pool_sizes(sizes, config.block_size, config.prefix_match_unit)   # its pages and slots, by group
    elif opts.swa_recovery is not None:
        raise ValueError(f"--swa-recovery {opts.swa_recovery}: applies to DeepSeek-V4 models (v4-tiny, v4-small, or "
                         f"a deepseek_v4 directory); --model {opts.model} is Kimi Linear, whose KDA checkpoints are "
                         "restored at the hit")
    check_pool_memory(config, sizes, host_bytes=opts.host_mib << 20)   # before loading anything
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    model = load_model(opts.model, opts.seed)
    return build_engine(model, config, model_name=opts.model, store_url=opts.store, host_bytes=opts.host_mib << 20,
                        listener=listener, swa_recovery=opts.swa_recovery)


def check_v4_options(opts: ServeOptions) -> None:
    """Refuse a simulate-only DeepSeek-V4 preset (published shapes, no weights): a server needs the
    model. (A host tier and a store carry V4's groups as they carry Kimi Linear's.)

    Raises:
        ValueError: naming the option, its value and the model.
    """
    from hybridkv.model.v4.config import V4_SIMULATE_ONLY
    if opts.model in V4_SIMULATE_ONLY:
        raise ValueError(f"--model {opts.model} is a simulate-only preset (published shapes, no weights); "
                         "serve v4-tiny, v4-small or a deepseek_v4 directory")


def build_server(opts: ServeOptions) -> Server:
    """Engine, started engine thread, tokenizer and metrics bound into a :class:`Server`.

    Raises:
        ValueError: a bad option, or ``max_model_len`` beyond what the KV pool holds (named).
    """
    events = EventFeed()
    handle = build_handle(opts, events)
    try:
        events.use_family(handle.backend.tier_family)              # events name the model's cache groups
        if handle.store_tier is not None:
            events.watch_store(handle.store_tier, opts.store)      # store writes reach routers too
        cfg = handle.engine.config
        pool_tokens = cfg.num_kv_pages * cfg.block_size
        limit = opts.max_model_len if opts.max_model_len is not None else pool_tokens
        if limit > pool_tokens:
            raise ValueError(f"max_model_len={limit} exceeds the KV pool's {pool_tokens} tokens "
                             f"({cfg.num_kv_pages} pages of {cfg.block_size})")
        codec = load_codec(opts.model, handle.backend.vocab_size)
        metrics = ServeMetrics()
        shadow = make_verifier(handle, opts.shadow_verify, metrics)
        log.info("shadow verification: %s", f"{100 * shadow.rate:.4g}% of requests (their cache hits recomputed when idle)"
                 if shadow is not None else "off")
        worker = EngineWorker(handle, opts.max_waiting, on_step=metrics.step.observe,
                              on_admit=lambda s: metrics.queue_wait.observe(s.queue_seconds),
                              on_purge=events.reset,     # purges are not evictions: routers rebuild
                              shadow=shadow)
        worker.start()
    except BaseException:
        handle.close()
        raise
    settings = ServeSettings(opts.model, limit, opts.default_max_tokens, opts.snapshot_readers)
    return Server(handle, worker, codec, settings, metrics, events)


class BackgroundUvicorn:
    """An ASGI app served by uvicorn on its own thread; ``url`` is ``http://HOST:PORT``.

    Args:
        app: the ASGI application.
        host, port: where to listen (``port=0``: a free port).
        lifespan: uvicorn's ``lifespan`` setting (``"on"`` runs the app's startup/shutdown).
        end_running: see :class:`DrainingUvicorn`.

    Raises:
        PortError: the address cannot be listened on (named); RuntimeError: the server did not
            start (naming the URL).
    """

    def __init__(self, app, host: str, port: int, lifespan: str = "off", end_running=None) -> None:
        self.sock = bind_listener(host, port)
        self.url = url_of(self.sock)
        config = uvicorn.Config(app, log_level="warning", lifespan=lifespan)
        self.uvicorn = DrainingUvicorn(config, end_running)
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]},
                                        name="hybridkv-http", daemon=True)
        self._thread.start()
        while not self.uvicorn.started and self._thread.is_alive():
            self._thread.join(0.05)
        if not self.uvicorn.started:
            self.close()
            raise RuntimeError(f"the HTTP server did not start on {self.url}")

    def close(self) -> None:
        """Stop uvicorn (running requests get :data:`SHUTDOWN_GRACE_S`) and close the socket."""
        self.uvicorn.should_exit = True
        self._thread.join(10)
        self.sock.close()


class RunningServer:
    """A server with uvicorn on its own thread; ``url`` is ``http://HOST:PORT``.

    Args:
        opts: server options (``port=0`` picks a free port).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, opts: ServeOptions) -> None:
        self.server = build_server(opts)
        try:
            self.http = BackgroundUvicorn(create_app(self.server, opts.auth), opts.host, opts.port,
                                          end_running=self.server.end_running)
        except BaseException:
            self.server.worker.stop()
            self.server.handle.close()
            raise
        self.url = self.http.url

    def close(self) -> None:
        """Stop uvicorn, the engine thread and the store worker."""
        self.http.close()
        self.server.worker.stop()
        self.server.handle.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_foreground(app, sock: socket.socket, what: str, lifespan: str = "off", end_running=None) -> DrainingUvicorn:
    """Serve ``app`` on the listening ``sock`` in the foreground until SIGINT or SIGTERM, then stop
    cleanly (:class:`DrainingUvicorn`); ``what`` names the server in the log lines. Returns the
    stopped server (its ``stop_signal`` and ``ended``)."""
    config = uvicorn.Config(app, log_level="info", lifespan=lifespan)
    server = DrainingUvicorn(config, end_running)
    log.info("%s on %s (Ctrl-C stops it)", what, url_of(sock))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return server


def serve_forever(opts: ServeOptions) -> None:
    """Run the server in the foreground until SIGINT or SIGTERM (``hybridkv serve``); requests still
    running :data:`SHUTDOWN_GRACE_S` seconds after the signal are ended (a stream gets an error
    chunk and ``[DONE]``), then the engine and the store are closed and one line says so.

    The port is bound before the model loads, so a taken port fails at once.

    Raises:
        PortError: the address cannot be listened on (named, with the option that changes it);
        ConfigError / ValueError / FileNotFoundError: a bad option or model (see :func:`build_server`).
    """
    sock = bind_listener(opts.host, opts.port)
    try:
        server = build_server(opts)
    except BaseException:
        sock.close()
        raise
    try:
        if opts.auth is not None:
            (log.warning if opts.auth.api_open or opts.auth.admin_open else log.info)("%s", opts.auth.describe())
        http = run_foreground(create_app(server, opts.auth), sock, f"serving {opts.model}",
                              end_running=server.end_running)
    finally:
        server.worker.stop()
        server.handle.close()
    log.info("shut down cleanly%s: %d running request(s) ended after the %g s grace; engine and store closed",
             f" on {http.stop_signal}" if http.stop_signal else "", http.ended, SHUTDOWN_GRACE_S)
