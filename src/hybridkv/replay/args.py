"""argparse value types shared by the ``hybridkv`` subcommands: each raises
``argparse.ArgumentTypeError`` naming the offending text (argparse adds the option's name).

The one validation layer of command-line options: every number is typed and range-checked here,
before any run starts, so that no value reaches a run that would overflow, allocate without bound
or be silently changed there; and :func:`unwritable` checks an output path before a run, so that a
run's results are never lost to a path that cannot be written after it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def positive_int(text: str) -> int:
    """An integer > 0."""
    n = _int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{n} must be positive")
    return n


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} must be 0 or more")
    return n


def port_number(text: str) -> int:
    """A TCP port in [0, 65535] (0: let the system pick a free one)."""
    n = _int(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a TCP port (0-65535)")
    return n


def positive_float(text: str) -> float:
    """A number > 0 (seconds and the like)."""
    x = _float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{x} must be positive")
    return x


def finite_positive_float(text: str) -> float:
    """A finite number > 0 (``inf`` would make a cutoff that selects nothing)."""
    x = positive_float(text)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{text!r} ({x}) must be finite")
    return x


def non_negative_float(text: str) -> float:
    """A number >= 0."""
    x = _float(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"{x} must be 0 or more")
    return x


def fraction(text: str) -> float:
    """A number in [0, 1] (a share of a capacity, or a weight)."""
    x = _float(text)
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in [0, 1]")
    return x + 0.0                                  # -0 reads as 0


def positive_fraction(text: str) -> float:
    """A number in (0, 1] (a share of a capacity that must hold something)."""
    x = _float(text)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in (0, 1]")
    return x


TIME_SCALE_RANGE = (1e-6, 1e6)
"""Bounds of ``--time-scale``: scaled arrival times of any trace with finite timestamps stay finite,
and a one-hour trace spans between 3.6 ms and 114 years of the fleet's clock."""

MAX_CLOCK_SECONDS = 1e9
"""Latest time in seconds (about 31.7 years) on the fleet's clock that ``--crash``, ``--restart``
and ``--cold-start`` accept: the clock's step arithmetic stays finite well past it."""

MAX_STORE_GIB = float(2**30)
"""Largest ``--store-gib`` (1 EiB in GiB): its byte count stays a representable integer."""

MAX_STORE_LATENCY_US = 1e9
"""Largest ``--store-latency-us`` (1,000 s per object)."""

MAX_STORE_GBPS = 1e6
"""Largest ``--store-gbps`` (1 PB/s)."""

MAX_BLOCK_TOKENS = 1 << 16
"""Largest ``--block-tokens``: tokens one trace hash id stands for. The Mooncake traces use 512; at
65,536 the bundled trace's longest prompt is already about 16 million tokens (124 MiB of token ids),
and above it a prompt's synthetic token ids alone run to gigabytes."""

MAX_POOL_ENTRIES = 1 << 24
"""Largest ``--kv-pages`` / ``--checkpoint-slots``: a pool keeps a few Python lists of this length
(about 0.6 GB for both pools at the bound); a real model's pools are further bounded by memory
when the run is built (:func:`hybridkv.engine.build.check_pool_memory`)."""

SEED_RANGE = (0, 2**63 - 1)
"""Bounds of ``--seed``: what torch, numpy and the 8-byte signed seed of synthetic tokens all accept."""


