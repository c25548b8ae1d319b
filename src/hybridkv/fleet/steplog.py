"""Per-step records of a timed run, and a cost model fitted to whole engine steps.

A timed run (``hybridkv replay --timed --step-log FILE``) can record every step each
instance takes: when it began on the instance's clock, how long it took (measured wall
time of ``Engine.step()`` for the real model, the cost model's price when simulating),
and its shape: the prefill chunks ``(start, tokens)`` and the decoding sequences with
their total context (tokens). The records say where a simulation and a real run part:
number of steps, batch composition, and each real step's time against the cost model's
price of the same shape (:func:`compare_steps`).

:func:`fit_steps` fits :class:`~hybridkv.fleet.costmodel.StepCostModel`'s compute terms
to *whole* real engine steps, so the price includes what the engine spends outside the
model's forward (lookup, admission, page and checkpoint bookkeeping, publishing, the
store tier's write-through and loads made inside the step), not only
``TorchBackend.run`` (which ``hybridkv calibrate`` times alone). ``hybridkv calibrate
--from-steps FILE`` writes such a model.

The records hold shapes and times only: no token ids, prompt text or cache keys.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hybridkv.fleet.costmodel import StepCostModel


class StepLogError(ValueError):
    """A step-log file that cannot be read, or a record with a bad field (named)."""


@dataclass(slots=True)
class StepRecord:
    """One engine step of one instance.

    Attributes:
        instance: 0-based instance index.
        start: the step's start on the instance's clock, seconds.
        seconds: its duration, seconds (measured wall time, or the cost model's price).
        chunks: ``[start, tokens]`` of each prefill chunk (tokens).
        decoders: decoding sequences in the step (one token each).
        decode_context: tokens the decoders attend, summed over them.
        backend_seconds: seconds inside the model's forward (``TorchBackend.run``, on the
            run's step clock); ``None`` when simulated.
        load_seconds: seconds of simulated store loads passed on the clock before the step.
        wall_seconds, cpu_seconds: a real step's wall time (``time.perf_counter``) and this
            process's CPU time in it (``time.process_time``), whichever ``seconds`` is;
            ``None`` when simulated.
    """

    instance: int
    start: float
    seconds: float
    chunks: list[list[int]] = field(default_factory=list)
    decoders: int = 0
    decode_context: int = 0
    backend_seconds: float | None = None
    load_seconds: float = 0.0
    wall_seconds: float | None = None
    cpu_seconds: float | None = None

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed in the step."""
        return sum(n for _, n in self.chunks)

    def price(self, cost: StepCostModel) -> float:
        """``cost``'s seconds for this step's shape (:meth:`StepCostModel.step_seconds`)."""
        return cost.step_seconds([(s, n) for s, n in self.chunks], self.decoders, self.decode_context)

    def features(self) -> list[float]:
        """``[1, tokens, pairs, sequences]``: the fitted terms' multipliers (see
        :mod:`hybridkv.fleet.costmodel`; a decoder at context ``c`` attends ``c`` pairs)."""
        tokens = self.decoders + self.prefill_tokens
        pairs = self.decode_context + sum(n * s + n * (n + 1) // 2 for s, n in self.chunks)
        return [1.0, float(tokens), float(pairs), float(self.decoders + len(self.chunks))]


class RecordingBackend:
    """Wraps a backend and remembers, of its last ``run``, the items' ``(start, tokens)``
    and the seconds it took by ``clock``; everything else is the wrapped backend's.

    Args:
        inner: the backend to wrap (:class:`~hybridkv.engine.backend.TorchBackend`).
        clock: seconds now (``time.perf_counter`` or ``time.process_time``).
    """

    def __init__(self, inner, clock=time.perf_counter) -> None:
        self._inner = inner
        self._clock = clock
        self.last_items: list[list[int]] = []
        self.last_seconds = 0.0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def run(self, items):
        """The wrapped ``run``, timed; shapes of ``items`` kept in :attr:`last_items`."""
        self.last_items = [[int(it.start), int(it.token_ids.shape[0])] for it in items]
        t0 = self._clock()
        out = self._inner.run(items)
        self.last_seconds = self._clock() - t0
        return out


def write_step_log(path: str | Path, records: list[StepRecord], meta: dict | None = None) -> None:
    """Write ``{"meta": meta, "steps": [record, ...]}`` as JSON.

    Raises:
        OSError: the file cannot be written.
    """
    Path(path).write_text(json.dumps({"meta": meta or {}, "steps": [asdict(r) for r in records]}) + "\n",
                          encoding="utf-8")


def read_step_log(path: str | Path) -> tuple[list[StepRecord], dict]:
    """Read a file written by :func:`write_step_log`: the records and the meta object.

    Raises:
        StepLogError: unreadable file, not JSON, or a record with a missing or bad field (named).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StepLogError(f"step log {str(path)!r}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise StepLogError(f"step log {str(path)!r}: expected an object with a 'steps' list")
    records = []
    for i, row in enumerate(data["steps"]):
        if not isinstance(row, dict):
            raise StepLogError(f"step log {str(path)!r}: step {i}: {row!r} is not an object")
        try:
            rec = StepRecord(**row)
        except TypeError as exc:
            raise StepLogError(f"step log {str(path)!r}: step {i}: {exc}") from None
        problem = _bad_field(rec)
        if problem:
            raise StepLogError(f"step log {str(path)!r}: step {i}: {problem}")
        records.append(rec)
    return records, data.get("meta") or {}


MAX_STEP_TOKENS = 2**31 - 1
"""Largest token count or position a step record may give (tokens); far above any context, and
small enough that the fit's features (token pairs, ~n^2 / 2) stay finite."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _bad_field(rec: StepRecord) -> str | None:
    """What is wrong with ``rec``'s fields (``"field=value: must be ..."``), or None.

    Seconds must be finite numbers >= 0 (optional ones may be null); ``instance``,
    ``decoders`` and ``decode_context`` integers in [0, MAX_STEP_TOKENS]; ``chunks`` a list
    of ``[start, tokens]`` integer pairs in the same range (an infinite time or a string
    count made ``calibrate --from-steps`` write a NaN model or fail with a traceback).
    """
    for name in ("start", "seconds", "load_seconds"):
        if not _is_seconds(getattr(rec, name)):
            return f"{name}={getattr(rec, name)!r}: must be a finite number of seconds >= 0"
    for name in ("backend_seconds", "wall_seconds", "cpu_seconds"):
        v = getattr(rec, name)
        if v is not None and not _is_seconds(v):
            return f"{name}={v!r}: must be a finite number of seconds >= 0, or null"
    for name in ("instance", "decoders", "decode_context"):
        v = getattr(rec, name)
        if not (_is_int(v) and 0 <= v <= MAX_STEP_TOKENS):
            return f"{name}={v!r}: must be an integer in [0, {MAX_STEP_TOKENS}]"
    if not isinstance(rec.chunks, list) or not all(
            isinstance(c, list) and len(c) == 2 and all(_is_int(x) and 0 <= x <= MAX_STEP_TOKENS for x in c)
            for c in rec.chunks):
        return (f"chunks={rec.chunks!r}: must be a list of [start, tokens] pairs of integers in "
                f"[0, {MAX_STEP_TOKENS}]")
    return None


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares ``x @ coef ≈ y`` with coefficients kept >= 0 (a column fitted negative is
    dropped and the rest refitted, until none is negative)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        if keep:
            coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        negative = [k for k in keep if coef[k] < 0]
        if not negative:
            return coef
        keep.remove(negative[0])


def fit_steps(records: list[StepRecord], name: str, source: str = "") -> StepCostModel:
    """Fit ``overhead + linear * tokens + attention * pairs + seq * sequences`` to whole steps.

    Least squares on relative error (each step weighs the same whatever its length), with
    non-negative coefficients; steps without tokens are skipped. The memory terms stay 0
    (a CPU is compute-bound).

    Args:
        records: measured steps (``seconds`` > 0).
        name: the model's name.
        source: appended to the model's ``source``.

    Raises:
        ValueError: fewer than 4 steps with tokens and positive seconds (nothing to fit).
    """
    use = [r for r in records if r.seconds > 0 and r.features()[1] > 0]
    if len(use) < 4:
        raise ValueError(f"fit_steps: {len(use)} steps with tokens and positive seconds; at least 4 are needed")
    x = np.asarray([r.features() for r in use])
    y = np.asarray([r.seconds for r in use])
    coef = nonnegative_fit(x / y[:, None], np.ones_like(y))
    rel = np.abs(x @ coef - y) / y
    return StepCostModel(
        name=name, overhead_s=float(coef[0]), linear_s_per_token=float(coef[1]),
        attention_s_per_pair=float(coef[2]), seq_s=float(coef[3]),
        source=f"fitted to {len(use)} whole engine steps (Engine.step() as the run timed it), least squares on relative "
               f"error; median |error| {float(np.median(rel)):.1%}, total {float((x @ coef).sum() / y.sum() - 1):+.1%}"
               + (f"; {source}" if source else ""))


def summarize_steps(records: list[StepRecord]) -> dict:
    """Counts and composition of a run's steps: ``steps``, ``seconds`` (sum), ``backend_seconds``
    (sum, ``None`` when simulated), ``prefill_tokens``, ``prefill_chunks``, ``decode_tokens``,
    ``mixed_steps`` (prefill and decode together), ``decode_only_steps`` and the mean chunks
    and tokens per step."""
    n = len(records)
    backend = [r.backend_seconds for r in records if r.backend_seconds is not None]
    return {
        "steps": n,
        "seconds": round(sum(r.seconds for r in records), 6),
        "backend_seconds": round(sum(backend), 6) if backend else None,
        "prefill_tokens": sum(r.prefill_tokens for r in records),
        "prefill_chunks": sum(len(r.chunks) for r in records),
        "decode_tokens": sum(r.decoders for r in records),
        "mixed_steps": sum(1 for r in records if r.chunks and r.decoders),
        "decode_only_steps": sum(1 for r in records if not r.chunks and r.decoders),
        "mean_chunks_per_step": round(sum(len(r.chunks) for r in records) / n, 3) if n else None,
        "mean_tokens_per_step": round(sum(r.prefill_tokens + r.decoders for r in records) / n, 3) if n else None,
    }


def compare_steps(records: list[StepRecord], cost: StepCostModel) -> dict:
    """Each measured step against ``cost``'s price of the same shape.

    Returns:
        ``{measured_s, predicted_s, ratio}`` over all steps (sums; ratio = measured / predicted),
        ``backend_s`` (time in the forward, ``None`` when not measured) and ``outside_s`` (the
        rest of the step), ``median_step_ratio``, and the same sums split into ``prefill``
        (steps with a prefill chunk) and ``decode_only`` steps.
    """
    def part(rs: list[StepRecord]) -> dict:
        m = sum(r.seconds for r in rs)
        p = sum(r.price(cost) for r in rs)
        b = [r.backend_seconds for r in rs if r.backend_seconds is not None]
        return {"steps": len(rs), "measured_s": round(m, 6), "predicted_s": round(p, 6),
                "ratio": round(m / p, 4) if p > 0 else None,
                "backend_s": round(sum(b), 6) if b else None,
                "outside_s": round(m - sum(b), 6) if b else None}

    ratios = [r.seconds / r.price(cost) for r in records if r.price(cost) > 0]
    out = part(records)
    out["median_step_ratio"] = round(statistics.median(ratios), 4) if ratios else None
    out["prefill"] = part([r for r in records if r.chunks])
    out["decode_only"] = part([r for r in records if not r.chunks])
    return out
