"""Is the simulator honest? A real timed replay and the simulation of the same requests (issue 9, item 5).

Phases, each a ``hybridkv`` command in its own process (printed, so any can be rerun):

1. calibrate (``--calibrate``):
   ``steps`` (default): a real timed replay of a *different* slice of the trace
   (``--calibration-slice``, default requests 40-79) with the same settings, recording every
   engine step (``--step-log``), then ``hybridkv calibrate --from-steps``: the cost model is
   fitted to whole ``Engine.step()`` times (cache bookkeeping, publishing and the store
   tier's write-through included), measured immediately before the real run under the
   same machine conditions;
   ``forward``: ``hybridkv calibrate`` (the model's forward alone);
   ``none``: use ``--cost-model``.
2. the real timed replay of the first ``--limit`` requests with ``--verify``;
3. the simulation (``--simulate --timed``) of the same requests and settings with that cost
   model and the shared store modelled at the disk store's measured load bandwidth
   (``benchmarks/results/store_small.json``).

Real steps are timed by this process's CPU seconds by default (``--clock cpu``): the machine
is shared, and wall time would time the other processes too; ``--clock wall`` times them by
wall clock. ``os.getloadavg()`` is recorded before and after every phase. Prints a table
(TTFT mean / p50 / p90, busy seconds per instance, reused tokens, steps: real, sim, ratio),
checks mean and p90 TTFT against ``--tolerance``, compares every real step with the cost
model's price of the same shape (also with a ``--forward-model`` when given), and writes
everything to ``--out`` (JSON).

Run by hand:
    PYTHONPATH=src .venv/bin/python benchmarks/bench_sim_truth.py [--limit 40] [--time-scale 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.fleet.steplog import compare_steps, read_step_log, summarize_steps
from hybridkv.replay.trace import _bundled_path

ROOT = Path(__file__).resolve().parent.parent
STORE_RESULTS = ROOT / "benchmarks" / "results" / "store_small.json"


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages (``os.getloadavg``), rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def run(cmd: list[str], phases: list[dict], name: str) -> None:
    """Run one ``hybridkv`` command, recording load averages and wall seconds in ``phases``.

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    print(f"\n[{name}] {shlex.join(cmd)}", flush=True)
    before, t0 = loadavg(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "hybridkv.cli", *cmd], check=True, cwd=ROOT)
    phases.append({"phase": name, "command": "hybridkv " + shlex.join(cmd), "loadavg_before": before,
                   "loadavg_after": loadavg(), "wall_seconds": round(time.perf_counter() - t0, 1)})
    print(f"[{name}] load average {before} -> {phases[-1]['loadavg_after']}, "
          f"{phases[-1]['wall_seconds']} s", flush=True)


def slice_trace(trace: Path, lo: int, hi: int, out: Path) -> None:
    """Write requests ``[lo, hi)`` of ``trace`` (non-empty lines) to ``out``, timestamps moved to start at 0."""
    rows = [json.loads(line) for line in trace.read_text(encoding="utf-8").splitlines() if line.strip()][lo:hi]
    if not rows:
        raise ValueError(f"calibration slice {lo}:{hi} is empty in {trace}")
    t0 = rows[0]["timestamp"]
    out.write_text("".join(json.dumps({**r, "timestamp": r["timestamp"] - t0}) + "\n" for r in rows),
                   encoding="utf-8")


def figures(report: dict) -> dict:
    """The compared figures of a replay's JSON report."""
    inst = report["instances"]
    return {"ttft_mean": report["ttft_seconds"]["mean"], "ttft_p50": report["ttft_seconds"]["p50"],
            "ttft_p90": report["ttft_seconds"]["p90"], "queue_mean": report["queue_seconds"]["mean"],
            "busy": [i["busy_seconds"] for i in inst], "reused": [i["reused_tokens"] for i in inst],
            "requests": [i["requests"] for i in inst], "makespan": report["makespan_seconds"]}


