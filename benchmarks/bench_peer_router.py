"""``hybridkv router`` against a peer router, ``sglang-router``, in front of the same workers.

Issue 10 item 6. For each router configuration this script starts fresh ``hybridkv serve``
workers on 127.0.0.1 (``--threads 1``, one shared disk store, a fresh store directory per
configuration), starts the router in front of them, replays the first ``--limit`` requests of
the bundled trace through it with ``hybridkv bench-serve``'s code (:func:`run_bench`, text
prompts: ``sglang-router`` 0.3.2 refuses token-id prompts), reads every worker's
``/metrics`` for the requests it finished, and stops every process it started by its PID.

Configurations: ``hybridkv-hybrid`` and ``hybridkv-round-robin`` (``hybridkv router --policy``),
``sglang-cache_aware`` and ``sglang-round_robin`` (``python -m sglang_router.launch_router
--policy``, defaults otherwise). The ``sglang-*`` ones are skipped, with a note in the output,
when ``--sglang-python`` cannot import ``sglang_router`` (install it in a throwaway venv:
``python3.11 -m venv /tmp/sgr && /tmp/sgr/bin/pip install sglang-router``).

Run by hand (not part of the test suite; minutes of CPU)::

    PYTHONPATH=src python benchmarks/bench_peer_router.py --limit 150 --time-scale 1 \\
        --json benchmarks/results/peer_router.json

Reports per configuration: requests sent / completed, errors, TTFT p50 / p99 (ms, at the client
through the router), prompt and cached tokens, requests finished per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hybridkv.serve.bench import BenchOptions, run_bench

CONFIGS = {
    "hybridkv-hybrid": ("hybridkv", "hybrid"),
    "hybridkv-round-robin": ("hybridkv", "round-robin"),
    "sglang-cache_aware": ("sglang", "cache_aware"),
    "sglang-round_robin": ("sglang", "round_robin"),
}
FINISHED = "hybridkv_e2e_request_latency_seconds_count"


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": "src"})


def _stop(p: subprocess.Popen) -> None:
    """Stop one process this script started, by its PID: SIGTERM, then SIGKILL after 10 s."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _wait(check, what: str, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process exited early ({p.args[:4]}..., rc {p.returncode})")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s")


def _finished(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(FINISHED))))


