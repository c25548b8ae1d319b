"""The compute backend of a DeepSeek-V4 model (:class:`~hybridkv.model.v4.model.V4Model`), behind
the same engine, scheduler and cache as Kimi Linear (DESIGN §12, §13).

The backend owns the device storage of V4's cache groups (:mod:`hybridkv.cache.swa`):

* the prefix groups ``csa`` and ``hca`` in one page id per ``block_size`` block: per group a
  tensor ``[layers of the group, num_pages, block_size / rate, width]`` (``csa`` also holds the
  Lightning Indexer's keys), so a request's block table addresses its compressed entries the
  way it addresses MLA KV pages;
* the boundary group ``swa`` in checkpoint slots (:meth:`new_checkpoint_pool`), each a fixed
  size padded bundle of every layer's window, compressor tails and CSA overlaps
  (:func:`swa_codec`), valid rows given by the boundary.

A request's working state is the :class:`~hybridkv.model.v4.state.V4BoundaryState` at its next
position; each step gathers its compressed entries of ``[0, start)`` from its pages, runs the
model one sequence at a time, and writes the entries that closed in the step into its pages.
:meth:`rebuild` restores the boundary state at a hit from a state saved further back (or none:
the recompute cone), which the engine calls when the joint hit's restart point lies below it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hybridkv._torch import torch
from hybridkv.cache.groups import BOUNDARY, PREFIX, Family, GroupSpec
from hybridkv.cache.pools import CheckpointPool, StateCodec
from hybridkv.cache.swa import CSA, HCA, SWA, SwaRecovery, check_block_size, v4_family
from hybridkv.engine.backend import NoTensors, StepItem, StepOutput


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def max_tail_rows(rate: int, unit: int) -> int:
    """Most unfinished-tail rows a compressor of ``rate`` has at a boundary that is a multiple of
    ``unit`` (tokens): ``rate − gcd(rate, unit)`` (0 when ``rate`` divides ``unit``)."""
    return rate - math.gcd(rate, unit)


def max_cone_tokens(config, unit: int) -> int:
    """The largest recompute cone (:func:`~hybridkv.model.v4.cone.recompute_cone_tokens`, tokens)
    at any boundary that is a multiple of ``unit``: the cone depends on ``h`` only through
    ``h mod rate`` once ``h`` exceeds it, so one period of every rate past the unclipped bound
    covers every case."""
    from hybridkv.model.v4.cone import recompute_cone_tokens
    period = math.lcm(unit, config.csa_rate, config.hca_rate)
    reach = config.num_hidden_layers * config.sliding_window + config.hca_rate + 2 * config.csa_rate
    first = -(-reach // unit) * unit
    return max(recompute_cone_tokens(config, h) for h in range(first, first + period + unit, unit))


def swa_spec(config, unit: int, dtype: str = "float32") -> GroupSpec:
    """The ``swa`` :class:`GroupSpec` of a V4 config whose states are taken at multiples of
    ``unit`` tokens: components (each padded to the most rows any such boundary needs)

    * ``window`` ``[L, W − 1, head_dim]``;
    * per compressed kind ``k`` in ``csa`` / ``hca`` with ``n_k`` layers: ``k.tail.kv`` and
      ``k.tail.gate`` ``[n_k, max tail rows, width]`` (width ``2·head_dim`` CSA, ``head_dim`` HCA);
    * CSA also ``csa.overlap.kv`` / ``.gate`` ``[n_csa, csa_rate, head_dim]`` and the indexer's
      ``csa.index.tail.*`` ``[n_csa, max tail rows, 2·index_head_dim]`` and
      ``csa.index.overlap.*`` ``[n_csa, csa_rate, index_head_dim]``.
    """
    comps = [("window", dtype, (config.num_hidden_layers, config.sliding_window - 1, config.head_dim))]
    n_csa, n_hca = len(config.csa_layers), len(config.hca_layers)
    tc, th = max_tail_rows(config.csa_rate, unit), max_tail_rows(config.hca_rate, unit)
    d, di, mc = config.head_dim, config.index_head_dim, config.csa_rate
    for part in ("kv", "gate"):
        comps += [(f"csa.tail.{part}", dtype, (n_csa, tc, 2 * d)), (f"csa.overlap.{part}", dtype, (n_csa, mc, d)),
                  (f"csa.index.tail.{part}", dtype, (n_csa, tc, 2 * di)),
                  (f"csa.index.overlap.{part}", dtype, (n_csa, mc, di)),
                  (f"hca.tail.{part}", dtype, (n_hca, th, d))]
    return GroupSpec(SWA, BOUNDARY, unit, tuple(comps))


def prefix_specs(config, dtype: str = "float32") -> tuple[GroupSpec, GroupSpec]:
    """The ``csa`` (granularity ``csa_rate``: entry ``kv`` ``[n_csa, ·, head_dim]`` and indexer key
    ``index`` ``[n_csa, ·, index_head_dim]``) and ``hca`` (granularity ``hca_rate``: ``kv``
    ``[n_hca, ·, head_dim]``) :class:`GroupSpec` of a V4 config; ``·`` is the entries axis."""
    n_csa, n_hca = len(config.csa_layers), len(config.hca_layers)
    csa = GroupSpec(CSA, PREFIX, config.csa_rate, (("kv", dtype, (n_csa, 1, config.head_dim)),
                                                    ("index", dtype, (n_csa, 1, config.index_head_dim))))
    hca = GroupSpec(HCA, PREFIX, config.hca_rate, (("kv", dtype, (n_hca, 1, config.head_dim)),))
    return csa, hca


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """Device bytes of a V4 model's pools, as :func:`~hybridkv.replay.runner.check_device_memory`
    reads them: ``kv_bytes_per_token`` (prefix-group entries per token, rounded up) and
    ``checkpoint_bytes`` (one ``swa`` slot)."""

    kv_bytes_per_token: int
    checkpoint_bytes: int


def pool_sizes(config, block_size: int, prefix_match_unit: int, dtype: str = "float32") -> PoolSizes:
    """:class:`PoolSizes` of a V4 config with pages of ``block_size`` tokens and states at
    multiples of ``prefix_match_unit`` (tokens), in ``dtype``."""
    csa, hca = prefix_specs(config, dtype)
    page = csa.bytes_per_entry * (block_size // csa.granularity) + hca.bytes_per_entry * (block_size // hca.granularity)
    return PoolSizes(-(-page // block_size), swa_spec(config, prefix_match_unit, dtype).bytes_per_entry)


def swa_codec(config, spec: GroupSpec) -> StateCodec:
    """A :class:`V4BoundaryState` as ``spec``'s padded components and back (the checkpoint pool's
    codec). Valid rows follow from the boundary ``t``: windows ``min(t, W − 1)``, tails
    ``t mod rate``, CSA overlaps present once ``t >= csa_rate``.

    Raises (encode):
        ValueError: a state whose tail is longer than the spec's padding (a boundary that is not a
            multiple of the spec's unit).
    """
    from hybridkv.model.v4.state import CompressorTail, LayerBoundary, V4BoundaryState

    shapes = {c: (getattr(torch, dt), s) for c, dt, s in spec.components}
    kinds = config.layer_types
    slot_of = {li: i for grp in (config.csa_layers, config.hca_layers) for i, li in enumerate(grp)}

    def encode(state) -> dict:
        parts = {c: torch.zeros(s, dtype=dt) for c, (dt, s) in shapes.items()}
        for li, lb in enumerate(state.layers):
            parts["window"][li, : lb.window.shape[0]] = lb.window
            kind = kinds[li]
            if kind == "sliding":
                continue
            k = slot_of[li]
            for prefix, tail in ((kind, lb.compressor), ("csa.index", lb.indexer)):
                if tail is None:
                    continue
                rows = tail.kv.shape[0]
                if rows > parts[f"{prefix}.tail.kv"].shape[1]:
                    raise ValueError(f"boundary {state.boundary}: layer {li} tail of {rows} rows does not fit the "
                                     f"swa slot (states are taken at multiples of {spec.granularity} tokens)")
                parts[f"{prefix}.tail.kv"][k, :rows] = tail.kv
                parts[f"{prefix}.tail.gate"][k, :rows] = tail.gate
                if tail.overlap_kv is not None:
                    parts[f"{prefix}.overlap.kv"][k] = tail.overlap_kv
                    parts[f"{prefix}.overlap.gate"][k] = tail.overlap_gate
        return parts

    def decode(parts: dict, t: int):
        w = min(t, config.sliding_window - 1)
        layers = []
        for li, kind in enumerate(kinds):
            comp = ix = None
            if kind != "sliding":
                k, m = slot_of[li], config.rate(li)
                over = kind == "csa" and t >= m

                def tail(prefix):
                    return CompressorTail(parts[f"{prefix}.tail.kv"][k, : t % m].clone(),
                                          parts[f"{prefix}.tail.gate"][k, : t % m].clone(),
                                          parts[f"{prefix}.overlap.kv"][k].clone() if over else None,
                                          parts[f"{prefix}.overlap.gate"][k].clone() if over else None)
                comp = tail(kind)
                ix = tail("csa.index") if kind == "csa" else None
            layers.append(LayerBoundary(parts["window"][li, :w].clone(), comp, ix))
        return V4BoundaryState(t, layers)

    return StateCodec(encode, decode)


class V4Backend:
    """Runs a :class:`~hybridkv.model.v4.model.V4Model` over paged compressed entries.

    Args:
        model: the V4 model (eval mode).
        num_pages, block_size: page pool geometry (pages, tokens per page); ``block_size`` must be
            a multiple of ``csa_rate`` and ``hca_rate``.
        prefix_match_unit: tokens; boundary states are taken at its multiples.
        swa_recovery: how a hit restores the boundary state (:class:`SwaRecovery` or its text).

    Raises:
        ConfigError: ``block_size`` not a multiple of every prefix group's granularity, or a
            ``periodic`` period not a multiple of ``prefix_match_unit`` (naming the values).
    """

    tensors = True
    """Step items carry their ids as torch tensors."""

    def __init__(self, model, num_pages: int, block_size: int, prefix_match_unit: int,
                 swa_recovery: SwaRecovery | str | None = None) -> None:
        cfg = model.config
        self.model, self.config = model, cfg
        self.vocab_size = cfg.vocab_size
        self.block_size, self.unit = block_size, prefix_match_unit
        self.recovery = SwaRecovery.parse(swa_recovery)
        self.recovery.check(prefix_match_unit)
        dt = _dtype_name(model.dtype)
        self.csa_spec, self.hca_spec = prefix_specs(cfg, dt)
        check_block_size(block_size, {CSA: cfg.csa_rate, HCA: cfg.hca_rate})
        self.swa_spec = swa_spec(cfg, prefix_match_unit, dt)
        self.cone_tokens = max_cone_tokens(cfg, prefix_match_unit)
        self.family: Family = v4_family(self.csa_spec, self.hca_spec, self.swa_spec,
                                        self.recovery.restore(self.cone_tokens))
        self._codec = swa_codec(cfg, self.swa_spec)
        #: The groups with their entry layouts (lower tiers store them by spec).
        self.tier_family = self.family
        #: The ``swa`` state as its entry components and back (lower tiers encode and decode with it).
        self.state_codec = self._codec
        dev, tdt = model.device, model.dtype
        n_csa, n_hca = len(cfg.csa_layers), len(cfg.hca_layers)
        z = (lambda *s: torch.zeros(s, dtype=tdt, device=dev))
        self.csa_kv = z(n_csa, num_pages, block_size // cfg.csa_rate, cfg.head_dim)
        self.csa_index = z(n_csa, num_pages, block_size // cfg.csa_rate, cfg.index_head_dim)
        self.hca_kv = z(n_hca, num_pages, block_size // cfg.hca_rate, cfg.head_dim)
        self._slot = {li: (CSA, i) for i, li in enumerate(cfg.csa_layers)}
        self._slot.update({li: (HCA, i) for i, li in enumerate(cfg.hca_layers)})
        self._rates = tuple(cfg.rate(i) for i in range(cfg.num_hidden_layers))
        self.restores: list[tuple[int, int]] = []
        """``(restart, hit)`` of each restore that recomputed ``[restart, hit)`` (:meth:`rebuild`), tokens."""

    # -- sizes (metrics) ----------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page over both prefix groups (``block_size`` tokens of entries)."""
        return self.csa_spec.bytes_per_entry * (self.block_size // self.csa_spec.granularity) \
            + self.hca_spec.bytes_per_entry * (self.block_size // self.hca_spec.granularity)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of prefix-group entries per token (a page's bytes over its tokens; rounded down)."""
        return self.page_bytes // self.block_size

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one ``swa`` slot."""
        return self.swa_spec.bytes_per_entry

    def cache_binding(self) -> bytes:
        """What cached state of this backend depends on: weights, dtype and the group specs."""
        specs = (self.csa_spec, self.hca_spec, self.swa_spec)
        return f"torch-v4|{self.model.weight_digest()}|{self.model.dtype}|{specs}".encode()

    def new_checkpoint_pool(self, num_slots: int, eviction: str = "lru") -> CheckpointPool:
        """A tensor-backed pool of ``swa`` slots (``eviction``: ``lru`` / ``value``)."""
        return CheckpointPool(num_slots, spec=self.swa_spec, codec=self._codec, device=self.model.device,
                              eviction=eviction)

    # -- pages --------------------------------------------------------------------
    def _pools(self):
        cfg = self.config
        return ((self.csa_kv, cfg.csa_rate), (self.csa_index, cfg.csa_rate), (self.hca_kv, cfg.hca_rate))

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the entries of page ``src`` whose windows close within its first ``num_tokens``
        tokens into page ``dst`` (every group; copy-on-write of a partial hit page)."""
        for pool, m in self._pools():
            n = num_tokens // m
            pool[:, dst, :n] = pool[:, src, :n]

    def _page_pools(self):
        """(page entry component, pool) of the prefix groups (names as in
        :func:`~hybridkv.cache.groups.tier_entry_shapes`)."""
        return ((f"{CSA}.kv", self.csa_kv), (f"{CSA}.index", self.csa_index), (f"{HCA}.kv", self.hca_kv))

    def read_page_entry(self, block_table: list[int], start: int, end: int) -> dict[str, torch.Tensor]:
        """The page entry of tokens ``[start, end)`` (whole pages): per component ``csa.kv``
        ``[n_csa, (end − start) / csa_rate, head_dim]``, ``csa.index`` (``index_head_dim``), ``hca.kv``
        ``[n_hca, (end − start) / hca_rate, head_dim]`` (copies).

        Raises:
            ValueError: ``start`` or ``end`` not a multiple of ``block_size`` (naming them).
        """
        b = self.block_size
        if start % b or end % b:
            raise ValueError(f"page entry [{start}, {end}) is not whole pages of {b} tokens")
        pages = torch.tensor(block_table[start // b: end // b], dtype=torch.long)
        return {name: pool[:, pages].reshape(pool.shape[0], -1, pool.shape[-1]).clone()
                for name, pool in self._page_pools()}

    def page_entry(self, page: int) -> dict[str, torch.Tensor]:
        """The page entry of one whole page (copies; shapes as :meth:`read_page_entry`)."""
        return {name: pool[:, page].clone() for name, pool in self._page_pools()}

    def write_page_entry(self, pages: list[int], components: dict[str, torch.Tensor]) -> None:
        """Fill whole ``pages`` from a page entry's components (shapes as :meth:`read_page_entry`)."""
        idx = torch.tensor(pages, dtype=torch.long)
        for name, pool in self._page_pools():
            src = components[name]
            pool[:, idx] = src.reshape(pool.shape[0], len(pages), pool.shape[2], pool.shape[-1]).to(pool.dtype)

    def entries(self, block_table: list[int], t: int):
        """The compressed entries of ``[0, t)`` gathered from pages (a
        :class:`~hybridkv.model.v4.state.V4CompressedEntries`, new storage)."""
        from hybridkv.model.v4.state import V4CompressedEntries
        pages = torch.tensor(block_table[: -(-t // self.block_size)], dtype=torch.long)
        kv, ix = [], []
        for li, m in enumerate(self._rates):
            if not m:
                kv.append(None)
                ix.append(None)
                continue
            grp, k = self._slot[li]
            pool = self.csa_kv if grp == CSA else self.hca_kv
            kv.append(pool[k, pages].reshape(-1, pool.shape[-1])[: t // m])
            ix.append(self.csa_index[k, pages].reshape(-1, self.csa_index.shape[-1])[: t // m] if grp == CSA else None)
        return V4CompressedEntries(t, self._rates, kv, ix)

    def _write_entries(self, block_table: list[int], compressed, start: int, end: int) -> None:
        """Write the entries closing in ``(start, end]`` into the request's pages."""
        for li, m in enumerate(self._rates):
            if not m or end // m <= start // m:
                continue
            grp, k = self._slot[li]
            e = torch.arange(start // m, end // m)
            per = self.block_size // m
            pages = torch.tensor(block_table, dtype=torch.long)[e // per]
            offs = e % per
            if grp == CSA:
                self.csa_kv[k, pages, offs] = compressed.kv[li][start // m: end // m]
                self.csa_index[k, pages, offs] = compressed.index[li][start // m: end // m]
            else:
                self.hca_kv[k, pages, offs] = compressed.kv[li][start // m: end // m]

    # -- compute --------------------------------------------------------------------
    def _state_at(self, block_table: list[int], t: int, boundary_state):
        from hybridkv.model.v4.state import restore
        if boundary_state is None:
            if t:
                raise ValueError(f"no boundary state for a step starting at token {t}")
            boundary_state = self.model.empty_state().boundary_state
        return restore(self.entries(block_table, t), boundary_state)

    def run(self, items: list[StepItem]) -> list[StepOutput]:
        """Every item, one sequence at a time (no autograd)."""
        outs = []
        with torch.no_grad():
            for it in items:
                n = int(it.token_ids.shape[0])
                state = self._state_at(it.block_table, it.start, it.state)
                logits, end, caps = self.model.prefill_capture(it.token_ids, state, it.capture)
                self._write_entries(it.block_table, end.compressed, it.start, it.start + n)
                outs.append(StepOutput(next_token=int(logits[-1].argmax()),
                                       logits=logits if it.all_logits else logits[-1:],
                                       end_state=end.boundary_state,
                                       checkpoints={b: s.boundary_state for b, s in caps.items()}))
        return outs

    def rebuild(self, prompt: np.ndarray, block_table: list[int], restart: int, hit: int, saved):
        """The boundary state at ``hit`` when the joint hit resumes at ``restart < hit``.

        The compressed entries of ``[0, hit)`` come from the request's pages. From the state
        ``saved`` at ``restart`` (or the zero state when ``restart == 0``) the model recomputes
        ``[restart, hit)`` (``periodic``; the entries it recomputes are discarded: the cached ones
        stand); with no saved state it recomputes the dependency cone ending at ``hit`` from the
        raw tokens (``recompute``; ``hit − restart`` covers it).

        Args:
            prompt: ``int64[T]`` the request's prompt (``T > hit``).
            block_table: the request's pages.
            restart, hit: tokens.
            saved: :class:`~hybridkv.model.v4.state.V4BoundaryState` at ``restart``, or ``None``.

        Returns:
            The :class:`~hybridkv.model.v4.state.V4BoundaryState` at ``hit``.
        """
        from hybridkv.model.v4.state import restore
        self.restores.append((restart, hit))
        entries = self.entries(block_table, hit)
        ids = torch.from_numpy(np.ascontiguousarray(prompt[:hit], dtype=np.int64))
        with torch.no_grad():
            if saved is None and restart > 0:
                return self.model.recompute_boundary(ids[restart:], entries, hit)
            start = saved if saved is not None else self.model.empty_state().boundary_state
            _, end = self.model.prefill(ids[restart:], restore(entries, start))
        return end.boundary_state


class SimulatedV4Backend(NoTensors):
    """A DeepSeek-V4 model's cache groups without tensors (``--simulate``): the same specs,
    family and restart points as :class:`V4Backend`, so the index, matcher, checkpoint policy
    and scheduler decide exactly as they do with the model; compute time comes from a cost
    model.

    Args:
        config: a :class:`~hybridkv.model.v4.config.V4Config` (only its shapes are read).
        block_size, prefix_match_unit: tokens, as for :class:`V4Backend`.
        swa_recovery: ``window``, ``periodic=P`` or ``recompute``.
        step_cost: ``step_cost(items) -> seconds`` of one step (a
            :class:`~hybridkv.fleet.costmodel.StepCostModel` through the fleet); ``None``: steps
            cost nothing (an untimed replay).
        restore_cost: ``restore_cost(restart, hit) -> seconds`` of rebuilding the boundary
            state at ``hit`` from ``restart`` (:func:`hybridkv.fleet.costmodel.v4_restore_pricer`,
            given by the fleet and replay layers); ``None``: restores are counted, not priced.
        dtype: entry dtype of the byte counts (``bfloat16``: the H200 models' assumption).

    Raises:
        ConfigError: a ``block_size`` that is not a multiple of the compression rates, or a
            ``periodic`` period not a multiple of ``prefix_match_unit``.
    """

    tensors = False
    """Step items carry numpy ids (no torch on the simulated path)."""
    copy_page = None
    state_codec = None
    """No tensors: lower tiers (a payload-free host tier) hold byte accounting only."""

    def __init__(self, config, block_size: int, prefix_match_unit: int, swa_recovery: SwaRecovery | str | None = None,
                 step_cost=None, restore_cost=None, dtype: str = "bfloat16") -> None:
        self.config, self.vocab_size = config, config.vocab_size
        self.block_size, self.unit = block_size, prefix_match_unit
        self.recovery = SwaRecovery.parse(swa_recovery)
        self.recovery.check(prefix_match_unit)
        check_block_size(block_size, {CSA: config.csa_rate, HCA: config.hca_rate})
        self.csa_spec, self.hca_spec = prefix_specs(config, dtype)
        self.swa_spec = swa_spec(config, prefix_match_unit, dtype)
        self.cone_tokens = max_cone_tokens(config, prefix_match_unit)
        self.family: Family = v4_family(self.csa_spec, self.hca_spec, self.swa_spec,
                                        self.recovery.restore(self.cone_tokens))
        #: The groups with their entry layouts (a payload-free host tier counts their bytes by spec).
        self.tier_family = self.family
        self.step_cost = step_cost
        self.restore_cost = restore_cost
        self.modelled_seconds = 0.0
        self.restores: list[tuple[int, int]] = []
        """``(restart, hit)`` of each restore that recomputed ``[restart, hit)``, tokens."""
        self.restore_seconds: list[float] = []
        """Modelled seconds of each restore's recompute (:meth:`recovery_seconds`), in order."""

    page_bytes = V4Backend.page_bytes
    kv_bytes_per_token = V4Backend.kv_bytes_per_token
    checkpoint_bytes = V4Backend.checkpoint_bytes

    def cache_binding(self) -> bytes:
        """No weights: the specs alone (simulated entries never meet real ones)."""
        return f"simulated-v4|{(self.csa_spec, self.hca_spec, self.swa_spec)}".encode()

    def new_checkpoint_pool(self, num_slots: int, eviction: str = "lru") -> CheckpointPool:
        """A bookkeeping-only pool of ``swa`` slots."""
        return CheckpointPool(num_slots, slot_bytes=self.swa_spec.bytes_per_entry, eviction=eviction)

    def run(self, items: list[StepItem]) -> list[StepOutput]:
        """Account the modelled time and answer with placeholders."""
        if self.step_cost is not None:
            self.modelled_seconds += self.step_cost(items)
        return [StepOutput(next_token=0, logits=None, end_state=None,
                           checkpoints={b: None for b in it.capture}) for it in items]

    def recovery_seconds(self, restart: int, hit: int) -> float:
        """Modelled compute seconds of rebuilding the boundary state at ``hit`` from ``restart``
        (tokens), by the ``restore_cost`` given (0 without one)."""
        if hit <= restart or self.restore_cost is None:
            return 0.0
        return self.restore_cost(restart, hit)

    def rebuild(self, prompt, block_table, restart: int, hit: int, saved):
        """Price the restore's recompute (added to the modelled seconds when steps are priced)
        and record it; the state is a placeholder."""
        seconds = self.recovery_seconds(restart, hit)
        self.restores.append((restart, hit))
        self.restore_seconds.append(seconds)
        if self.step_cost is not None:
            self.modelled_seconds += seconds
        return None
