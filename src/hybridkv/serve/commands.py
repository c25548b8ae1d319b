"""``hybridkv serve``, ``hybridkv router`` and ``hybridkv bench-serve``: argument parsing and entry points.

Exit status: 0 on success, 2 on a bad option or model (one ``error:`` line naming it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from hybridkv.fleet.store import MOONCAKE_GET_LATENCY_S, MOONCAKE_LOAD_BYTES_PER_S
from hybridkv.replay.args import (
    add_hybrid_arguments,
    add_store_cost_arguments,
    block_tokens,
    checkpoint_policy,
    finite_positive_float,
    fraction,
    hybrid_flags_given,
    hybrid_options,
    non_negative_float,
    non_negative_int,
    poll_seconds,
    max_num_seqs,
    page_tokens,
    pool_entries,
    port_number,
    positive_int,
    seed_value,
    add_swa_recovery_argument,
    thread_count,
    time_scale,
)
from hybridkv.serve.auth import add_auth_arguments
from hybridkv.serve.bench import PROBE_TIMEOUT_S
from hybridkv.serve.cache_events import MAX_WAIT_S, SNAPSHOT_KEEP


def register_cli(sub) -> None:
    """Add the ``serve``, ``router`` and ``bench-serve`` subcommands to ``sub`` (argparse subparsers)."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the engine (docs/how-to/serve.md)",
                       description="Serve a model with the hybrid prefix cache over an OpenAI-compatible API.")
    s.add_argument("--model", default="tiny",
                   help="preset (tiny, small, kimi-linear-48b-a3b; DeepSeek-V4: v4-tiny, v4-small) or a model directory")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port_number, default=8000,
                   help="port (default 8000; 0: a free one, printed at start); a taken port is an error at start")
    s.add_argument("--store", default="none", help="store URL: none, disk:///PATH, memory:// (private to this server), "
                                                    "mooncake://HOST:PORT")
    s.add_argument("--store-alignment", type=positive_int, default=None, help="tokens; store entry boundaries")
    s.add_argument("--host-mib", type=non_negative_int, default=0, help="host tier MiB (0 = off)")
    s.add_argument("--seed", type=seed_value, default=0, help="seed of a preset's weights")
    s.add_argument("--block-size", type=page_tokens, default=64, help="KV page size in tokens")
    s.add_argument("--prefix-match-unit", type=page_tokens, default=64, help="hash/lookup unit in tokens")
    s.add_argument("--policy", type=checkpoint_policy, default="branch+tail",
                   help="checkpoint policy: branch, tail[=N], interval=N, hint, supersede joined by '+'; "
                        "'none' turns reuse off (default branch+tail)")
    s.add_argument("--mechanism", choices=("extract", "split"), default="extract")
    s.add_argument("--kv-pages", type=pool_entries, default=None, help="device KV pages (default: 65,536 tokens)")
    s.add_argument("--checkpoint-slots", type=pool_entries, default=64)
    s.add_argument("--max-num-seqs", type=max_num_seqs, default=4)
    s.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    s.add_argument("--max-model-len", type=positive_int, default=None,
                   help="prompt + generated tokens per request (default: the KV pool's tokens)")
    s.add_argument("--max-waiting", type=positive_int, default=64,
                   help="requests waiting for admission before answering 503 (default 64)")
    s.add_argument("--threads", type=thread_count, default=None, help="torch intra-op threads")
    add_swa_recovery_argument(s, "--host-mib and --store carry a V4 model's groups as they carry Kimi Linear's")
    s.add_argument("--shadow-verify", type=fraction, default=None, metavar="RATE",
                   help="share of requests, in [0, 1], whose cache hits are recomputed without the cache in the "
                        "engine's idle time and compared (logits within 1e-4, same greedy tokens, ties apart); a "
                        "mismatch quarantines the entries the request reused in every tier (default 0.01; 0: off; "
                        "1: every hit; Kimi Linear and DeepSeek-V4 models, every --swa-recovery)")
    s.add_argument("--snapshot-readers", type=_snapshot_readers, default=SNAPSHOT_KEEP, metavar="N",
                   help="cache snapshots held at once for readers paging through GET /v1/cache/snapshot (one "
                        "per router resyncing at the same time; a reader whose snapshot was dropped for a "
                        f"newer one gets 410 and reads again; about 75 bytes per cached unit each at most; "
                        f"at most {MAX_SNAPSHOT_READERS}; default {SNAPSHOT_KEEP})")
    add_auth_arguments(s, router=False)
    s.set_defaults(func=_serve)

    _register_router(sub)

    b = sub.add_parser("bench-serve", help="replay a trace against a running server and report TTFT",
                       description="Replay a Mooncake-format trace against a loopback server with its "
                                   "timestamps; report TTFT percentiles, cached tokens and errors.")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="server URL (loopback only)")
    b.add_argument("--trace", default=None, help="trace path (default: the bundled trace)")
    b.add_argument("--limit", type=positive_int, default=200, help="first N requests (default 200)")
    b.add_argument("--time-scale", type=time_scale, default=1.0,
                   help="factor on the trace's timestamps, 1e-6 to 1e6 (2: half the rate; default 1)")
    b.add_argument("--max-seconds", type=finite_positive_float, default=600.0, help="stop after this long (default 600)")
    b.add_argument("--block-tokens", type=block_tokens, default=64, help="synthetic tokens per trace hash id")
    b.add_argument("--max-tokens", type=positive_int, default=4, help="cap on generated tokens (default 4)")
    b.add_argument("--seed", type=seed_value, default=0, help="seed of the synthetic token ids")
    b.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="ids: token-id prompts; text: each synthetic id as one printable ASCII character (one "
                        "token each under the presets' byte tokenizer), for routers that only take text")
    b.add_argument("--probe-timeout", type=finite_positive_float, default=PROBE_TIMEOUT_S, metavar="SECONDS",
                   help="seconds to connect to the server and to wait for its /v1/models answer before the replay "
                        f"(default {PROBE_TIMEOUT_S:g})")
    b.add_argument("--json", dest="json_path", help="write the summary as JSON here")
    b.add_argument("--api-key", default=None, metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY' with every request, for a server or router started "
                        "with keys (default: $HYBRIDKV_API_KEY if set)")
    b.set_defaults(func=_bench)


