"""A/B speed comparison in one run: a base git revision against the working tree, alternated.

On a shared, loaded machine two benchmark runs made at different times are not comparable
(the load changes between them), so this script measures "before" and "after" in one run:
it checks the base revision out into a detached worktree of its own (``git worktree add
--detach``, removed at the end; the main working tree's checkout is never touched), then runs
the same benchmark command against each side in turn, with ``PYTHONPATH`` set to that side's
``src``, and compares the figure each run reports.

Sides: ``base`` (the ``--base`` revision) and one or more variants of the working tree
(``--variant LABEL=ARGS``; default one, ``current``, with no extra arguments), and with
``--control`` a side ``control`` that runs the base again (an A/A check of the run's noise). With
``--current REV`` the variants run a second detached worktree of ``REV`` instead (also removed
at the end): edits others make to the working tree during the comparison then do not reach it. Each round runs
every side once, in the order base, variants ... in even rounds and reversed in odd ones
(A B | B A | A B ... for two sides), so a drift in the machine's load over the run hits
every side alike. Per round, the ratio variant / base; reported: each side's median, min and
max over the rounds, and per variant the ratio of its median to the base's median with the
spread of the per-round ratios (their min and max).

Figures (``--figure``), parsed from each run:

* ``overhead``: ``benchmarks/bench_overhead.py --clock cpu --no-baseline --json {out}``: the
  real engine's cache bookkeeping, microseconds (CPU time of the engine's thread) per request,
  one figure per workload (lower is better);
* ``simspeed``: ``benchmarks/bench_simspeed.py --out {out}``: requests simulated per CPU second
  of the replay (``requests_per_replay_cpu_second``: trace load to report, start-up excluded),
  one figure per case (higher is better);
* ``json:KEY.PATH``: a number at that dotted path (list indices as numbers) in the JSON file the
  command writes to ``{out}``;
* ``regex:PATTERN``: the first group of the first match of ``PATTERN`` in the command's stdout.

Every run also records its CPU seconds (user + system of the child and its descendants,
``resource.getrusage(RUSAGE_CHILDREN)`` around it), its wall seconds and the load average.

Placeholders in the command (given after ``--``; the presets have a default command, and
arguments given after ``--`` replace it): ``{python}`` this interpreter, ``{out}`` a fresh JSON
path per run, ``{src}`` the side's ``src`` directory, ``{args}`` (a whole argument) the side's
extra arguments as separate arguments, ``{args_str}`` (inside an argument) the same joined as one
shell-quoted string. Without ``{args}`` or ``{args_str}`` the side's extra arguments are
appended. The command runs in the working tree's root (``--script-tree working``: every side
runs the benchmark script as it is on disk in the working tree, so only the library differs), in
the current side's root (``--script-tree current``: with ``--current REV``, that revision's
script, which edits made during the run do not reach) or in each side's own root
(``--script-tree each``: each side's own copy of the script).

Ctrl-C (exit 130) and SIGTERM (exit 143) remove the worktrees before exiting. A worktree of the
repository still registered at ``--worktree`` from a killed run is pruned when its directory is
gone; when the directory is still there the run stops with the command that removes it.

Run by hand (from the repository root)::

    .venv/bin/python benchmarks/ab_compare.py --figure simspeed --rounds 3 \\
        --variant current= --variant probation0='--checkpoint-probation 0'
    .venv/bin/python benchmarks/ab_compare.py --figure overhead --rounds 3 --json ab.json \\
        --variant current= --variant probation0='--checkpoint-probation 0'
    .venv/bin/python benchmarks/ab_compare.py --figure 'regex:took ([0-9.]+)' -- {python} my_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_BASE = "9809ff5"
DEFAULT_WORKTREE = Path("/tmp/hkv_ab_base")


@dataclass(frozen=True)
class Preset:
    """A named figure: its default command, how each run's figures are read, and which way is better."""

    command: tuple[str, ...]
    higher_is_better: bool
    unit: str


PRESETS = {
    "overhead": Preset(("{python}", "benchmarks/bench_overhead.py", "--workload", "trace", "--requests", "12",
                        "--repeats", "2", "--clock", "cpu", "--no-baseline", "--json", "{out}"),
                       higher_is_better=False, unit="us/request (CPU)"),
    "simspeed": Preset(("{python}", "benchmarks/bench_simspeed.py", "--cases", "untimed", "--out", "{out}",
                        "--replay-args={args_str}"),
                       higher_is_better=True, unit="requests/replay CPU s"),
}