def table(real: dict, sim: dict, real_steps: dict, sim_steps: dict) -> tuple[str, list[dict]]:
    """Markdown table real vs sim with ratios (sim / real), and its rows."""
    rows = [("TTFT mean (s)", real["ttft_mean"], sim["ttft_mean"]),
            ("TTFT p50 (s)", real["ttft_p50"], sim["ttft_p50"]),
            ("TTFT p90 (s)", real["ttft_p90"], sim["ttft_p90"]),
            ("queue mean (s)", real["queue_mean"], sim["queue_mean"])]
    rows += [(f"busy s, instance {k}", b, sim["busy"][k]) for k, b in enumerate(real["busy"])]
    rows += [(f"reused tokens, instance {k}", u, sim["reused"][k]) for k, u in enumerate(real["reused"])]
    rows += [(f"requests, instance {k}", u, sim["requests"][k]) for k, u in enumerate(real["requests"])]
    rows += [("engine steps", real_steps["steps"], sim_steps["steps"]),
             ("prefill tokens computed", real_steps["prefill_tokens"], sim_steps["prefill_tokens"]),
             ("mixed prefill+decode steps", real_steps["mixed_steps"], sim_steps["mixed_steps"])]
    out = ["| figure | real | sim | sim / real |", "|---|---|---|---|"]
    data = []
    for name, r, s in rows:
        ratio = s / r if r else None
        data.append({"figure": name, "real": r, "sim": s, "ratio": None if ratio is None else round(ratio, 3)})
        fmt = (lambda v: f"{v:.3f}") if isinstance(r, float) else (lambda v: f"{v:,}")
        out.append(f"| {name} | {fmt(r)} | {fmt(s)} | {'-' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(out), data


def common_options(args: argparse.Namespace) -> list[str]:
    """The ``hybridkv replay`` options every phase shares: fleet, router (with ``--router-args``
    split as a shell would), block and output tokens, checkpoint slots.

    Raises:
        ValueError: ``args.router_args`` does not split (an unclosed quote).
    """
    return ["--instances", str(args.instances), "--time-scale", str(args.time_scale), "--router", args.router,
            *shlex.split(args.router_args), "--block-tokens", "64", "--max-output-tokens", "4",
            "--checkpoint-slots", str(args.checkpoint_slots), "--no-progress"]


def main(argv: list[str] | None = None) -> int:
    """Run the phases and print / write the comparison; 0 when the tolerance held, 1 when not."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=40, help="first N requests compared (default 40)")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--router", default="least-load")
    ap.add_argument("--router-args", default="",
                    help="more options of the router for every replay, e.g. the hybrid router's previous settings: "
                         "--router-args='--own-waiting 1 --waiting-weight 1 --tie-kv-run off'")
    ap.add_argument("--verify", type=int, default=4, help="requests of the real run checked against a cache-free run")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="how real steps are timed")
    ap.add_argument("--calibrate", choices=("steps", "forward", "none"), default="steps")
    ap.add_argument("--calibration-slice", default="40:80", help="trace requests LO:HI replayed to calibrate (steps)")
    ap.add_argument("--cost-model", default=None, help="with --calibrate none: the cost model file")
    ap.add_argument("--forward-model", default=None,
                    help="also price the real steps with this (forward-only) cost model, for the decomposition")
    ap.add_argument("--checkpoint-slots", type=int, default=512, help="both runs (enough that nothing is evicted)")
    ap.add_argument("--tolerance", type=float, default=0.25, help="claimed |sim / real - 1| on TTFT mean and p90")
    ap.add_argument("--out", default="benchmarks/results/sim_truth.json")
    ap.add_argument("--work", default=None, help="directory for the step logs and reports (default: a temp dir)")
    args = ap.parse_args(argv)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT, check=False).stdout.strip())
    work = Path(args.work or tempfile.mkdtemp(prefix="sim-truth-"))
    work.mkdir(parents=True, exist_ok=True)
    phases: list[dict] = []
    try:
        common = common_options(args)
    except ValueError as e:
        ap.error(f"--router-args {args.router_args!r}: {e}")
    real_opts = ["--step-clock", args.clock, "--threads", "1"]
    cost = work / "cost_model.json"
    if args.calibrate == "steps":
        lo, hi = (int(x) for x in args.calibration_slice.split(":"))
        cal_trace = work / "calibration_trace.jsonl"
        slice_trace(_bundled_path(), lo, hi, cal_trace)
        run(["replay", "--timed", "--trace", str(cal_trace), "--limit", str(hi - lo), *common, *real_opts,
             "--step-log", str(work / "calibration_steps.json"), "--json", str(work / "calibration.json")],
            phases, "calibrate: real replay")
        run(["calibrate", "--from-steps", str(work / "calibration_steps.json"), "--out", str(cost)],
            phases, "calibrate: fit")
    elif args.calibrate == "forward":
        run(["calibrate", "--model", "small", "--clock", args.clock, "--out", str(cost)], phases, "calibrate")
    else:
        if not args.cost_model:
            ap.error("--calibrate none needs --cost-model FILE")
        cost = Path(args.cost_model)
    run(["replay", "--timed", "--limit", str(args.limit), *common, *real_opts, "--verify", str(args.verify),
         "--cost-model", str(cost), "--step-log", str(work / "real_steps.json"), "--json", str(work / "real.json")],
        phases, "real")
    store = json.loads(STORE_RESULTS.read_text(encoding="utf-8"))["results"]["DiskStore"]
    run(["replay", "--timed", "--simulate", "--limit", str(args.limit), *common, "--cost-model", str(cost),
         "--store-gbps", f"{store['load_gbps']:.4f}", "--store-latency-us", "0",
         "--step-log", str(work / "sim_steps.json"), "--json", str(work / "sim.json")], phases, "sim")

    real_rep = json.loads((work / "real.json").read_text(encoding="utf-8"))
    sim_rep = json.loads((work / "sim.json").read_text(encoding="utf-8"))
    real, sim = figures(real_rep), figures(sim_rep)
    real_steps, _ = read_step_log(work / "real_steps.json")
    sim_steps, _ = read_step_log(work / "sim_steps.json")
    model = StepCostModel.load(cost)
    md, rows = table(real, sim, summarize_steps(real_steps), summarize_steps(sim_steps))
    held = {q: abs(sim[q] / real[q] - 1) <= args.tolerance for q in ("ttft_mean", "ttft_p90")}
    wall = [r.wall_seconds for r in real_steps if r.wall_seconds is not None]
    cpu = [r.cpu_seconds for r in real_steps if r.cpu_seconds is not None]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit + ("+uncommitted changes" if dirty else ""),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
        "phases": phases, "cost_model": json.loads(cost.read_text(encoding="utf-8")),
        "real": real, "sim": sim, "table": rows,
        "verify": real_rep.get("verify"),
        "evictions": {"real": real_rep.get("evictions"), "sim": sim_rep.get("evictions")},
        "tiers": {"real": real_rep.get("tiers"), "sim": sim_rep.get("tiers")},
        "steps": {"real": summarize_steps(real_steps), "sim": summarize_steps(sim_steps),
                  "real_priced_by_model": compare_steps(real_steps, model),
                  "real_wall_over_cpu": round(sum(wall) / sum(cpu), 3) if wall and cpu and sum(cpu) else None},
        "tolerance": args.tolerance, "held": held,
    }
    if args.forward_model:
        result["steps"]["real_priced_by_forward_model"] = compare_steps(real_steps, StepCostModel.load(args.forward_model))
    print("\n" + md)
    print(f"\nreal steps: wall / CPU seconds {result['steps']['real_wall_over_cpu']}; "
          f"priced by the model: {result['steps']['real_priced_by_model']}")
    if args.forward_model:
        print(f"priced by the forward model: {result['steps']['real_priced_by_forward_model']}")
    print(f"verify: {real_rep.get('verify')}")
    print(f"tolerance ±{args.tolerance:.0%}: " + ", ".join(f"{q} {'held' if ok else 'NOT held'}" for q, ok in held.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out} (step logs and reports in {work})")
    return 0 if all(held.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