def _serve(args) -> int:
    from hybridkv.cache.config import ConfigError
    from hybridkv.serve.launch import ServeOptions, serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from hybridkv.serve.auth import keyring_from_options
    try:
        auth = keyring_from_options(args.api_key, args.api_keys_file, args.admin_key)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    opts = ServeOptions(model=args.model, host=args.host, port=args.port, store=args.store,
                        store_alignment=args.store_alignment, seed=args.seed, block_size=args.block_size,
                        prefix_match_unit=args.prefix_match_unit, policy=args.policy, mechanism=args.mechanism,
                        kv_pages=args.kv_pages, checkpoint_slots=args.checkpoint_slots,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        host_mib=args.host_mib, threads=args.threads, max_model_len=args.max_model_len,
                        max_waiting=args.max_waiting, swa_recovery=args.swa_recovery,
                        shadow_verify=args.shadow_verify, snapshot_readers=args.snapshot_readers)
    opts.auth = auth
    try:
        serve_forever(opts)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _register_router(sub) -> None:
    from hybridkv.fleet.routers import ROUTER_NAMES
    r = sub.add_parser("router", help="HTTP router in front of several `hybridkv serve` workers (docs/how-to/route-a-fleet.md)",
                       description="Route OpenAI-style requests to workers by their cache events and load.")
    r.add_argument("--worker", action="append", required=True, metavar="URL",
                   help="a worker's base URL, e.g. http://127.0.0.1:8001 (repeat for each)")
    r.add_argument("--policy", choices=ROUTER_NAMES, default="hybrid", help="routing policy (default hybrid)")
    r.add_argument("--model", default="tiny", help="the workers' --model (its tokenizer is used to hash prompts)")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    r.add_argument("--port", type=port_number, default=8080,
                   help="port (default 8080; 0: a free one, printed at start); a taken port is an error at start")
    r.add_argument("--cost-model", default=None,
                   help="hybrid: a calibrated cost-model JSON or built-in name (default: flat 4000 prefill tokens/s)")
    add_hybrid_arguments(r, "hybrid")
    r.add_argument("--poll-interval", type=poll_seconds, default=0.2, help="seconds between event polls")
    r.add_argument("--health-every", type=positive_int, default=5, help="polls between /health checks")
    r.add_argument("--follow-wait", type=_follow_wait, default=2.0,
                   help="seconds of each long poll of a worker's events (they arrive as published); 0: periodic "
                        "polls only")
    r.add_argument("--max-tree-tokens", type=positive_int, default=None, metavar="N",
                   help="prefix, prefix-smg: tokens each worker's prefix tree keeps; past it the least recently used "
                        "leaves are evicted (default 4194304: 65,536 nodes at a 64-token prefix_match_unit)")
    add_store_cost_arguments(r, "hybrid: load bandwidth in GB/s of the store the workers share; 0: ignore the store",
                             "hybrid: microseconds per store object")
    r.add_argument("--purge-timeout", type=_purge_timeout, default=None, metavar="SECONDS",
                   help="seconds to wait for each worker's whole answer to a purge (POST /admin/cache/invalidate, "
                        "/flush_cache); a worker past it is reported as failed in the 502 and may still purge "
                        "(default 10; at least 0.1, at most 600)")
    add_auth_arguments(r, router=True)
    r.set_defaults(func=_router)


