"""Bad command-line options of every ``hybridkv`` command: refused before any run by the one
validation layer (``hybridkv.replay.args``), exit 2, one line naming the option and the value."""

from __future__ import annotations

import json

import pytest

from hybridkv.cache.config import CheckpointPolicy, ConfigError
from hybridkv.cli import main

NO_SERVER = "http://127.0.0.1:9"          # bench-serve's options are checked before it connects


def _refused(capsys, argv: list[str]) -> str:
    """Run ``hybridkv argv`` in-process; assert argparse refused it (exit 2); its stderr on one line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = " ".join(capsys.readouterr().err.split())
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("extra,named", [
    # before: IndexError in simulator.route (traceback, exit 1)
    (["--time-scale", "1e308"], "--time-scale: '1e308' must be a number in [1e-06, 1000000]"),
    # before: nan TTFT and exit 0; with --json "ValueError: Out of range float", no report
    (["--time-scale", "inf"], "--time-scale: 'inf' must be a number in [1e-06, 1000000]"),
    (["--time-scale", "nan"], "--time-scale: 'nan' is not a number"),
    (["--time-scale", "1e-7"], "--time-scale: '1e-7' must be a number in [1e-06, 1000000]"),
    # before: OverflowError (traceback, exit 1)
    (["--instances", "2", "--store-gib", "inf"], "--store-gib: 'inf' must be a number in [0, 1073741824] GiB"),
    (["--instances", "2", "--crash", "0@1e308"], "--crash: seconds '1e308' in '0@1e308' must be a number in [0, 1000000000]"),
    (["--instances", "2", "--restart", "0@inf"], "--restart: seconds 'inf' in '0@inf' must be a number in [0, 1000000000]"),
    (["--instances", "2", "--crash", "0@1", "--cold-start", "1e308"],
     "--cold-start: '1e308' must be a number in [0, 1000000000]"),
    (["--instances", "2", "--store-latency-us", "inf"], "--store-latency-us: 'inf' must be a number in [0, 1000000000]"),
    (["--instances", "2", "--store-gbps", "inf"], "--store-gbps: 'inf' must be a number in [0, 1000000]"),
])
def test_timed_numbers_are_finite_and_in_range(capsys, extra, named):
    err = _refused(capsys, ["replay", "--simulate", "--timed", "--limit", "5", "--no-progress", *extra])
    assert named in err


@pytest.mark.parametrize("argv", [
    ["replay", "--simulate", "--limit", "5", "--no-progress"],
    ["bench-serve", "--url", NO_SERVER, "--limit", "1"],
])
def test_block_tokens_has_a_bound(capsys, argv):
    """Before: a raw numpy allocation error of 16 GiB to 1.24 TiB (exit 1), or the kernel's OOM kill."""
    err = _refused(capsys, [*argv, "--block-tokens", "1000000000"])
    assert "--block-tokens: 1000000000 is more than 65536 tokens per trace hash id" in err


@pytest.mark.parametrize("argv", [
    ["replay", "--simulate", "--limit", "5", "--no-progress"],
    ["calibrate", "--out", "unused.json"],
    ["soak", "--rounds", "1"],
    ["serve", "--port", "0"],
    ["bench-serve", "--url", NO_SERVER],
])
@pytest.mark.parametrize("value", ["99999999999999999999999", "-1", str(2**63)])
def test_seed_is_range_checked_on_every_command(capsys, argv, value):
    """Before: "Overflow when unpacking long long" (replay, serve) or an OverflowError traceback."""
    err = _refused(capsys, [*argv, "--seed", value])
    assert f"--seed: {value} is outside [0, 2**63 - 1]" in err


