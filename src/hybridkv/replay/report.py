"""The result of one trace replay: a JSON file other tools read, and a summary table.

The top-level JSON keys and their order are a contract (see :data:`REPORT_KEYS`);
optional keys (``mode``, ``config``, ``skipped_lines``) may follow them.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPORT_KEYS = (
    "requests",
    "prompt_tokens",
    "computed_prompt_tokens",
    "reused_tokens",
    "token_hit_rate",
    "request_hit_rate",
    "byte_weighted_hit_rate",
    "oracle_reused_tokens",
    "oracle_fraction",
    "checkpoints_created",
    "branch_recompute_tokens",
    "checkpoint_bytes_peak",
    "kv_bytes_peak",
    "verify",
    "wall_seconds",
    "prefill_tokens_per_second",
)
"""Required top-level keys of the report JSON, in order."""

TIMED_KEYS = ("ttft_seconds", "ttft_cdf_seconds", "queue_seconds", "e2e_seconds", "instances", "load_skew",
              "makespan_seconds", "router", "time_scale", "cost_model", "store", "restarts",
              "crashes", "requeued")
"""Keys only a timed replay sets (:func:`hybridkv.fleet.simulator.timing_summary`)."""

OPTIONAL_KEYS = ("tiers", "store_misses", "mode", "config", "skipped_lines", "rejected",
                 "warm_start_reused_tokens", "evictions", "reused_histogram") + TIMED_KEYS + (
                     "interrupted", "cpu_seconds", "requests_per_second", "requests_per_cpu_second",
                     "peak_rss_bytes", "workload_notes") + (
                     "goodput", "queue_skew", "tier_capacity", "device_memory", "phases")
"""Keys written after :data:`REPORT_KEYS`, only when set."""

OPERATING_KEYS = ("goodput", "queue_skew", "tier_capacity", "device_memory", "phases")
"""Operating figures a timed replay sets (:mod:`hybridkv.fleet.operating`; ``goodput`` only with an SLO)."""

REUSE_BUCKET_EDGES = (1, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
"""Lower edges (tokens) of the reused-length histogram's buckets after the ``0`` bucket."""


def reuse_histogram(reused_lengths) -> dict[str, int]:
    """Requests per reused length (tokens): ``"0"``, ``"1-1023"``, ``"1024-2047"``, ... ``"65536+"``.

    Every bucket is present (zero counts included), in increasing order.
    """
    edges = REUSE_BUCKET_EDGES
    labels = ["0"] + [f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(edges)] + [f"{edges[-1]}+"]
    out = dict.fromkeys(labels, 0)
    for n in reused_lengths:
        k = 0
        while k < len(edges) and n >= edges[k]:
            k += 1
        out[labels[k]] += 1
    return out


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, or ``None`` when the denominator is 0."""
    return numerator / denominator if denominator else None


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Exactness check of reused prefixes against full prefills.

    requests: how many requests were re-run without the cache and compared.
    max_abs_logit_diff: largest |logit(reuse) - logit(full prefill)| over all
        compared positions and vocabulary entries (float, logit units).
    greedy_mismatches: compared requests whose greedy (argmax) tokens differ.
    """

    requests: int
    max_abs_logit_diff: float
    greedy_mismatches: int


