"""Operating figures of a timed replay: goodput against a service-level objective, queue skew,
per-tier capacity / occupancy / eviction rate, the cache's share of device memory against the
decode KV it displaces, and the trace split into phases (cold start, steady state, hot-spot drift).

Everything here is computed after a run from the requests' times and the instances' counters;
nothing changes what the fleet does. Hash keys are used only to count requests per prefix in
memory (the prefixes of :func:`phases`); no key is ever returned or logged.

Phases (:func:`phases`): the span of arrivals is cut into :data:`PHASE_WINDOWS` equal windows.

* **cold start**: the leading windows whose token hit rate is below :data:`COLD_HIT_FRACTION`
  of the median window's (the caches are still filling); it ends at the first window at or
  above it.
* **hot-spot drift**: a later window in which the share of requests whose prefix (its first
  :data:`HOT_PREFIX_PAGES` pages) was also requested in the previous window is below
  :data:`DRIFT_FRACTION` of the median window's share: the traffic moved to prefixes the caches
  did not just serve.
* **steady state**: every other window.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

SLO_METRICS = ("ttft", "e2e", "queue")
"""What a service-level target may bound: seconds from arrival to first token, to last token,
to admission."""
SLO_STATS = ("mean", "p50", "p90", "p99")
"""Which statistic of it (percentiles by linear interpolation, numpy's default)."""
SLO_KEYS = tuple(f"{m}_{s}" for m in SLO_METRICS for s in SLO_STATS)
"""Keys ``--slo`` accepts: ``ttft_p99``, ``e2e_mean``, ... (seconds)."""
MAX_SLO_SECONDS = 1e6
"""Largest target accepted (about 11.6 days)."""

PHASE_WINDOWS = 20
"""Equal windows the arrival span is cut into for :func:`phases`."""
COLD_HIT_FRACTION = 0.9
"""A leading window is cold while its token hit rate is below this share of the median window's."""
HOT_PREFIX_PAGES = 2
"""Pages of a request's prompt that name its prefix (a shared system prompt and the first page of
the conversation or document that follows it)."""
DRIFT_FRACTION = 0.5
"""A window drifts when the share of its requests on a prefix of the previous window is below this
fraction of the median window's share."""


class SLOError(ValueError):
    """A service-level objective that cannot be read (the offending key or value is named)."""


def parse_slo(text: str) -> dict[str, float]:
    """``ttft_p99=2.0,ttft_p50=0.5`` -> ``{"ttft_p99": 2.0, "ttft_p50": 0.5}`` (seconds).

    Raises:
        SLOError: empty text, an item without ``=``, an unknown key (the known ones listed), a key
            given twice, or a value that is not a number in ``(0, MAX_SLO_SECONDS]``.
    """
    out: dict[str, float] = {}
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise SLOError("the SLO is empty: give KEY=SECONDS[,KEY=SECONDS...], e.g. ttft_p99=2.0")
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise SLOError(f"SLO item {item!r} is not KEY=SECONDS (e.g. ttft_p99=2.0)")
        if key not in SLO_KEYS:
            raise SLOError(f"unknown SLO key {key!r}: expected one of {', '.join(SLO_KEYS)}")
        if key in out:
            raise SLOError(f"SLO key {key!r} is given twice")
        try:
            x = float(value)
        except ValueError:
            raise SLOError(f"SLO {key}={value.strip()!r} is not a number of seconds") from None
        if not (0 < x <= MAX_SLO_SECONDS):
            raise SLOError(f"SLO {key}={value.strip()!r} must be a number of seconds in (0, {MAX_SLO_SECONDS:g}]")
        out[key] = x
    return out


def format_slo(slo: dict[str, float]) -> str:
    """The text :func:`parse_slo` reads back."""
    return ",".join(f"{k}={v:g}" for k, v in slo.items())


def _request_seconds(fr, metric: str) -> float:
    if metric == "ttft":
        return fr.ttft_end - fr.arrival
    if metric == "e2e":
        return fr.finished - fr.arrival
    return fr.admitted - fr.arrival


def _served(requests) -> list:
    return [fr for fr in requests if not fr.rejected and fr.first_token is not None]


def _stat(values: list[float], stat: str) -> float | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()) if stat == "mean" else float(np.percentile(a, float(stat[1:])))


