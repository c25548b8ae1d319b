"""argparse value types shared by the ``hybridkv`` subcommands: each raises
``argparse.ArgumentTypeError`` naming the offending text."""

from __future__ import annotations

import argparse
import math


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


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


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
    if not (t >= 0 and math.isfinite(t)):
        raise argparse.ArgumentTypeError(f"seconds {seconds!r} in {text!r} must be a finite number >= 0")
    return j, t


def add_store_cost_arguments(parser: argparse.ArgumentParser, gbps_help: str, latency_help: str) -> None:
    """``--store-gbps`` (GB/s) and ``--store-latency-us`` (microseconds per object) with the
    Mooncake figures measured in docs/benchmarks.md as defaults
    (:data:`~hybridkv.fleet.store.MOONCAKE_LOAD_BYTES_PER_S`, ``MOONCAKE_GET_LATENCY_S``);
    ``*_help`` says what each prices in the command at hand (the default is appended)."""
    from hybridkv.fleet.store import MOONCAKE_GET_LATENCY_S, MOONCAKE_LOAD_BYTES_PER_S
    gbps, us = MOONCAKE_LOAD_BYTES_PER_S / 1e9, MOONCAKE_GET_LATENCY_S * 1e6
    parser.add_argument("--store-gbps", type=non_negative_float, default=gbps,
                        help=f"{gbps_help} (default {gbps:g}, Mooncake measured)")
    parser.add_argument("--store-latency-us", type=non_negative_float, default=us,
                        help=f"{latency_help} (default {us:g}, Mooncake measured)")
