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
