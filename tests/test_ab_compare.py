"""benchmarks/ab_compare.py: the base revision and the working tree alternate within one run, each
imports its own ``src``, the figures and ratios come from what the runs printed, and the base
worktree is removed without touching the working tree's checkout.

A throwaway git repository stands in for the project: its package ``abpkg`` holds ``VALUE = 2.0``
at the commit and ``3.0`` in the working tree, and its real benchmark script ``fig.py`` logs which
value it imported and reports ``VALUE`` (times ``--mult``)."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ab_compare.py"
_spec = importlib.util.spec_from_file_location("ab_compare", SCRIPT)
ab = importlib.util.module_from_spec(_spec)
sys.modules["ab_compare"] = ab       # dataclasses look their module up while the class is built
_spec.loader.exec_module(ab)

RATIO_TOL = 1e-9
"""Figures are printed with repr(): the ratios are exact up to float rounding."""

FIG = """\
import argparse, json
import abpkg
p = argparse.ArgumentParser()
p.add_argument("log")
p.add_argument("out")
p.add_argument("--mult", type=float, default=1.0)
p.add_argument("--fail", action="store_true")
a = p.parse_args()
if a.fail:
    raise RuntimeError("asked to fail")
value = abpkg.VALUE * a.mult
with open(a.log, "a") as f:
    f.write(f"{value!r}\\n")
