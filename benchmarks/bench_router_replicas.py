"""Two `hybridkv router` replicas in front of the same two workers (one shared disk store), each
driven by its own `hybridkv bench-serve`; one replica is killed (SIGKILL) mid-run. Reports what
each replica's client saw: requests sent, completed, errors and TTFT percentiles.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_router_replicas.py --limit 100 --time-scale 2 \
        --kill-after 20 --json benchmarks/results/router_replicas.json

Every process binds 127.0.0.1 on a free port and is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
START_BOUND_S = 180


def start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``hybridkv CMD --port 0`` in the background; its process and the URL its start line names."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", *cmd, "--port", "0"], env=ENV,
                                stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + START_BOUND_S
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " on http://127.0.0.1:" in line and "Ctrl-C stops it" in line:
                return proc, line.split(" on ")[1].split()[0]
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{cmd[0]} did not start; see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def router_command(args: argparse.Namespace, workers: list[str]) -> list[str]:
    """``hybridkv router`` (without ``--port``) in front of ``workers`` with ``args.policy`` and the
    options of ``args.router_args`` (split as a shell would).

    Raises:
        ValueError: ``args.router_args`` does not split (an unclosed quote).
    """
    return ["router", "--model", "tiny", "--policy", args.policy, *shlex.split(args.router_args),
            *[f"--worker={u}" for u in workers]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=100, help="trace requests each bench-serve sends")
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--kill-after", type=float, default=20.0,
                    help="seconds into the run the first router dies (SIGKILL); 0: neither dies (the baseline)")
    ap.add_argument("--policy", default="hybrid")
    ap.add_argument("--router-args", default="",
                    help="more options of both routers, e.g. the hybrid policy's previous settings: "
                         "--router-args='--own-waiting 1 --waiting-weight 1 --tie-kv-run off'")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args()
    try:
        shlex.split(args.router_args)
    except ValueError as e:
        ap.error(f"--router-args {args.router_args!r}: {e}")

    work = Path(tempfile.mkdtemp(prefix="hkv-replicas-"))
    store = f"disk://{work / 'store'}"
    procs: list[subprocess.Popen] = []
    try:
        workers = []
        for i in range(2):
            p, url = start(["serve", "--model", "tiny", "--threads", "1", "--store", store], work / f"w{i}.log")
            procs.append(p)
            workers.append(url)
        routers = []
        for i in range(2):
            p, url = start(router_command(args, workers), work / f"r{i}.log")
            procs.append(p)
            routers.append((p, url))
        for _p, url in routers:
            for _ in range(600):
                if httpx.get(f"{url}/health", timeout=10).json().get("workers_in_rotation") == 2:
                    break
                time.sleep(0.1)
        benches = []
        for i, (_p, url) in enumerate(routers):
            out = work / f"bench{i}.json"
            benches.append((subprocess.Popen(
                [sys.executable, "-m", "hybridkv.cli", "bench-serve", "--url", url, "--limit", str(args.limit),
                 "--time-scale", str(args.time_scale), "--seed", str(i), "--max-seconds", "600", "--json", str(out)],
                env=ENV, stdout=subprocess.DEVNULL, stderr=open(work / f"bench{i}.log", "w")), out))
        began = time.monotonic()
        before_kill, killed_at = None, None
        if args.kill_after > 0:
            time.sleep(args.kill_after)
            before_kill = {"router0": httpx.get(f"{routers[0][1]}/router/stats", timeout=10).json(),
                           "worker_loads": [httpx.get(f"{u}/get_load", timeout=10).json()[0] for u in workers]}
            doomed = routers[0][0]
            doomed.send_signal(signal.SIGKILL)
            doomed.wait()
            killed_at = round(time.monotonic() - began, 1)
        for b, _out in benches:
            b.wait(timeout=900)
        summary = {"limit": args.limit, "time_scale": args.time_scale, "policy": args.policy,
                   "router_args": args.router_args,
                   "killed_router_after_s": killed_at, "load_average": os.getloadavg()}
        for i, (b, out) in enumerate(benches):
            summary[f"router{i}"] = json.loads(out.read_text()) if out.exists() else {"exit": b.returncode}
        summary["killed_router_in_flight_at_kill"] = (sum(w["in_flight"] for w in before_kill["router0"]["workers"])
                                                      if before_kill else None)
        summary["before_kill"] = before_kill
        summary["survivor_stats"] = httpx.get(f"{routers[1][1]}/router/stats", timeout=10).json()
        print(json.dumps({k: v for k, v in summary.items() if k != "survivor_stats"}, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
    finally:
        for p in reversed(procs):
            stop(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
