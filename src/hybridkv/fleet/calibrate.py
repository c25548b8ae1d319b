"""``hybridkv calibrate``: fit a :class:`~hybridkv.fleet.costmodel.StepCostModel` to the real
model's step times on this machine, for the simulator to read (``--cost-model FILE``).

It times :meth:`~hybridkv.engine.backend.TorchBackend.run` on prefill chunks of several
lengths and starting positions and on decode batches of several sizes and contexts
(median of ``repeats`` runs each, after one warm-up), then fits
``seconds = overhead + linear * tokens + attention * pairs + seq * sequences`` by least
squares on relative error, with non-negative coefficients (the CPU is compute-bound, so
the memory terms stay 0).
The fit's relative error on each sample is reported with it.

``--from-steps FILE`` fits the same terms to the *whole* engine steps a real timed replay
recorded (``replay --timed --step-log FILE``, :func:`hybridkv.fleet.steplog.fit_steps`):
what ``Engine.step()`` costs, including the cache's lookup, bookkeeping, publishing and
the store tier's write-through, which timing the forward alone leaves out.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import numpy as np

from hybridkv._torch import torch
from hybridkv.engine.backend import StepItem, TorchBackend
from hybridkv.engine.build import load_model, refuse_v4
from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.fleet.steplog import (
    StepLogError,
    compare_steps,
    fit_steps,
    nonnegative_fit,
    read_step_log,
)
from hybridkv.model.state import KDACheckpoint

PREFILL_SHAPES = ((0, 64), (0, 256), (0, 512), (0, 1024), (1024, 256), (2048, 256), (2048, 1024))
"""``(start, tokens)`` of the timed prefill chunks."""
DECODE_SHAPES = ((1, 256), (4, 256), (4, 2048), (8, 1024))
"""``(sequences, context)`` of the timed decode steps."""


def _features(chunks: list[tuple[int, int]], decoders: int, context: int) -> list[float]:
    tokens = decoders + sum(n for _, n in chunks)
    pairs = decoders * context + sum(n * s + n * (n + 1) // 2 for s, n in chunks)
    return [1.0, float(tokens), float(pairs), float(decoders + len(chunks))]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""How ``calibrate`` times a forward: wall clock, or this process's CPU seconds (other processes on a
shared machine left out)."""


def _time(backend: TorchBackend, items: list[StepItem], repeats: int, clock=time.perf_counter) -> float:
    backend.run(items)                                     # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock()
        backend.run(items)
        times.append(clock() - t0)
    return statistics.median(times)


def _state_at(model, position: int) -> KDACheckpoint | None:
    """A zero KDA state claimed to be at ``position`` (its values do not change a step's time)."""
    if not position:
        return None
    zero = model.zero_checkpoint()
    return KDACheckpoint(zero.recurrent, zero.conv, position)


def calibrate(model_name: str = "small", seed: int = 0, repeats: int = 3,
              block_size: int = 64, clock: str = "wall") -> tuple[StepCostModel, list[dict]]:
    """Time the model and fit the cost model; ``clock`` is ``wall`` or ``cpu`` (:data:`CLOCKS`).

    Returns:
        The fitted model and one ``{kind, shape, seconds, fitted}`` row per sample.

    Raises:
        ValueError: unknown preset or bad model directory (from :func:`load_model`), unknown ``clock``.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {', '.join(CLOCKS)}")
    tick = CLOCKS[clock]
    refuse_v4(model_name, "calibrate")
    model = load_model(model_name, seed)
    longest = max(s + n for s, n in PREFILL_SHAPES) + max(c for _, c in DECODE_SHAPES)
    pages = -(-longest // block_size)
    backend = TorchBackend(model, pages * max(b for b, _ in DECODE_SHAPES), block_size)
    table = list(range(pages))
    rng = np.random.default_rng(seed)
    rows, x, y = [], [], []

    def ids(n: int) -> torch.Tensor:
        return torch.from_numpy(rng.integers(0, model.config.vocab_size, n))

    for start, n in PREFILL_SHAPES:
        state = _state_at(model, start)
        sec = _time(backend, [StepItem(ids(n), start, table, state)], repeats, tick)
        rows.append({"kind": "prefill", "shape": [start, n], "seconds": sec})
        x.append(_features([(start, n)], 0, 0))
        y.append(sec)
    for b, ctx in DECODE_SHAPES:
        items = [StepItem(ids(1), ctx, list(range(k * pages, (k + 1) * pages)), _state_at(model, ctx))
                 for k in range(b)]
        sec = _time(backend, items, repeats, tick)
        rows.append({"kind": "decode", "shape": [b, ctx], "seconds": sec})
        x.append(_features([], b, ctx))
        y.append(sec)
    xa, ya = np.asarray(x), np.asarray(y)
    coef = nonnegative_fit(xa / ya[:, None], np.ones_like(ya))           # relative error of each sample
    for row, feats in zip(rows, x):
        row["fitted"] = float(np.dot(coef, feats))
    worst = max(abs(r["fitted"] - r["seconds"]) / r["seconds"] for r in rows)
    cost = StepCostModel(
        name=f"{model_name} on {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s)",
        overhead_s=float(coef[0]), linear_s_per_token=float(coef[1]), attention_s_per_pair=float(coef[2]),
        seq_s=float(coef[3]),
        source=f"hybridkv calibrate: {len(rows)} timed forwards (median of {repeats}, {clock} clock), least squares, "
               f"worst relative error {worst:.1%}")
    return cost, rows


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``hybridkv calibrate`` (options: ``model, out, repeats, threads, seed, from_steps``): 0 when
    the file is written, 2 on a bad model, a bad step log or an unwritable path."""
    if getattr(args, "from_steps", None):
        return _from_steps(args)
    torch.set_num_threads(args.threads)
    try:
        cost, rows = calibrate(args.model, args.seed, args.repeats, clock=getattr(args, "clock", "wall"))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not _write(cost, args.out):
        return 2
    for r in rows:
        print(f"{r['kind']:8s} {r['shape']!s:14s} measured {r['seconds'] * 1e3:9.2f} ms  "
              f"fitted {r['fitted'] * 1e3:9.2f} ms")
    print(f"wrote {args.out}: {cost.source}")
    return 0


def _write(cost, out: str) -> bool:
    """Write ``cost`` (a step cost model) as JSON to ``out``; ``False`` after saying why it could not."""
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(cost.to_json() + "\n")
    except OSError as exc:
        print(f"error: --out {out}: {exc.strerror or exc}", file=sys.stderr)
        return False
    return True


def _from_steps(args: argparse.Namespace) -> int:
    """``calibrate --from-steps``: fit whole engine steps of a real timed replay's step log."""
    try:
        records, meta = read_step_log(args.from_steps)
        if meta.get("mode") != "model":
            raise StepLogError(f"step log {args.from_steps!r}: mode {meta.get('mode')!r}; "
                               "only a real model's steps (mode 'model') can be fitted")
        cost = fit_steps(records, f"{meta.get('model', args.model)} whole engine steps on {platform.machine()} CPU",
                         source=f"step log of a {meta.get('instances', '?')}-instance timed replay, "
                                f"{meta.get('step_clock') or 'wall'} clock")
    except (StepLogError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not _write(cost, args.out):
        return 2
    c = compare_steps(records, cost)
    print(f"{c['steps']} steps: measured {c['measured_s']:.2f} s, fitted {c['predicted_s']:.2f} s, "
          f"median step ratio {c['median_step_ratio']}")
    print(f"wrote {args.out}: {cost.source}")
    return 0