def slo_check(requests, slo: dict[str, float]) -> dict[str, dict]:
    """Each target against the run: ``{key: {target, value, met}}`` (seconds; ``value`` ``None``
    when no request was served). A refused request fails every target: with any, ``met`` is
    false whatever the value."""
    served = _served(requests)
    refused = any(fr.rejected for fr in requests)
    out = {}
    for key, target in slo.items():
        metric, stat = key.split("_")
        value = _stat([_request_seconds(fr, metric) for fr in served], stat)
        out[key] = {"target": target, "value": None if value is None else round(value, 6),
                    "met": value is not None and value <= target and not refused}
    return out


def goodput(requests, slo: dict[str, float]) -> dict:
    """Requests that met every target, per second of the fleet's span.

    A request meets the SLO when it was served and each of its own times is within every target
    on that time (``ttft_p99=2`` and ``ttft_p50=0.5``: its TTFT at most 0.5 s). The span runs from
    the first arrival to the last finish.

    Returns:
        ``{slo, requests, fraction, per_second, targets}``: the targets as given, requests that met
        them, their share of all requests, requests/s, and :func:`slo_check`.
    """
    bound: dict[str, float] = {}
    for key, target in slo.items():
        metric = key.split("_")[0]
        bound[metric] = min(bound.get(metric, math.inf), target)
    met = sum(all(_request_seconds(fr, m) <= t for m, t in bound.items()) for fr in _served(requests))
    span = _span(requests)
    return {"slo": dict(slo), "requests": met, "fraction": round(met / len(requests), 6) if requests else None,
            "per_second": round(met / span, 6) if span > 0 else None, "targets": slo_check(requests, slo)}


def _span(requests) -> float:
    if not requests:
        return 0.0
    return max((fr.finished or fr.arrival) for fr in requests) - min(fr.arrival for fr in requests)


def queue_skew(requests, n_instances: int) -> dict:
    """Mean queue length of each instance over the span (Little's law: the seconds its requests
    waited from arrival to admission, summed, over the span) and the skew, max / mean over
    instances (``None`` when nothing waited).

    Returns:
        ``{skew, mean_queue}``: the ratio, and requests waiting on average per instance.
    """
    span = _span(requests)
    waited = [0.0] * n_instances
    for fr in requests:
        if fr.instance is not None and fr.admitted is not None:
            waited[fr.instance] += max(fr.admitted - fr.arrival, 0.0)
    mean_queue = [round(w / span, 6) if span > 0 else 0.0 for w in waited]
    mean = sum(mean_queue) / n_instances if n_instances else 0.0
    return {"skew": round(max(mean_queue) / mean, 6) if mean > 0 else None, "mean_queue": mean_queue}


def device_memory(requests, num_kv_pages: int, page_bytes: int, num_checkpoint_slots: int,
                  checkpoint_bytes: int) -> dict:
    """The cache's share of each instance's device pools against the decode KV it displaces.

    The page pool holds both the KV of running requests (reserved for prompt plus output at
    admission) and cached pages (evicted on demand); the checkpoint slots are the cache's alone.
    So the cache's fixed share is its slots' bytes over the pools' bytes; what it displaces shows
    as requests that waited for pages (``delayed``: admission found no room at least once) or
    were refused (the prompt plus output did not fit the pool even without reuse).

    Returns:
        ``{pool_bytes, kv_pages, checkpoint_slots, cache_share, delayed_requests, admission_waits,
        refused_requests}`` (bytes per instance; ``cache_share`` 0..1; counts over the fleet).
    """
    kv, ck = num_kv_pages * page_bytes, num_checkpoint_slots * checkpoint_bytes
    return {"pool_bytes": kv + ck, "kv_pages": num_kv_pages, "checkpoint_slots": num_checkpoint_slots,
            "cache_share": round(ck / (kv + ck), 6) if kv + ck else None,
            "delayed_requests": sum(fr.request.admission_failures > 0 and not fr.rejected for fr in requests),
            "admission_waits": sum(fr.request.admission_failures for fr in requests),
            "refused_requests": sum(fr.rejected for fr in requests)}


