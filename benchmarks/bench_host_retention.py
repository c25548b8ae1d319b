"""The checkpoint frontier with host tier options the replay command line does not set, simulate mode.

Run by hand (not part of the test suite)::

    python benchmarks/bench_host_retention.py --retention inclusive --trace tenants.jsonl \\
        --cells 0.01:0.05 0.02:0.1 --json inclusive.json
    python benchmarks/bench_host_retention.py --retention exclusive --host-probation 0 --protected-share 0.5 ...

Every argument but the three below is ``benchmarks/bench_frontier.py``'s, and the runs are its runs
(the same :func:`bench_frontier.main`); only each :class:`~hybridkv.tiers.host.HostTier` the
replays build gets these keyword arguments:

* ``--retention inclusive|demote|exclusive``: ``HostTier(retention=...)`` (default: the tier's
  default, ``DEFAULT_HOST_RETENTION``);
* ``--host-probation F``: ``probation_share`` (default: the replay's ``--host-probation``);
* ``--protected-share F``: ``protected_share`` (default: none).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from hybridkv.tiers import host as _host


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1]")
    return v


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--retention", choices=_host.HOST_RETENTION, default=None)
    p.add_argument("--host-probation", type=_fraction, default=None)
    p.add_argument("--protected-share", type=_fraction, default=None)
    ours, rest = p.parse_known_args(argv)
    given = {k: v for k, v in (("retention", ours.retention), ("probation_share", ours.host_probation),
                               ("protected_share", ours.protected_share)) if v is not None}
    original = _host.HostTier.__init__

    def init(self, *args, **kwargs):
        kwargs.update(given)
        original(self, *args, **kwargs)

    spec = importlib.util.spec_from_file_location("bench_frontier", Path(__file__).resolve().parent / "bench_frontier.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _host.HostTier.__init__ = init
    sys.argv = [sys.argv[0], *rest]
    try:
        bench.main()
    finally:
        _host.HostTier.__init__ = original


if __name__ == "__main__":
    main()