def sglang_available(python: str) -> bool:
    """Whether ``python`` imports ``sglang_router``."""
    try:
        return subprocess.run([python, "-c", "import sglang_router"], capture_output=True, timeout=60,
                              check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def hybridkv_router_command(args, policy: str, port: int, urls: list[str]) -> list[str]:
    """``hybridkv router`` on ``port`` in front of ``urls`` with routing ``policy``; with policy
    ``hybrid``, the options of ``args.hybrid_args`` too (split as a shell would).

    Raises:
        ValueError: ``args.hybrid_args`` does not split (an unclosed quote).
    """
    extra = shlex.split(args.hybrid_args) if policy == "hybrid" else []
    return [sys.executable, "-m", "hybridkv.cli", "router", "--model", args.model, "--port", str(port),
            "--policy", policy, *extra] + [a for u in urls for a in ("--worker", u)]


def run_config(name: str, args, root: Path) -> dict:
    """Workers, router, replay, figures; every process stopped before returning."""
    kind, policy = CONFIGS[name]
    ports = [args.base_port + i for i in range(args.workers)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    store = root / f"store-{name}"
    store.mkdir()
    procs: list[subprocess.Popen] = []
    try:
        workers = [_start([sys.executable, "-m", "hybridkv.cli", "serve", "--model", args.model, "--port", str(p),
                           "--threads", "1", "--store", f"disk://{store}"], root / f"{name}-worker{p}.log")
                   for p in ports]
        procs += workers
        _wait(lambda: all(httpx.get(f"{u}/health", timeout=5).status_code == 200 for u in urls), "workers", 300, procs)
        rport = args.base_port + 50
        if kind == "hybridkv":
            cmd = hybridkv_router_command(args, policy, rport, urls)
            def ready() -> bool:
                return httpx.get(f"http://127.0.0.1:{rport}/health", timeout=5).json().get(
                    "workers_in_rotation") == len(urls)
        else:
            cmd = [args.sglang_python, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy",
                   policy, "--port", str(rport), "--prometheus-port", str(rport + 1), "--log-level", "warn"]
            def ready() -> bool:
                return httpx.get(f"http://127.0.0.1:{rport}/workers", timeout=5).text.count(
                    '"is_healthy":true') == len(urls)
        router = _start(cmd, root / f"{name}-router.log")
        procs.append(router)
        _wait(ready, f"{name} router", 120, procs)
        before = [_finished(u) for u in urls]
        report = asyncio.run(run_bench(BenchOptions(url=f"http://127.0.0.1:{rport}", limit=args.limit,
                                                    time_scale=args.time_scale, max_seconds=args.max_seconds,
                                                    max_tokens=args.max_tokens, prompt_format="text")))
        per_worker = [_finished(u) - b for u, b in zip(urls, before, strict=True)]
        out = {"config": name, **report.summary(), "requests_per_worker": per_worker}
        if kind == "hybridkv":
            stats = httpx.get(f"http://127.0.0.1:{rport}/router/stats", timeout=10).json()
            out["router"] = {"predicted_hit_tokens": sum(w["predicted_hit_tokens_routed"] for w in stats["workers"]),
                             "predicted_store_hit_tokens": sum(w["predicted_store_hit_tokens_routed"]
                                                               for w in stats["workers"]),
                             "stores": stats["stores"]}
        return out
    finally:
        for p in reversed(procs):
            _stop(p)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--limit", type=int, default=150, help="first N bundled-trace requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="factor on the trace's timestamps")
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--base-port", type=int, default=18300)
    p.add_argument("--hybrid-args", default="",
                   help="more options of the hybridkv-hybrid router, e.g. the hybrid policy's previous settings: "
                        "--hybrid-args='--own-waiting 1 --waiting-weight 1 --tie-kv-run off'")
    p.add_argument("--sglang-python", default="/tmp/sgr/bin/python", help="a python that imports sglang_router")
    p.add_argument("--json", dest="json_path", help="write the results here")
    p.add_argument("--logs", default=None, help="keep the workers' and routers' logs and stores in this "
                                                "directory (default: a temporary one, removed)")
    args = p.parse_args()
    try:
        shlex.split(args.hybrid_args)
    except ValueError as e:
        p.error(f"--hybrid-args {args.hybrid_args!r}: {e}")
    configs = list(args.configs)
    if any(CONFIGS[c][0] == "sglang" for c in configs) and not sglang_available(args.sglang_python):
        print(f"sglang-router is not importable by {args.sglang_python}: skipping the sglang configurations")
        configs = [c for c in configs if CONFIGS[c][0] != "sglang"]
    results = []
    with tempfile.TemporaryDirectory(prefix="peer-router-") as tmp:
        root = Path(args.logs) if args.logs else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in configs:
            r = run_config(name, args, root)
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"limit": args.limit, "time_scale": args.time_scale,
                                                    "model": args.model, "workers": args.workers,
                                                    "hybrid_args": args.hybrid_args, "results": results},
                                                   indent=2) + "\n")
    print(f"{'config':24} {'sent':>5} {'done':>5} {'errors':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'cached':>8} {'prompt':>8}  per worker")
    for r in results:
        p50, p99 = (_ms(r[k]) for k in ("ttft_p50_ms", "ttft_p99_ms"))
        print(f"{r['config']:24} {r['sent']:>5} {r['completed']:>5} {sum(r['errors'].values()):>8} "
              f"{p50:>9} {p99:>9} {r['cached_tokens']:>8} {r['prompt_tokens']:>8}  "
              f"{' / '.join(map(str, r['requests_per_worker']))}")


if __name__ == "__main__":
    main()