class ABError(Exception):
    """A bad argument or a failed run: the one-line message printed before exiting non-zero."""


@dataclass
class Side:
    """One side of the comparison: a label, the tree its library comes from, and its extra arguments."""

    label: str
    root: Path
    args: list[str] = field(default_factory=list)


def schedule(rounds: int, n_sides: int) -> list[tuple[int, int]]:
    """``(round, side index)`` in run order: sides 0..n-1 in even rounds, n-1..0 in odd ones.

    For two sides and three rounds: A B B A A B. Raises ``ValueError`` if ``rounds < 1`` or
    ``n_sides < 2``.
    """
    if rounds < 1 or n_sides < 2:
        raise ValueError(f"need rounds >= 1 and at least 2 sides, got rounds={rounds}, sides={n_sides}")
    order = []
    for r in range(rounds):
        idx = range(n_sides) if r % 2 == 0 else range(n_sides - 1, -1, -1)
        order += [(r, i) for i in idx]
    return order


def _dig(data, path: str):
    cur = data
    for part in path.split("."):
        if isinstance(cur, list):
            try:
                cur = cur[int(part)]
            except (ValueError, IndexError):
                raise ABError(f"json path {path!r}: no list index {part!r}") from None
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise ABError(f"json path {path!r}: no key {part!r}")
    if not isinstance(cur, (int, float)) or isinstance(cur, bool):
        raise ABError(f"json path {path!r}: {cur!r} is not a number")
    return float(cur)


def parse_figures(figure: str, stdout: str, out_path: Path) -> dict[str, float]:
    """The figures of one run, name -> value, read as ``figure`` says (see the module docstring).

    ``overhead``: ``{"overhead_us_per_request[<workload>]": us}`` from ``out_path``;
    ``simspeed``: ``{"requests_per_replay_cpu_second[<case>]": requests/s}`` from ``out_path``;
    ``json:P``: ``{P: value}``; ``regex:R``: ``{R: value}`` from ``stdout``.
    Raises :class:`ABError` when the run did not report the figure.
    """
    if figure in ("overhead", "simspeed") or figure.startswith("json:"):
        try:
            data = json.loads(out_path.read_text())
        except (OSError, ValueError) as e:
            raise ABError(f"the run wrote no readable JSON to {out_path} ({e})") from None
        if figure == "overhead":
            return {f"overhead_us_per_request[{r['workload']}]": float(r["overhead_us_per_request"])
                    for r in data["results"]}
        if figure == "simspeed":
            return {f"requests_per_replay_cpu_second[{r['case']}]": float(r["requests_per_replay_cpu_second"])
                    for r in data["runs"]}
        path = figure[len("json:"):]
        return {path: _dig(data, path)}
    if figure.startswith("regex:"):
        pattern = figure[len("regex:"):]
        m = re.search(pattern, stdout)
        if m is None or not m.groups():
            raise ABError(f"--figure {figure!r}: no match (with a group) in the run's stdout")
        try:
            return {pattern: float(m.group(1))}
        except ValueError:
            raise ABError(f"--figure {figure!r}: matched {m.group(1)!r}, not a number") from None
    raise ABError(f"--figure {figure!r}: choose overhead, simspeed, json:KEY.PATH or regex:PATTERN")


