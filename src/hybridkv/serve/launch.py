"""Start a server: the engine and its thread, the tokenizer, the app, and uvicorn on a socket.

:func:`start_server` is what ``hybridkv serve`` runs in the foreground and what tests run in a
background thread (:class:`RunningServer`, port 0 = a free port on 127.0.0.1).
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from typing import Self

import torch

from hybridkv.api import DEFAULT_KV_TOKENS
from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.engine.build import EngineHandle, build_engine, load_model
from hybridkv.serve.app import Server, ServeSettings, create_app
from hybridkv.serve.cache_events import EventFeed
from hybridkv.serve.metrics import ServeMetrics
from hybridkv.serve.tokenizer import load_codec
from hybridkv.serve.worker import EngineWorker

log = logging.getLogger("hybridkv.serve")

SHUTDOWN_GRACE_S = 2.0
"""Seconds a stopping server (SIGINT, SIGTERM, :meth:`RunningServer.close`) lets running requests
finish before it cancels them (their cache references are released; a stream ends without
``[DONE]``). Without a bound, shutdown would wait for every generation to reach ``max_tokens``."""


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
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    model = load_model(opts.model, opts.seed)
    return build_engine(model, config, model_name=opts.model, store_url=opts.store, host_bytes=opts.host_mib << 20,
                        listener=listener)


def build_server(opts: ServeOptions) -> Server:
    """Engine, started engine thread, tokenizer and metrics bound into a :class:`Server`.

    Raises:
        ValueError: a bad option, or ``max_model_len`` beyond what the KV pool holds (named).
    """
    events = EventFeed()
    handle = build_handle(opts, events)
    try:
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
        worker = EngineWorker(handle, opts.max_waiting, on_step=metrics.step.observe,
                              on_admit=lambda s: metrics.queue_wait.observe(s.queue_seconds),
                              on_purge=events.reset)     # purges are not evictions: routers rebuild
        worker.start()
    except BaseException:
        handle.close()
        raise
    return Server(handle, worker, codec, ServeSettings(opts.model, limit, opts.default_max_tokens), metrics,
                  events)


class BackgroundUvicorn:
    """An ASGI app served by uvicorn on its own thread; ``url`` is ``http://HOST:PORT``.

    Args:
        app: the ASGI application.
        host, port: where to listen (``port=0``: a free port).
        lifespan: uvicorn's ``lifespan`` setting (``"on"`` runs the app's startup/shutdown).

    Raises:
        RuntimeError: the server did not start (naming the URL).
    """

    def __init__(self, app, host: str, port: int, lifespan: str = "off") -> None:
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(app, log_level="warning", lifespan=lifespan,
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        self.uvicorn = uvicorn.Server(config)
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
            self.http = BackgroundUvicorn(create_app(self.server), opts.host, opts.port)
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


def serve_forever(opts: ServeOptions) -> None:
    """Run the server in the foreground until SIGINT or SIGTERM (``hybridkv serve``); requests still
    running :data:`SHUTDOWN_GRACE_S` seconds after the signal are cancelled."""
    import uvicorn
    server = build_server(opts)
    log.info("serving %s on http://%s:%d", opts.model, opts.host, opts.port)
    try:
        uvicorn.run(create_app(server), host=opts.host, port=opts.port, log_level="info", lifespan="off",
                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    finally:
        server.worker.stop()
        server.handle.close()
