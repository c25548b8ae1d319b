"""Step-time cost models of one engine instance: seconds of one continuous-batching step.

A step runs prefill chunks and one token of each decoding sequence. Its time is a
roofline (compute or memory, whichever is slower) plus a fixed overhead::

    step = overhead + max(compute, memory)
    compute = linear_s_per_token * tokens + attention_s_per_pair * pairs + seq_s * sequences
    memory  = weights_s(tokens) + kv_read_s_per_token * decode_context + state_s_per_seq * decoders
    weights_s(n) = dense_weights_s + expert_weights_s * (1 - (1 - k / E) ** n)

``tokens`` counts every token the step computes (prefill chunk tokens plus one per decoder),
``sequences`` the step's items (chunks plus decoders: per-sequence work such as the CPU
path's per-request loops);
``pairs`` counts (query token, attended token) pairs of the MLA layers: a chunk
``[s, s + n)`` attends ``n * s + n * (n + 1) / 2`` of them, a decoder at context ``c``
attends ``c``; ``weights_s(n)`` is the time to read the weights that ``n`` tokens
touch, with ``k`` of ``E`` routed experts per token per layer drawn uniformly.

Two models ship: :func:`h200_kimi_linear_48b` (derived from FLOPs and bandwidth, the
default of ``--simulate --timed``) and a CPU model fitted by ``hybridkv calibrate``
(:mod:`hybridkv.fleet.calibrate`), read with :meth:`StepCostModel.load`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

H200_BF16_DENSE_FLOPS = 989e12
"""NVIDIA H200 SXM peak dense BF16 tensor throughput, FLOP/s (NVIDIA H200 datasheet: 1,979
TFLOPS with 2:4 sparsity, half of it dense)."""
H200_HBM_BYTES_PER_S = 4.8e12
"""NVIDIA H200 HBM3e bandwidth, bytes/s (NVIDIA H200 datasheet)."""
KIMI_LINEAR_48B_ACTIVATED_PARAMS = 3e9
"""Activated parameters per token of Kimi-Linear-48B-A3B (model card: 48B total, 3B activated)."""
KIMI_LINEAR_48B_TOTAL_PARAMS = 48e9
"""Total parameters of Kimi-Linear-48B-A3B (model card)."""


MAX_COEFFICIENT_S = 3600.0
"""Largest value of a cost model's seconds coefficient (seconds per step, token, pair or
sequence): an hour, far above any hardware, so prices stay finite (an infinite one raised an
``IndexError`` in the simulator)."""

MAX_EXPERTS = 1 << 20
"""Largest ``experts`` / ``experts_per_token`` of a cost model (routed experts)."""


class CostModelError(ValueError):
    """A cost-model file that cannot be read or has a bad field (named)."""


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Coefficients of the step-time formula in the module docstring (all seconds per unit).

    Attributes:
        name: what the model describes (hardware and model).
        overhead_s: fixed seconds per step (scheduling, launches).
        linear_s_per_token: compute seconds per token through every non-attention FLOP.
        attention_s_per_pair: compute seconds per (query, attended token) pair over all MLA layers.
        seq_s: compute seconds per sequence in the step (prefill chunk or decoder).
        dense_weights_s: seconds to read the weights every token touches.
        expert_weights_s: seconds to read every routed expert once.
        experts, experts_per_token: ``E`` and ``k`` of the expert-coverage term (``E = 0``: none).
        kv_read_s_per_token: seconds to read one cached token's KV (all MLA layers) in decode.
        state_s_per_seq: seconds to read and write one sequence's KDA state in decode.
        source: where the numbers come from.
    """

    name: str
    overhead_s: float
    linear_s_per_token: float
    attention_s_per_pair: float
    seq_s: float = 0.0
    dense_weights_s: float = 0.0
    expert_weights_s: float = 0.0
    experts: int = 0
    experts_per_token: int = 0
    kv_read_s_per_token: float = 0.0
    state_s_per_seq: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "source"):
                if not isinstance(v, str):
                    raise CostModelError(f"cost model {self.name!r}: {f.name}={v!r} must be a string")
            elif f.name in ("experts", "experts_per_token"):
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_EXPERTS:
                    raise CostModelError(f"cost model {self.name!r}: {f.name}={v!r} must be an integer "
                                         f"in [0, {MAX_EXPERTS}]")
            elif not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= MAX_COEFFICIENT_S:
                raise CostModelError(f"cost model {self.name!r}: {f.name}={v!r} must be a number of seconds "
                                     f"in [0, {MAX_COEFFICIENT_S:g}]")
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise CostModelError(f"cost model {self.name!r}: experts_per_token={self.experts_per_token} "
                                 f"must be in 1..experts={self.experts}")

    def weights_seconds(self, tokens: int) -> float:
        """Seconds to read the weights that ``tokens`` tokens touch (0 tokens: none)."""
        if tokens <= 0:
            return 0.0
        cover = 1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens if self.experts else 0.0
        return self.dense_weights_s + self.expert_weights_s * cover

    def step_seconds(self, chunks: list[tuple[int, int]], decoders: int = 0, decode_context: int = 0) -> float:
        """Seconds of one step running prefill ``chunks`` (``(start, tokens)`` each) and
        ``decoders`` decoding sequences attending ``decode_context`` tokens in total."""
        tokens = decoders + sum(n for _, n in chunks)
        if tokens == 0:
            return 0.0
        pairs = decode_context + sum(n * s + n * (n + 1) // 2 for s, n in chunks)
        compute = (self.linear_s_per_token * tokens + self.attention_s_per_pair * pairs
                   + self.seq_s * (decoders + len(chunks)))
        memory = (self.weights_seconds(tokens) + self.kv_read_s_per_token * decode_context
                  + self.state_s_per_seq * decoders)
        return self.overhead_s + max(compute, memory)

    def prefill_seconds(self, start: int, end: int) -> float:
        """Compute seconds of prefilling tokens ``[start, end)`` alone (no overhead, no
        per-sequence term); a router's estimate."""
        n = max(end - start, 0)
        return self.linear_s_per_token * n + self.attention_s_per_pair * (n * start + n * (n + 1) // 2)

    def to_json(self) -> str:
        """The model as a JSON object (the file :meth:`load` reads)."""
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        """Read a JSON file written by :meth:`to_json` (``hybridkv calibrate``).

        Raises:
            CostModelError: unreadable file, not JSON, unknown or missing field, a bad value.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CostModelError(f"cost model {str(path)!r}: {exc}") from None
        if not isinstance(data, dict):
            raise CostModelError(f"cost model {str(path)!r}: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CostModelError(f"cost model {str(path)!r}: unknown field {unknown[0]!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise CostModelError(f"cost model {str(path)!r}: {exc}") from None


def h200_kimi_linear_48b(mfu: float = 0.4, bandwidth_efficiency: float = 0.7,
                         overhead_s: float = 0.002) -> StepCostModel:
    """Kimi-Linear-48B-A3B (bf16) on one H200, from FLOPs per token and published peaks.

    * Linear FLOPs: ``2 * 3e9`` per token (two FLOPs per activated parameter, model card),
      plus the KDA recurrence, ``20 layers * 32 heads * 128 * 128 * 8`` per token
      (four ``K x K`` products a token in the chunked form; preset config).
    * Attention: ``7 MLA layers * 32 heads * 2 * (192 + 128)`` FLOPs per pair (q·k over
      ``qk_nope + qk_rope = 192`` dims, p·v over 128; preset config).
    * Compute at ``mfu`` of :data:`H200_BF16_DENSE_FLOPS` (40%: a stated assumption for
      MoE prefill, not a measurement).
    * Memory at ``bandwidth_efficiency`` of :data:`H200_HBM_BYTES_PER_S`. Routed expert
      parameters ``X`` solve ``D + X = 48e9``, ``D + X * 8 / 256 = 3e9`` (dense ``D``
      touched by every token), so ``X = 46.45e9``, ``D = 1.55e9``; two bytes each.
      KV read per cached token: ``7 * (512 + 64) * 2`` bytes (MLA latent, bf16). KDA
      state per sequence: ``20 * 32 * 128 * 128 * 4`` bytes fp32, read and written.
    * ``overhead_s``: 2 ms per step (an assumption: scheduling and launches).
    """
    flops = H200_BF16_DENSE_FLOPS * mfu
    bw = H200_HBM_BYTES_PER_S * bandwidth_efficiency
    kda_flops = 20 * 32 * 128 * 128 * 8
    experts, k = 256, 8
    routed = (KIMI_LINEAR_48B_TOTAL_PARAMS - KIMI_LINEAR_48B_ACTIVATED_PARAMS) / (1 - k / experts)
    dense = KIMI_LINEAR_48B_TOTAL_PARAMS - routed
    return StepCostModel(
        name="kimi-linear-48b-a3b on 1x H200 (bf16)", overhead_s=overhead_s,
        linear_s_per_token=(2 * KIMI_LINEAR_48B_ACTIVATED_PARAMS + kda_flops) / flops,
        attention_s_per_pair=7 * 32 * 2 * (192 + 128) / flops,
        dense_weights_s=2 * dense / bw, expert_weights_s=2 * routed / bw, experts=experts, experts_per_token=k,
        kv_read_s_per_token=7 * (512 + 64) * 2 / bw, state_s_per_seq=2 * 20 * 32 * 128 * 128 * 4 / bw,
        source=f"derived: H200 {H200_BF16_DENSE_FLOPS / 1e12:.0f} TFLOPS bf16 dense at {mfu:.0%} MFU, "
               f"{H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s HBM at {bandwidth_efficiency:.0%}; "
               f"Kimi-Linear-48B-A3B 3B activated / 48B total params")


BUILTIN_COST_MODELS = {"h200-kimi-linear-48b": h200_kimi_linear_48b}
"""Cost models by name (``--cost-model NAME``); anything else is read as a JSON file."""


def cost_model(name_or_path: str) -> StepCostModel:
    """A built-in model by name, or a calibrated one from a JSON file.

    Raises:
        CostModelError: neither a built-in name nor a readable cost-model file.
    """
    if name_or_path in BUILTIN_COST_MODELS:
        return BUILTIN_COST_MODELS[name_or_path]()
    if not Path(name_or_path).is_file():
        raise CostModelError(f"cost model {name_or_path!r} is neither a built-in "
                             f"({', '.join(BUILTIN_COST_MODELS)}) nor a file")
    return StepCostModel.load(name_or_path)


# -- DeepSeek-V4 ----------------------------------------------------------------------------
BF16_BYTES = 2
"""Bytes per value of the bf16 weights and cache entries the H200 models assume."""


@dataclass(frozen=True, slots=True)
class V4Shapes:
    """What the step and recovery costs of a DeepSeek-V4 model need from its config, derived by
    :meth:`of` (all counts; bytes in bf16).

    Attributes:
        total_params, routed_params: every parameter, and those of the routed experts.
        experts, experts_per_token: ``n_routed_experts`` / ``num_experts_per_tok``.
        layers, window: ``num_hidden_layers`` / ``sliding_window`` (tokens).
        csa_layers, hca_layers, csa_rate, hca_rate, index_topk: the compressed branches.
        window_flops_per_key: FLOPs of one query against one window row, all heads of one layer
            (``H · 2 · 2d``: q·k and p·v over ``head_dim``; K = V).
        entry_flops_per_key: the same against one compressed entry.
        index_flops_per_entry: the Lightning Indexer scoring one CSA entry (``H_i · 2 · d_i``).
        csa_bytes_per_token, hca_bytes_per_token: compressed entries per token of context, all
            layers of the kind (CSA: entry ``head_dim`` and indexer key ``index_head_dim`` per
            ``csa_rate`` tokens; HCA: ``head_dim`` per ``hca_rate`` tokens).
        index_bytes_per_token: the indexer keys alone per token (what a decode step reads of CSA
            besides its top-k entries).
        swa_bytes_per_token: the sliding-window K=V of one token over every layer
            (``L · head_dim``), the quantity the seed compares with the compressed cache.
        window_state_bytes: one saved window state, ``L · (W − 1) · head_dim``.
        head_dim, index_head_dim: K=V width, indexer key width.
    """

    total_params: int
    routed_params: int
    experts: int
    experts_per_token: int
    layers: int
    window: int
    csa_layers: int
    hca_layers: int
    csa_rate: int
    hca_rate: int
    index_topk: int
    head_dim: int
    index_head_dim: int
    window_flops_per_key: int
    entry_flops_per_key: int
    index_flops_per_entry: int
    csa_bytes_per_token: float
    hca_bytes_per_token: float
    index_bytes_per_token: float
    swa_bytes_per_token: int
    window_state_bytes: int

    @property
    def activated_params(self) -> float:
        """Parameters one token touches: the dense ones and ``k / E`` of the routed experts."""
        return self.total_params - self.routed_params * (1 - self.experts_per_token / self.experts)

    @property
    def compressed_bytes_per_token(self) -> float:
        """Compressed entries (both groups) per cached token, bytes."""
        return self.csa_bytes_per_token + self.hca_bytes_per_token

    def tail_bytes(self, t: int) -> int:
        """Compressor tails and CSA overlaps of the boundary state at ``t`` (tokens), bytes: per
        CSA layer ``t mod 4`` rows of both series (``2·head_dim``) and of the indexer
        (``2·index_head_dim``) plus the ``csa_rate``-row overlap of each, per HCA layer
        ``t mod hca_rate`` rows of ``head_dim`` — kv and gate projections alike."""
        d, di = self.head_dim, self.index_head_dim
        csa_rows = (t % self.csa_rate) * 2 * (d + di) + (self.csa_rate * (d + di) if t >= self.csa_rate else 0)
        return BF16_BYTES * 2 * (self.csa_layers * csa_rows + self.hca_layers * (t % self.hca_rate) * d)

    def boundary_state_bytes(self, t: int) -> int:
        """One saved boundary state at ``t``: windows plus tails and overlaps, bytes."""
        return self.window_state_bytes * min(t, self.window - 1) // (self.window - 1) + self.tail_bytes(t)

    @classmethod
    def of(cls, config) -> V4Shapes:
        """From a :class:`~hybridkv.model.v4.config.V4Config` (``D`` hidden, ``H`` heads of
        ``d``, query rank ``r``, ``g`` output groups of rank ``r_o``, indexer ``H_i`` heads of
        ``d_i``, ``E`` experts of width ``I``, ``N`` hyper-connection streams, vocab ``V``),
        counting the tensors of ``transformers.DeepseekV4ForCausalLM`` (which
        :class:`~hybridkv.model.v4.model.V4Model` mirrors by name):

        * every layer: sinks ``H``; ``q_a`` ``r·D`` + norm ``r``; ``q_b`` ``H·d·r``; ``kv`` ``d·D``
          + norm ``d``; ``o_a`` ``r_o·H·d``; ``o_b`` ``D·g·r_o``; two RMSNorms ``2D``; two mHC
          mixers ``2·((2+N)·N·(N·D + 1) + 3)``; router ``E·D``; experts ``E·3·I·D``; shared
          expert ``3·I·D``;
        * a compressed layer of rate ``m`` and width ``c`` (``2d`` CSA, ``d`` HCA): kv and gate
          ``2·c·D``, position bias ``m·c``, norm ``d``; CSA's indexer: kv and gate
          ``2·2d_i·D``, position bias ``m·2d_i``, norm ``d_i``, ``q_b`` ``H_i·d_i·r``, head
          weights ``H_i·D``;
        * once: embeddings and ``lm_head`` ``2·V·D``, final norm ``D``, head mixer ``N·N·D + N + 1``.
        """
        c = config
        D, H, d, r, N = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.hc_mult
        Hi, di, E, inner = c.index_n_heads, c.index_head_dim, c.n_routed_experts, c.moe_intermediate_size
        routed_layer = E * 3 * inner * D
        per_layer = (H + r * D + r + H * d * r + d * D + d + c.o_lora_rank * H * d + D * c.o_groups * c.o_lora_rank
                     + 2 * D + 2 * ((2 + N) * N * (N * D + 1) + 3) + E * D + routed_layer + 3 * inner * D)
        n_csa, n_hca = len(c.csa_layers), len(c.hca_layers)
        csa_extra = (2 * 2 * d * D + c.csa_rate * 2 * d + d
                     + 2 * 2 * di * D + c.csa_rate * 2 * di + di + Hi * di * r + Hi * D)
        hca_extra = 2 * d * D + c.hca_rate * d + d
        L = c.num_hidden_layers
        total = (L * per_layer + n_csa * csa_extra + n_hca * hca_extra
                 + 2 * c.vocab_size * D + D + N * N * D + N + 1)
        return cls(
            total_params=total, routed_params=L * routed_layer, experts=E, experts_per_token=c.num_experts_per_tok,
            layers=L, window=c.sliding_window, csa_layers=n_csa, hca_layers=n_hca, csa_rate=c.csa_rate,
            hca_rate=c.hca_rate, index_topk=c.index_topk, head_dim=d, index_head_dim=di,
            window_flops_per_key=H * 2 * 2 * d, entry_flops_per_key=H * 2 * 2 * d, index_flops_per_entry=Hi * 2 * di,
            csa_bytes_per_token=n_csa * (d + di) * BF16_BYTES / c.csa_rate,
            hca_bytes_per_token=n_hca * d * BF16_BYTES / c.hca_rate,
            index_bytes_per_token=n_csa * di * BF16_BYTES / c.csa_rate,
            swa_bytes_per_token=L * d * BF16_BYTES, window_state_bytes=L * (c.sliding_window - 1) * d * BF16_BYTES)

    def flops_per_token(self) -> float:
        """Position-independent FLOPs of one token: two per activated parameter, plus every
        layer's window at its full ``W`` keys and every CSA layer's ``index_topk`` entries (the
        bound a token past ``csa_rate · index_topk`` positions reaches)."""
        return (2 * self.activated_params + self.layers * self.window * self.window_flops_per_key
                + self.csa_layers * self.index_topk * self.entry_flops_per_key)

    def flops_per_pair(self) -> float:
        """FLOPs per (query, earlier token) pair, the part that grows with the context: the
        indexer scoring each CSA entry and HCA attending each entry (per token of context)."""
        return (self.csa_layers * self.index_flops_per_entry / self.csa_rate
                + self.hca_layers * self.entry_flops_per_key / self.hca_rate)


def v4_flash_config():
    """The bundled ``deepseek-v4-flash`` preset, DeepSeek-V4-Flash's published shapes: the layer
    schedule of the model card (``deepseek-ai/DeepSeek-V4-Flash``: layers 0 and 1 sliding
    window only, even layers from 2 CSA at rate 4, odd layers from 3 HCA at rate 128: 2 + 21 +
    20 = 43), every other shape from ``transformers.DeepseekV4Config()``'s defaults
    (transformers 5.25, whose docstring names the ``deepseek-ai/DeepSeek-V4-Flash-Base``
    checkpoint): hidden 4096, 64 heads of 512 (one shared K=V head, 64 RoPE channels),
    ``q_lora_rank`` 1024, 8 output groups of rank 1024, 256 routed experts (6 per token) + 1
    shared of width 2048, the first 3 layers hash-routed, ``sliding_window`` 128, indexer 64
    heads of 128 with ``index_topk`` 512, ``hc_mult`` 4, vocab 129,280. The parameters these
    give (284.33e9, :class:`V4Shapes`) match the published 284B total."""
    from hybridkv.model.v4.config import V4Config
    return V4Config.preset("deepseek-v4-flash")


def h200_deepseek_v4_flash(mfu: float = 0.4, bandwidth_efficiency: float = 0.7,
                           overhead_s: float = 0.002) -> StepCostModel:
    """DeepSeek-V4-Flash (bf16) on one H200, from the config's FLOPs and bytes per token
    (:class:`V4Shapes` of :func:`v4_flash_config`) and the published peaks, at the same
    assumptions as :func:`h200_kimi_linear_48b` (40% MFU, 70% of HBM bandwidth, 2 ms a step).

    * Linear FLOPs per token: ``2 ×`` activated parameters (dense + 6/256 of the routed
      experts: 13.8e9 of 284.3e9, embeddings included), plus the attention a token does whatever its position
      once past 2048 tokens: 43 windows of 128 keys and 21 CSA top-512 selections, each key
      ``64 heads · 2 · 1024`` FLOPs (:meth:`V4Shapes.flops_per_token`).
    * Per (query, context token) pair: the indexer scoring CSA entries (``64 · 2 · 128`` per
      entry, one entry per 4 tokens, 21 layers) and HCA attending every entry (one per 128
      tokens, 20 layers) (:meth:`V4Shapes.flops_per_pair`).
    * Memory: dense and routed weights as for Kimi (2 bytes each, expert coverage ``1 −
      (1 − 6/256)^n``); a decoder reads per context token the indexer keys (21 layers × 128 ×
      2 B / 4) and the HCA entries (20 × 512 × 2 B / 128), and per sequence its 43 windows (127
      rows) and 21 × 512 selected CSA entries of 1024 B.
    """
    s = V4Shapes.of(v4_flash_config())
    flops = H200_BF16_DENSE_FLOPS * mfu
    bw = H200_HBM_BYTES_PER_S * bandwidth_efficiency
    dense = s.total_params - s.routed_params
    per_seq_bytes = s.window_state_bytes + s.csa_layers * s.index_topk * s.head_dim * BF16_BYTES
    return StepCostModel(
        name="deepseek-v4-flash on 1x H200 (bf16)", overhead_s=overhead_s,
        linear_s_per_token=s.flops_per_token() / flops, attention_s_per_pair=s.flops_per_pair() / flops,
        dense_weights_s=BF16_BYTES * dense / bw, expert_weights_s=BF16_BYTES * s.routed_params / bw,
        experts=s.experts, experts_per_token=s.experts_per_token,
        kv_read_s_per_token=(s.index_bytes_per_token + s.hca_bytes_per_token) / bw,
        state_s_per_seq=per_seq_bytes / bw,
        source=f"derived: H200 {H200_BF16_DENSE_FLOPS / 1e12:.0f} TFLOPS bf16 dense at {mfu:.0%} MFU, "
               f"{H200_HBM_BYTES_PER_S / 1e12:.1f} TB/s HBM at {bandwidth_efficiency:.0%}; DeepSeek-V4-Flash "
               f"shapes (model card schedule, transformers DeepseekV4Config defaults): "
               f"{s.activated_params / 1e9:.1f}B activated / "
               f"{s.total_params / 1e9:.1f}B total params")


def v4_recompute_seconds(cost: StepCostModel, shapes: V4Shapes, layer_rows: tuple[int, ...], start: int) -> float:
    """Compute seconds of rebuilding a boundary state by computing ``layer_rows[l]`` output rows
    of each layer ``l`` (tokens: the cone's ``R_{l+1}`` of
    :func:`~hybridkv.model.v4.cone.recompute_cone_rows`, or ``(n,) * L`` for ``n`` tokens
    through every layer) ending at token ``start + max rows``: each layer-row costs ``1 / L`` of
    a token's linear time and of its context pairs (the K=V projections of the extra window rows
    a layer reads are not counted)."""
    L = shapes.layers
    rows = sum(layer_rows)
    n = max(layer_rows, default=0)
    pairs = n * start + n * (n + 1) // 2
    return cost.linear_s_per_token * rows / L + cost.attention_s_per_pair * pairs * rows / max(L * n, 1)


def v4_restore_pricer(config, swa_recovery, cost: StepCostModel | None = None) -> Callable[[int, int], float]:
    """``price(restart, hit) -> seconds`` of rebuilding a DeepSeek-V4 boundary state at ``hit``
    from ``restart`` (tokens) under ``swa_recovery`` (a :class:`~hybridkv.cache.swa.SwaRecovery`
    or its text), for :class:`~hybridkv.engine.v4backend.SimulatedV4Backend`: ``periodic``
    recomputes ``[restart, hit)`` through every layer; ``recompute`` only the cone: layer ``l``
    computes outputs for the last ``R_{l+1}`` rows (:func:`~hybridkv.model.v4.cone.recompute_cone_rows`,
    a triangle: 114,681 layer-rows for V4-Flash against 43 x 5,461 through every layer), priced by
    :func:`v4_recompute_seconds`; a hit shorter than the cone recomputes ``[0, hit)`` through every
    layer, as the engine does. ``cost``: default the built-in ``h200-deepseek-v4-flash``."""
    from hybridkv.cache.swa import SwaRecovery
    from hybridkv.model.v4.cone import recompute_cone_rows
    kind = SwaRecovery.parse(swa_recovery).kind
    cost = cost or cost_model("h200-deepseek-v4-flash")
    shapes = V4Shapes.of(config)

    def price(restart: int, hit: int) -> float:
        if hit <= restart:
            return 0.0
        if kind == "recompute" and restart > 0:
            rows = (*recompute_cone_rows(config, hit)[1:], 0)      # layer l computes outputs for R_{l+1} rows
        else:
            rows = (hit - restart,) * config.num_hidden_layers
        return v4_recompute_seconds(cost, shapes, rows, hit - max(rows))

    return price


BUILTIN_COST_MODELS["h200-deepseek-v4-flash"] = h200_deepseek_v4_flash
