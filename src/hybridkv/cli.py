"""Command line: ``hybridkv replay`` (the main job), ``hybridkv store`` (a local Mooncake
store, docs/how-to/mooncake.md), ``hybridkv soak`` (randomized exactness checks, docs/how-to/soak.md),
``hybridkv serve``, ``hybridkv router`` and ``hybridkv bench-serve`` (the OpenAI-compatible server, its
router and its load generator, docs/how-to/serve.md), ``hybridkv cache purge``
(docs/how-to/purge-and-quotas.md), ``hybridkv calibrate`` (the CPU cost model of timed simulation,
docs/how-to/simulate-and-calibrate.md) and ``hybridkv trace synth`` / ``trace scale`` (synthetic and
scaled traces, docs/how-to/synthesise-traces.md). Every option: docs/reference/cli.md.

Exit status: 0 on success, 1 when every request was rejected (the reason is
printed), 130 when Ctrl-C stopped a replay (the figures so far are printed and
written), 2 on bad input (trace line, option, model, an unwritable ``--json``
path), with one ``error:`` line naming the offending value.
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from hybridkv import __version__
from hybridkv.cache.config import HOST_PROBATION
from hybridkv.replay.args import (
    add_hybrid_arguments,
    add_swa_recovery_argument,
    add_store_cost_arguments,
    block_tokens,
    checkpoint_policy,
    clock_seconds,
    finite_positive_float,
    fraction,
    hybrid_flags_given,
    hybrid_options,
    non_negative_int,
    max_num_seqs,
    page_tokens,
    pool_entries,
    positive_fraction,
    positive_int,
    restart_spec,
    seed_value,
    store_gib,
    thread_count,
    time_scale,
    unwritable,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from hybridkv.fleet.candidates import DEFAULT_ROUTE_CANDIDATES
    p = argparse.ArgumentParser(prog="hybridkv", description="Exact prefix cache for hybrid (MLA + KDA) LLMs.")
    p.add_argument("--version", action="version", version=f"hybridkv {__version__}",
                   help="print the installed version (hybridkv X.Y.Z) and exit")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replay", help="replay a Mooncake-format request trace through the engine",
                       description="Replay a trace (default: the bundled one-hour Kimi conversation trace) "
                                   "through the engine with the real model, or with --simulate a cost model.")
    r.add_argument("--trace", help="trace path (JSONL, Mooncake format); default: the bundled trace")
    r.add_argument("--limit", type=positive_int, default=None, help="first N requests (default 40; --simulate: all)")
    r.add_argument("--all", action="store_true", help="no limit: every request of the trace")
    r.add_argument("--model", default="small",
                   help="preset (tiny, small, kimi-linear-48b-a3b; DeepSeek-V4: v4-tiny, v4-small, deepseek-v4-flash with "
                        "--simulate) or a model "
                        "directory (Kimi Linear or deepseek_v4)")
    r.add_argument("--block-tokens", type=block_tokens, default=None,
                   help="tokens per trace hash id: 512 replays real lengths (the --simulate default); "
                        "smaller scales the trace down keeping its sharing (model runs default to 64; at most 65536)")
    r.add_argument("--block-size", type=page_tokens, default=None,
                   help="KV page size in tokens (default: --block-tokens rounded up to --prefix-match-unit)")
    r.add_argument("--prefix-match-unit", type=page_tokens, default=64, help="hash/lookup unit in tokens (default 64)")
    r.add_argument("--policy", type=checkpoint_policy, default=None,
                   help="checkpoint policy: terms branch, tail[=N], interval=N, hint, supersede joined by '+' "
                        "(default: branch+tail=B+interval=14B+supersede, B = --block-tokens)")
    r.add_argument("--mechanism", choices=("extract", "split"), default="extract",
                   help="how checkpoints are taken: extract (states at chunk boundaries inside one step) or "
                        "split (steps end at checkpoint boundaries); default extract")
    r.add_argument("--max-output-tokens", type=positive_int, default=None,
                   help="cap on generated tokens per request (default 4; --simulate --timed: the trace's lengths)")
    r.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                   help="scheduler budget of prompt and decode tokens per engine step (default 8192)")
    r.add_argument("--max-num-seqs", type=max_num_seqs, default=4,
                   help="requests running at once on an engine (default 4)")
    r.add_argument("--kv-pages", type=pool_entries, default=None, help="KV pool pages (default: no eviction)")
    r.add_argument("--checkpoint-slots", type=pool_entries, default=None,
                   help="checkpoint pool slots (default: enough that nothing is evicted)")
    r.add_argument("--eviction", choices=("lru", "value"), default="lru",
                   help="eviction order of the device pools: lru, or value "
                        "(p*C_saved/(M*T_residence), see hybridkv.store.eviction); default lru "
                        "(value measured no better at the frontier's target cell: docs/concepts/eviction.md, "
                        "'Which order to use')")
    r.add_argument("--host-eviction", choices=("lru", "value"), default=None,
                   help="eviction order of the host tier (it holds the device's victims); needs a host tier; "
                        "default lru, which measured better than value there (docs/concepts/eviction.md)")
    r.add_argument("--host-probation", type=fraction, default=None,
                   help="share of the host tier that speculative host-only checkpoints (--host-interval) may "
                        "hold while entries the device evicted need the room (2Q's A1in; needs a host tier; default "
                        f"{HOST_PROBATION}; docs/how-to/tiers.md)")
    r.add_argument("--host-protected-share", type=positive_fraction, default=None, metavar="SHARE",
                   help="share (0, 1] of the host tier kept for checkpoints loaded from it before (a segmented "
                        "LRU: the others go first while these hold at most SHARE, one pushed past it rejoins them as "
                        "their most recent); with --host-eviction lru and a host tier (not a --simulate --timed "
                        "fleet's); "
                        "default off (docs/results/memory.md measures 0.3)")
    r.add_argument("--checkpoint-probation", type=fraction, default=None, metavar="SHARE",
                   help="share 0..1 of the device checkpoint slots that the policy's interval checkpoints may "
                        "hold, until a request uses one, while branch and tail checkpoints need the room (2Q's "
                        "A1in; with --eviction lru; default off: one lru order; 0 is the setting measured in "
                        "docs/results/memory.md)")
    r.add_argument("--checkpoint-eviction", choices=("lru", "utility"), default=None,
                   help="utility: the device checkpoint pool evicts the checkpoint of least expected saving "
                        "(its hits, or its term's observed use share, times the tokens it saves over the "
                        "checkpoint below it; aged GreedyDual-style); not with --checkpoint-probation; default: "
                        "the pool follows --eviction, lru unless --eviction value (lru names that default, with "
                        "--eviction lru only) (docs/concepts/eviction.md)")
    r.add_argument("--verify", type=non_negative_int, default=0,
                   help="re-run N sampled requests without cache and compare logits")
    r.add_argument("--simulate", action="store_true", help="no tensors: cost model, whole trace by default")
    r.add_argument("--skip-bad", action="store_true", help="count and skip malformed trace lines")
    r.add_argument("--seed", type=seed_value, default=0, help="seed of weights and synthetic tokens (default 0)")
    r.add_argument("--threads", type=thread_count, default=1,
                   help="torch threads per engine process (default 1: several threads collapse on a busy machine)")
    r.add_argument("--store", default="none",
                   help="store URL: none, disk:///PATH (embedded), mooncake://127.0.0.1:50051, memory:// "
                        "(private to one engine: refused with --instances > 1) (default none; several instances "
                        "without one share a fresh disk store)")
    r.add_argument("--store-required", action="store_true",
                   help="exit with an error when the store does not answer at startup, instead of running without "
                        "it (a mooncake:// URL takes ?timeout_s=S for its setup deadline, default 5)")
    r.add_argument("--store-alignment", type=positive_int, default=None,
                   help="tokens; only these boundaries become store entries (default: --block-size)")
    r.add_argument("--host-mib", type=non_negative_int, default=None,
                   help="host tier capacity in MiB (write-back of evicted device entries; 0 = off; default 256, "
                        "0 for a DeepSeek-V4 model; "
                        "--simulate: byte accounting only)")
    add_swa_recovery_argument(r)
    r.add_argument("--host-write-through", action="store_true",
                   help="save every page-aligned entry into the host tier as it is computed, not only on eviction")
    r.add_argument("--host-groups", choices=("all", "kda"), default="all",
                   help="what the host tier holds: all (KV pages and checkpoints, default) or kda (checkpoints "
                        "only: for runs whose device KV is not short)")
    r.add_argument("--host-interval", type=non_negative_int, default=None,
                   help="tokens: also capture a checkpoint every N tokens of each prefill for the host tier only "
                        "(written through; not kept on the device); a multiple of --block-size; 0 = off; default "
                        "4 x --block-size with a host tier (docs/how-to/tiers.md)")
    r.add_argument("--instances", type=positive_int, default=1,
                   help="engine instances (own processes) sharing the store, requests dealt round-robin (default 1)")
    r.add_argument("--timed", action="store_true",
                   help="honour the trace's arrival times: a router places requests on --instances instances "
                        "in this process, each on a virtual clock; the report adds TTFT, queue and end-to-end "
                        "seconds and per-instance load")
    r.add_argument("--time-scale", type=time_scale, default=1.0,
                   help="--timed: multiply arrival times by this, 1e-6 to 1e6 (> 1 slows arrivals; default 1)")
    r.add_argument("--slo", type=slo_arg, default=None, metavar="KEY=SECONDS[,...]",
                   help="--timed: service-level targets the report's goodput counts against: ttft_, e2e_ or "
                        "queue_ with mean, p50, p90 or p99, e.g. ttft_p99=2.0,ttft_p50=0.5")
    from hybridkv.fleet.routers import ROUTER_NAMES
    r.add_argument("--router", choices=ROUTER_NAMES, default=None,
                   help="--timed: router (default hybrid with --instances > 1)")
    add_hybrid_arguments(r, "--timed, hybrid router")
    r.add_argument("--cost-model", default=None,
                   help="--timed: step cost model, a built-in name (h200-kimi-linear-48b, the --simulate "
                        "default; h200-deepseek-v4-flash, the default for a DeepSeek-V4 model) or a JSON file "
                        "from `hybridkv calibrate`; a real run's router prices prefill with it")
    add_store_cost_arguments(r, "--timed: store load bandwidth in GB/s of the simulated store (--simulate with "
                                "--instances > 1; 0: none) and of the router's estimate",
                             "--timed: microseconds per store object, likewise")
    r.add_argument("--step-clock", choices=("wall", "cpu"), default="wall",
                   help="--timed, real model: time each engine step by wall clock (default; includes other "
                        "processes on a shared machine) or by this process's CPU seconds (what the step would "
                        "take on a core of its own)")
    r.add_argument("--step-log", default=None,
                   help="--timed: write every instance's steps (start, seconds, prefill chunks, decoders; "
                        "shapes and times only) to this JSON file, for `hybridkv calibrate --from-steps`")
    r.add_argument("--store-gib", type=store_gib, default=None,
                   help="--timed --simulate: capacity of the simulated shared store in GiB, least recently "
                        "used evicted first (default 1024; 0: unlimited; at most 2^30)")
    r.add_argument("--restart", dest="restarts", type=restart_spec, action="append", default=[],
                   metavar="INSTANCE@SECONDS",
                   help="--timed: restart instance INSTANCE (0-based) with an empty cache at the first moment "
                        "it is idle at or after SECONDS on the fleet's clock; repeatable")
    r.add_argument("--crash", dest="crashes", type=restart_spec, action="append", default=[],
                   metavar="INSTANCE@SECONDS",
                   help="--timed: crash instance INSTANCE at SECONDS on the fleet's clock: its cache and the "
                        "requests it holds are lost, those requests are routed again (TTFT from their arrival), "
                        "and it is back with an empty cache after --cold-start; repeatable")
    r.add_argument("--route-candidates", type=non_negative_int, default=DEFAULT_ROUTE_CANDIDATES, metavar="K",
                   help="--timed: on a fleet of more than K instances the hybrid, least-load and kv-overlap routers "
                        "weigh the K lightest instances (half by their own load key, half by least-load's) plus "
                        "those the prompt's prefix was last sent to, not every instance (bounded cost a decision; "
                        f"least-load decides exactly as a full scan); 0: every instance (default {DEFAULT_ROUTE_CANDIDATES}, "
                        "so 32 instances or fewer are always scanned whole)")
    r.add_argument("--cold-start", dest="cold_start_s", type=clock_seconds, default=None, metavar="SECONDS",
                   help="--crash: seconds a crashed instance takes to be back (default 30, an assumption)")
    r.add_argument("--json", dest="json_path", help="write the JSON report here")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (the summary is still printed)")
    _register_cache_cli(sub)
    from hybridkv.store.mooncake.service import register_cli
    register_cli(sub)
    from hybridkv.replay.soak import register_cli as register_soak_cli
    register_soak_cli(sub)
    from hybridkv.serve.commands import register_cli as register_serve_cli
    register_serve_cli(sub)
    _add_calibrate(sub)
    from hybridkv.replay.plan_cmd import add_plan_parser
    add_plan_parser(sub)
    from hybridkv.replay.synth import register_cli as register_trace_cli
    register_trace_cli(sub)
    return p


def _leave_to_exit() -> None:
    """Let the process exit without collecting what a simulated replay left.

    The run's fleet (millions of index nodes, unit tables and views, held in cycles) is garbage
    once the report is written, and the interpreter's exit would collect it and free it one
    object at a time: about 1.1 CPU s after the whole trace at 32 instances (docs/results/replay.md,
    "Simulator speed"). ``gc.freeze`` moves every tracked object out of the
    collector's reach instead, and the operating system takes the memory back. Only for the
    command line's own process after a simulated replay: it has no files or connections left
    open in those objects (a simulation opens no store; the scratch store is removed before)
    and nothing runs after it; callers of :func:`main` with ``argv`` keep a normal collector.
    """
    import gc

    gc.freeze()


def slo_arg(text: str) -> dict[str, float]:
    """``--slo``: :func:`~hybridkv.fleet.operating.parse_slo`'s targets (seconds)."""
    from hybridkv.fleet.operating import parse_slo
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_calibrate(sub) -> None:
    from hybridkv.fleet.calibrate import cmd_calibrate
    c = sub.add_parser("calibrate", help="fit a step cost model to the real model on this machine",
                       description="Time the real model's prefill and decode steps and write the fitted "
                                   "cost model (JSON) that `replay --simulate --timed --cost-model` reads.")
    c.add_argument("--model", default="small", help="preset or model directory (default small)")
    c.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time each forward by wall clock (default) or by this process's CPU seconds")
    c.add_argument("--from-steps", default=None, metavar="STEP_LOG",
                   help="fit to the whole engine steps of a real timed replay's --step-log (what Engine.step "
                        "costs, cache bookkeeping and store tier included) instead of timing the forward alone")
    c.add_argument("--out", required=True, help="JSON file to write")
    c.add_argument("--repeats", type=positive_int, default=3, help="timed runs per shape (median; default 3)")
    c.add_argument("--threads", type=thread_count, default=1, help="torch threads (default 1, like replay)")
    c.add_argument("--seed", type=seed_value, default=0, help="seed of the preset weights (default 0)")
    c.set_defaults(calibrate_func=cmd_calibrate)


