"""Build an engine from a model and a cache config: backend, namespace, lower tiers and
:class:`~hybridkv.engine.engine.Engine` in one :class:`EngineHandle`. What ``hybridkv replay``
builds each instance with, and what :class:`hybridkv.api.LLM` stands on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

from hybridkv.cache.config import CacheConfig
from hybridkv.cache.groups import FullAttentionSpec, KDASpec
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import SimulatedBackend, StepItem, TorchBackend
from hybridkv.engine.engine import CacheListener, Engine
from hybridkv.model.config import PRESETS, HybridConfig
from hybridkv.model.v4.config import V4_PRESETS, V4_SIMULATE_ONLY, MODEL_TYPE as V4_MODEL_TYPE, V4Config
from hybridkv.tiers.base import TierStats
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.store_tier import StoreTier

if TYPE_CHECKING:                 # imported where a model is loaded: it imports torch
    from hybridkv.model.model import HybridModel
    from hybridkv.model.v4.model import V4Model

log = logging.getLogger("hybridkv.engine.build")


# -- models ------------------------------------------------------------------
def is_v4(name: str | os.PathLike) -> bool:
    """Whether ``name`` is a DeepSeek-V4 model: a ``v4-*`` preset, or a directory whose
    ``config.json`` has ``model_type`` ``deepseek_v4`` (an unreadable one is not)."""
    if not isinstance(name, (str, os.PathLike)):
        return False
    path = Path(name)
    if path.is_dir():
        try:
            data = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and data.get("model_type") == V4_MODEL_TYPE
    return str(name) in V4_PRESETS


def refuse_v4(name: str | os.PathLike, what: str) -> None:
    """Raise when ``name`` is a DeepSeek-V4 model and ``what`` (a command) does not run one yet.

    Raises:
        ValueError: naming the model and the command, and what does run it.
    """
    if is_v4(name):
        raise ValueError(f"{what} does not run DeepSeek-V4 models yet (model {str(name)!r}); "
                         "`hybridkv replay --model ...` and `LLM(...)` do")


def model_config(name: str | os.PathLike) -> HybridConfig | V4Config:
    """Config of a preset name (``tiny``, ``small``, ``kimi-linear-48b-a3b``; ``v4-tiny``,
    ``v4-small``) or a model directory (Kimi Linear, or ``model_type`` ``deepseek_v4``).

    Raises:
        ValueError: unknown preset name, or an invalid ``config.json`` (named).
    """
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"model must be a preset name or a model directory, got {name!r}")
    path = Path(name)
    if is_v4(path):
        return V4Config.from_hf(path) if path.is_dir() else V4Config.preset(str(name))
    if path.is_dir():
        return HybridConfig.from_hf(path)
    names = ", ".join((*PRESETS, *V4_PRESETS))
    if str(name) not in PRESETS and (os.sep in str(name) or str(name).startswith(".")):
        raise FileNotFoundError(f"model directory {str(name)!r} does not exist (presets: {names})")
    if str(name) not in PRESETS:
        raise ValueError(f"unknown preset {str(name)!r}; choose one of {names} or a model directory")
    return HybridConfig.preset(str(name))


def load_model(name: str | os.PathLike, seed: int = 0) -> HybridModel | V4Model:
    """A :class:`~hybridkv.model.model.HybridModel` (or, for a DeepSeek-V4 preset or directory,
    a :class:`~hybridkv.model.v4.model.V4Model`) in eval mode, fp32 on CPU: a preset with
    deterministic random weights from ``seed``, or a directory saved by ``transformers`` /
    ``HybridModel.save_pretrained`` (``seed`` unused).

    Raises:
        ValueError: unknown preset, a simulate-only preset (``deepseek-v4-flash``), or a bad
            config / missing or misshaped tensor (named).
        FileNotFoundError: a directory without config or weights.
    """
    from hybridkv.model.model import HybridModel          # here: it imports torch

    path = Path(name)
    if str(name) in V4_SIMULATE_ONLY and not path.is_dir():
        raise ValueError(f"model {str(name)!r} is a simulate-only preset (published shapes, no weights to build "
                         "on this machine): simulate it (`hybridkv replay --simulate`), or use v4-tiny / v4-small")
    if is_v4(path):
        from hybridkv.model.v4.model import V4Model
        model = V4Model.from_pretrained(path) if path.is_dir() else V4Model.from_preset(str(name), seed=seed)
        return model.eval()
    model = HybridModel.from_pretrained(path) if path.is_dir() else HybridModel.from_preset(str(name), seed=seed)
    return model.eval()


def _is_v4_model(model) -> bool:
    """A DeepSeek-V4 model or config."""
    return isinstance(getattr(model, "config", model), V4Config)


CLI_POOL_NAMES = {"kv": "--kv-pages {}", "checkpoint": "--checkpoint-slots {}", "host": "--host-mib {}"}
"""How :func:`check_pool_memory` names the sizes: as the command-line options that set them."""
API_POOL_NAMES = {"kv": "num_kv_pages={}", "checkpoint": "num_checkpoint_slots={}", "host": "host_mib={}"}
"""... and as the keyword arguments of :class:`hybridkv.api.LLM`."""


def check_pool_memory(config: CacheConfig, model: HybridConfig, instances: int = 1, kv_hint: str = "",
                      host_bytes: int = 0, names: dict[str, str] = CLI_POOL_NAMES) -> None:
    """Refuse device pools that cannot fit in this machine's memory, before any is allocated.

    Bytes per engine: ``num_kv_pages * block_size * kv_bytes_per_token`` (MLA latents, fp32) plus
    ``num_checkpoint_slots * checkpoint_bytes`` (KDA checkpoints, fp32), both allocated when the
    engine is built; times ``instances``, against physical memory (``SC_PHYS_PAGES * SC_PAGE_SIZE``).
    ``kv_hint`` is appended to the KV pool's part of the message (how its size was chosen).
    ``host_bytes`` is each engine's host tier capacity (bytes): it fills as entries are written,
    so a capacity above physical memory can only end in an out-of-memory kill later.
    ``names`` formats each size in the message (:data:`CLI_POOL_NAMES` or :data:`API_POOL_NAMES`).

    Raises:
        ValueError: more than physical memory; names ``--kv-pages`` / ``--checkpoint-slots`` (or
            ``--host-mib``) with their values, the GiB each needs and the machine's memory.
    """
    kv = config.num_kv_pages * config.block_size * model.kv_bytes_per_token
    ckpt = config.num_checkpoint_slots * model.checkpoint_bytes
    need = (kv + ckpt) * instances
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):          # not reported on this system: nothing to compare with
        return
    if host_bytes * instances > have:
        each = f" x {instances} instances" if instances > 1 else ""
        raise ValueError(f"{names['host'].format(host_bytes >> 20)}{each}: the host tier may hold "
                         f"{host_bytes * instances / 2**30:.1f} GiB but this machine has {have / 2**30:.1f} GiB "
                         "of memory; give at most the memory the host tier may take")
    if need <= have:
        return
    each = f", x {instances} instances" if instances > 1 else ""
    raise ValueError(f"the device pools need {need / 2**30:.1f} GiB ({names['kv'].format(config.num_kv_pages)} of "
                     f"{config.block_size} tokens: {kv / 2**30:.1f} GiB{kv_hint}; "
                     f"{names['checkpoint'].format(config.num_checkpoint_slots)}: {ckpt / 2**30:.1f} GiB{each}) but this machine has "
                     f"{have / 2**30:.1f} GiB of memory")


# -- engine construction -------------------------------------------------------
@dataclass(slots=True, eq=False)
class EngineHandle:
    """An engine and what was built for it (see :func:`build_engine`).

    Attributes:
        engine: the :class:`~hybridkv.engine.engine.Engine`.
        backend: :class:`~hybridkv.engine.backend.TorchBackend` (real model) or
            :class:`~hybridkv.engine.backend.SimulatedBackend` (cost model).
        model: the :class:`~hybridkv.model.model.HybridModel`; ``None`` when simulating.
        namespace: 32-byte namespace digest of every cache entry (:class:`CacheIdentity`).
        host_tier: the host tier, or ``None`` (``host_bytes == 0``); payload-free when simulating.
        store_tier: the store tier, or ``None`` (no store, or unreachable at startup).
    """

    engine: Engine
    backend: TorchBackend | SimulatedBackend
    model: HybridModel | None
    namespace: bytes
    host_tier: HostTier | None = None
    store_tier: StoreTier | None = None
    closed: bool = False

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Per tier (``device``, ``host``, ``store``, in that order): the same keys for every tier,
        those of ``TierStats.as_dict`` (``hit_tokens``, ``bytes_loaded``, ``bytes_saved``,
        ``evictions``, ``bytes_evicted``, ``loads_taken``, ``loads_declined``; tokens, bytes,
        counts). A missing tier reports zeros; the device is credited with every reused token the
        lower tiers did not supply (its own evictions are the cache's ``evicted_pages`` /
        ``evicted_checkpoints``)."""
        empty = TierStats().as_dict()
        host = self.host_tier.stats.as_dict() if self.host_tier is not None else dict(empty)
        store = self.store_tier.stats.as_dict() if self.store_tier is not None else dict(empty)
        device = {**empty, "hit_tokens": self.engine.stats.reused_tokens - host["hit_tokens"] - store["hit_tokens"]}
        return {"device": device, "host": host, "store": store}

    def close(self) -> None:
        """Stop the store tier's worker thread, release its staging memory and close the store.
        Idempotent; the counters stay readable."""
        if self.closed:
            return
        self.closed = True
        if self.store_tier is not None:
            try:
                self.store_tier.close()           # its worker thread and staging arena
            finally:
                self.store_tier.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open_store_tier(store_url: str, backend, namespace: bytes, config: CacheConfig,
                     required: bool = False) -> StoreTier | None:
    """The store tier for ``store_url``; ``None`` for ``none`` or a store unreachable at startup (a
    warning; :class:`StoreUnavailable` instead when ``required``)."""
    from hybridkv.store.base import StoreUnavailable
    from hybridkv.store.url import open_store
    from hybridkv.tiers.connector import tier_for
    try:
        store = open_store(store_url, quota=config.tenant_quota)  # disk: per-owner share of its capacity
    except StoreUnavailable as exc:
        if required:
            raise StoreUnavailable(f"store {store_url} unreachable at startup: {exc}") from exc
        log.warning("store %s unreachable at startup; running without it: %s", store_url, exc)
        return None
    if store is None:
        return None
    try:
        return tier_for(store, backend, namespace, config.prefix_match_unit, config.store_boundary)
    except BaseException:
        store.close()
        raise