def tier_capacity(span_s: float, tiers: dict[str, dict]) -> dict:
    """Per tier ``{capacity_bytes, bytes_peak, occupancy, evicted_bytes, evicted_bytes_per_second}``
    from ``tiers`` (``{name: {capacity_bytes, bytes_peak, evicted_bytes}}``; ``capacity_bytes``
    ``None``: unlimited): occupancy is peak over capacity (0..1, ``None`` when unlimited or 0),
    the eviction rate evicted bytes per second of the span."""
    out = {}
    for name, t in tiers.items():
        cap = t["capacity_bytes"]
        out[name] = {"capacity_bytes": cap, "bytes_peak": t["bytes_peak"],
                     "occupancy": round(t["bytes_peak"] / cap, 6) if cap else None,
                     "evicted_bytes": t["evicted_bytes"],
                     "evicted_bytes_per_second": round(t["evicted_bytes"] / span_s, 3) if span_s > 0 else None}
    return out


def _phase_figures(rs: list) -> dict:
    served = _served(rs)
    ttft = [fr.ttft_end - fr.arrival for fr in served]
    admitted = [fr for fr in rs if fr.admitted is not None and not fr.rejected]
    prompt = sum(fr.request.prompt_len for fr in admitted)
    reused = sum(fr.request.reused for fr in admitted)
    return {"requests": len(rs),
            "ttft_seconds": {k: (None if v is None else round(v, 6))
                             for k, v in (("mean", _stat(ttft, "mean")), ("p50", _stat(ttft, "p50")),
                                          ("p99", _stat(ttft, "p99")))},
            "token_hit_rate": round(reused / prompt, 6) if prompt else None,
            "request_hit_rate": round(sum(fr.request.reused > 0 for fr in admitted) / len(admitted), 6)
            if admitted else None}


def phases(requests, block_size: int, unit: int) -> dict:
    """The trace split into cold start, steady state and hot-spot drift (module docstring).

    Args:
        requests: the run's requests (arrival, times, hashes, reuse).
        block_size: tokens per page (a request's prefix is its first :data:`HOT_PREFIX_PAGES` pages).
        unit: ``prefix_match_unit`` in tokens (one chained hash per unit).

    Returns:
        ``{window_seconds, windows, cold_start, steady, drift}``: each phase ``{windows (indices),
        requests, ttft_seconds {mean, p50, p99}, token_hit_rate, request_hit_rate}``; ``cold_start``
        adds ``until_seconds`` (on the fleet's clock).
    """
    if not requests:
        return {}
    t0 = min(fr.arrival for fr in requests)
    t1 = max(fr.arrival for fr in requests)
    width = (t1 - t0) / PHASE_WINDOWS if t1 > t0 else 1.0
    windows: list[list] = [[] for _ in range(PHASE_WINDOWS)]
    for fr in requests:
        windows[min(int((fr.arrival - t0) / width), PHASE_WINDOWS - 1)].append(fr)
    rates = [_phase_figures(w)["token_hit_rate"] for w in windows]
    known = [r for r in rates if r is not None]
    median = statistics.median(known) if known else 0.0
    cold = 0
    while cold < PHASE_WINDOWS - 1 and (rates[cold] is None or rates[cold] < COLD_HIT_FRACTION * median):
        cold += 1
    k = max(1, HOT_PREFIX_PAGES * block_size // unit)
    keys = [[fr.hashes[min(k, len(fr.hashes)) - 1] for fr in w if fr.hashes] for w in windows]
    seen = [None] + [sum(h in prev for h in cur) / len(cur) if cur else None
                     for prev, cur in zip(map(set, keys), keys[1:])]
    shares = [x for x in seen[max(cold, 1):] if x is not None]
    typical = statistics.median(shares) if shares else 0.0
    drift = [i for i in range(max(cold, 1), PHASE_WINDOWS)
             if seen[i] is not None and seen[i] < DRIFT_FRACTION * typical]
    steady = [i for i in range(cold, PHASE_WINDOWS) if i not in drift]
    out = {"window_seconds": round(width, 6), "windows": PHASE_WINDOWS}
    for name, idx in (("cold_start", list(range(cold))), ("steady", steady), ("drift", drift)):
        out[name] = {"windows": idx, **_phase_figures([fr for i in idx for fr in windows[i]])}
    out["cold_start"]["until_seconds"] = round(t0 + cold * width, 6)
    return out