def _bounded(base, high: float, over: str, low: float | None = None, under: str = ""):
    """An argparse type: ``base(text)`` (its own checks and one-line errors first), refused above
    ``high`` or below ``low`` (``None``: no lower bound) with the one-line error ``over`` or ``under``
    (format strings of ``text``, as given, and ``x``, the value read)."""
    def check(text: str):
        x = base(text)
        if x > high:
            raise argparse.ArgumentTypeError(over.format(text=text, x=x))
        if low is not None and x < low:
            raise argparse.ArgumentTypeError(under.format(text=text, x=x))
        return x
    return check


_follow_wait = _bounded(non_negative_float, MAX_WAIT_S,
                        f"--follow-wait {{x}} exceeds a worker's longest long poll, {MAX_WAIT_S} s")
"""``--follow-wait``: seconds in [0, MAX_WAIT_S] (a worker refuses a longer long poll)."""

MAX_SNAPSHOT_READERS = 1024
"""The most ``--snapshot-readers`` (each held snapshot may copy the whole device index)."""

_snapshot_readers = _bounded(positive_int, MAX_SNAPSHOT_READERS,
                             f"{{x}} exceeds {MAX_SNAPSHOT_READERS} snapshots held at once")
"""``--snapshot-readers``: an integer in [1, MAX_SNAPSHOT_READERS]."""

MIN_PURGE_TIMEOUT_S = 0.1
"""The shortest ``--purge-timeout`` (seconds)."""
MAX_PURGE_TIMEOUT_S = 600.0
"""The longest ``--purge-timeout`` (seconds)."""

_purge_timeout = _bounded(finite_positive_float, MAX_PURGE_TIMEOUT_S,
                          f"{{text!r}} exceeds {MAX_PURGE_TIMEOUT_S:g} seconds", MIN_PURGE_TIMEOUT_S,
                          f"{{text!r}} is under {MIN_PURGE_TIMEOUT_S:g} s, too short for any worker to answer a purge")
"""``--purge-timeout``: seconds in [MIN_PURGE_TIMEOUT_S, MAX_PURGE_TIMEOUT_S] (a shorter wait fails
every purge before a worker could answer it)."""


