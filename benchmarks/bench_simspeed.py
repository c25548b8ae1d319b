"""Simulator speed (issue 9 item 4): requests simulated per second on the bundled trace.

Runs ``hybridkv replay`` in a child process per case, one case at a time, and records each
run's replay wall time (the report's ``wall_seconds``: trace load to report, interpreter and
imports excluded), the child's CPU seconds (user + system, from ``getrusage``; less
sensitive than wall time to other work on a shared machine), its peak RSS, the load
average before and after, and the figures that must not change with speed work (oracle
fraction, reused tokens, evictions, TTFT percentiles). Cases:

* ``timed32``: ``--simulate --timed --instances 32 --router hybrid --model kimi-linear-48b-a3b``
  (the issue's target: the whole trace in <= 3 minutes, >= 2,000 requests/s);
* ``untimed``: ``--simulate`` (one engine, no clock).

Each run also records the replay's own CPU seconds (``time.process_time`` around
``run_replay`` in the child: trace load to report, start-up and imports excluded).

Run by hand:  PYTHONPATH=src .venv/bin/python benchmarks/bench_simspeed.py [--limit N] [--cases timed32,untimed]
    [--out benchmarks/results/simspeed.json] [--replay-args='--checkpoint-probation 0']
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "timed32": ["--simulate", "--timed", "--instances", "32", "--router", "hybrid", "--model", "kimi-linear-48b-a3b"],
    "untimed": ["--simulate"],
}
KEPT = ("requests", "reused_tokens", "oracle_reused_tokens", "oracle_fraction", "evictions", "ttft_seconds",
        "load_skew")


# the child: ``hybridkv`` with run_replay timed in CPU seconds of the process (time.process_time:
# trace load to report, like the report's wall_seconds), written to the file named first
_CHILD = """
import sys, time
import hybridkv.replay.runner as runner
from hybridkv.cli import main
cpu_file, inner = sys.argv[1], runner.run_replay
def timed(*a, **k):
    t0 = time.process_time()
    try:
        return inner(*a, **k)
    finally:
        open(cpu_file, "w").write(repr(time.process_time() - t0))
runner.run_replay = timed
sys.argv = ["hybridkv"] + sys.argv[2:]
main()
"""


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_case(name: str, limit: int | None, extra: list[str] | None = None) -> dict:
    """One replay in a child process; its speed and its unchanged-by-speed figures (``extra``:
    more ``hybridkv replay`` arguments, after the case's own)."""
    extra = list(extra or [])
    with tempfile.TemporaryDirectory(prefix="hybridkv-simspeed-") as tmp:
        out = Path(tmp) / "report.json"
        cpu_file = Path(tmp) / "replay_cpu"
        cmd = [sys.executable, "-c", _CHILD, str(cpu_file), "replay", *CASES[name], *extra,
               "--no-progress", "--json", str(out)] + (["--limit", str(limit)] if limit else [])
        load_before = os.getloadavg()
        cpu0, t0 = _children_cpu(), time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        process_wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
        rep = json.loads(out.read_text())
        replay_cpu = float(cpu_file.read_text())
    n, wall = rep["requests"], rep["wall_seconds"]
    return {"case": name, "args": CASES[name] + extra, "limit": limit, "requests": n,
            "replay_wall_seconds": wall, "requests_per_second": round(n / wall, 1),
            "process_wall_seconds": round(process_wall, 2), "process_cpu_seconds": round(cpu, 2),
            "requests_per_cpu_second": round(n / cpu, 1),
            "replay_cpu_seconds": round(replay_cpu, 2), "requests_per_replay_cpu_second": round(n / replay_cpu, 1),
            "largest_child_rss_bytes_so_far": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "figures": {k: rep.get(k) for k in KEPT}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="first N requests (default: the whole trace)")
    ap.add_argument("--cases", default="timed32,untimed", help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/simspeed.json"))
    ap.add_argument("--commit", default=None,
                    help="commit of the code measured (default: this checkout's HEAD; set it when PYTHONPATH "
                         "points at another tree)")
    ap.add_argument("--replay-args", default="",
                    help="more hybridkv replay arguments for every case, one shell-quoted string "
                         "(e.g. --replay-args='--checkpoint-probation 0')")
    args = ap.parse_args()
    try:
        extra = shlex.split(args.replay_args)
    except ValueError as e:
        ap.error(f"--replay-args {args.replay_args!r}: {e}")
    names = [c for c in args.cases.split(",") if c]
    for c in names:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {sorted(CASES)}")
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, check=False,
                                           text=True).stdout.strip()
    runs = []
    for c in names:
        r = run_case(c, args.limit, extra)
        print(f"{c}: {r['requests']} requests, replay {r['replay_wall_seconds']:.1f} s "
              f"({r['requests_per_second']:.0f}/s), replay CPU {r['replay_cpu_seconds']:.1f} s "
              f"({r['requests_per_replay_cpu_second']:.0f}/CPU s), process CPU {r['process_cpu_seconds']:.1f} s "
              f"({r['requests_per_cpu_second']:.0f}/CPU s), load {r['load_average_before'][0]:.1f}", flush=True)
        runs.append(r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"commit": commit, "cpus": os.cpu_count(), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
