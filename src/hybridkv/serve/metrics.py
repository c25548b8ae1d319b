"""Prometheus metrics of one server, in a per-server ``CollectorRegistry``.

Three kinds: histograms the server observes as requests go (TTFT, end-to-end latency, queue
wait, reused length, engine step time); histograms of cache operations the engine and its
connector report as they happen (:class:`ServeMetrics.observe`, a
:class:`~hybridkv.tiers.connector.TimingSink`: lookup, load, transfer and install seconds per
tier, saved prefill seconds per request); and engine counters read at scrape time from a
snapshot taken on the engine thread (:func:`engine_snapshot`). All figures are aggregate over
tenants: no label carries a tenant, prompt text, token ids or keys.

Hit rates derive from the counters: token hit rate
``hybridkv_reused_tokens_total / hybridkv_prompt_tokens_total``, request hit rate
``hybridkv_requests_with_hit_total / hybridkv_requests_total``, byte-weighted hit rate
``hybridkv_reused_kv_bytes_total / hybridkv_prompt_kv_bytes_total`` (MLA KV bytes of the reused
and of all prompt tokens); ``hybridkv_hit_rate{weight="token"|"request"|"byte"}`` exports the
three ratios since start as gauges.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridkv.engine.build import EngineHandle

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FINE_SECONDS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0)
"""Buckets (seconds) of the cache operation histograms: a device lookup takes microseconds, a
store load of a long prefix seconds."""
_TOKENS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def engine_snapshot(handle: EngineHandle, queue_depth: int) -> dict:
    """The engine's counters and tier occupancy as plain numbers (run on the engine thread).

    Returns:
        ``counters`` (name -> value), ``checkpoints_created`` (policy -> count), ``tiers``
        (tier -> ``{held_bytes, capacity_bytes, evictions, hit_tokens, loaded_bytes,
        saved_bytes}``, bytes and tokens), ``misses`` (tier -> reason -> count), ``queue_depth``
        and ``running`` (requests), ``hit_rates`` (``token``, ``request``, ``byte`` -> the
        fraction since start, 0 before any request).
    """
    engine, cache = handle.engine, handle.engine.cache
    s = engine.stats
    kv_per_token = handle.backend.kv_bytes_per_token      # MLA latents; a V4 model: its csa/hca entries
    counters = {"requests": s.requests, "requests_with_hit": s.requests_with_hit,
                "prompt_tokens": s.prompt_tokens, "reused_tokens": s.reused_tokens,
                "kv_hit_tokens": s.kv_hit_tokens, "computed_prompt_tokens": s.computed_prompt_tokens,
                "reused_kv_bytes": s.reused_tokens * kv_per_token, "prompt_kv_bytes": s.prompt_tokens * kv_per_token,
                "requests_rejected": s.rejected, "requests_cancelled": s.cancelled, "engine_steps": s.steps,
                "checkpoints_superseded": s.checkpoints_retired, "checkpoints_skipped": s.checkpoints_skipped,
                "checkpoints_evicted": cache.evicted_checkpoints}
    pages, slots = cache.pages, cache.checkpoints
    device = {"held_bytes": (pages.num_pages - pages.num_free) * cache.page_bytes
              + (slots.num_slots - slots.num_free) * slots.slot_bytes,
              "capacity_bytes": pages.num_pages * cache.page_bytes + slots.num_slots * slots.slot_bytes,
              "evictions": cache.evicted_pages + cache.evicted_checkpoints}
    tiers, misses = {"device": device}, {}
    for tier in (handle.host_tier, handle.store_tier):
        if tier is not None:
            tiers[tier.name] = {"held_bytes": getattr(tier, "used_bytes", None),
                                "capacity_bytes": getattr(tier, "capacity_bytes", None),
                                "evictions": tier.stats.evictions}
            misses[tier.name] = dict(tier.stats.misses)
    for name, st in handle.tier_stats().items():
        if name in tiers:
            tiers[name].update(hit_tokens=st["hit_tokens"], loaded_bytes=st["bytes_loaded"],
                               saved_bytes=st["bytes_saved"])
    rates = {"token": _ratio(s.reused_tokens, s.prompt_tokens), "request": _ratio(s.requests_with_hit, s.requests),
             "byte": _ratio(counters["reused_kv_bytes"], counters["prompt_kv_bytes"])}
    return {"counters": counters, "checkpoints_created": dict(s.checkpoints_created), "tiers": tiers,
            "misses": misses, "queue_depth": queue_depth, "running": len(engine.running), "hit_rates": rates}


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


_COUNTER_HELP = {
    "requests": "requests admitted by the engine",
    "requests_with_hit": "admitted requests that reused at least one cached token",
    "prompt_tokens": "prompt tokens of admitted requests",
    "reused_tokens": "prompt tokens taken from the cache (joint MLA + KDA hit)",
    "kv_hit_tokens": "prompt tokens whose MLA KV was cached",
    "computed_prompt_tokens": "prompt tokens run through the model",
    "reused_kv_bytes": "MLA KV bytes of the reused prompt tokens",
    "prompt_kv_bytes": "MLA KV bytes of all prompt tokens",
    "requests_rejected": "requests the engine could not place",
    "requests_cancelled": "requests cancelled (client gone)",
    "engine_steps": "engine steps run",
    "checkpoints_superseded": "checkpoints retired by the supersede policy",
    "checkpoints_skipped": "checkpoints not created because one existed",
    "checkpoints_evicted": "checkpoints evicted from the device pool",
}
_TIER_HELP = {"held_bytes": ("gauge", "bytes held by the tier"),
              "capacity_bytes": ("gauge", "bytes the tier may hold"),
              "evictions": ("counter", ("entries evicted from the tier for capacity (device: pages and "
                                        "checkpoints; a store backend's own evictions are not seen)")),
              "hit_tokens": ("counter", "reused prompt tokens this tier supplied"),
              "loaded_bytes": ("counter", "bytes loaded from the tier"),
              "saved_bytes": ("counter", "bytes saved into the tier")}


class _EngineCollector:
    """Turns the latest :func:`engine_snapshot` into metric families at scrape time."""

    def __init__(self) -> None:
        self.snapshot: dict | None = None

    def collect(self):
        snap = self.snapshot
        if snap is None:
            return
        for name, value in snap["counters"].items():
            yield CounterMetricFamily(f"hybridkv_{name}", _COUNTER_HELP[name], value=value)
        created = CounterMetricFamily("hybridkv_checkpoints_created", "checkpoints created, by policy",
                                      labels=["policy"])
        for policy, n in snap["checkpoints_created"].items():
            created.add_metric([policy], n)
        yield created
        for key, (kind, text) in _TIER_HELP.items():
            cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            fam = cls(f"hybridkv_tier_{key}", text, labels=["tier"])
            for tier, vals in snap["tiers"].items():
                if vals.get(key) is not None:
                    fam.add_metric([tier], vals[key])
            yield fam
        fam = CounterMetricFamily("hybridkv_tier_misses", "lower-tier misses by reason", labels=["tier", "reason"])
        for tier, reasons in snap["misses"].items():
            for reason, n in reasons.items():
                fam.add_metric([tier, reason], n)
        yield fam
        rates = GaugeMetricFamily("hybridkv_hit_rate", "reused / prompt tokens (token), requests with a hit / "
                                  "requests (request), reused / prompt MLA KV bytes (byte), since start",
                                  labels=["weight"])
        for weight, value in snap["hit_rates"].items():
            rates.add_metric([weight], value)
        yield rates
        yield GaugeMetricFamily("hybridkv_queue_depth", "requests waiting for admission", value=snap["queue_depth"])
        yield GaugeMetricFamily("hybridkv_running_requests", "requests running in the engine", value=snap["running"])


class ServeMetrics:
    """The metrics of one server (its own registry; nothing global).

    Attributes:
        registry: the ``CollectorRegistry`` ``/metrics`` renders.
        ttft, e2e, queue_wait, step: latency histograms (seconds).
        reused: histogram of reused prompt tokens per request (tokens).
        lookup, load, transfer, install: cache operation histograms by ``tier`` (seconds).
        saved_prefill: histogram of the prefill seconds each hit saved (seconds).
        http_errors: error answers by HTTP status code.
        flushes: ``POST /flush_cache`` calls served.
        shadow_checks, shadow_mismatches, shadow_dropped: shadow verification counters;
            shadow_ties: by ``kind`` (``routing``, ``argmax``); shadow_check_seconds: a sampled hit's
            end to its verdict (seconds) (:mod:`hybridkv.serve.shadow`).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("hybridkv_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_SECONDS, registry=r)
        self.e2e = Histogram("hybridkv_e2e_request_latency_seconds", "request arrival to last token",
                             buckets=_SECONDS, registry=r)
        self.queue_wait = Histogram("hybridkv_queue_wait_seconds", "submission to admission by the engine",
                                    buckets=_SECONDS, registry=r)
        self.step = Histogram("hybridkv_engine_step_seconds", "one engine step (lookup, loads, installs, "
                              "forward, publish)", buckets=_SECONDS, registry=r)
        self.reused = Histogram("hybridkv_reused_prompt_tokens", "prompt tokens reused per request",
                                buckets=_TOKENS, registry=r)
        self.http_errors = Counter("hybridkv_http_errors", "error answers by status code", ["code"], registry=r)
        self.flushes = Counter("hybridkv_cache_flushes", "POST /flush_cache calls served", registry=r)
        self.lookup = Histogram("hybridkv_cache_lookup_seconds", "one cache lookup: the device index at an "
                                "admission attempt (tier=device) or a lower tier's directory", ["tier"],
                                buckets=_FINE_SECONDS, registry=r)
        self.load = Histogram("hybridkv_tier_load_seconds", "one batched read of a tier's entries into host "
                              "memory (at admission or by a background prefetch)", ["tier"],
                              buckets=_FINE_SECONDS, registry=r)
        self.transfer = Histogram("hybridkv_tier_transfer_seconds", "one install's copy of loaded KV into "
                                  "device pages", ["tier"], buckets=_FINE_SECONDS, registry=r)
        self.install = Histogram("hybridkv_tier_install_seconds", "one install's page allocation, indexing "
                                 "and checkpoint attach (transfer excluded)", ["tier"],
                                 buckets=_FINE_SECONDS, registry=r)
        self.saved_prefill = Histogram("hybridkv_saved_prefill_seconds", "per request with a hit: reused "
                                       "tokens times the measured compute seconds per token",
                                       buckets=_FINE_SECONDS, registry=r)
        self.shadow_checks = Counter("hybridkv_shadow_checks", "shadow verifications completed (a served hit "
                                     "recomputed without the cache and compared), whatever the outcome",
                                     registry=r)
        self.shadow_mismatches = Counter("hybridkv_shadow_mismatches", "shadow verifications that found a served "
                                         "hit wrong (its entries were quarantined)", registry=r)
        self.shadow_ties = Counter("hybridkv_shadow_ties", "shadow verifications that differed only at a routing "
                                   "or argmax tie (nothing quarantined)", ["kind"], registry=r)
        for kind in ("routing", "argmax"):
            self.shadow_ties.labels(kind)          # both series from the start, at 0
        self.shadow_dropped = Counter("hybridkv_shadow_dropped", "sampled hits not verified: the shadow queue was "
                                      "full", registry=r)
        self.shadow_check_seconds = Histogram("hybridkv_shadow_check_seconds", "a sampled hit's end to its shadow "
                                              "verification's verdict (waiting for idle slots included)",
                                              buckets=_SECONDS, registry=r)
        self._timing = {"lookup": self.lookup, "load": self.load, "transfer": self.transfer,
                        "install": self.install}
        self._engine = _EngineCollector()
        r.register(self._engine)

    def observe(self, kind: str, seconds: float, tier: str | None = None) -> None:
        """One cache operation's time (the :class:`~hybridkv.tiers.connector.TimingSink` the engine
        reports to; thread-safe). ``kind``: ``lookup``, ``load``, ``transfer``, ``install`` (per
        ``tier``) or ``saved_prefill`` (no tier).

        Raises:
            ValueError: an unknown ``kind``, or a per-tier kind without a tier (naming it).
        """
        if kind == "saved_prefill":
            self.saved_prefill.observe(seconds)
            return
        hist = self._timing.get(kind)
        if hist is None or tier is None:
            raise ValueError(f"timing kind={kind!r} tier={tier!r}: expected saved_prefill, or one of "
                             f"{sorted(self._timing)} with a tier")
        hist.labels(tier).observe(seconds)

    def set_snapshot(self, snapshot: dict) -> None:
        """The engine figures the next scrape reports (from :func:`engine_snapshot`)."""
        self._engine.snapshot = snapshot
