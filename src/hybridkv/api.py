"""The public Python API: :class:`LLM` (load a model, generate with the prefix cache) and
:func:`~hybridkv.engine.build.build_engine` (the engine, its backend and lower tiers from a
model and a config) builds what it runs on.

``LLM(...)`` is the entry point a user reaches from the README::

    from hybridkv import LLM

    with LLM("tiny") as llm:
        llm.generate([[1, 2, 3] * 100], max_tokens=8)               # computes and caches the prefix
        outs = llm.generate([[1, 2, 3] * 100 + [4]], max_tokens=8)
        print(outs[0].reused_tokens)                                 # 256: four 64-token units

Prompts are token ids (``int64``; there is no tokenizer), lengths are in
tokens, sizes in bytes unless the name says MiB. Generation is greedy.
:func:`~hybridkv.engine.build.build_engine` is also what ``hybridkv replay`` builds each
instance with.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.engine.build import (API_POOL_NAMES, EngineHandle, build_engine, check_pool_memory, load_model,
                                   model_config)
from hybridkv.engine.engine import Engine, EngineStats
from hybridkv.engine.request import Request, Status
from hybridkv.model.config import HybridConfig

log = logging.getLogger("hybridkv.api")

DEFAULT_KV_TOKENS = 65536
"""Tokens the device KV pool of an :class:`LLM` holds when ``num_kv_pages`` is not given."""


# -- LLM ---------------------------------------------------------------------------
@dataclass(slots=True)
class GenerationOutput:
    """The result of one prompt of :meth:`LLM.generate` (lengths in tokens).

    Attributes:
        request_id: the engine's id of this request (unique within the :class:`LLM`).
        prompt_token_ids: the prompt, ``T`` token ids.
        token_ids: the greedily generated ids, ``max_tokens`` of them (no stop at EOS).
        reused_tokens: prompt tokens taken from the cache (the joint MLA + KDA hit;
            at most ``T - 1``, a multiple of ``prefix_match_unit``), from any tier.
        computed_prompt_tokens: ``T - reused_tokens``, the prompt tokens run through the model.
        kv_hit_tokens: prompt tokens whose MLA KV was cached; ``kv_hit_tokens - reused_tokens``
            were recomputed because no KDA checkpoint existed deeper than ``reused_tokens``.
        finish_reason: ``"length"`` (``max_tokens`` generated); the only reason there is.
        logits: with ``return_logits=True``: ``float32[max_tokens, vocab]``, row ``i`` the
            logits at position ``T - 1 + i`` that ``token_ids[i]`` is the argmax of; else ``None``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    reused_tokens: int
    computed_prompt_tokens: int
    kv_hit_tokens: int
    finish_reason: str = "length"
    logits: torch.Tensor | None = None


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


def _is_id_scalar(x) -> bool:
    """A token id: a Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A scalar (id or not): a list of these is one prompt, to be checked id by id."""
    return isinstance(x, (int, float, bool, np.number, np.bool_))


