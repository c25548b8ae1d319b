"""Guard of the simulator speed work (issue 9 item 4): the report JSON of a set of simulated
replays must not change with speed work.

Runs each guard case (``hybridkv replay --simulate ...``, :data:`CASES`: four routers, eviction pressure under
``lru`` and ``value``, a crash and a restart, an eviction-pressure hybrid run and runs whose simulated store evicts) with the package found
under ``--src`` (default this checkout's ``src``), writes each report to ``--out/<case>.json``
with the keys that depend on the machine removed (``wall_seconds``, rates computed from it,
the scratch store path), and with ``--against DIR`` compares every case field for field with
the reports of an earlier run, printing each difference. Exit status 1 when any differs.

Run by hand:
    PYTHONPATH=src .venv/bin/python benchmarks/guard_simspeed.py --out /tmp/guard_before [--src OTHER/src]
    PYTHONPATH=src .venv/bin/python benchmarks/guard_simspeed.py --out /tmp/guard_after --against /tmp/guard_before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

K48 = ["--model", "kimi-linear-48b-a3b"]
PRESSURE = ["--kv-pages", "3000", "--checkpoint-slots", "300"]
CASES = {
    "t32_hybrid": ["--timed", "--instances", "32", "--router", "hybrid", *K48, "--limit", "2000"],
    "t32_leastload": ["--timed", "--instances", "32", "--router", "least-load", *K48, "--limit", "2000"],
    "t8_prefix": ["--timed", "--instances", "8", "--router", "prefix", "--limit", "1500"],
    "t8_hybrid_small": ["--timed", "--instances", "8", "--router", "hybrid", "--limit", "2000"],
    "untimed": ["--limit", "2000"],
    # 32 pools of 3,000 pages never fill with 2,000 requests (pool sizes are per instance): no
    # eviction here, kept for the earlier rounds' comparisons; t32_hybrid_evicting evicts
    "t32_hybrid_pressure": ["--timed", "--instances", "32", "--router", "hybrid", *K48, "--limit", "2000",
                            *PRESSURE],
    "t32_hybrid_evicting": ["--timed", "--instances", "32", "--router", "hybrid", *K48, "--limit", "2000",
                            "--kv-pages", "300", "--checkpoint-slots", "30"],
    "t8_kvoverlap_value": ["--timed", "--instances", "8", "--router", "kv-overlap", "--limit", "2000", *PRESSURE,
                           "--eviction", "value"],
    "untimed_pressure_lru": ["--limit", "2000", *PRESSURE],
    "untimed_pressure_value": ["--limit", "2000", *PRESSURE, "--eviction", "value"],
    "t32_hybrid_store64": ["--timed", "--instances", "32", "--router", "hybrid", *K48, "--limit", "2000",
                           "--store-gib", "64"],
    "t32_leastload_store128": ["--timed", "--instances", "32", "--router", "least-load", *K48, "--limit", "2000",
                               "--store-gib", "128"],
    "t8_hybrid_crash": ["--timed", "--instances", "8", "--router", "hybrid", *K48, "--limit", "1500",
                        "--time-scale", "0.5", "--crash", "0@100", "--restart", "3@200"],
}
DROPPED = {"wall_seconds", "cpu_seconds", "requests_per_second", "requests_per_cpu_second", "store_path", "scratch_store"}
"""Keys removed before comparing (machine-dependent)."""


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if k not in DROPPED}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, str) and "hybridkv-" in x and "/tmp" in x:
        return "<scratch path>"
    return x


def run_case(name: str, src: Path, out: Path) -> Path:
    """One guard case with the package under ``src``; its cleaned report at ``out/name.json``."""
    with tempfile.TemporaryDirectory(prefix="hybridkv-guard-") as tmp:
        rep = Path(tmp) / "r.json"
        env = dict(os.environ, PYTHONPATH=str(src))
        cmd = [sys.executable, "-m", "hybridkv.cli", "replay", "--simulate", *CASES[name], "--no-progress",
               "--json", str(rep)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env, cwd=tmp)
        data = _clean(json.loads(rep.read_text()))
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def diff(a, b, where: str = "") -> list[str]:
    """Every path at which ``a`` and ``b`` differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{where}/{k}: only in {'after' if k in b else 'before'}")
            else:
                out += diff(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def count_fields(x) -> int:
    if isinstance(x, dict):
        return sum(count_fields(v) for v in x.values())
    if isinstance(x, list):
        return sum(count_fields(v) for v in x) if x else 1
    return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--against", type=Path, default=None, help="directory of an earlier run's reports")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    names = [c for c in args.cases.split(",") if c]
    for c in names:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {sorted(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as ex:
        paths = list(ex.map(lambda c: run_case(c, args.src.resolve(), args.out), names))
    bad = 0
    for c, p in zip(names, paths):
        after = json.loads(p.read_text())
        if args.against is None:
            print(f"{c}: {count_fields(after)} fields")
            continue
        before = json.loads((args.against / f"{c}.json").read_text())
        d = diff(before, after)
        print(f"{c}: {count_fields(after)} fields, {'identical' if not d else f'{len(d)} DIFFER'}")
        for line in d[:20]:
            print("   ", line)
        bad += bool(d)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