def router_service(args):
    """The :class:`~hybridkv.serve.router.RouterService` of parsed ``router`` arguments.

    Raises:
        ValueError / CostModelError / FileNotFoundError: a bad model, cost model or worker list, or
            a hybrid option (``--own-waiting``, ``--waiting-weight``, ``--tie-kv-run``,
            ``--price-restore``) with a policy other than ``hybrid`` (named).
    """
    from hybridkv.engine.build import model_config
    from hybridkv.fleet.costmodel import cost_model
    from hybridkv.replay.timed import CPU_ESTIMATE
    from hybridkv.serve.router import DEFAULT_MAX_TREE_TOKENS, PURGE_TIMEOUT_S, RouterService, RouterSettings
    from hybridkv.serve.tokenizer import load_codec

    given = hybrid_flags_given(args)
    if given and args.policy != "hybrid":
        raise ValueError(f"{given[0]} is an option of the hybrid policy, not of {args.policy}")
    tree = getattr(args, "max_tree_tokens", None)
    if tree is not None and args.policy not in ("prefix", "prefix-smg"):
        raise ValueError(f"--max-tree-tokens {tree} is an option of the prefix and prefix-smg policies, not of "
                         f"{args.policy}")
    cost = cost_model(args.cost_model) if args.cost_model else CPU_ESTIMATE
    codec = load_codec(args.model, model_config(args.model).vocab_size)
    settings = RouterSettings(args.policy, cost, poll_interval_s=args.poll_interval, health_every=args.health_every,
                              follow_wait_s=getattr(args, "follow_wait", 2.0),
                              store_bytes_per_s=getattr(args, "store_gbps", MOONCAKE_LOAD_BYTES_PER_S / 1e9) * 1e9,
                              store_latency_s=getattr(args, "store_latency_us", MOONCAKE_GET_LATENCY_S * 1e6) * 1e-6,
                              hybrid=hybrid_options(args),
                              max_tree_tokens=getattr(args, "max_tree_tokens", None) or DEFAULT_MAX_TREE_TOKENS,
                              purge_timeout_s=getattr(args, "purge_timeout", None) or PURGE_TIMEOUT_S)
    settings = router_auth(settings, args)
    return RouterService(args.worker, codec, settings)


def router_auth(settings, args):
    """``settings`` with the keys of ``args`` (``--api-key``, ``--api-keys-file``, ``--admin-key``,
    ``--worker-key``; absent attributes: none).

    Raises:
        ValueError: a bad key or keys file (named; a key is never shown).
    """
    import dataclasses

    from hybridkv.serve.auth import keyring_from_options, worker_key_from_option

    keys = keyring_from_options(getattr(args, "api_key", None), getattr(args, "api_keys_file", None),
                                getattr(args, "admin_key", None))
    return dataclasses.replace(settings, keys=keys, worker_key=worker_key_from_option(getattr(args, "worker_key", None)))


def _router(args) -> int:
    from hybridkv.serve.launch import bind_listener, run_foreground
    from hybridkv.serve.router import create_router_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)     # not a line per event poll
    try:
        sock = bind_listener(args.host, args.port)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        service = router_service(args)
    except (ValueError, FileNotFoundError) as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    keys, rlog = service.settings.keys, logging.getLogger("hybridkv.serve.router")
    if keys is not None:                                   # what is open, in counts (never a key)
        (rlog.warning if keys.api_open or keys.admin_open else rlog.info)(
            "%s", keys.describe("purge or flush every worker's cache, or read /router/stats", "/health is"))        # the router has no /metrics
    server = run_foreground(create_router_app(service), sock, f"routing to {len(args.worker)} worker(s)",
                            lifespan="on", end_running=service.end_running)
    logging.getLogger("hybridkv.serve.router").info(
        "shut down cleanly%s: %d relayed answer(s) ended after the grace", f" on {server.stop_signal}"
        if server.stop_signal else "", server.ended)
    return 0


def _bench(args) -> int:
    from hybridkv.replay.trace import TraceError
    from hybridkv.serve.bench import BenchOptions, ProbeError, render, run_bench

    opts = BenchOptions(url=args.url, trace=args.trace, limit=args.limit, time_scale=args.time_scale,
                        max_seconds=args.max_seconds, block_tokens=args.block_tokens, max_tokens=args.max_tokens,
                        seed=args.seed, prompt_format=args.prompt_format, probe_timeout=args.probe_timeout,
                        api_key=args.api_key or os.environ.get("HYBRIDKV_API_KEY") or None)
    try:
        report = asyncio.run(run_bench(opts))
    except (ValueError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ProbeError as exc:
        print(f"error: --url {args.url}: cannot read the server's /v1/models: {exc}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json_path:
        try:
            with open(args.json_path, "w", encoding="utf-8") as f:
                json.dump(report.summary(), f, indent=2)
        except OSError as exc:
            print(f"error: --json {args.json_path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``serve`` or ``bench-serve`` alone (``python -m hybridkv.serve.commands``)."""
    parser = argparse.ArgumentParser(prog="hybridkv")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