class LLM:
    """A model with the hybrid prefix cache behind it: ``LLM("tiny").generate(prompts)``.

    Prompts are token ids (no tokenizer); generation is greedy. Everything a
    call computes stays cached (device pools, then the host tier and the store
    if configured), so later prompts sharing a prefix reuse it exactly: their
    tokens and logits equal a run without cache (logits within 1e-4).

    Args:
        model: ``tiny``, ``small``, ``kimi-linear-48b-a3b``, or DeepSeek-V4's ``v4-tiny``,
            ``v4-small`` (presets, random weights from ``seed``), or a directory saved by
            ``transformers`` / ``HybridModel.save_pretrained`` / ``V4Model.save_pretrained``.
        seed: seed of a preset's weights.
        block_size: KV page size in tokens (a multiple of ``prefix_match_unit``); the host
            tier keeps one entry per page.
        prefix_match_unit: hash / lookup granularity in tokens (a multiple of 64); reuse
            is always a multiple of it.
        policy: checkpoint placement, terms ``branch``, ``tail[=N]``, ``interval=N``, ``hint``,
            ``supersede``, ``none`` joined by ``+`` (:meth:`CheckpointPolicy.parse`), or a
            :class:`CheckpointPolicy`. ``none`` creates no checkpoints, so nothing is reused.
        mechanism: ``extract`` or ``split`` (how checkpoint states are taken; same bytes).
        num_kv_pages: device KV pool pages; default enough for ``DEFAULT_KV_TOKENS`` (65,536)
            tokens. Unreferenced pages are evicted LRU when short.
        num_checkpoint_slots: device checkpoint pool slots (one KDA state of every layer each).
        max_num_seqs: requests running at once.
        max_num_batched_tokens: scheduler budget per engine step (tokens).
        host_mib: host tier capacity in MiB (write-back of evicted device entries); 0: none.
        store: store URL: ``none``, ``disk:///ABS/DIR`` or ``mooncake://127.0.0.1:50051`` (shared
            across processes and restarts), or ``memory://`` (private to this LLM: a dict in this
            process, shared with no other LLM or process, gone when it closes). Unreachable at
            startup (e.g. a disk store on a read-only file system): a warning naming it, and the
            LLM runs without it. (Mooncake clients open wildcard listeners unless the
            process runs under ``hybridkv.store.mooncake.loopback``; see docs/how-to/mooncake.md.)
        store_alignment: tokens; only these boundaries become store entries (a multiple of
            ``block_size``; default ``block_size``).
        threads: torch intra-op threads (``torch.set_num_threads``, process-wide); ``None``
            leaves the setting alone.
        swa_recovery: DeepSeek-V4 models only (``v4-tiny``, ``v4-small`` or a ``deepseek_v4``
            directory): how a hit restores the sliding-window state: ``window`` (the state saved
            at the hit, placed by ``policy``; ``None`` means this), ``periodic=P`` (saved every
            ``P`` tokens, a multiple of ``prefix_match_unit``; the hit recomputes from the nearest
            one) or ``recompute`` (nothing saved; the hit recomputes the window's dependency
            cone). A V4 model's groups go to the host tier and the store like Kimi Linear's.

    Attributes:
        model: the loaded :class:`~hybridkv.model.model.HybridModel` (fp32, CPU).
        model_name: ``model`` as given (a string).
        config: the validated :class:`CacheConfig`.

    Raises:
        ConfigError: an invalid cache setting (a ``ValueError`` naming the field and value), e.g.
            a ``swa_recovery`` text, or a ``block_size`` not a multiple of a V4 model's rates.
        ValueError: an unknown preset, a ``seed`` outside [0, 2**63 - 1], a bad ``host_mib`` / ``threads``,
            or a malformed store URL; ``swa_recovery`` with a Kimi Linear model.
        TypeError: ``model`` not a string or path, ``seed`` not an integer, ``store`` not a string.
        FileNotFoundError: a model directory without config or weights.

    Not thread-safe: one :meth:`generate` at a time. Use as a context manager or call
    :meth:`close` to stop the store worker thread.
    """

    def __init__(self, model: str | os.PathLike = "tiny", *, seed: int = 0, block_size: int = 64,
                 prefix_match_unit: int = 64, policy: str | CheckpointPolicy = "branch+tail",
                 mechanism: str = "extract", num_kv_pages: int | None = None, num_checkpoint_slots: int = 64,
                 max_num_seqs: int = 4, max_num_batched_tokens: int = 8192, host_mib: int = 0,
                 store: str = "none", store_alignment: int | None = None, threads: int | None = None,
                 swa_recovery: str | None = None) -> None:
        self._handle: EngineHandle | None = None
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model={model!r} must be a preset name or a model directory")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise TypeError(f"seed={seed!r} must be an integer")
        if not 0 <= seed <= 2**63 - 1:          # the seeds torch and numpy accept, as the CLI's --seed
            raise ValueError(f"seed={seed!r} must be in [0, 2**63 - 1]")
        if not isinstance(host_mib, (int, np.integer)) or isinstance(host_mib, bool) or host_mib < 0:
            raise ValueError(f"host_mib={host_mib!r} must be an integer >= 0")
        if threads is not None:
            threads = _positive_int("threads", threads)
        if not isinstance(store, str):
            raise TypeError(f"store={store!r} must be a store URL string (e.g. 'disk:///tmp/hkv' or 'none')")
        if isinstance(policy, str):
            policy = CheckpointPolicy.parse(policy)
        if num_kv_pages is None and isinstance(block_size, int) and not isinstance(block_size, bool) \
                and block_size > 0:
            num_kv_pages = -(-DEFAULT_KV_TOKENS // block_size)
        self.config = CacheConfig(
            block_size=block_size, prefix_match_unit=prefix_match_unit,
            max_num_batched_tokens=max_num_batched_tokens, num_kv_pages=num_kv_pages,
            num_checkpoint_slots=num_checkpoint_slots, policy=policy, mechanism=mechanism,
            max_num_seqs=max_num_seqs, store_alignment=store_alignment)
        self.model_name = str(model)
        self.store_url = store
        sizes = model_config(model)
        if not isinstance(sizes, HybridConfig):         # DeepSeek-V4: its pages and slots, from the group specs
            from hybridkv.engine.v4backend import pool_sizes
            sizes = pool_sizes(sizes, self.config.block_size, self.config.prefix_match_unit)
        check_pool_memory(self.config, sizes, host_bytes=int(host_mib) << 20, names=API_POOL_NAMES)
        if threads is not None:
            torch.set_num_threads(threads)
        self.model = load_model(model, int(seed))
        self._handle = build_engine(self.model, self.config, model_name=self.model_name, store_url=store,
                                    host_bytes=int(host_mib) << 20, swa_recovery=swa_recovery)
        self._calls = 0

    # -- properties ------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The underlying :class:`~hybridkv.engine.engine.Engine`."""
        return self._live().engine

    @property
    def stats(self) -> EngineStats:
        """Engine counters over every request so far (tokens; ``reused_tokens`` is the joint hit)."""
        return self._handle.engine.stats

    @property
    def vocab_size(self) -> int:
        """Token ids must lie in ``[0, vocab_size)``."""
        return self.model.config.vocab_size

    @property
    def closed(self) -> bool:
        """:meth:`close` was called."""
        return self._handle is None or self._handle.closed

    def cache_info(self) -> dict:
        """Cache counters so far.

        Returns:
            ``tiers``: per tier (``device``, ``host``, ``store``) the replay report's per-tier
            keys ``{hit_tokens, bytes_loaded, bytes_saved, evictions, bytes_evicted,
            loads_taken, loads_declined}`` (tokens, bytes, counts); ``store_misses``: reason -> count (``absent``, ``evicted``,
            ``checksum``, ``incomplete``, ``unreachable``, ``expired``); ``kv_bytes_peak`` and
            ``checkpoint_bytes_peak`` (bytes held by published entries at peak);
            ``evicted_pages``, ``evicted_checkpoints`` (device evictions); ``store_connected``.
        """
        h = self._handle
        cache = h.engine.cache
        return {"tiers": h.tier_stats(),
                "store_misses": dict(h.store_tier.stats.misses) if h.store_tier is not None else {},
                "kv_bytes_peak": cache.kv_bytes_peak, "checkpoint_bytes_peak": cache.checkpoint_bytes_peak,
                "evicted_pages": cache.evicted_pages, "evicted_checkpoints": cache.evicted_checkpoints,
                "store_connected": h.store_tier is not None}

    # -- generation -----------------------------------------------------------
    def _live(self) -> EngineHandle:
        if self.closed:
            raise RuntimeError("LLM is closed")
        return self._handle

    def _prompts(self, prompts) -> list[np.ndarray]:
        """Validated ``int64[T]`` arrays from one prompt or a list of prompts (see :meth:`generate`)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], str)):
            raise TypeError("prompts must be token ids, not text: hybridkv has no tokenizer")
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.detach().cpu().numpy()
        if isinstance(prompts, np.ndarray):
            if prompts.ndim == 1:
                batch = [prompts]
            elif prompts.ndim == 2:
                batch = list(prompts)
            else:
                raise ValueError(f"prompts array must be 1-D (one prompt) or 2-D (one per row), "
                                 f"got shape {prompts.shape}")
        elif isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("prompts is empty: pass one prompt (a list of token ids) or a list of prompts")
            numbers = [_is_number(x) for x in prompts]
            if all(numbers):
                batch = [prompts]
            elif any(numbers):
                i = numbers.index(not numbers[0])
                raise ValueError(f"prompts mixes token ids and prompts (element {i} is {prompts[i]!r}); "
                                 "pass one list of ids or a list of id lists")
            else:
                batch = list(prompts)
        else:
            raise TypeError(f"prompts must be a list of token-id lists, one list, or an int array; "
                             f"got {type(prompts).__name__}")
        if isinstance(prompts, np.ndarray) and not batch:
            raise ValueError(f"prompts array of shape {prompts.shape} holds no prompt")
        return [self._prompt(i, p) for i, p in enumerate(batch)]

    def _prompt(self, i: int, p) -> np.ndarray:
        """Prompt ``i`` as ``int64[T]``; ``ValueError`` / ``TypeError`` naming the index and the bad value."""
        if isinstance(p, torch.Tensor):
            p = p.detach().cpu().numpy()
        if isinstance(p, str):
            raise TypeError(f"prompt {i} is text, not token ids: hybridkv has no tokenizer")
        if isinstance(p, np.ndarray):
            if p.ndim != 1:
                raise ValueError(f"prompt {i} must be a 1-D list of token ids, got shape {p.shape}")
            if p.dtype.kind not in "iu":
                raise ValueError(f"prompt {i}: token ids must be integers, got dtype {p.dtype}")
            ids = p
        elif isinstance(p, (list, tuple)):
            for j, x in enumerate(p):
                if not _is_id_scalar(x):
                    raise ValueError(f"prompt {i}: element {j} is {x!r} ({type(x).__name__}), not an integer "
                                     "token id")
            ids = p
        else:
            raise TypeError(f"prompt {i} must be a list or 1-D array of token ids, got {type(p).__name__}")
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty (0 token ids); a prompt needs at least 1 token")
        vocab = self.vocab_size
        if isinstance(ids, np.ndarray):
            lo, hi = int(ids.min()), int(ids.max())
            bad = lo if lo < 0 else hi if hi >= vocab else None
        else:
            bad = next((int(x) for x in ids if not 0 <= int(x) < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt {i}: token id {bad} is outside the vocabulary [0, {vocab}) "
                             f"of model {self.model_name!r}")
        return np.asarray(ids, dtype=np.int64)

    def generate(self, prompts, max_tokens: int = 16, *, return_logits: bool = False) -> list[GenerationOutput]:
        """Greedily generate ``max_tokens`` tokens after each prompt, reusing cached prefixes.

        The prompts of one call are queued together and run batched (up to
        ``max_num_seqs`` at once, ``max_num_batched_tokens`` per step). A prompt
        reuses what earlier calls left in the cache, and what prompts of this call
        published before it was admitted: two prompts admitted in the same step do
        not share their new common prefix (the second one of a later call does).

        Args:
            prompts: a list of prompts, each a list / 1-D array of token ids (int) in
                ``[0, vocab_size)``; or a single prompt (a list of ints or a 1-D array);
                or a 2-D int array, one prompt per row.
            max_tokens: tokens to generate per prompt (>= 1); generation does not stop at EOS.
            return_logits: also return the logits behind every generated token
                (:attr:`GenerationOutput.logits`); costs the LM head over every computed
                prompt position.

        Returns:
            One :class:`GenerationOutput` per prompt, in input order (a list even for one prompt).

        Raises:
            TypeError: text instead of token ids, or ``prompts`` of another type.
            ValueError: naming the prompt index and value: no prompts, an empty prompt, non-integer ids, an id outside the vocabulary, ``max_tokens`` not
                an integer >= 1, or a prompt that needs more KV pages than the pool has
                (``ceil((T + max_tokens - 1) / block_size) > num_kv_pages``). Nothing runs then.
            RuntimeError: the LLM is closed. A request the engine rejects anyway (it cannot
                once the checks above pass) raises a ``RuntimeError`` naming it after the call.
        """
        engine = self._live().engine
        batch = self._prompts(prompts)
        max_tokens = _positive_int("max_tokens", max_tokens)
        b, pages = self.config.block_size, self.config.num_kv_pages
        for i, p in enumerate(batch):
            need = -(-(len(p) + max_tokens - 1) // b)
            if need > pages:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_tokens={max_tokens} need {need} KV pages "
                                 f"of {b} tokens; the pool has num_kv_pages={pages}")
        call, self._calls = self._calls, self._calls + 1
        reqs = [Request(f"g{call}-{i}", p, max_tokens, record_logits=return_logits) for i, p in enumerate(batch)]
        try:
            for r in reqs:
                engine.add_request(r)
            while engine.has_work:
                engine.step()
        except BaseException:
            for r in reqs:
                if r.status != Status.WAITING or r in engine.waiting:
                    engine.cancel(r)
            raise
        bad = [(i, r) for i, r in enumerate(reqs) if r.status != Status.FINISHED]
        if bad:
            i, r = bad[0]
            raise RuntimeError(f"prompt {i} ({r.prompt_len} tokens) was {r.status.value} by the engine: "
                               f"{r.reject_reason or 'no reason given'}")
        return [self._output(r, return_logits) for r in reqs]

    @staticmethod
    def _output(r: Request, return_logits: bool) -> GenerationOutput:
        logits = None
        if return_logits:
            t = r.prompt_len
            logits = torch.stack([r.logits[t - 1 + k] for k in range(len(r.output))]).to(torch.float32)
        return GenerationOutput(request_id=r.request_id, prompt_token_ids=r.prompt.tolist(),
                                token_ids=list(r.output), reused_tokens=r.reused,
                                computed_prompt_tokens=r.prompt_len - r.reused,
                                kv_hit_tokens=r.match.kv_hit if r.match is not None else 0,
                                finish_reason="length", logits=logits)

    # -- lifetime --------------------------------------------------------------
    def close(self) -> None:
        """Stop the store worker and close the store. Idempotent; counters stay readable,
        :meth:`generate` raises ``RuntimeError`` afterwards."""
        if self._handle is not None:
            self._handle.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"LLM(model={self.model_name!r}, block_size={c.block_size}, prefix_match_unit={c.prefix_match_unit}, "
                f"policy={str(c.policy)!r}, store={self.store_url!r})")