def build_engine(model: HybridModel | HybridConfig, config: CacheConfig, *, model_name: str, store_url: str = "none",
                 host_bytes: int = 0, host_write_through: bool = False, host_groups: tuple[str, ...] = ("full", "kda"),
                 prefetch: bool = True, store_required: bool = False,
                 listener: CacheListener | None = None,
                 step_cost: Callable[[list[StepItem]], float] | None = None,
                 swa_recovery: str | None = None,
                 restore_cost: Callable[[int, int], float] | None = None) -> EngineHandle:
    """Backend, namespace, lower tiers and engine for ``model`` under ``config``.

    Args:
        model: a :class:`~hybridkv.model.model.HybridModel` (real compute through
            :class:`TorchBackend`), or a :class:`~hybridkv.model.config.HybridConfig`
            (simulation through :class:`SimulatedBackend`: no tensors; a host tier is
            payload-free, byte accounting only; no store).
        config: validated cache / scheduler config (tokens).
        model_name: preset name or model directory; with the weight digest (``"simulated"``
            when simulating) it forms the namespace, so engines of the same weights share
            store entries and no others do.
        store_url: ``none``, ``memory://``, ``disk:///PATH`` or ``mooncake://HOST:PORT``
            (:func:`hybridkv.store.url.open_store`). A store unreachable at startup logs a
            warning and the engine runs without it (unless ``store_required``).
        host_bytes: host tier capacity in bytes (write-back of evicted device entries); 0: none.
        host_write_through: the host tier also saves page-aligned entries as they are computed.
            Without it, a ``config.host_interval`` still writes checkpoints through (the host-only
            captures and the device's own), KV pages only on eviction.
        host_groups: the groups the host tier holds (``("kda",)``: checkpoints only).
        prefetch: start store loads for waiting requests in the background.
        store_required: raise instead of running without a store unreachable at startup.
        listener: hears every publication and eviction (:class:`~hybridkv.engine.engine.CacheListener`).
        step_cost: simulation only: ``step_cost(items) -> seconds`` of one step
            (:class:`~hybridkv.engine.backend.SimulatedBackend`).
        swa_recovery: DeepSeek-V4 only: how a hit restores the ``swa`` boundary state,
            ``window`` (default), ``periodic=P`` or ``recompute``
            (:class:`~hybridkv.cache.swa.SwaRecovery`); it also sets which boundaries get a
            saved state (``config.policy`` for ``window``, every ``P`` tokens, or none).

    Returns:
        An :class:`EngineHandle`; call its ``close()`` when done (it stops the store worker).

    Raises:
        ValueError: ``host_bytes`` negative, ``host_write_through`` without a host tier, a
            store asked for in simulation, ``step_cost`` with a real model, bad ``host_groups``,
            ``config.host_interval`` without a host tier holding checkpoints, or a malformed store
            URL (named); ``swa_recovery`` with a Kimi Linear model (a
            :class:`~hybridkv.model.v4.config.V4Config` is simulated by
            :class:`~hybridkv.engine.v4backend.SimulatedV4Backend`, with a payload-free host tier
            when ``host_bytes`` is given, as a simulated Kimi Linear model is).
        ConfigError: a bad ``swa_recovery``, or a ``block_size`` that is not a multiple of a V4
            model's compression rates (named).
        StoreUnavailable: ``store_required`` and the store does not answer at startup.
    """
    if not isinstance(host_bytes, int) or isinstance(host_bytes, bool) or host_bytes < 0:
        raise ValueError(f"host_bytes={host_bytes!r} must be an integer >= 0")
    if host_write_through and not host_bytes:
        raise ValueError("host_write_through=True needs a host tier: host_bytes is 0")
    v4 = _is_v4_model(model)
    if swa_recovery is not None and not v4:
        raise ValueError(f"swa_recovery={swa_recovery!r} applies to DeepSeek-V4 models (sliding-window state); "
                         f"{model_name} is a Kimi Linear model, whose KDA checkpoints are restored at the hit")
    if v4 and not hasattr(model, "prefill_capture"):       # a V4Config: simulate its groups, no tensors
        if store_url not in ("none", ""):
            raise ValueError(f"simulation has no tensors for a store: store_url={store_url!r}; use 'none' "
                             f"({model_name}: a simulated fleet models its shared store itself)")
        from hybridkv.cache.swa import SwaRecovery
        from hybridkv.engine.v4backend import SimulatedV4Backend
        recovery = SwaRecovery.parse(swa_recovery)
        recovery.check(config.prefix_match_unit)
        config = dataclasses.replace(config, policy=recovery.policy(config.policy))
        backend = SimulatedV4Backend(model, config.block_size, config.prefix_match_unit, recovery, step_cost=step_cost,
                                     restore_cost=restore_cost)
        digest, model, payload = "simulated", None, False
    elif v4:
        from hybridkv.cache.swa import SwaRecovery
        from hybridkv.engine.v4backend import V4Backend
        recovery = SwaRecovery.parse(swa_recovery)
        recovery.check(config.prefix_match_unit)
        config = dataclasses.replace(config, policy=recovery.policy(config.policy))
        backend = V4Backend(model, config.num_kv_pages, config.block_size, config.prefix_match_unit, recovery)
        digest, payload = model.weight_digest(), True
    elif isinstance(model, HybridConfig):
        if store_url not in ("none", ""):
            raise ValueError(f"simulation has no tensors for a store: store_url={store_url!r}; use 'none'")
        full, kda = FullAttentionSpec.for_model(model, config.block_size), KDASpec.for_model(model)
        backend = SimulatedBackend(full, kda, vocab_size=model.vocab_size, step_cost=step_cost)
        digest, model, payload = "simulated", None, False
    elif step_cost is not None:
        raise ValueError("step_cost prices simulated steps; a real model is timed by the clock")
    else:
        backend = TorchBackend(model, config.num_kv_pages, config.block_size)
        digest, payload = model.weight_digest(), True
    namespace = CacheIdentity(model_repo=str(model_name), weight_digest=digest).digest()
    host = store = None
    if host_bytes:
        from hybridkv.tiers.connector import host_tier_for
        from hybridkv.cache.groups import page_entry_name
        fam = backend.tier_family
        page, state = page_entry_name(fam), fam.boundary[0][0]
        # the Kimi Linear names of the two entry kinds stand for the page entry and the state entry
        groups = tuple({"full": page, "kda": state}.get(g, g) for g in host_groups)
        through = groups if host_write_through else tuple(g for g in groups if g == state and config.host_interval)
        host = host_tier_for(host_bytes, backend, namespace, config.prefix_match_unit, config.block_size,
                             write_through=bool(through), eviction=config.host_eviction, quota=config.tenant_quota,
                             payload=payload, groups=groups, through_groups=through or None,
                             probation_share=config.host_probation,
                             protected_share=config.host_protected_share)
    if model is not None:
        store = _open_store_tier(store_url, backend, namespace, config, required=store_required)
    tiers = [t for t in (host, store) if t is not None]
    handle = EngineHandle(engine=None, backend=backend, model=model, namespace=namespace,
                          host_tier=host, store_tier=store)
    try:
        handle.engine = Engine(config, backend, namespace, tiers=tiers, prefetch=prefetch, listener=listener)
    except BaseException:
        handle.close()
        raise
    return handle