@dataclass(slots=True)
class ReplayReport:
    """Counters of one replay. Token counts are prompt tokens of the (scaled) trace.

    requests: requests replayed.
    prompt_tokens: sum of prompt lengths, tokens.
    computed_prompt_tokens: prompt tokens actually prefilled (not reused), tokens;
        ``prompt_tokens - reused_tokens`` plus any branch recompute.
    reused_tokens: prompt tokens whose state came from the cache, tokens.
    token_hit_rate: ``reused_tokens / prompt_tokens`` (fraction 0..1; null if no tokens).
    request_hit_rate: fraction of requests with ``reused > 0`` (0..1).
    byte_weighted_hit_rate: bytes of model state (KV pages + KDA state) that did not
        have to be recomputed, divided by the bytes a full prefill of every prompt
        would produce (fraction 0..1); the engine computes it from its per-token
        state sizes.
    oracle_reused_tokens: tokens an infinite cache with a checkpoint at every
        ``prefix_match_unit`` boundary would reuse within this run
        (:mod:`hybridkv.replay.oracle`), over the requests served (a refused request's
        reuse is left out; each served request's still assumes every earlier one cached), tokens.
    oracle_fraction: reused tokens within the oracle's reach per request, divided by
        ``oracle_reused_tokens`` (0..1; null if the oracle reuses nothing).
    checkpoints_created: KDA checkpoints materialised, per placement policy name (and ``lead``:
        those the ``utility`` order placed a block past a request's KV hit, without a host tier).
    branch_recompute_tokens: tokens recomputed to create checkpoints at branching
        boundaries (work beyond a plain prefill), tokens.
    checkpoint_bytes_peak: peak resident bytes of KDA checkpoints, bytes.
    kv_bytes_peak: peak resident bytes of full-attention KV pages, bytes.
    verify: the exactness check, or ``None`` (null) in simulate mode.
    wall_seconds: wall-clock time of the replay, seconds (from the trace load to the report;
        interpreter start-up and imports excluded).
    prefill_tokens_per_second: ``computed_prompt_tokens`` per second of engine time
        (the slowest instance's time running its requests, not the wall time, which
        also loads the model and the trace), tokens/s. In simulate mode the seconds
        are the cost model's, so the figure restates its rate.
    tiers: per tier (``device``, ``host``, ``store``): ``hit_tokens`` (reused tokens
        served from that tier), ``bytes_loaded``, ``bytes_saved`` (bytes), ``loads_taken``,
        ``loads_declined`` (loads skipped because recomputing was predicted faster), ``bytes_peak``
        (most bytes the tier held).
    store_misses: store lookups / loads that found nothing usable, by reason
        (:data:`~hybridkv.tiers.base.MISS_REASONS`: absent, evicted, checksum, incomplete, unreachable, expired).
    mode, config, skipped_lines: run mode (e.g. "simulate"); the run's settings as resolved
        (e.g. ``policy`` as run, ``host_groups`` ``full+kda`` for ``--host-groups all``,
        ``weight_digest``, the model's, which ``hybridkv cache purge --weight-digest`` takes; null
        when simulating; ``own_waiting``, ``waiting_weight``, ``tie_kv_run`` and ``price_restore``,
        the ``hybrid`` router's settings as run, null unless ``--timed`` with the ``hybrid``
        router); malformed trace lines skipped (``--skip-bad``).
    rejected: ``{"requests": n, "reasons": {kind: count}, "examples": {kind: reason}}``:
        requests the engine refused (they count in no other figure), counted by the kind of
        refusal (:attr:`~hybridkv.engine.request.Request.reject_code`, a fixed text), with the
        full reason of the largest refused request (prompt plus output tokens) of each kind:
        the pages it needed and the pool's.
    warm_start_reused_tokens: reused tokens beyond what the oracle allows a request from
        this run's earlier requests: they came from a store filled before the run.
        ``oracle_fraction`` counts only the rest, so it stays within 0..1.
    interrupted: ``True`` when the run was stopped (Ctrl-C) before every request ran: the
        figures cover the requests admitted until then (written only when ``True``).
    evictions: entries evicted for capacity per tier: ``device`` ``{kv_pages, kv_bytes,
        checkpoints, checkpoint_bytes}``, ``host`` ``{entries, bytes}`` (bytes).
    reused_histogram: admitted requests per reused length bucket (tokens; :func:`reuse_histogram`).
    ttft_seconds, queue_seconds, e2e_seconds: timed replay only: ``{mean, p50, p90, p99}``
        seconds from arrival to first token, to admission, to last token (served requests).
    ttft_cdf_seconds: timed only: ``[percentile, seconds]`` pairs of the TTFT distribution.
    instances: timed only: per instance ``{requests, busy_seconds, reused_tokens, queue_peak}``.
    load_skew: timed only: max / mean busy seconds over instances.
    makespan_seconds: timed only: when the last request ended, seconds on the fleet's clock.
    router, time_scale, cost_model: timed only: the router's name, the arrival multiplier,
        the cost model's name (what prices simulated steps and the router's estimates).
    store: timed only: ``{hit_tokens, bytes_loaded, seconds, declined}``: what the fleet
        loaded from a simulated shared store, and loads it declined because recomputing was
        predicted faster (zeros for real engines: their store tier reports in ``tiers``); with a
        simulated store also ``capacity_bytes`` (``None``: unlimited), ``bytes_peak`` (most held)
        and ``evicted_bytes``.
    restarts: timed only: ``{instance, requested, at}`` of each ``--restart`` done (seconds on the
        fleet's clock: asked for, and when the instance was idle and restarted).
    crashes: timed only: ``{instance, requested, at, back_at, requeued}`` of each ``--crash`` done
        (asked for, when it happened, when the instance was back, requests it lost).
    requeued: timed only: ``{requests, times, ttft_seconds}``: requests a crash sent back to the
        router, how many times in all, and their TTFT from the original arrival.
    cpu_seconds: CPU seconds (user + system, ``getrusage``) over the span of ``wall_seconds``, of
        the replaying process and of the instance processes it ran (untimed ``--instances > 1``).
    requests_per_second, requests_per_cpu_second: ``requests`` (those served: rejected requests
        are not counted; those run before Ctrl-C in an interrupted run) per ``wall_seconds`` and
        per ``cpu_seconds``, requests/s (0.0 when every request was rejected; the second is the
        simulator's speed figure).
    peak_rss_bytes: peak resident memory of the replaying process by the end of the run, bytes
        (``getrusage`` ``ru_maxrss``; the trace load and the report included).
    workload_notes: ``[{option, this_run, other_mode, why}]``: each value in which this run's work
        differs from the same command line run in the other mode (a ``--simulate`` run against
        the model run's defaults: lengths, requests, output tokens, pool sizes, step pricing,
        store, host tier; a real timed run: the flat estimate its router prices with when no
        ``--cost-model`` is given), printed before the run (:mod:`hybridkv.replay.workload`);
        ``[]``: the same work.
    goodput: timed with ``--slo`` only: ``{slo, requests, fraction, per_second, targets}``: the
        targets (seconds), requests served within every target on their own times (a request's TTFT
        within every ``ttft_*`` target, and so on), their share, their rate over the span from the
        first arrival to the last finish (requests/s), and per target ``{target, value, met}`` (the
        run's statistic; a refused request fails every target).
    queue_skew: timed only: ``{skew, mean_queue}``: per instance the mean number of requests
        waiting for admission over the span (their waits summed over the span), and max / mean of it.
    tier_capacity: timed only: per tier (``device``; ``host`` when one held entries; a simulated
        ``store``) ``{capacity_bytes, bytes_peak, occupancy, evicted_bytes, evicted_bytes_per_second}``:
        bytes over the fleet (``None``: unlimited), peak (the device's and host's the sum of each
        engine's), peak over capacity (0..1) and bytes evicted for capacity, in all and per second.
    device_memory: timed only: ``{pool_bytes, kv_pages, checkpoint_slots, cache_share,
        delayed_requests, admission_waits, refused_requests}``: each instance's device pools (bytes),
        the checkpoint slots' share of them (the cache's own; cached pages share the page pool with
        running requests' KV and are evicted for them), and the decode KV this displaced: requests
        that waited for pages, the admission attempts that found none, requests refused.
    phases: timed only: ``{window_seconds, windows, cold_start, steady, drift}``: the arrival span cut
        into equal windows, grouped into cold start (leading windows below 90% of the median window's
        token hit rate), hot-spot drift (windows whose share of requests on a prefix also requested in
        the previous window is under half the median window's) and steady state (the rest); each ``{windows, requests, ttft_seconds
        {mean, p50, p99}, token_hit_rate, request_hit_rate}`` (:func:`hybridkv.fleet.operating.phases`).
    """

    requests: int
    prompt_tokens: int
    computed_prompt_tokens: int
    reused_tokens: int
    token_hit_rate: float | None
    request_hit_rate: float | None
    byte_weighted_hit_rate: float | None
    oracle_reused_tokens: int
    oracle_fraction: float | None
    checkpoints_created: dict[str, int]
    branch_recompute_tokens: int
    checkpoint_bytes_peak: int
    kv_bytes_peak: int
    verify: VerifyReport | None
    wall_seconds: float
    prefill_tokens_per_second: float | None
    tiers: dict[str, dict[str, int]] | None = None
    store_misses: dict[str, int] | None = None
    mode: str | None = None
    config: dict[str, Any] | None = None
    skipped_lines: int | None = None
    rejected: dict[str, Any] | None = None
    warm_start_reused_tokens: int | None = None
    interrupted: bool | None = None
    evictions: dict[str, dict[str, int]] | None = None
    reused_histogram: dict[str, int] | None = None
    ttft_seconds: dict[str, float | None] | None = None
    ttft_cdf_seconds: list[list[float]] | None = None
    queue_seconds: dict[str, float | None] | None = None
    e2e_seconds: dict[str, float | None] | None = None
    instances: list[dict[str, Any]] | None = None
    load_skew: float | None = None
    makespan_seconds: float | None = None
    router: str | None = None
    time_scale: float | None = None
    cost_model: str | None = None
    store: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] | None = None
    crashes: list[dict[str, Any]] | None = None
    requeued: dict[str, Any] | None = None
    cpu_seconds: float | None = None
    requests_per_second: float | None = None
    requests_per_cpu_second: float | None = None
    peak_rss_bytes: int | None = None
    workload_notes: list[dict[str, str]] | None = None
    goodput: dict[str, Any] | None = None
    queue_skew: dict[str, Any] | None = None
    tier_capacity: dict[str, Any] | None = None
    device_memory: dict[str, Any] | None = None
    phases: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the required keys in order, then the optional keys that are set."""
        out: dict[str, Any] = {}
        for name in REPORT_KEYS:
            value = getattr(self, name)
            if name == "verify" and value is not None:
                value = asdict(value)
            elif name == "checkpoints_created":
                value = dict(value)
            out[name] = value
        for name in OPTIONAL_KEYS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplayReport:
        missing = [k for k in REPORT_KEYS if k not in data]
        if missing:
            raise ValueError(f"replay report is missing keys: {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if kwargs["verify"] is not None:
            kwargs["verify"] = VerifyReport(**kwargs["verify"])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> ReplayReport:
        return cls.from_dict(json.loads(text))


# --- rendering ---------------------------------------------------------------------


def _tokens(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.2f}%"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 1 << 30:
        return f"{n / (1 << 30):,.2f} GiB"
    return f"{n / (1 << 20):,.2f} MiB"


def _timed_rows(r: ReplayReport, table: Table) -> None:
    """Rows of a timed replay: router, latencies, load skew."""
    if r.ttft_seconds is None:
        return
    table.add_row("router / time scale", f"{r.router} / {r.time_scale:g}x")
    for label, stats in (("TTFT", r.ttft_seconds), ("queue", r.queue_seconds), ("end to end", r.e2e_seconds)):
        if stats["mean"] is not None:
            table.add_row(f"{label} mean / p50 / p90 / p99",
                          " / ".join(f"{stats[k]:.3f}" for k in ("mean", "p50", "p90", "p99")) + " s")
    if r.load_skew is not None:
        table.add_row("load skew (max / mean busy)", f"{r.load_skew:.3f}")
    for c in r.restarts or ():
        table.add_row(f"restart of instance {c['instance']}", f"asked {c['requested']:g} s, done {c['at']:g} s")
    for c in r.crashes or ():
        table.add_row(f"crash of instance {c['instance']}",
                      f"at {c['at']:.1f} s, back {c['back_at']:.1f} s, {c['requeued']:,} requeued")
    if r.requeued and r.requeued["requests"]:
        q = r.requeued["ttft_seconds"]
        table.add_row("requeued: TTFT mean / p50 / p99",
                      f"{r.requeued['requests']:,}: " + " / ".join(f"{q[k]:.3f}" for k in ("mean", "p50", "p99")) + " s")


def _operating_rows(r: ReplayReport, table: Table) -> None:
    """Rows of a timed replay's operating figures: goodput, queue skew, tiers, device memory, phases."""
    if r.goodput is not None:
        g = r.goodput
        rate = "-" if g["per_second"] is None else f"{g['per_second']:.3f} req/s"
        table.add_row("goodput (met every target)", f"{g['requests']:,} ({_pct(g['fraction'])}), {rate}")
        for key, t in g["targets"].items():
            value = "-" if t["value"] is None else f"{t['value']:.3f}"
            table.add_row(f"SLO {key} <= {t['target']:g} s", f"{value} s: {'met' if t['met'] else 'MISSED'}")
    if r.queue_skew is not None and r.queue_skew["skew"] is not None:
        table.add_row("queue skew (max / mean queue)", f"{r.queue_skew['skew']:.3f}")
    for name, t in (r.tier_capacity or {}).items():
        occ = "unlimited" if t["occupancy"] is None else _pct(t["occupancy"])
        rate = "-" if t["evicted_bytes_per_second"] is None else f"{_bytes(int(t['evicted_bytes_per_second']))}/s"
        table.add_row(f"{name} capacity / peak / evicted", f"{_bytes(t['capacity_bytes'])} / {occ} / {rate}")
    d = r.device_memory
    if d is not None:
        share = "-" if d["cache_share"] is None else _pct(d["cache_share"])
        table.add_row("checkpoint share of device pools", share)
        table.add_row("requests delayed / refused for KV pages",
                      f"{d['delayed_requests']:,} / {d['refused_requests']:,}")
    for name in ("cold_start", "steady", "drift"):
        p = (r.phases or {}).get(name)
        if p and p["requests"]:
            t = p["ttft_seconds"]
            ttft = "-" if t["p50"] is None else f"{t['p50']:.3f} / {t['p99']:.3f} s"   # every request refused
            table.add_row(f"phase {name.replace('_', ' ')}: requests, TTFT p50 / p99, hit",
                          f"{p['requests']:,}, {ttft}, {_pct(p['token_hit_rate'])}")


