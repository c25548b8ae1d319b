"""Compute backends behind the engine: the real model, or a cost model for simulation.

The engine hands a backend a list of :class:`StepItem` (one per scheduled
sequence) and gets :class:`StepOutput` back. The torch backend runs
:meth:`hybridkv.model.model.HybridModel.forward_paged`; the simulated backend
runs nothing and returns the same shapes of answers without tensors, so the
index, matcher, policy and scheduler make identical decisions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv._torch import torch
from hybridkv.cache.groups import KIMI_LINEAR, FullAttentionSpec, KDASpec, kimi_linear
from hybridkv.cache.pools import CheckpointPool, StateCodec
from hybridkv.model.state import ForwardRequest, KDACheckpoint



def _kda_decode(parts: dict[str, torch.Tensor], boundary: int) -> KDACheckpoint:
    """A :class:`KDACheckpoint` at ``boundary`` (tokens) that owns copies of ``parts`` (a checkpoint
    slot's own tensors, :meth:`KDACheckpoint.components`' names; the conv thirds are joined into a
    new tensor, the recurrent state cloned)."""
    return KDACheckpoint.from_components({**parts, "recurrent": parts["recurrent"].clone()}, boundary)


KDA_CODEC = StateCodec(KDACheckpoint.components, _kda_decode)
"""A :class:`KDACheckpoint` as the ``kda`` group's components and back (the checkpoint pool's codec)."""


@dataclass(slots=True)
class StepItem:
    """One sequence in one engine step.

    Attributes:
        token_ids: ``int64[n]`` ids of positions ``[start, start + n)``: a torch tensor for a
            backend whose ``tensors`` is true, else a numpy array (the prompt's slice, no copy).
        start: first position computed.
        block_table: page ids covering ``start + n``.
        state: KDA working state at ``start`` (``None``: zeros or simulation).
        capture: boundaries in ``(start, start + n]`` to return checkpoints for.
        all_logits: logits of every position instead of the last.
    """

    token_ids: torch.Tensor
    start: int
    block_table: list[int]
    state: KDACheckpoint | None
    capture: list[int] = field(default_factory=list)
    all_logits: bool = False


@dataclass(slots=True)
class StepOutput:
    """Backend answer for one :class:`StepItem`.

    Attributes:
        next_token: greedy token after the last position.
        logits: ``float32[1 or n, vocab]`` or ``None`` (simulation).
        end_state: KDA state at the end (``None`` in simulation).
        checkpoints: boundary -> checkpoint for every captured boundary.
    """

    next_token: int
    logits: torch.Tensor | None
    end_state: KDACheckpoint | None
    checkpoints: dict[int, KDACheckpoint | None]


class _KimiSizes:
    """Sizes of a Kimi Linear backend's entries, from its ``full_spec`` and ``kda_spec`` (bytes)."""

    full_spec: FullAttentionSpec
    kda_spec: KDASpec

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page over all MLA layers."""
        return self.full_spec.page_size_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all MLA layers."""
        return self.full_spec.bytes_per_token

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one KDA checkpoint."""
        return self.kda_spec.page_size_bytes


class TorchBackend(_KimiSizes):
    """Runs the real model over a paged KV pool.

    Args:
        model: a :class:`hybridkv.model.model.HybridModel`.
        num_pages, block_size: KV pool geometry (pages, tokens per page).
    """

    tensors = True
    """Step items carry their ids as torch tensors."""
    family = KIMI_LINEAR
    """The cache groups this backend's state is made of (``full`` + ``kda``)."""

    def __init__(self, model, num_pages: int, block_size: int) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.kv_pool = model.new_kv_pool(num_pages, block_size)
        cfg = model.config
        self.full_spec = FullAttentionSpec.for_model(cfg, block_size, self.kv_pool.latents.element_size())
        zero = model.zero_checkpoint()
        self.kda_spec = KDASpec.for_model(cfg, str(zero.conv.dtype).removeprefix("torch."))
        self._zero = zero
        #: The groups with their entry layouts (what lower tiers store; :func:`~hybridkv.cache.groups.tier_entry_shapes`).
        self.tier_family = kimi_linear(self.full_spec, self.kda_spec)

    state_codec = KDA_CODEC
    """The ``kda`` state as its entry components and back (lower tiers encode and decode with it)."""

    def cache_binding(self) -> bytes:
        """What cached state of this backend depends on, whatever namespace a caller passes:
        the model's weight digest, its compute dtype and the group specs (state layout)."""
        return f"torch|{self.model.weight_digest()}|{self.model.dtype}|{self.full_spec}|{self.kda_spec}".encode()

    def new_checkpoint_pool(self, num_slots: int, eviction: str = "lru") -> CheckpointPool:
        """A tensor-backed pool shaped like this model's checkpoints (``eviction``: ``lru`` / ``value``)."""
        return CheckpointPool(num_slots, spec=self.kda_spec.group_spec(), codec=KDA_CODEC,
                              device=self._zero.recurrent.device, eviction=eviction)

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` latents of page ``src`` into ``dst`` (all MLA layers)."""
        self.kv_pool.copy_page(src, dst, num_tokens)

    def read_kv(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Latents ``float32[L_mla, end - start, D]`` of positions ``[start, end)`` (a copy)."""
        b = self.kv_pool.block_size
        pages = block_table[start // b: -(-end // b)]
        flat = self.kv_pool.latents[:, pages].reshape(self.kv_pool.latents.shape[0], -1,
                                                       self.kv_pool.latents.shape[-1])
        off = start - (start // b) * b
        return flat[:, off: off + end - start].to(torch.float32).clone()

    def page_latents(self, page: int) -> torch.Tensor:
        """A copy of one whole page: ``float32[L_mla, block_size, D]``."""
        return self.kv_pool.latents[:, page].to(torch.float32).clone()

    def write_pages(self, pages: list[int], latents: torch.Tensor) -> None:
        """Fill whole ``pages`` with ``latents [L_mla, len(pages) * block_size, D]``."""
        b = self.kv_pool.block_size
        view = latents.reshape(latents.shape[0], len(pages), b, latents.shape[-1])
        self.kv_pool.latents[:, pages] = view.to(self.kv_pool.latents.dtype)

    def read_page_entry(self, block_table: list[int], start: int, end: int) -> dict[str, torch.Tensor]:
        """The page entry of tokens ``[start, end)`` (whole pages): ``{"latents": read_kv(...)}``."""
        return {"latents": self.read_kv(block_table, start, end)}

    def page_entry(self, page: int) -> dict[str, torch.Tensor]:
        """The page entry of one whole page: ``{"latents": page_latents(page)}``."""
        return {"latents": self.page_latents(page)}

    def write_page_entry(self, pages: list[int], components: dict[str, torch.Tensor]) -> None:
        """Fill whole ``pages`` from a page entry's components (:meth:`write_pages` of ``latents``)."""
        self.write_pages(pages, components["latents"])

    def run(self, items: list[StepItem]) -> list[StepOutput]:
        """One batched forward over every item (no autograd)."""
        reqs = [ForwardRequest(token_ids=it.token_ids, start=it.start,
                               page_table=torch.tensor(it.block_table, dtype=torch.long),
                               initial_state=it.state, capture=tuple(it.capture), all_logits=it.all_logits)
                for it in items]
        with torch.no_grad():
            outs = self.model.forward_paged(reqs, self.kv_pool)
        return [StepOutput(next_token=int(o.logits[-1].argmax()), logits=o.logits, end_state=o.end_state,
                           checkpoints=dict(o.checkpoints)) for o in outs]


class NoTensors:
    """The tensor side of a backend in simulation: page reads give ``None`` and writes do nothing,
    so the engine's bookkeeping runs unchanged without any KV or state held. Shared by
    :class:`SimulatedBackend` and :class:`~hybridkv.engine.v4backend.SimulatedV4Backend`."""

    def read_kv(self, block_table, start, end):
        """No tensors in simulation."""
        return

    def write_pages(self, pages, latents) -> None:
        """No tensors in simulation."""

    def read_page_entry(self, block_table, start, end):
        """No tensors in simulation."""
        return

    def page_entry(self, page):
        """No tensors in simulation."""
        return

    def write_page_entry(self, pages, components) -> None:
        """No tensors in simulation."""


class SimulatedBackend(NoTensors, _KimiSizes):
    """No tensors: every answer is a placeholder; compute time comes from a cost model.

    Cost model (seconds) for a step: ``sum(n_i) / prefill_tokens_per_second``
    plus ``decode_seconds`` per single-token item. The defaults are the measured
    throughput of the ``small`` preset on 2 CPU cores; override for other models,
    or pass ``step_cost``, which then prices each whole step (a batch of items).

    Args:
        full_spec, kda_spec: group specs (bytes per page / checkpoint for metrics).
        prefill_tokens_per_second: modelled prefill throughput.
        vocab_size: checked against request token ids (``None``: not checked).
        step_cost: ``step_cost(items) -> seconds`` of one step, replacing the
            per-token rates (e.g. :class:`hybridkv.fleet.costmodel.StepCostModel`).
    """

    tensors = False
    """Step items carry their ids as numpy arrays (no torch on the simulated path)."""
    state_codec = None
    """No tensors: lower tiers hold byte accounting only."""
    family = KIMI_LINEAR
    """The cache groups this backend's state is made of (``full`` + ``kda``)."""

    def __init__(self, full_spec: FullAttentionSpec, kda_spec: KDASpec,
                 prefill_tokens_per_second: float = 4000.0, decode_seconds: float = 0.005,
                 vocab_size: int | None = None,
                 step_cost: Callable[[list[StepItem]], float] | None = None) -> None:
        self.step_cost = step_cost
        self.vocab_size = vocab_size
        self.full_spec = full_spec
        self.kda_spec = kda_spec
        self.tier_family = kimi_linear(full_spec, kda_spec)
        self.prefill_tokens_per_second = prefill_tokens_per_second
        self.decode_seconds = decode_seconds
        self.modelled_seconds = 0.0

    def cache_binding(self) -> bytes:
        """No weights: the specs alone (simulated entries never meet real ones)."""
        return f"simulated|{self.full_spec}|{self.kda_spec}".encode()

    def new_checkpoint_pool(self, num_slots: int, eviction: str = "lru") -> CheckpointPool:
        """A bookkeeping-only pool (``eviction``: ``lru`` / ``value``)."""
        return CheckpointPool(num_slots, slot_bytes=self.kda_spec.page_size_bytes, eviction=eviction)

    copy_page = None

    def run(self, items: list[StepItem]) -> list[StepOutput]:
        """Account the modelled time and answer with placeholders."""
        if self.step_cost is not None:
            self.modelled_seconds += self.step_cost(items)
        else:
            for it in items:
                n = int(it.token_ids.shape[0])
                self.modelled_seconds += self.decode_seconds if n == 1 else n / self.prefill_tokens_per_second
        return [StepOutput(next_token=0, logits=None, end_state=None,
                           checkpoints={b: None for b in it.capture}) for it in items]
