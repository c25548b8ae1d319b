"""The DeepSeek-V4 part of a replay report: what restoring hits cost under the run's
``--swa-recovery`` (recompute tokens per hit, recovery seconds) and what the cache holds per
cached token (compressed entries against sliding-window state).

Written into ``report.config["swa_restore"]`` (docs/reference/report.md).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from hybridkv.cache.swa import RECOMPUTE
from hybridkv.fleet.costmodel import BF16_BYTES, V4Shapes
from hybridkv.fleet.store import MOONCAKE_GET_LATENCY_S, MOONCAKE_LOAD_BYTES_PER_S


def _dist(xs: list[float], digits: int) -> dict:
    """``mean``, ``p50``, ``p99`` and ``max`` of ``xs`` (all ``None`` when empty), rounded."""
    if not xs:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    a = np.asarray(xs, dtype=np.float64)
    p50, p99 = np.percentile(a, [50, 99])
    return {k: round(float(v), digits) for k, v in
            (("mean", a.mean()), ("p50", p50), ("p99", p99), ("max", a.max()))}


def restore_summary(results, config, recovery, simulate: bool, kv_bytes_per_token: int, kv_bytes_peak: int,
                    checkpoint_bytes_peak: int) -> dict:
    """The ``swa_restore`` object of a V4 replay.

    Args:
        results: the instances' :class:`~hybridkv.replay.instance.InstanceResult` (their
            ``reused`` hits, ``restores`` ``(restart, hit)`` pairs and, simulated,
            ``restore_seconds``).
        config: the model's :class:`~hybridkv.model.v4.config.V4Config`.
        recovery: the run's :class:`~hybridkv.cache.swa.SwaRecovery`.
        simulate: modelled seconds exist (the recovery figures are given only then).
        kv_bytes_per_token, kv_bytes_peak, checkpoint_bytes_peak: the engine's figures (bytes, in
            the engine's dtype: fp32 for the CPU presets, bf16 simulated).

    Returns:
        ``hits`` (requests admitted with a hit > 0), ``restores`` (hits that recomputed),
        ``recompute_tokens_per_hit`` (``mean``/``p50``/``p99``/``max`` over every hit, 0 for
        a hit restored from a state saved at it), ``device_bytes_per_cached_token``
        (``compressed``, ``swa_states`` = saved-state peak over cached tokens, ``total``),
        ``bf16`` sizes from the config (``compressed_per_token``, ``swa_kv_per_token``,
        ``swa_to_compressed``, ``window_state``), and when ``simulate``: ``recovery_seconds``
        (device: the modelled recompute, loads from device memory counted as 0) and
        ``recovery_seconds_from_store`` (the same hit read from a Mooncake store at 1.1 GB/s and
        194 µs a read: its compressed entries and, when one is used, the saved state, plus
        the recompute), each ``mean``/``p50``/``p99``/``max`` in seconds.
    """
    hits = [h for r in results for h in r.reused.values() if h > 0]
    restores = [p for r in results for p in r.restores]
    seconds = [s for r in results for s in r.restore_seconds]
    plain = Counter(hits) - Counter(h for _, h in restores)        # hits restored from a state saved at them
    tokens = [h - c for c, h in restores] + [0] * sum(plain.values())
    cached = kv_bytes_peak / kv_bytes_per_token if kv_bytes_per_token else 0
    states = checkpoint_bytes_peak / cached if cached else 0.0
    shapes = V4Shapes.of(config)
    out = {
        "hits": len(hits), "restores": len(restores),
        "recompute_tokens_per_hit": _dist(tokens, 1),
        "device_bytes_per_cached_token": {"compressed": kv_bytes_per_token, "swa_states": round(states, 1),
                                          "total": round(kv_bytes_per_token + states, 1)},
        "bf16": {"compressed_per_token": shapes.compressed_bytes_per_token,
                 "swa_kv_per_token": shapes.swa_bytes_per_token,
                 "swa_to_compressed": round(shapes.swa_bytes_per_token / shapes.compressed_bytes_per_token, 2),
                 "window_state": shapes.window_state_bytes, "bytes_per_value": BF16_BYTES},
    }
    if simulate:
        device = list(seconds) + [0.0] * sum(plain.values())

        def from_store(restart: int, hit: int, recompute_s: float) -> float:
            saved = 0 if recovery.kind == RECOMPUTE or restart == 0 else shapes.boundary_state_bytes(restart)
            return (MOONCAKE_GET_LATENCY_S + (hit * shapes.compressed_bytes_per_token + saved)
                    / MOONCAKE_LOAD_BYTES_PER_S + recompute_s)

        store = [from_store(c, h, s) for (c, h), s in zip(restores, seconds)]
        store += [from_store(h, h, 0.0) for h, n in plain.items() for _ in range(n)]
        out["recovery_seconds"] = _dist(device, 6)
        out["recovery_seconds_from_store"] = _dist(store, 6)
    return out