def expand(template: list[str], side: Side, out: Path) -> list[str]:
    """The command of one run: placeholders replaced (module docstring); extra args appended if unplaced."""
    subs = {"{python}": sys.executable, "{out}": str(out), "{src}": str(side.root / "src"),
            "{args_str}": shlex.join(side.args)}
    cmd, placed = [], False
    for tok in template:
        if tok == "{args}":
            cmd += side.args
            placed = True
            continue
        placed |= "{args_str}" in tok
        for k, v in subs.items():
            tok = tok.replace(k, v)
        cmd.append(tok)
    return cmd if placed else cmd + side.args


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def side_env(side: Side) -> dict[str, str]:
    """The environment of a side's runs: ``PYTHONPATH`` is that side's ``src`` alone; one BLAS thread."""
    env = dict(os.environ, PYTHONPATH=str(side.root / "src"))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_once(template: list[str], side: Side, figure: str, cwd: Path, tmp: Path, n: int) -> dict:
    """One run of the command for ``side``: its figures, CPU and wall seconds, load average.

    Raises :class:`ABError` if it exits non-zero (with its last stderr line) or reports no figure.
    """
    out = tmp / f"run{n}.json"
    cmd = expand(template, side, out)
    load0 = os.getloadavg()[0]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=side_env(side), capture_output=True, text=True, check=False)
    except OSError as e:                 # no such program, not executable, ...
        raise ABError(f"the {side.label} run could not start: {shlex.join(cmd)}: "
                      f"{e.strerror or e}: {e.filename or cmd[0]}") from None
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["(no stderr)"]
        errors = [ln for ln in lines if re.match(r"[A-Za-z_.]*(Error|Exception)\b", ln)]
        why = lines[-1] if not errors else errors[0] if len(errors) == 1 else f"{errors[0]} (then {errors[-1]})"
        raise ABError(f"the {side.label} run exited {proc.returncode}: {shlex.join(cmd)}: {why}")
    return {"side": side.label, "figures": parse_figures(figure, proc.stdout, out), "cpu_seconds": round(cpu, 3),
            "wall_seconds": round(wall, 3), "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)}


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ABError(f"git {' '.join(args)}: {(proc.stderr.strip().splitlines() or ['failed'])[-1]}")
    return proc.stdout.strip()


def _check_import(side: Side, cwd: Path, package: str) -> str:
    """Where ``package`` is imported from under the side's environment; must be the side's ``src``."""
    code = f"import {package}, os; print(os.path.dirname(os.path.abspath({package}.__file__)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=side_env(side), capture_output=True,
                          text=True, check=False)
    where = proc.stdout.strip()
    if proc.returncode != 0:            # the import failed: its last stderr line (the exception), not the traceback
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise ABError(f"--package {package}: the {side.label} side cannot import it from "
                      f"{side.root / 'src'}: {why}")
    if not Path(where).resolve().is_relative_to((side.root / "src").resolve()):
        raise ABError(f"the {side.label} side imports {package} from {where!r}, not from {side.root / 'src'}")
    return where


def summarise(runs: list[dict], labels: list[str]) -> dict:
    """Per figure: each side's median/min/max, and per variant (every label after the first, the base)
    ``ratio`` = its median / the base's median, with ``pair_min``/``pair_median``/``pair_max`` of the
    per-round ratios (variant / base of the same round)."""
    names = list(runs[0]["figures"])
    out = {}
    for name in names:
        per = {lab: [r for r in runs if r["side"] == lab] for lab in labels}
        sides = {}
        for lab, rs in per.items():
            vals = [r["figures"][name] for r in rs]
            sides[lab] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals,
                          "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in rs)}
        ratios = {}
        base_by_round = {r["round"]: r["figures"][name] for r in per[labels[0]]}
        for lab in labels[1:]:
            pair = [r["figures"][name] / base_by_round[r["round"]] for r in per[lab]]
            ratios[lab] = {"ratio": sides[lab]["median"] / sides[labels[0]]["median"], "pair_min": min(pair),
                           "pair_median": statistics.median(pair), "pair_max": max(pair), "pair_ratios": pair}
        out[name] = {"sides": sides, "ratios": ratios}
    return out