def number_range(low: float, high: float, why: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (``-0`` reads as 0). ``why`` ends the
    error message (what the bounds protect)."""
    def check(text: str) -> float:
        x = _float(text)
        if not low <= x <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be a number in [{_show(low)}, {_show(high)}]{why}")
        return x + 0.0
    check.__name__ = f"number in [{_show(low)}, {_show(high)}]"
    return check


def _show(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 1e16 else f"{x:g}"


time_scale = number_range(*TIME_SCALE_RANGE, " (scaled arrival times must stay finite and representable)")
"""``--time-scale``: a factor in :data:`TIME_SCALE_RANGE`."""

clock_seconds = number_range(0.0, MAX_CLOCK_SECONDS, " seconds on the fleet's clock")
"""Seconds (``--cold-start``) in ``[0, MAX_CLOCK_SECONDS]``."""

store_gib = number_range(0.0, MAX_STORE_GIB, " GiB (0: unlimited)")
"""``--store-gib``: GiB in ``[0, MAX_STORE_GIB]``."""

poll_seconds = number_range(1e-3, 3600.0, " seconds between polls")
"""``router --poll-interval``: seconds in [1 ms, 1 hour] (``inf`` would never poll the workers)."""


def block_tokens(text: str) -> int:
    """``--block-tokens``: an integer in ``[1, MAX_BLOCK_TOKENS]``."""
    n = positive_int(text)
    if n > MAX_BLOCK_TOKENS:
        raise argparse.ArgumentTypeError(
            f"{n} is more than {MAX_BLOCK_TOKENS} tokens per trace hash id (the traces use 512; a larger "
            "value makes prompts of gigabytes)")
    return n


def _positive_at_most(text: str, high: int, what: str) -> int:
    """An integer in ``[1, high]``; above it, an error saying ``is more than {high} {what}``."""
    n = positive_int(text)
    if n > high:
        raise argparse.ArgumentTypeError(f"{n} is more than {high} {what}")
    return n


def page_tokens(text: str) -> int:
    """``--block-size`` / ``--prefix-match-unit``: tokens in ``[1, MAX_BLOCK_TOKENS]`` (a page of
    more tokens than a trace hash id stands for has no use and makes one page gigabytes)."""
    return _positive_at_most(text, MAX_BLOCK_TOKENS, "tokens")


def pool_entries(text: str) -> int:
    """``--kv-pages`` / ``--checkpoint-slots``: an integer in ``[1, MAX_POOL_ENTRIES]``."""
    return _positive_at_most(text, MAX_POOL_ENTRIES, "entries in a pool")


MAX_THREADS = 1024
"""Largest ``--threads`` (torch threads of one process): 4,096 crashed the OpenMP runtime (a
segmentation fault) on the 2-core test machine, and a value beyond the int64 range overflowed."""


def thread_count(text: str) -> int:
    """``--threads``: an integer in ``[1, MAX_THREADS]``."""
    return _positive_at_most(text, MAX_THREADS, "torch threads")


MAX_NUM_SEQS = 1 << 16
"""Largest ``--max-num-seqs``: requests running at once on one engine (each holds pool entries)."""


def max_num_seqs(text: str) -> int:
    """``--max-num-seqs``: an integer in ``[1, MAX_NUM_SEQS]``."""
    return _positive_at_most(text, MAX_NUM_SEQS, "requests running at once on an engine")


def seed_value(text: str) -> int:
    """``--seed``: an integer in :data:`SEED_RANGE`."""
    n = _int(text)
    low, high = SEED_RANGE
    if not low <= n <= high:
        raise argparse.ArgumentTypeError(f"{text} is outside [{low}, 2**63 - 1], the seeds torch and numpy accept")
    return n


def checkpoint_policy(text: str) -> str:
    """``--policy``: checkpoint policy text that :meth:`~hybridkv.cache.config.CheckpointPolicy.parse`
    accepts, returned as given (its default may depend on other options)."""
    from hybridkv.cache.config import CheckpointPolicy, ConfigError

    try:
        CheckpointPolicy.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def unwritable(path: str) -> str | None:
    """Why an output file could not be written at ``path``, or ``None``: tried before a run (the
    file is opened for appending and, if it did not exist, removed again), so that a run's results
    are not lost to a path found bad after it. A missing directory is a problem, not created."""
    p = Path(path)
    existed = p.exists()
    if not p.parent.is_dir():                  # not created: a mistyped directory is an error
        return f"no directory {p.parent}"
    if p.is_dir():
        return "is a directory"
    try:
        with open(p, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        p.unlink(missing_ok=True)
    return None


def _float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if math.isnan(x):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    return x


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def swa_recovery_arg(text: str) -> str:
    """``window``, ``periodic=P`` (``P`` a positive integer, tokens) or ``recompute``
    (``--swa-recovery``); returned as written, normalised (:class:`~hybridkv.cache.swa.SwaRecovery`)."""
    from hybridkv.cache.config import ConfigError
    from hybridkv.cache.swa import SwaRecovery
    try:
        return str(SwaRecovery.parse(text))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_swa_period(value: str | None, prefix_match_unit: int) -> None:
    """Refuse ``--swa-recovery periodic=P`` whose ``P`` is not a multiple of ``--prefix-match-unit``
    (states are saved at unit boundaries only), naming both options and their values, before
    anything is built (the engine's own check names the config fields).

    Raises:
        ValueError: ``P % prefix_match_unit != 0``.
    """
    from hybridkv.cache.swa import SwaRecovery
    recovery = SwaRecovery.parse(value)
    p = recovery.period
    if p is not None and p % prefix_match_unit:
        near = max(prefix_match_unit, p // prefix_match_unit * prefix_match_unit)
        raise ValueError(f"--swa-recovery {value}: P={p} tokens must be a multiple of --prefix-match-unit "
                         f"{prefix_match_unit} (sliding-window states are saved at unit boundaries), "
                         f"e.g. --swa-recovery periodic={near}")


SWA_RECOVERY_HELP = ("DeepSeek-V4 models: how a cache hit restores the sliding-window state: window (the state "
                     "saved at the hit, placed by --policy; default), periodic=P (saved every P tokens, a "
                     "multiple of --prefix-match-unit; the hit recomputes from the nearest one) or recompute "
                     "(nothing saved; the hit recomputes the window's dependency cone)")
"""Help text of ``--swa-recovery``, shared by every command that takes it."""


def add_swa_recovery_argument(parser: argparse.ArgumentParser, extra: str = "") -> None:
    """Add ``--swa-recovery`` (:func:`swa_recovery_arg`, default ``None``) to ``parser``, its help
    :data:`SWA_RECOVERY_HELP` followed by ``extra`` (a command's own note, may be empty)."""
    parser.add_argument("--swa-recovery", type=swa_recovery_arg, default=None, metavar="window|periodic=P|recompute",
                        help=SWA_RECOVERY_HELP + (f"; {extra}" if extra else ""))


def restart_spec(text: str) -> tuple[int, float]:
    """``INSTANCE@SECONDS`` (``--restart``): a 0-based instance index and a time on the fleet's
    clock in seconds (after ``--time-scale``), e.g. ``3@120.5``."""
    index, sep, seconds = text.partition("@")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not INSTANCE@SECONDS (e.g. 3@120.5)")
    try:
        j = int(index)
    except ValueError:
        raise argparse.ArgumentTypeError(f"instance {index!r} in {text!r} is not an integer") from None
    if j < 0:
        raise argparse.ArgumentTypeError(f"instance {j} in {text!r} must be 0 or more")
    try:
        t = float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds {seconds!r} in {text!r} is not a number") from None
    if not 0 <= t <= MAX_CLOCK_SECONDS:
        raise argparse.ArgumentTypeError(
            f"seconds {seconds!r} in {text!r} must be a number in [0, {_show(MAX_CLOCK_SECONDS)}] (the fleet's clock)")
    return j, t + 0.0


def add_store_cost_arguments(parser: argparse.ArgumentParser, gbps_help: str, latency_help: str) -> None:
    """``--store-gbps`` (GB/s) and ``--store-latency-us`` (microseconds per object) with the
    Mooncake figures measured in docs/results/store.md as defaults
    (:data:`~hybridkv.fleet.store.MOONCAKE_LOAD_BYTES_PER_S`, ``MOONCAKE_GET_LATENCY_S``);
    ``*_help`` says what each prices in the command at hand (the default is appended)."""
    from hybridkv.fleet.store import MOONCAKE_GET_LATENCY_S, MOONCAKE_LOAD_BYTES_PER_S
    gbps, us = MOONCAKE_LOAD_BYTES_PER_S / 1e9, MOONCAKE_GET_LATENCY_S * 1e6
    parser.add_argument("--store-gbps", type=number_range(0.0, MAX_STORE_GBPS, " GB/s"), default=gbps,
                        help=f"{gbps_help} (default {gbps:g}, Mooncake measured)")
    parser.add_argument("--store-latency-us", type=number_range(0.0, MAX_STORE_LATENCY_US, " microseconds"),
                        default=us,
                        help=f"{latency_help} (default {us:g}, Mooncake measured)")


MAX_WAITING_WEIGHT = 1000.0
"""Largest ``--waiting-weight``: past it the work term swamps every wait (seconds stay finite)."""

HYBRID_FLAGS = (("--own-waiting", "own_waiting"), ("--waiting-weight", "waiting_weight"),
                ("--tie-kv-run", "tie_kv_run"), ("--price-restore", "price_restore"))
"""The ``hybrid`` router's command-line options and the :class:`~hybridkv.fleet.routers.HybridOptions`
field each sets."""


def add_hybrid_arguments(parser: argparse.ArgumentParser, scope: str) -> None:
    """The ``hybrid`` router's options (:data:`HYBRID_FLAGS`), each defaulting to ``None`` (the
    :class:`~hybridkv.fleet.routers.HybridOptions` default, stated in the help); ``scope`` starts
    each help text (where the option applies, e.g. ``"--timed, hybrid router"``)."""
    from hybridkv.fleet.routers import HybridOptions

    d = HybridOptions()
    on = {True: "on", False: "off"}
    parser.add_argument("--own-waiting", type=fraction, default=None, metavar="A",
                        help=f"{scope}: share 0..1 of an instance's own waiting count in the count that weighs its "
                             f"work, the rest the mean over live instances (default {d.own_waiting:g}; "
                             "docs/concepts/routing.md)")
    parser.add_argument("--waiting-weight", type=number_range(0.0, MAX_WAITING_WEIGHT), default=None, metavar="K",
                        help=f"{scope}: each waiting request counts K times in the weight 1 + K*n on the work a "
                             f"placement adds: the requests delayed until the queue drains, not only those waiting "
                             f"now (default {d.waiting_weight:g}; 0..{_show(MAX_WAITING_WEIGHT)})")
    parser.add_argument("--tie-kv-run", choices=("on", "off"), default=None,
                        help=f"{scope}: among instances tied on cost, one with a free sequence slot and the "
                             f"deepest KV run beyond every tied joint hit wins (its next request at that branch "
                             f"hits a checkpoint there); off: the least loaded (default {on[d.tie_kv_run]})")
    parser.add_argument("--price-restore", choices=("on", "off"), default=None,
                        help=f"{scope}: a hit whose state restarts below it is worth the prefill it saves less "
                             f"the recompute that restores the state (DeepSeek-V4 periodic and recompute); off: "
                             f"the prefill saved alone (default {on[d.price_restore]})")


def hybrid_flags_given(args: argparse.Namespace) -> list[str]:
    """``"FLAG VALUE"`` of each :data:`HYBRID_FLAGS` option given on the command line (in order)."""
    out = []
    for flag, name in HYBRID_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            out.append(f"{flag} {v:g}" if isinstance(v, float) else f"{flag} {v}")
    return out


def hybrid_options(args: argparse.Namespace):
    """The :class:`~hybridkv.fleet.routers.HybridOptions` of parsed :func:`add_hybrid_arguments`
    options: the defaults, with each option given set (``on`` / ``off`` as ``True`` / ``False``)."""
    from hybridkv.fleet.routers import HybridOptions

    given = {}
    for _, name in HYBRID_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            given[name] = v == "on" if isinstance(v, str) else v
    return HybridOptions(**given)