def render_summary(report: ReplayReport, console: Console | None = None) -> None:
    """Print the report as a two-column rich table."""
    console = console or Console()
    table = Table(title="hybridkv replay", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")          # wrap long values, never cut them
    r = report
    if r.mode is not None:
        table.add_row("mode", r.mode)
    if r.interrupted:
        table.add_row("interrupted", "yes: the figures cover the requests admitted before Ctrl-C")
    if r.config:
        c = r.config
        table.add_row("model / block size / unit", f"{c.get('model')} / {c.get('block_size')} / "
                                                   f"{c.get('prefix_match_unit')} tokens")
        table.add_row("checkpoint policy", str(c.get("policy")))
        table.add_row("mechanism", str(c.get("mechanism")))
    table.add_row("requests", _tokens(r.requests))
    if r.rejected and r.rejected["requests"]:
        kind = max(r.rejected["reasons"].items(), key=lambda kv: kv[1])[0]
        table.add_row("rejected requests", f"{r.rejected['requests']:,} (largest: "
                                           f"{r.rejected.get('examples', {}).get(kind, kind)})")
    if r.skipped_lines:
        table.add_row("skipped trace lines", _tokens(r.skipped_lines))
    table.add_row("prompt tokens", _tokens(r.prompt_tokens))
    table.add_row("reused tokens", _tokens(r.reused_tokens))
    table.add_row("computed prompt tokens", _tokens(r.computed_prompt_tokens))
    table.add_row("token hit rate", _pct(r.token_hit_rate))
    table.add_row("request hit rate", _pct(r.request_hit_rate))
    table.add_row("byte-weighted hit rate", _pct(r.byte_weighted_hit_rate))
    table.add_row("oracle reused tokens", _tokens(r.oracle_reused_tokens))
    table.add_row("fraction of oracle", _pct(r.oracle_fraction))
    if r.warm_start_reused_tokens:
        table.add_row("reused from before this run", _tokens(r.warm_start_reused_tokens))
    for policy, count in sorted(r.checkpoints_created.items()):
        table.add_row(f"checkpoints created ({policy})", _tokens(count))
    table.add_row("branch recompute tokens", _tokens(r.branch_recompute_tokens))
    if r.config and "swa_recovery" in r.config:        # DeepSeek-V4
        table.add_row("SWA recovery", str(r.config["swa_recovery"]))
        table.add_row("restore recompute tokens", _tokens(r.config["restore_recompute_tokens"]))
        sr = r.config.get("swa_restore")
        if sr:
            per = sr["recompute_tokens_per_hit"]
            if per["mean"] is not None:
                table.add_row("restore recompute per hit mean / p99", f"{per['mean']:,.1f} / {per['p99']:,.0f}")
            b = sr["device_bytes_per_cached_token"]
            table.add_row("device bytes per cached token", f"{b['total']:,.1f} ({b['compressed']:,} compressed "
                          f"+ {b['swa_states']:,.1f} saved states)")
            rs = sr.get("recovery_seconds")
            if rs and rs["p50"] is not None:
                st = sr["recovery_seconds_from_store"]
                table.add_row("recovery p50 / p99 (device; store)",
                              f"{rs['p50'] * 1e3:.2f} / {rs['p99'] * 1e3:.2f} ms; "
                              f"{st['p50'] * 1e3:.2f} / {st['p99'] * 1e3:.2f} ms")
    table.add_row("checkpoint bytes (peak)", _bytes(r.checkpoint_bytes_peak))
    table.add_row("KV bytes (peak)", _bytes(r.kv_bytes_peak))
    if r.verify is None or not r.verify.requests:
        table.add_row("verify", "off")
    else:
        table.add_row("verified requests", _tokens(r.verify.requests))
        table.add_row("max |logit diff|", f"{r.verify.max_abs_logit_diff:.3g}")
        table.add_row("greedy mismatches", _tokens(r.verify.greedy_mismatches))
    if r.tiers and any(t["bytes_saved"] or t["hit_tokens"] for n, t in r.tiers.items() if n != "device"):
        for name, t in r.tiers.items():
            table.add_row(f"{name} tier hit tokens", _tokens(t["hit_tokens"]))
        for name in ("host", "store"):
            t = r.tiers.get(name)
            if t and (t["bytes_loaded"] or t["bytes_saved"]):
                table.add_row(f"{name} bytes loaded / saved",
                              f"{_bytes(t['bytes_loaded'])} / {_bytes(t['bytes_saved'])}")
    if r.evictions:
        d, h = r.evictions["device"], r.evictions["host"]
        table.add_row("device evictions: KV pages / checkpoints",
                      f"{d['kv_pages']:,} ({_bytes(d['kv_bytes'])}) / "
                      f"{d['checkpoints']:,} ({_bytes(d['checkpoint_bytes'])})")
        if h["entries"]:
            table.add_row("host evictions", f"{h['entries']:,} ({_bytes(h['bytes'])})")
    if r.reused_histogram:
        table.add_row("requests by reused tokens",
                      ", ".join(f"{k}: {v:,}" for k, v in r.reused_histogram.items() if v))
    if r.store_misses and any(r.store_misses.values()):
        table.add_row("store misses", ", ".join(f"{k} {v}" for k, v in r.store_misses.items() if v))
    _timed_rows(r, table)
    _operating_rows(r, table)
    table.add_row("wall time", f"{r.wall_seconds:,.2f} s")
    if r.cpu_seconds is not None:
        table.add_row("CPU time", f"{r.cpu_seconds:,.2f} s")
    if r.requests_per_second is not None and r.requests_per_cpu_second is not None:
        table.add_row("requests per wall / CPU second", f"{r.requests_per_second:,.1f} / {r.requests_per_cpu_second:,.1f}")
    tps = r.prefill_tokens_per_second
    label = "prefill throughput (cost model)" if r.mode == "simulate" else "prefill throughput (engine time)"
    table.add_row(label, "-" if tps is None else f"{tps:,.0f} tok/s")
    console.print(table)
    if r.config and "swa_recovery" in r.config:
        console.print("reused: prompt tokens whose compressed entries (csa, hca) and sliding-window state (swa) came "
                      "from the cache; oracle: what a state at every prefix_match_unit boundary with no eviction "
                      "would reuse; branch recompute: entries that were cached but recomputed for lack of a saved "
                      "state; restore recompute: tokens recomputed to rebuild the window state at a hit "
                      "(periodic, recompute).", style="dim")
        return
    console.print("reused: prompt tokens whose MLA KV and KDA state came from a cache tier; oracle: what a "
                  "checkpoint at every prefix_match_unit boundary with no eviction would reuse; branch recompute: KV that "
                  "was cached but recomputed for lack of a checkpoint.", style="dim")