def _no_host_tier(args: argparse.Namespace) -> str | None:
    """Why a ``replay`` builds no host tier (the reason, for an error message), or ``None`` when it builds one.

    None is built with ``--host-mib 0``, with a DeepSeek-V4 model whose ``--host-mib`` is not given
    (its default is 0), or by a ``--simulate --timed`` fleet (its instances have no host tier).
    """
    from hybridkv.engine.build import is_v4
    if args.host_mib == 0:
        return "--host-mib is 0"
    if args.host_mib is None and is_v4(args.model):
        return "--host-mib is 0 for a DeepSeek-V4 model unless given"
    if args.simulate and args.timed:
        return "a simulated timed fleet builds none"
    return None


def _command_parser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    """The sub-command parser ``name`` of ``parser`` (``parser`` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hybridkv`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = _command_parser(parser, args.command)   # its errors name the command and print its usage
    if args.command == "replay":                   # the host tier's own options, given without one
        missing = _no_host_tier(args)
        if missing and args.host_write_through:
            command.error(f"--host-write-through needs a host tier: {missing}")
        for flag, value in (("--host-interval", args.host_interval or None),
                            ("--host-groups", None if args.host_groups == "all" else args.host_groups),
                            ("--host-protected-share", args.host_protected_share),
                            ("--host-eviction", args.host_eviction), ("--host-probation", args.host_probation)):
            if missing and value is not None:
                command.error(f"{flag} {value:g} needs a host tier: {missing}" if isinstance(value, float)
                              else f"{flag} {value} needs a host tier: {missing}")
        if args.host_protected_share is not None and args.host_eviction not in (None, "lru"):
            command.error(f"--host-protected-share {args.host_protected_share:g} works with --host-eviction lru, "
                          f"not {args.host_eviction}")
        args.host_eviction = args.host_eviction or "lru"                  # the defaults, resolved
        args.host_probation = HOST_PROBATION if args.host_probation is None else args.host_probation
    if args.command == "replay" and not args.timed:
        for flag, value in (("--router", args.router), *(f.split(" ", 1) for f in hybrid_flags_given(args)),
                            ("--cost-model", args.cost_model),
                            ("--time-scale", None if args.time_scale == 1.0 else args.time_scale),
                            ("--step-log", args.step_log),
                            ("--step-clock", None if args.step_clock == "wall" else args.step_clock),
                            ("--store-gib", args.store_gib), ("--restart", args.restarts or None),
                            ("--slo", None if args.slo is None else ",".join(f"{k}={v:g}" for k, v in args.slo.items())),
                            ("--crash", args.crashes or None), ("--cold-start", args.cold_start_s)):
            if value is not None:
                shown = " ".join(f"{j}@{at:g}" for j, at in value) if isinstance(value, list) else value
                command.error(f"{flag} {shown} needs --timed (untimed replays deal requests round-robin)")
    if args.command == "replay" and hybrid_flags_given(args):
        router = args.router or ("hybrid" if args.instances > 1 else "round-robin")    # the replay's default
        if router != "hybrid":
            how = "" if args.router else f" (the default with --instances {args.instances})"
            command.error(f"{hybrid_flags_given(args)[0]} is an option of the hybrid router, not of {router}{how}")
    if args.command == "replay" and args.cold_start_s is not None and not args.crashes:
        command.error(f"--cold-start {args.cold_start_s:g} needs --crash (it is how long a crashed instance is down)")
    if args.command == "replay" and args.checkpoint_probation is not None and args.eviction != "lru":
        command.error(f"--checkpoint-probation {args.checkpoint_probation:g} works with --eviction lru, "
                      f"not {args.eviction}")
    if args.command == "replay" and args.checkpoint_eviction == "lru":     # the default, named
        if args.eviction != "lru":
            command.error(f"--checkpoint-eviction lru with --eviction {args.eviction}: the checkpoint pool "
                          f"follows --eviction unless --checkpoint-eviction utility; leave it out")
        args.checkpoint_eviction = None
    if args.command == "replay" and args.checkpoint_eviction and args.checkpoint_probation is not None:
        command.error(f"--checkpoint-eviction {args.checkpoint_eviction} and --checkpoint-probation "
                      f"{args.checkpoint_probation:g} exclude each other")
    if args.command == "replay" and args.verify and args.simulate:
        command.error(f"--verify {args.verify} needs the real model: --simulate has no logits to compare")
    console = Console(stderr=True)
    for flag, path in _output_paths(args):         # checked before a run, not after it (its results kept)
        problem = unwritable(path)
        if problem:
            console.print(f"[red]error:[/red] {flag} {path}: {problem}", markup=True, highlight=False, soft_wrap=True)
            return 2
    clash = _output_clash(args)
    if clash:
        console.print(f"[red]error:[/red] {clash}", markup=True, highlight=False, soft_wrap=True)
        return 2
    if args.command in ("replay", "serve") and args.store.startswith("mooncake://"):
        from hybridkv.store.url import check_store_url
        try:                                       # before a log file or a re-exec: a bad URL is one line
            check_store_url(args.store)
        except ValueError as exc:
            console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
            return 2
        _native_log_to_file(console)
        if argv is None:
            from hybridkv.store.mooncake.loopback import reexec_under_loopback
            reexec_under_loopback([sys.executable, "-m", "hybridkv.cli", *sys.argv[1:]])
    if args.command == "replay":
        code = _replay(args, console)
        if argv is None and args.simulate:       # the command line's process: it exits next
            _leave_to_exit()
        return code
    if args.command == "store":
        return args.store_func(args)
    if args.command == "soak":
        return args.soak_func(args)
    if args.command == "cache":
        return _cache_purge(args, console)
    if args.command in ("serve", "bench-serve", "router"):
        return args.func(args)
    if args.command == "calibrate":
        return args.calibrate_func(args)
    if args.command == "plan":
        return args.plan_func(args)
    if args.command == "trace":
        return args.trace_func(args)
    return 2


NAMESPACE_BYTES = 32
"""Bytes of a namespace digest (``CacheIdentity.digest()``): what ``cache purge --namespace`` takes."""


_BYTE_IDENTITY = ("hybridkv-byte-v1", "hybridkv-chat-v1")
"""``(tokenizer_version, chat_template_version)`` of the byte tokenizer ``hybridkv serve`` runs with by
default (:class:`hybridkv.serve.tokenizer.ByteTokenizer`; a test checks they agree): part of every
namespace a server gives its requests, so of the one ``cache purge --tenant`` must name."""


def _register_cache_cli(sub) -> None:
    c = sub.add_parser("cache", help="maintain a cache store").add_subparsers(dest="cache_command", required=True)
    p = c.add_parser("purge", help="remove entries from a store by tenant, namespace, model version or age",
                     description="Remove cache entries (manifest first, then components) from a store. Criteria "
                                 "combine with AND. A running engine's device and host tiers are purged through "
                                 "hybridkv.tiers.purge.purge in that process, not by this command.")
    p.add_argument("--store", required=True, help="store URL (disk:///PATH, mooncake://HOST:PORT, memory://)")
    p.add_argument("--model", help="model repo / preset name the entries were made with")
    p.add_argument("--weight-digest", help="weight digest of the model version to purge (with --model): 64 hex digits, "
                        "`weight_digest` in a server's /server_info")
    p.add_argument("--tenant", action="append", default=[],
                   help="tenant whose entries to purge: the namespace hybridkv serve gives its requests without "
                        "a cache salt, CacheIdentity(model_repo=--model, weight_digest=--weight-digest, "
                        "tokenizer_version=--tokenizer-version, chat_template_version=--chat-template-version, "
                        "tenant=T); repeatable")
    p.add_argument("--tokenizer-version", default=_BYTE_IDENTITY[0],
                   help="with --tenant: the server's tokenizer identity (GET /v1/cache/info, identity."
                        f"tokenizer_version; default {_BYTE_IDENTITY[0]}, the byte tokenizer's)")
    p.add_argument("--chat-template-version", default=_BYTE_IDENTITY[1],
                   help="with --tenant: the server's chat template identity (GET /v1/cache/info, identity."
                        f"chat_template_version; default {_BYTE_IDENTITY[1]})")
    p.add_argument("--namespace", action="append", default=[], help="request namespace digest (hex); repeatable")
    p.add_argument("--older-than", type=finite_positive_float, help="seconds: entries created longer ago than this")
    p.add_argument("--abi-version", type=int, metavar="N",
                   help="remove every object of the older cache ABI vN (1 to 4: keys hkvN/...), which no current "
                        "reader reaches; alone, or for v3 and v4 with --model and --weight-digest "
                        "(docs/reference/cache-abi.md)")


def _cache_purge(args, console: Console) -> int:
    import os
    import time
    import urllib.parse

    from hybridkv.cache.namespace import CacheIdentity
    from hybridkv.cache.purge import PurgeSelector
    from hybridkv.store.base import StoreUnavailable
    from hybridkv.store.url import open_store
    from hybridkv.tiers.purge import purge_store_detail

    def fail(msg: str) -> int:
        console.print(f"[red]error:[/red] {msg}", markup=True, highlight=False)
        return 2

    if bool(args.model) != bool(args.weight_digest):
        return fail("--model and --weight-digest go together (they name one model version)")
    if args.tenant and not args.model:
        return fail("--tenant needs --model and --weight-digest (a tenant's namespace includes them)")
    if args.weight_digest is not None and not _is_sha256_hex(args.weight_digest):
        return fail(f"--weight-digest {args.weight_digest!r} is not a weight digest (64 hex digits, the "
                    "model's weight_digest(); a server shows it in /server_info)")
    if not (args.namespace or args.tenant or args.model or args.older_than or args.abi_version is not None):
        return fail("say what to purge: --tenant or --namespace (owners), --model with --weight-digest "
                    "(a model version), --older-than SECONDS (age), or several of them; or --abi-version N "
                    "(objects of an older cache ABI)")
    owners = set()
    for text in args.namespace:
        try:
            digest = bytes.fromhex(text)
        except ValueError:
            return fail(f"--namespace {text!r} is not a hex digest")
        if len(digest) != NAMESPACE_BYTES:       # a truncated digest selects nothing: refuse, not "removed 0"
            return fail(f"--namespace {text!r} is {len(digest)} bytes; a namespace digest is "
                        f"{NAMESPACE_BYTES} bytes ({2 * NAMESPACE_BYTES} hex digits)")
        owners.add(digest)
    owners |= {CacheIdentity(model_repo=args.model, weight_digest=args.weight_digest,
                             tokenizer_version=args.tokenizer_version,
                             chat_template_version=args.chat_template_version, tenant=t).digest()
               for t in args.tenant}
    # the model namespace is every store key's second segment; a tenant's entries lie under it too,
    # so it narrows --namespace owners given with --tenant as well (before: dropped with --tenant)
    models = {CacheIdentity(model_repo=args.model, weight_digest=args.weight_digest).digest()} \
        if args.model else None
    cutoff = time.time() - args.older_than if args.older_than else None
    parsed = urllib.parse.urlsplit(args.store)
    if parsed.scheme == "memory":             # a new empty store of this process: nothing could be purged
        return fail(f"--store {args.store}: memory:// is a new empty store in this process; nothing to purge")
    if parsed.scheme == "disk" and not parsed.netloc and parsed.path and not os.path.isdir(parsed.path):
        # opening would create an empty store there and report "removed 0" (a mistyped path)
        return fail(f"--store {args.store}: no disk store at {parsed.path} (not a directory)")
    try:
        selector = PurgeSelector(owners=owners or None, models=models, created_before=cutoff,
                                 abi_version=args.abi_version)
        store = open_store(args.store)
    except (ValueError, StoreUnavailable) as exc:
        return fail(str(exc))
    if store is None:
        return fail("--store none has nothing to purge")
    try:
        got = purge_store_detail(store, selector)
    except (StoreUnavailable, RuntimeError, ValueError) as exc:
        return fail(str(exc))
    finally:
        store.close()
    of_abi = f" of cache ABI v{args.abi_version}" if args.abi_version is not None else ""
    print(f"removed {got.removed} entries{of_abi}")
    if got.hidden_before is not None:       # a store that cannot list keys: an expiry horizon
        print(f"entries created before {got.hidden_before:.3f} (Unix seconds) are expired for every reader "
              "from now on and removed when read (this store cannot list its keys)")
    return 0


def _replay(args, console: Console) -> int:
    from hybridkv.cache.config import ConfigError
    from hybridkv.fleet.costmodel import CostModelError
    from hybridkv.replay.report import render_summary
    from hybridkv.replay.runner import ReplayOptions, run_replay
    from hybridkv.replay.timed import DEFAULT_COLD_START_S
    from hybridkv.replay.trace import TraceError

    limit = args.limit if args.limit is not None else (None if args.simulate else 40)
    from hybridkv.engine.build import is_v4
    from hybridkv.replay.args import check_swa_period
    from hybridkv.replay.runner import check_v4_replay
    host_mib = args.host_mib if args.host_mib is not None else (0 if is_v4(args.model) else 256)
    try:                                       # the model-family rules, before anything is loaded
        check_v4_replay(args.model, args.swa_recovery, args.simulate, host_mib << 20, args.timed)
        check_swa_period(args.swa_recovery, args.prefix_match_unit)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return 2
    if args.all:
        if args.limit is not None:
            console.print(f"[red]error:[/red] --all and --limit {args.limit} contradict each other; give one",
                          markup=True, highlight=False)
            return 2
        limit = None
    opts = ReplayOptions(
        trace=args.trace, limit=limit, model=args.model, block_tokens=args.block_tokens,
        block_size=args.block_size, prefix_match_unit=args.prefix_match_unit, policy=args.policy,
        mechanism=args.mechanism, max_output_tokens=args.max_output_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        num_kv_pages=args.kv_pages, num_checkpoint_slots=args.checkpoint_slots, verify=args.verify,
        simulate=args.simulate, skip_bad=args.skip_bad, seed=args.seed, progress=not args.no_progress,
        instances=args.instances, store=args.store, store_alignment=args.store_alignment,
        host_bytes=host_mib << 20, host_write_through=args.host_write_through, threads=args.threads,
        swa_recovery=args.swa_recovery,
        host_groups=("full", "kda") if args.host_groups == "all" else ("kda",),
        host_interval=args.host_interval,
        eviction=args.eviction, host_eviction=args.host_eviction, host_probation=args.host_probation,
        host_protected_share=args.host_protected_share,
        checkpoint_probation=args.checkpoint_probation, checkpoint_eviction=args.checkpoint_eviction,
        timed=args.timed, time_scale=args.time_scale, router=args.router,
        hybrid=hybrid_options(args),
        cost_model=args.cost_model, store_gbps=args.store_gbps, store_latency_s=args.store_latency_us * 1e-6,
        step_log=args.step_log, step_clock=args.step_clock,
        store_gib=args.store_gib, restarts=tuple(args.restarts), crashes=tuple(args.crashes),
        cold_start_s=DEFAULT_COLD_START_S if args.cold_start_s is None else args.cold_start_s, slo=args.slo,
        defaulted_limit=args.limit is None and not args.all, route_candidates=args.route_candidates)
    if args.store_required and args.store != "none":
        problem = _store_unavailable(args.store)
        if problem:
            console.print(f"[red]error:[/red] --store-required: {problem}", markup=True, highlight=False)
            return 2
    if args.simulate and args.store != "none":
        console.print(f"[red]error:[/red] --store {args.store}: a simulated replay has no tensors to store; its "
                      "fleet models a shared store instead (--timed --instances N, --store-gib, --store-gbps)",
                      markup=True, highlight=False)
        return 2
    try:
        report = run_replay(opts, console)
    except (TraceError, ConfigError, CostModelError, ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return 2
    except KeyboardInterrupt:                  # before the engines ran (loading) or after (merging)
        console.print("interrupted: no report", markup=False, highlight=False)
        return 130
    render_summary(report, Console())
    _faults_not_done(args, report, console)
    if args.json_path:
        try:
            report.write_json(args.json_path)
        except OSError as exc:
            console.print(f"[red]error:[/red] --json {args.json_path}: {exc.strerror or exc}", markup=True,
                          highlight=False)
            return 2
    rejected = report.rejected["requests"] if report.rejected else 0
    if report.interrupted:
        console.print(f"interrupted: the report covers the {report.requests} requests admitted before Ctrl-C"
                      + (f" and {rejected} refused" if rejected else "")
                      + (f" (written to {args.json_path})" if args.json_path else ""), markup=False, highlight=False)
        return 130
    if rejected:
        kind = max(report.rejected["reasons"].items(), key=lambda kv: kv[1])[0]
        reason = report.rejected.get("examples", {}).get(kind, kind)
        if not report.requests:
            console.print(f"[red]error:[/red] every request ({rejected}) was rejected: {reason}",
                          markup=True, highlight=False)
            return 1
        console.print(f"[yellow]warning:[/yellow] {rejected} of {rejected + report.requests} requests were "
                      f"rejected and count in no figure; the largest {reason}", markup=True, highlight=False)
    return 0


def _is_sha256_hex(text: str) -> bool:
    """Whether ``text`` is 64 hex digits (a sha256 digest written out)."""
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def _faults_not_done(args, report, console: Console) -> None:
    """Warn (stderr) of each ``--crash`` / ``--restart`` asked for that did not happen, with the
    reason: the instance was down then (a crash while it is down from an earlier one does
    nothing), or the fleet had no work left by then (the report lists only those done)."""
    for flag, asked, done in (("--crash", args.crashes, report.crashes), ("--restart", args.restarts, report.restarts)):
        left = [tuple(a) for a in asked or ()]
        for d in done or ():
            if (d["instance"], d["requested"]) in left:
                left.remove((d["instance"], d["requested"]))
        for j, at in left:
            down = [c for c in report.crashes or () if c["instance"] == j and c["at"] <= at <= c["back_at"]]
            why = (f"instance {j} was down then (crashed at {down[0]['at']:g} s, back at {down[0]['back_at']:g} s)"
                   if down else f"the fleet's work ended at {report.makespan_seconds:g} s")
            console.print(f"[yellow]warning:[/yellow] {flag} {j}@{at:g} not done: {why}", markup=True, highlight=False)


def _store_unavailable(url: str) -> str | None:
    """Why the store at ``url`` cannot be used now (opened and closed again), or ``None``: unreachable,
    a malformed URL (``ValueError``), a path or log file that cannot be opened (``OSError``), or
    Mooncake not installed (``ImportError``)."""
    from hybridkv.store.base import StoreUnavailable
    from hybridkv.store.url import open_store

    try:
        open_store(url).close()
    except StoreUnavailable as exc:
        return f"store {url} unreachable: {exc}"
    except (ValueError, OSError, ImportError) as exc:
        return f"store {url}: {exc}"
    return None


def _native_log_to_file(console: Console) -> None:
    """Send Mooncake's own log to a file unless ``HYBRIDKV_MOONCAKE_LOG`` says otherwise (empty:
    leave it on stderr), and say where once. Processes started from here inherit the choice."""
    import os
    import tempfile

    from hybridkv.store.mooncake.support import NATIVE_LOG_ENV

    if NATIVE_LOG_ENV in os.environ:
        return
    import atexit

    path = os.path.join(tempfile.gettempdir(), f"hybridkv-mooncake-{os.getpid()}.log")
    os.environ[NATIVE_LOG_ENV] = path
    atexit.register(_drop_if_empty, path)       # the usual case: Mooncake had nothing to say
    console.print(f"Mooncake's own log: {path} (set {NATIVE_LOG_ENV}= to keep it on stderr)",
                  markup=False, highlight=False, soft_wrap=True)


def _drop_if_empty(path: str) -> None:
    """Remove the file at ``path`` if it exists and is empty (a log nothing was written to)."""
    import os

    try:
        if os.path.getsize(path) == 0:
            os.unlink(path)
    except OSError:
        pass


def _output_paths(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(option, path)`` of each file the command will write after its run: checked before it."""
    options = {"replay": (("--json", "json_path"), ("--step-log", "step_log")), "calibrate": (("--out", "out"),),
               "bench-serve": (("--json", "json_path"),)}.get(args.command, ())     # soak: in cmd_soak
    return [(flag, getattr(args, name)) for flag, name in options if getattr(args, name, None)]


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (the same real path, or one inode)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:                      # one of them does not exist yet
        return False


def _output_clash(args: argparse.Namespace) -> str | None:
    """An output file that is also an input file or another output of the command (``replay --json``
    onto its ``--trace`` replaced the trace with the report; ``--json`` and ``--step-log`` onto one
    file kept only the last written), as an error naming both options; else ``None``."""
    inputs = {"replay": (("--trace", "trace"), ("--cost-model", "cost_model")),
              "calibrate": (("--from-steps", "from_steps"),),
              "bench-serve": (("--trace", "trace"),)}.get(args.command, ())
    seen = [(flag, path) for flag, name in inputs if (path := getattr(args, name, None))]
    for flag, path in _output_paths(args):
        for other_flag, other in seen:
            if _same_file(path, other):
                return (f"{flag} {path} is the same file as {other_flag} {other}: writing one would overwrite "
                        "the other; choose another path")
        seen.append((flag, path))
    return None


if __name__ == "__main__":
    sys.exit(main())