def print_table(summary: dict, labels: list[str], higher_is_better: bool | None) -> None:
    better = {True: "higher is better", False: "lower is better", None: ""}[higher_is_better]
    for name, s in summary.items():
        print(f"\n{name}" + (f"  ({better})" if better else ""))
        print(f"{'side':<16}{'median':>12}{'min':>12}{'max':>12}{'CPU s':>9}{'ratio':>9}  "
              "round ratios: min / median / max")
        for lab in labels:
            v = s["sides"][lab]
            r = s["ratios"].get(lab)
            ratio = (f"{r['ratio']:9.3f}  {r['pair_min']:.3f} / {r['pair_median']:.3f} / {r['pair_max']:.3f}" if r
                     else f"{'1':>9}")
            print(f"{lab:<16}{v['median']:>12.4g}{v['min']:>12.4g}{v['max']:>12.4g}{v['cpu_seconds_median']:>9.1f}"
                  f"{ratio}")


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``LABEL=ARGS`` -> ``(LABEL, shlex.split(ARGS))``; raises :class:`ABError` on a bad spec."""
    label, sep, rest = spec.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label) or label in ("base", "control"):
        raise ABError(f"--variant {spec!r}: give LABEL=ARGS with a label of letters, digits, _.+- "
                      "(not 'base' or 'control')")
    try:
        return label, shlex.split(rest)
    except ValueError as e:
        raise ABError(f"--variant {spec!r}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Give the benchmark command after '--' (placeholders in the docstring).")
    ap.add_argument("--base", default=DEFAULT_BASE, help=f"base git revision (default {DEFAULT_BASE})")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1],
                    help="the repository whose working tree is compared (default: this script's)")
    ap.add_argument("--worktree", type=Path, default=DEFAULT_WORKTREE,
                    help=f"where the base is checked out, removed at the end (default {DEFAULT_WORKTREE})")
    ap.add_argument("--current", default=None, metavar="REV",
                    help="compare this revision (checked out beside the base, at WORKTREE_current) instead of "
                         "the working tree: what others edit meanwhile does not reach the runs")
    ap.add_argument("--figure", default="overhead", help="overhead, simspeed, json:KEY.PATH or regex:PATTERN")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every side once (default 3)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                    help="a working-tree side with extra arguments (repeatable; default: current=)")
    ap.add_argument("--base-args", default="", help="extra arguments of the base side's runs")
    ap.add_argument("--control", action="store_true",
                    help="add a side 'control': the base revision again with the base's arguments (an A/A check: "
                         "its ratio to the base shows the run's noise)")
    ap.add_argument("--script-tree", choices=("working", "current", "each"), default="working",
                    help="run the command in the working tree's root for every side (default), in the current "
                         "side's root (with --current: that revision's scripts) or in each side's own root")
    ap.add_argument("--package", default="hybridkv", help="package checked to import from each side's src")
    ap.add_argument("--json", dest="json_path", type=Path, help="write the runs and the summary here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the benchmark command (after --)")
    args = ap.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(args)
    except ABError as e:
        print(f"ab_compare: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ab_compare: interrupted (its worktrees were removed)", file=sys.stderr)
        return 130
    except Terminated:
        print("ab_compare: terminated (its worktrees were removed)", file=sys.stderr)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so the run unwinds as on Ctrl-C: the running benchmark
    is killed and the worktrees are removed (a ``BaseException``: no ``except Exception`` swallows it)."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated


def check_figure(figure: str) -> None:
    """Raises :class:`ABError` unless ``figure`` can be read: a preset, ``json:`` with a dotted path of
    non-empty parts, or ``regex:`` with a pattern that compiles and has a group."""
    if figure in PRESETS:
        return
    if figure.startswith("json:"):
        path = figure[len("json:"):]
        if not path or "" in path.split("."):
            raise ABError(f"--figure {figure!r}: give json:KEY.PATH, dotted non-empty keys such as result.value")
        return
    if figure.startswith("regex:"):
        try:
            groups = re.compile(figure[len("regex:"):]).groups
        except re.error as e:
            raise ABError(f"--figure {figure!r}: not a regular expression ({e})") from None
        if not groups:
            raise ABError(f"--figure {figure!r}: the pattern needs a group, (...), around the number")
        return
    raise ABError(f"--figure {figure!r}: choose overhead, simspeed, json:KEY.PATH or regex:PATTERN")


def check_writable(option: str, path: Path) -> None:
    """Raises :class:`ABError` unless ``path`` can be written (checked before any run): it is opened
    for append, which changes nothing in an existing file, and removed again if it did not exist."""
    if path.is_dir():
        raise ABError(f"{option} {path}: is a directory")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ABError(f"{option} {path}: cannot write there ({e.strerror or e})") from None
    if not existed:
        path.unlink(missing_ok=True)


def _registered_worktrees(repo: Path) -> set[Path]:
    """The resolved paths of ``repo``'s linked worktrees (``git worktree list --porcelain``)."""
    lines = _git(repo, "worktree", "list", "--porcelain").splitlines()
    return {Path(ln[len("worktree "):]).resolve() for ln in lines if ln.startswith("worktree ")}


def check_worktree_path(repo: Path, path: Path) -> None:
    """Make ``path`` free for ``git worktree add``: a registered worktree of ``repo`` whose directory
    is gone (an earlier run was killed and its directory removed) is pruned (``git worktree
    prune``); an existing path raises :class:`ABError` saying how to remove it."""
    registered = path.resolve() in _registered_worktrees(repo)
    if registered and not path.exists():
        _git(repo, "worktree", "prune")
        return
    if registered:
        raise ABError(f"worktree path {path} is a worktree of {repo} left by an earlier run (or one still "
                      f"running): remove it (git -C {repo} worktree remove --force {path}) or give another --worktree")
    if path.exists():
        raise ABError(f"worktree path {path} exists: remove it or give another --worktree")


