"""SGLang-style metadata, load and flush endpoints, so an SGLang router can register and drive a
``hybridkv serve`` worker (docs/how-to/serve.md, "Behind an SGLang router").

Routes (all JSON):

* ``GET /server_info`` and ``GET /get_server_info``: model id and path, tokenizer path (the model
  directory when it carries its own tokenizer, else ``null``), the weight digest (hex SHA-256 of
  the weights, as ``/v1/cache/info`` ``identity.weight_digest``), context and pool limits in
  tokens, ``tp_size`` and ``dp_size`` 1.
* ``GET /model_info`` and ``GET /get_model_info``: ``model_path``, ``tokenizer_path``,
  ``is_generation`` (always true), ``model_type`` and ``architectures``.
* ``GET /get_load``: a list with one entry per data-parallel rank (one here):
  ``{"dp_rank": 0, "num_reqs", "num_waiting_reqs", "num_tokens"}`` (requests, tokens; see
  :meth:`EngineWorker.load`). SGLang's router sums ``num_tokens`` over the list for its
  ``power_of_two`` policy (sgl-router ``WorkerManager::get_worker_load``). A key bound to a
  tenant (or an ``X-Tenant`` header) sees its own tenant's figures only.
* ``POST /flush_cache``: drops every device entry of this worker's model through the shared purge
  (:func:`hybridkv.tiers.purge.purge` with no lower tiers), between two engine steps. Entries a
  running request reads are detached, not torn: their pages stay with the request until it
  releases them, and its output is unchanged. The host tier and the store keep their entries.
  Answers the counts (no keys) and counts the flush in ``hybridkv_cache_flushes_total``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request

from hybridkv import __version__
from hybridkv.cache.purge import PurgeSelector
from hybridkv.engine.build import EngineHandle
from hybridkv.model.config import MODEL_TYPE
from hybridkv.serve.cache_events import group_info
from hybridkv.serve.auth import principal_of, request_tenant
from hybridkv.serve.protocol import APIError, tenant_header
from hybridkv.tiers.purge import purge as purge_tiers

if TYPE_CHECKING:
    from fastapi import FastAPI

    from hybridkv.serve.app import Server

ARCHITECTURE = "KimiLinearForCausalLM"
"""The ``architectures`` entry of a Kimi Linear ``config.json`` (what the model code implements)."""
V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
"""The ``architectures`` entry of a DeepSeek-V4 ``config.json``."""


def tokenizer_path(model: str) -> str | None:
    """The directory whose tokenizer the server uses, or ``None`` for the built-in byte tokenizer
    (same rule as :func:`hybridkv.serve.tokenizer.load_codec`)."""
    path = Path(model)
    if path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return str(path.resolve())
    return None


def flush_device(handle: EngineHandle) -> dict[str, int]:
    """Remove every device entry of ``handle``'s model namespace (engine thread only).

    Returns:
        ``device_nodes`` (index nodes, one per ``prefix_match_unit`` tokens), ``device_checkpoints``
        and ``held_pages`` (removed pages running requests still hold; freed on their release).
    """
    done = purge_tiers(handle.engine.cache, [], PurgeSelector(models=frozenset({handle.namespace})))
    return {"device_nodes": done.device_nodes, "device_checkpoints": done.device_checkpoints,
            "held_pages": done.held_pages}


class CompatRoutes:
    """The SGLang-style routes of one :class:`~hybridkv.serve.app.Server`."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def _model_path(self) -> str:
        model = self.server.settings.model_name
        return str(Path(model).resolve()) if Path(model).is_dir() else model

    async def server_info(self) -> dict:
        """``GET /server_info``: what the worker serves and its limits (tokens, requests), and
        ``weight_digest``: the hex SHA-256 of its weights (``"simulated"`` without a model), the
        ``--weight-digest`` that ``hybridkv cache purge --model`` needs (a digest, never content),
        and ``cache_groups``: the model's cache groups (name, kind ``paged`` / ``state``, unit in
        tokens, bytes per entry; :func:`~hybridkv.serve.cache_events.group_info`)."""
        s = self.server
        cfg = s.handle.engine.config
        return {"model_id": s.settings.model_name, "served_model_name": s.settings.model_name,
                "weight_digest": s.identity()["weight_digest"],
                "model_path": self._model_path(), "tokenizer_path": tokenizer_path(s.settings.model_name),
                "context_length": s.settings.max_model_len, "max_total_tokens": cfg.num_kv_pages * cfg.block_size,
                "max_prefill_tokens": cfg.max_num_batched_tokens, "max_running_requests": cfg.max_num_seqs,
                "max_waiting_requests": s.worker.max_waiting, "page_size": cfg.block_size,
                "prefix_match_unit": cfg.prefix_match_unit, "tp_size": 1, "dp_size": 1,
                "cache_groups": group_info(s.handle.backend.tier_family),
                "version": f"hybridkv-{__version__}"}

    async def model_info(self) -> dict:
        """``GET /model_info``: model and tokenizer paths, always a generation model; ``model_type`` and
        ``architectures`` as the model's ``config.json`` names them (``kimi_linear`` /
        ``KimiLinearForCausalLM``, ``deepseek_v4`` / ``DeepseekV4ForCausalLM``; ``null`` without a model)."""
        from hybridkv.model.v4.config import MODEL_TYPE as V4_MODEL_TYPE
        from hybridkv.model.v4.config import V4Config
        s = self.server
        model = s.handle.model
        kind = None if model is None else (
            (V4_MODEL_TYPE, V4_ARCHITECTURE) if isinstance(model.config, V4Config) else (MODEL_TYPE, ARCHITECTURE))
        return {"model_path": self._model_path(), "tokenizer_path": tokenizer_path(s.settings.model_name),
                "is_generation": True, "model_type": kind and kind[0], "architectures": kind and [kind[1]]}

    async def get_load(self, request: Request) -> list[dict]:
        """``GET /get_load``: one entry (rank 0) of requests and tokens this worker has to do.

        A request of a key bound to a tenant, or with an ``X-Tenant`` header, gets that tenant's
        figures only (its own requests: tenants never see each other's counts); the admin key, a
        key bound to no tenant and an open server get the whole worker's (what ``hybridkv router``
        reads with its ``--worker-key``).

        Raises:
            APIError: 403 (``tenant_mismatch``) for a bound key whose ``X-Tenant`` header names
                another tenant; 400 for an empty or repeated ``X-Tenant`` header.
        """
        tenant = request_tenant(principal_of(request), request.headers, None)
        return [{"dp_rank": 0, **self.server.worker.load(tenant)}]

    async def flush_cache(self, request: Request) -> dict:
        """``POST /flush_cache``: drop this worker's device entries (see the module docstring).

        Raises:
            APIError: 403 for a request with an ``X-Tenant`` header (a flush drops every tenant's
                entries; a tenant purges its own with ``POST /admin/cache/invalidate``).
        """
        s = self.server
        if tenant_header(request.headers) is not None:
            raise APIError(403, "a request with the X-Tenant header may not flush every tenant's entries; "
                                "POST /admin/cache/invalidate purges that tenant's", None, "tenant_scope",
                           "permission_error")
        s._check_alive()
        events = s.events

        def flush(handle: EngineHandle) -> dict[str, int]:
            counts = flush_device(handle)
            if events is not None:        # a flush is not a stream of evictions: routers rebuild.
                events.reset()            # On the engine thread, before its next step stores anything:
            return counts                 # reset later (on the loop), it would drop the new epoch's events

        counts = await asyncio.wrap_future(s.worker.call(flush))
        s.metrics.flushes.inc()
        return {"success": True, **counts}


def add_compat_routes(app: FastAPI, server: Server) -> None:
    """Add the SGLang-style routes of ``server`` to ``app``."""
    routes = CompatRoutes(server)
    for path in ("/server_info", "/get_server_info"):
        app.get(path)(routes.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.get(path)(routes.model_info)
    app.get("/get_load")(routes.get_load)
    app.post("/flush_cache")(routes.flush_cache)