def test_the_largest_seed_is_taken(tmp_path):
    out = tmp_path / "r.json"
    assert main(["replay", "--simulate", "--limit", "5", "--no-progress", "--seed", str(2**63 - 1),
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["requests"] == 5


@pytest.mark.parametrize("argv", [["replay", "--simulate", "--limit", "5", "--no-progress"], ["serve", "--port", "0"]])
@pytest.mark.parametrize("policy,named", [
    ("", "--policy: policy '' is empty"),                           # before: ran the default policy
    ("none+branch", "--policy: policy 'none+branch' combines 'none'"),  # before: ran branch
    ("branch++tail", "--policy: policy 'branch++tail' has an empty term"),
])
def test_an_empty_or_contradictory_policy_is_refused(capsys, argv, policy, named):
    assert named in _refused(capsys, [*argv, "--policy", policy])


def test_policy_none_alone_still_parses():
    assert str(CheckpointPolicy.parse("none")) == "none"
    with pytest.raises(ConfigError, match="combines 'none'"):
        CheckpointPolicy.parse("branch+none")


def test_verify_with_simulate_is_refused(capsys):
    """Before: --simulate turned verification off without a word (exit 0, verify: off)."""
    err = _refused(capsys, ["replay", "--simulate", "--limit", "5", "--no-progress", "--verify", "2"])
    assert "--verify 2 needs the real model" in err


@pytest.mark.parametrize("argv,flag", [
    (["replay", "--model", "tiny", "--timed", "--limit", "1", "--no-progress", "--step-log"], "--step-log"),
    (["replay", "--model", "tiny", "--limit", "1", "--no-progress", "--json"], "--json"),
    (["calibrate", "--model", "tiny", "--repeats", "1", "--out"], "--out"),
    (["bench-serve", "--url", NO_SERVER, "--limit", "1", "--json"], "--json"),
])
def test_an_unwritable_output_path_fails_before_the_run(tmp_path, capsys, argv, flag):
    """Before: --step-log and calibrate --out failed only after the run, losing its results."""
    path = tmp_path / "missing-dir" / "out.json"
    rc = main([*argv, str(path)])
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert rc == 2 and f"error: {flag} {path}: no directory {path.parent}" in err
    assert captured.out == ""                           # nothing ran: no table, no fitted rows
    assert not path.parent.exists()


def test_the_output_check_leaves_an_existing_file_as_it_was(tmp_path, capsys):
    keep = tmp_path / "steps.json"
    keep.write_text("kept")
    (tmp_path / "dir").mkdir()
    rc = main(["replay", "--model", "tiny", "--timed", "--limit", "1", "--no-progress",
               "--step-log", str(keep), "--json", str(tmp_path / "dir")])
    assert rc == 2 and "--json" in capsys.readouterr().err and keep.read_text() == "kept"


def test_soak_json_to_a_missing_directory_is_refused_like_replay(tmp_path, capsys):
    """Before: soak created the directory (replay refuses a mistyped one)."""
    path = tmp_path / "nonexistent" / "x.json"
    assert main(["soak", "--rounds", "1", "--json", str(path)]) == 2
    assert f"error: --json {path}: no directory {path.parent}" in capsys.readouterr().err
    assert not path.parent.exists()


@pytest.mark.parametrize("content,found", [
    ("[1, 2]", "holds a JSON array"),                          # before: "list indices must be integers or slices"
    ('{"config": [1]}', "holds an object with keys ['config']"),
    ('{"failures": {}}', '"failures" is dict, not an array'),
    ("{", "not valid JSON"),
])
def test_soak_case_of_the_wrong_shape_names_the_shape(tmp_path, capsys, content, found):
    case = tmp_path / "case.json"
    case.write_text(content)
    assert main(["soak", "--case", str(case)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"error: --case {case}: ") and found in err
    assert 'expected a soak --json report with "failures", or one failure' in err


@pytest.mark.parametrize("argv", [["replay", "--simulate", "--limit", "5", "--no-progress"], ["serve", "--port", "0"]])
@pytest.mark.parametrize("option", ["--kv-pages", "--checkpoint-slots"])
def test_pool_sizes_have_a_bound(capsys, argv, option):
    """Before: a MemoryError traceback (exit 1) building the pools' lists."""
    err = _refused(capsys, [*argv, option, "100000000000"])
    assert f"{option}: 100000000000 is more than 16777216 entries in a pool" in err


def test_real_pools_larger_than_memory_are_refused_before_loading(capsys):
    """Before: torch's "DefaultCPUAllocator: can't allocate memory" traceback from inside an instance.
    16,777,216 slots of the small model's 438 KiB checkpoints are 7 TiB: more than any machine here."""
    rc = main(["replay", "--model", "small", "--limit", "1", "--no-progress", "--checkpoint-slots", "16777216"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "the device pools need 7008.0 GiB" in err and "--checkpoint-slots 16777216" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["inf", "1e308", "0"])
def test_router_poll_interval_is_bounded(capsys, value):
    """Before: inf or 1e308 started a router that never polled its workers (exit 0 on Ctrl-C)."""
    err = _refused(capsys, ["router", "--worker", NO_SERVER, "--port", "0", "--poll-interval", value])
    assert f"--poll-interval: '{value}' must be a number in [0.001, 3600]" in err


@pytest.mark.parametrize("argv", [["replay", "--simulate", "--limit", "5", "--no-progress"], ["serve", "--port", "0"]])
def test_max_num_seqs_has_a_bound(capsys, argv):
    """Before: a MemoryError traceback (exit 1): the default KV pool has a page per running request."""
    err = _refused(capsys, [*argv, "--max-num-seqs", "100000000000"])
    assert "--max-num-seqs: 100000000000 is more than 65536 requests running at once" in err


def test_a_step_log_that_fails_after_the_run_keeps_the_report(tmp_path, capsys):
    """The library path (no CLI pre-check): a step log that cannot be written is a warning, and
    the run's report is still returned (before: the OSError escaped and the report was lost)."""
    from rich.console import Console

    from hybridkv.replay.runner import ReplayOptions, run_replay

    opts = ReplayOptions(limit=20, simulate=True, timed=True, progress=False, step_log=str(tmp_path))
    report = run_replay(opts, Console(stderr=True))
    err = " ".join(capsys.readouterr().err.split())
    assert report.requests == 20
    assert f"warning: --step-log {tmp_path}: Is a directory" in err and "the report is" in err


def test_serve_pools_larger_than_memory_are_refused_before_loading(capsys):
    """Before: torch's "DefaultCPUAllocator: can't allocate memory" traceback (exit 1)."""
    rc = main(["serve", "--port", "0", "--model", "small", "--checkpoint-slots", "16777216"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "the device pools need 7008.1 GiB" in err and "--checkpoint-slots 16777216: 7008.0 GiB" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["replay", "--simulate", "--limit", "5", "--no-progress"], ["serve", "--port", "0"]])
@pytest.mark.parametrize("option", ["--block-size", "--prefix-match-unit"])
def test_page_sizes_have_a_bound(capsys, argv, option):
    """Before (serve --block-size 1000000000): a 178.8 GiB allocation traceback."""
    assert f"{option}: 1000000000 is more than 65536 tokens" in _refused(capsys, [*argv, option, "1000000000"])


@pytest.mark.parametrize("argv", [
    ["replay", "--simulate", "--limit", "5", "--no-progress"],
    ["calibrate", "--out", "unused.json"],
    ["soak", "--rounds", "1"],
    ["serve", "--port", "0"],
])
@pytest.mark.parametrize("value", ["99999999999999999999", "4096"])
def test_threads_have_a_bound(capsys, argv, value):
    """Before: "Overflow when unpacking long long" (a traceback in calibrate and soak), or with 4096 a
    segmentation fault of the OpenMP runtime (exit 139)."""
    assert f"--threads: {value} is more than 1024 torch threads" in _refused(capsys, [*argv, "--threads", value])