def _run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    preset = PRESETS.get(args.figure)
    check_figure(args.figure)
    if args.json_path is not None:
        check_writable("--json", args.json_path)
    if preset is None:
        if not command:
            raise ABError(f"--figure {args.figure!r} has no default command: give one after --")
    template = command or list(preset.command)
    if args.rounds < 1:
        raise ABError(f"--rounds {args.rounds}: must be at least 1")
    try:
        base_args = shlex.split(args.base_args)
    except ValueError as e:
        raise ABError(f"--base-args {args.base_args!r}: {e}") from None
    variants = [parse_variant(v) for v in (args.variant or ["current="])]
    labels = ["base"] + [lab for lab, _ in variants] + (["control"] if args.control else [])
    if len(set(labels)) != len(labels):
        raise ABError(f"--variant labels repeat: {labels[1:]}")
    repo = Path(_git(args.repo, "rev-parse", "--show-toplevel"))
    try:
        base_commit = _git(repo, "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}")
    except ABError:
        raise ABError(f"--base {args.base!r} is not a commit of {repo}") from None
    if args.current is not None:
        try:
            head = _git(repo, "rev-parse", "--verify", "--quiet", f"{args.current}^{{commit}}")
        except ABError:
            raise ABError(f"--current {args.current!r} is not a commit of {repo}") from None
        dirty = []
    else:
        head = _git(repo, "rev-parse", "HEAD")
        dirty = [ln[3:] for ln in _git(repo, "status", "--porcelain", "--untracked-files=no").splitlines()]
    wt = args.worktree.resolve()
    cur_wt = wt.with_name(wt.name + "_current") if args.current is not None else None
    for path in (wt, cur_wt):
        if path is not None:
            check_worktree_path(repo, path)
    made = []
    try:
        for path, commit in ((wt, base_commit), (cur_wt, head)):
            if path is not None:
                made.append(path)       # first: a signal right after the add still removes it
                _git(repo, "worktree", "add", "--detach", str(path), commit)
        cur_root = cur_wt or repo
        sides = [Side("base", wt, base_args)] + [Side(lab, cur_root, a) for lab, a in variants]
        if args.control:                # the base again: its ratio to the base is the run's own noise
            sides.append(Side("control", wt, base_args))
        cwd_of = {s.label: {"working": repo, "current": cur_root, "each": s.root}[args.script_tree] for s in sides}
        for root in {cur_root, wt}:        # compile first, so no run pays for writing .pyc files
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "src")], check=False,
                           stdout=subprocess.DEVNULL)
        imports = {s.label: _check_import(s, cwd_of[s.label], args.package) for s in sides} if args.package else {}
        order = schedule(args.rounds, len(sides))
        what = (f"{args.current} = {head[:10]} in {cur_wt}" if cur_wt else
                f"the working tree at HEAD {head[:10]} with {len(dirty)} modified tracked files")
        print(f"base {args.base} = {base_commit[:10]} in {wt}; current: {what}; {args.rounds} rounds, order "
              + " ".join(sides[i].label for _, i in order[:2 * len(sides)]) + " ...", flush=True)
        runs = []
        with tempfile.TemporaryDirectory(prefix="hkv-ab-") as tmp:
            for n, (rnd, i) in enumerate(order):
                side = sides[i]
                rec = run_once(template, side, args.figure, cwd_of[side.label], Path(tmp), n)
                rec["round"] = rnd
                runs.append(rec)
                figs = ", ".join(f"{k} {v:.4g}" for k, v in rec["figures"].items())
                print(f"  round {rnd} {side.label:<12} {figs}  (CPU {rec['cpu_seconds']:.1f} s, wall "
                      f"{rec['wall_seconds']:.1f} s, load {rec['load_before']:.1f})", flush=True)
    finally:
        for path in made:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], check=False,
                           capture_output=True)
    summary = summarise(runs, labels)
    print_table(summary, labels, preset.higher_is_better if preset else None)
    if args.json_path:
        doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
               "base": args.base, "base_commit": base_commit, "current": args.current or "working tree",
               "head": head, "modified_tracked_files": dirty,
               "figure": args.figure, "command": template, "script_tree": args.script_tree,
               "sides": {s.label: {"root": str(s.root), "args": s.args, "imports_from": imports.get(s.label)}
                         for s in sides},
               "order": [sides[i].label for _, i in order], "runs": runs, "summary": summary}
        args.json_path.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
