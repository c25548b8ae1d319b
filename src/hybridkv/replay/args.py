"""argparse value types shared by the ``hybridkv`` subcommands: each raises
``argparse.ArgumentTypeError`` naming the offending text."""

from __future__ import annotations

import argparse


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


def non_negative_float(text: str) -> float:
    """A number >= 0."""
    x = _float(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"{x} must be 0 or more")
    return x


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