json.dump({"result": {"value": value}}, open(a.out, "w"))
print(f"figure: {value!r}")
"""


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "src" / "abpkg").mkdir(parents=True)
    (r / "src" / "abpkg" / "__init__.py").write_text("VALUE = 2.0\n")
    (r / "fig.py").write_text(FIG)
    _git(r, "init", "-q")
    _git(r, "add", "src/abpkg/__init__.py", "fig.py")
    _git(r, "commit", "-q", "-m", "base")
    (r / "src" / "abpkg" / "__init__.py").write_text("VALUE = 3.0\n")    # uncommitted: the working tree
    return r


def _run(repo, tmp_path, *args):
    cmd = [sys.executable, str(SCRIPT), "--repo", str(repo), "--base", "HEAD", "--worktree",
           str(tmp_path / "wt"), "--package", "abpkg", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)


def test_schedule_alternates_the_sides():
    assert ab.schedule(3, 2) == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]     # A B B A A B
    assert [i for _, i in ab.schedule(2, 3)] == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="rounds=0"):
        ab.schedule(0, 2)


def test_base_and_working_tree_alternate_and_the_ratio_is_theirs(repo, tmp_path):
    log, out = tmp_path / "order.log", tmp_path / "ab.json"
    head = _git(repo, "rev-parse", "HEAD")
    p = _run(repo, tmp_path, "--figure", "json:result.value", "--rounds", "3", "--variant", "current=",
             "--variant", "double=--mult 2", "--control", "--json", str(out), "--", "{python}", "fig.py", str(log),
             "{out}")
    assert p.returncode == 0, p.stderr
    # each run imported its side's src: base 2.0, the working tree 3.0, its variant 6.0, the control (the
    # base again) 2.0; order A B C D D C B A A B C D
    assert [float(x) for x in log.read_text().split()] == [2.0, 3.0, 6.0, 2.0, 2.0, 6.0, 3.0, 2.0, 2.0, 3.0, 6.0, 2.0]
    doc = json.loads(out.read_text())
    assert doc["order"] == ["base", "current", "double", "control", "control", "double", "current", "base",
                            "base", "current", "double", "control"]
    assert doc["summary"]["result.value"]["ratios"]["control"]["ratio"] == pytest.approx(1.0, abs=RATIO_TOL)
    assert doc["sides"]["base"]["imports_from"].startswith(str(tmp_path / "wt"))
    assert doc["sides"]["current"]["imports_from"].startswith(str(repo))
    s = doc["summary"]["result.value"]
    assert s["sides"]["base"]["median"] == pytest.approx(2.0, abs=RATIO_TOL)
    assert s["ratios"]["current"]["ratio"] == pytest.approx(1.5, abs=RATIO_TOL)
    assert s["ratios"]["double"]["ratio"] == pytest.approx(3.0, abs=RATIO_TOL)
    assert s["ratios"]["double"]["pair_min"] == pytest.approx(3.0, abs=RATIO_TOL)
    assert s["ratios"]["double"]["pair_max"] == pytest.approx(3.0, abs=RATIO_TOL)
    assert s["ratios"]["current"]["pair_median"] == pytest.approx(1.5, abs=RATIO_TOL)
    assert all(r["cpu_seconds"] > 0 for r in doc["runs"])
    assert "current" in p.stdout and "1.500" in p.stdout
    # the base worktree is gone; the working tree's checkout and edit are as they were
    assert not (tmp_path / "wt").exists()
    assert _git(repo, "worktree", "list").count("\n") == 0
    assert _git(repo, "rev-parse", "HEAD") == head
    assert (repo / "src" / "abpkg" / "__init__.py").read_text() == "VALUE = 3.0\n"


def test_current_revision_and_stdout_regex(repo, tmp_path):
    """--current HEAD compares the committed code (2.0), not the working tree's edit (3.0); with
    --script-tree current the committed fig.py runs, not the working tree's edited one."""
    log = tmp_path / "order.log"
    (repo / "fig.py").write_text('print("figure: 99")\n' + FIG)
    p = _run(repo, tmp_path, "--current", "HEAD", "--script-tree", "current", "--figure",
             r"regex:figure: ([0-9.]+)", "--rounds", "1", "--control", "--", "{python}", "fig.py", str(log), "{out}")
    assert p.returncode == 0, p.stderr
    assert [float(x) for x in log.read_text().split()] == [2.0, 2.0, 2.0]     # base, current, control
    figures = re.findall(r"^  round \d+ .* (\S+)  \(CPU", p.stdout, flags=re.M)   # each run's parsed figure
    assert figures == ["2", "2", "2"]                 # never the edited script's 99 (hashes may hold "99")
    assert not (tmp_path / "wt").exists() and not (tmp_path / "wt_current").exists()
    assert "1.000" in p.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--base", "no-such-rev", "--", "{python}", "fig.py", "L", "{out}"], "--base 'no-such-rev' is not a commit"),
    (["--figure", "speed", "--", "{python}", "fig.py", "L", "{out}"], "--figure 'speed'"),
    (["--variant", "nolabel", "--", "{python}", "fig.py", "L", "{out}"], "--variant 'nolabel'"),
    (["--figure", "json:result.value", "--base-args=--fail", "--", "{python}", "fig.py", "L", "{out}"],
     "the base run exited 1"),
    (["--figure", "json:result.nothing", "--", "{python}", "fig.py", "L", "{out}"], "no key 'nothing'"),
])
def test_bad_input_is_one_line(repo, tmp_path, args, message):
    p = _run(repo, tmp_path, *args)
    assert p.returncode == 1
    assert p.stderr.startswith("ab_compare: error: ") and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    assert not (tmp_path / "wt").exists()
    assert (repo / "src" / "abpkg" / "__init__.py").read_text() == "VALUE = 3.0\n"


def _load_bench(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_overhead_cache_option(capsys):
    """bench_overhead --cache-option FIELD=VALUE (what a compared variant passes to the cached run)."""
    bo = _load_bench("bench_overhead")
    assert bo.cache_option("checkpoint_eviction=utility") == ("checkpoint_eviction", "utility")
    assert bo.cache_option("host_probation=0.5") == ("host_probation", 0.5)
    assert bo.cache_option("tenant_quota=none") == ("tenant_quota", None)
    with pytest.raises(SystemExit) as e:
        bo.main(["--cache-option", "no_such_field=1"])
    assert e.value.code == 2
    assert "--cache-option no_such_field=...: not a CacheConfig field" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bo.main(["--cache-option", "block_size=64"])       # the script sets it: refused, not a TypeError
    assert "block_size=..." in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--figure", "regex:(", "--", "{python}", "fig.py", "L", "{out}"], "--figure 'regex:(': not a regular expression"),
    (["--figure", "regex:figure", "--", "{python}", "fig.py", "L", "{out}"], "the pattern needs a group"),
    (["--figure", "json:", "--", "{python}", "fig.py", "L", "{out}"], "--figure 'json:': give json:KEY.PATH"),
    (["--figure", "json:result..value", "--", "{python}", "fig.py", "L", "{out}"], "'json:result..value'"),
    (["--figure", "json:result.value", "--json", "{tmp}/no/dir/ab.json", "--", "{python}", "fig.py", "L", "{out}"],
     "--json {tmp}/no/dir/ab.json: cannot write there"),
    (["--figure", "json:result.value", "--", "{tmp}/no-such-cmd", "{out}"],
     "the base run could not start: {tmp}/no-such-cmd {tmp_out}: No such file or directory"),
    (["--figure", "json:result.value", "--", "{python}", "-c", "pass"], "the run wrote no readable JSON to /"),
    (["--package", "nosuchpkg", "--figure", "json:result.value", "--", "{python}", "fig.py", "L", "{out}"],
     "--package nosuchpkg: the base side cannot import it from {tmp}/wt/src: ModuleNotFoundError: No module named"),
])
def test_more_bad_input_is_one_line(repo, tmp_path, args, message):
    p = _run(repo, tmp_path, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert p.returncode == 1
    want = message.replace("{tmp}", str(tmp_path)).partition(" {tmp_out}")
    assert p.stderr.startswith("ab_compare: error: ") and want[0] in p.stderr and want[2] in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "{out}" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "wt").exists() and _git(repo, "worktree", "list").count("\n") == 0
    assert not (tmp_path / "no").exists()


def test_sigterm_removes_the_worktrees(repo, tmp_path):
    """SIGTERM (what `timeout` and schedulers send) unwinds like Ctrl-C: the running benchmark is
    killed, both worktrees are removed, exit 143, and the next run starts cleanly."""
    cmd = [sys.executable, str(SCRIPT), "--repo", str(repo), "--base", "HEAD", "--current", "HEAD", "--worktree",
           str(tmp_path / "wt"), "--package", "abpkg", "--figure", "regex:(x)", "--",
           "{python}", "-c", "import time; print('started', flush=True); time.sleep(60)"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("base HEAD = ")      # printed just before the first run
        assert (tmp_path / "wt").exists() and (tmp_path / "wt_current").exists()
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err == "ab_compare: terminated (its worktrees were removed)\n"
    assert not (tmp_path / "wt").exists() and not (tmp_path / "wt_current").exists()
    assert _git(repo, "worktree", "list").count("\n") == 0


def test_stale_worktree_is_pruned_or_named(repo, tmp_path):
    """A worktree left registered at --worktree: pruned when its directory is gone; a one-line error
    with the command that removes it when it is still there."""
    wt = tmp_path / "wt"
    _git(repo, "worktree", "add", "--detach", str(wt), "HEAD")
    p = _run(repo, tmp_path, "--figure", "json:result.value", "--", "{python}", "fig.py", "L", "{out}")
    assert p.returncode == 1 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1
    assert f"is a worktree of {repo} left by an earlier run" in p.stderr
    assert f"git -C {repo} worktree remove --force {wt}" in p.stderr
    assert wt.exists()                       # not removed: a run still using it is not disturbed
    subprocess.run(["rm", "-rf", str(wt)], check=True)    # its directory gone, still registered
    p = _run(repo, tmp_path, "--figure", "json:result.value", "--rounds", "1", "--", "{python}", "fig.py",
             str(tmp_path / "log"), "{out}")
    assert p.returncode == 0, p.stderr
    assert not wt.exists() and _git(repo, "worktree", "list").count("\n") == 0
