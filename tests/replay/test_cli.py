"""``hybridkv replay`` end to end: the main job's report, errors and instances."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from hybridkv.engine.request import REJECT_POOL_TOO_SMALL
from hybridkv.cli import main
from hybridkv.replay.report import REPORT_KEYS


def _replay(tmp_path, *args):
    out = tmp_path / "report.json"
    rc = main(["replay", "--no-progress", "--json", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


def test_replay_limit_40_verify_5_is_exact(tmp_path):
    rep = _replay(tmp_path, "--limit", "40", "--verify", "5")
    assert list(rep)[: len(REPORT_KEYS)] == list(REPORT_KEYS)
    assert rep["requests"] == 40 and rep["verify"]["requests"] == 5
    assert rep["verify"]["max_abs_logit_diff"] <= 1e-4
    assert rep["verify"]["greedy_mismatches"] == 0
    assert rep["reused_tokens"] > 0
    assert rep["reused_tokens"] + rep["computed_prompt_tokens"] == rep["prompt_tokens"]
    assert rep["reused_tokens"] <= rep["oracle_reused_tokens"]


def test_simulate_has_same_fields_without_verify(tmp_path):
    rep = _replay(tmp_path, "--simulate", "--limit", "300")
    assert list(rep)[: len(REPORT_KEYS)] == list(REPORT_KEYS)
    assert rep["verify"] is None and rep["mode"] == "simulate"
    assert rep["requests"] == 300 and 0 < rep["oracle_fraction"] <= 1.0
    assert set(rep["checkpoints_created"]) == {"branch", "tail", "interval"}


RATE_TOL = 0.05 + 1e-9
"""Rates are rounded to 0.1 request/s in the report."""


def test_report_gives_cpu_seconds_and_request_rates(tmp_path):
    rep = _replay(tmp_path, "--simulate", "--limit", "200")
    assert rep["cpu_seconds"] > 0 and rep["wall_seconds"] > 0
    assert abs(rep["requests_per_second"] - 200 / rep["wall_seconds"]) <= RATE_TOL
    assert abs(rep["requests_per_cpu_second"] - 200 / rep["cpu_seconds"]) <= RATE_TOL


def test_request_rates_count_the_requests_served(tmp_path):
    """18 of 20 requests rejected (4 KV pages): the rates are of the 2 served; all 20 rejected
    (1 page): the replay exits 1 and reports rates of 0.0, not an error or a null."""
    rep = _replay(tmp_path, "--simulate", "--limit", "20", "--kv-pages", "4")
    assert rep["requests"] + rep["rejected"]["requests"] == 20 and rep["rejected"]["requests"] > 0
    assert abs(rep["requests_per_cpu_second"] - rep["requests"] / rep["cpu_seconds"]) <= RATE_TOL
    out = tmp_path / "none.json"
    assert main(["replay", "--no-progress", "--json", str(out), "--simulate", "--limit", "20", "--kv-pages", "1"]) == 1
    none = json.loads(out.read_text())
    assert none["requests"] == 0 and none["rejected"]["requests"] == 20
    assert none["requests_per_second"] == none["requests_per_cpu_second"] == 0.0 and none["cpu_seconds"] >= 0


def test_two_instances_share_a_store(tmp_path):
    store = tmp_path / "store"
    rep = _replay(tmp_path, "--limit", "40", "--model", "tiny", "--instances", "2", "--verify", "4",
                  "--store", f"disk://{store}")
    assert rep["verify"]["greedy_mismatches"] == 0 and rep["verify"]["max_abs_logit_diff"] <= 1e-4
    assert rep["tiers"]["store"]["hit_tokens"] > 0 and rep["tiers"]["store"]["bytes_saved"] > 0
    assert set(rep["store_misses"]) == {"absent", "evicted", "checksum", "incomplete", "unreachable", "expired"}
    # a second fleet on the same disk store (restart) starts warm
    rep2 = _replay(tmp_path, "--limit", "8", "--model", "tiny", "--store", f"disk://{store}")
    assert rep2["tiers"]["store"]["hit_tokens"] > 0
    # the report names the weight digest, so the replay's entries can be purged by model version
    digest = rep["config"]["weight_digest"]
    assert digest == rep2["config"]["weight_digest"] and len(digest) == 64 and int(digest, 16) >= 0
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "cache", "purge", "--store", f"disk://{store}",
                           "--model", "tiny", "--weight-digest", digest], check=True, capture_output=True, text=True)
    removed = int(proc.stdout.split("removed ")[1].split()[0])
    assert removed > 0, proc.stdout
    rep3 = _replay(tmp_path, "--limit", "8", "--model", "tiny", "--store", f"disk://{store}")
    assert rep3["tiers"]["store"]["hit_tokens"] == 0 and rep3["warm_start_reused_tokens"] == 0


def test_bad_trace_line_names_file_and_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 1, "input_length": -4, "output_length": 5, "hash_ids": [1]}\n')
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "replay", "--trace", str(trace), "--simulate",
                           "--no-progress"], check=False, capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"{trace}:2" in proc.stderr and "input_length" in proc.stderr
    rep = _replay(tmp_path, "--trace", str(trace), "--simulate", "--skip-bad")
    assert rep["requests"] == 1 and rep["skipped_lines"] == 1


def test_bad_option_names_the_value(capsys):
    assert main(["replay", "--simulate", "--limit", "5", "--prefix-match-unit", "48", "--no-progress"]) == 2
    assert "prefix_match_unit=48" in capsys.readouterr().err


def test_store_absent_at_startup_runs_without_it(tmp_path, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                                    # nothing listens here
    out = tmp_path / "r.json"
    with caplog.at_level("WARNING"):
        rc = main(["replay", "--limit", "3", "--model", "tiny", "--no-progress", "--json", str(out),
                   "--store", f"mooncake://127.0.0.1:{port}"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["requests"] == 3 and rep["tiers"]["store"]["bytes_saved"] == 0
    assert sum("unreachable" in r.message or "running without it" in r.message for r in caplog.records) == 1


def test_rejected_requests_are_reported_and_all_rejected_exits_1(tmp_path, capsys):
    """Before: `--kv-pages 1` exited 0 reporting `requests 0` and no reason."""
    out = tmp_path / "rej.json"
    rc = main(["replay", "--no-progress", "--model", "tiny", "--limit", "3", "--kv-pages", "1", "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 1 and rep["requests"] == 0
    assert rep["rejected"]["requests"] == 3
    # one entry for the kind of refusal, however many requests and of whatever sizes
    assert rep["rejected"]["reasons"] == {REJECT_POOL_TOO_SMALL: 3}
    example = rep["rejected"]["examples"][REJECT_POOL_TOO_SMALL]
    assert example.startswith("needs ") and example.endswith("the pool has 1")
    assert f"every request (3) was rejected: {example}" in " ".join(capsys.readouterr().err.split())


def test_an_unwritable_json_path_fails_before_the_run(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    rc = main(["replay", "--no-progress", "--model", "tiny", "--limit", "1",
               "--json", str(tmp_path / "file" / "r.json")])
    err = capsys.readouterr()
    assert rc == 2 and "error: --json" in err.err and "hybridkv replay" not in err.out   # no run, no table


def test_a_missing_model_directory_is_named(tmp_path, capsys):
    rc = main(["replay", "--no-progress", "--model", str(tmp_path / "no-such-dir"), "--limit", "1"])
    assert rc == 2 and "model directory" in capsys.readouterr().err.replace("\n", " ")


def test_a_block_size_above_most_prompts_warns_that_lower_tiers_stay_empty(tmp_path, capsys):
    rc = main(["replay", "--no-progress", "--model", "tiny", "--limit", "3", "--block-size", "2048",
               "--json", str(tmp_path / "r.json")])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 0 and err.count("warning:") == 1 and "host tier's entry size (2048 tokens)" in err


def test_a_warm_store_keeps_the_oracle_fraction_within_one(tmp_path):
    """A second run against a store the first one filled reuses more than this run's oracle allows:
    that share is reported apart (before: "fraction of oracle" read 2942%)."""
    store = f"disk://{tmp_path / 'store'}"
    first = _replay(tmp_path, "--model", "tiny", "--limit", "12", "--store", store)
    second = _replay(tmp_path, "--model", "tiny", "--limit", "12", "--store", store)
    assert first.get("warm_start_reused_tokens", 0) == 0
    assert second["reused_tokens"] > second["oracle_reused_tokens"] and second["warm_start_reused_tokens"] > 0
    for rep in (first, second):
        assert 0 <= rep["oracle_fraction"] <= 1


def _silent_port():
    """A loopback port that accepts connections and never answers; closed by the caller."""
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []

    def accept():
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv, held


def test_a_store_that_accepts_but_never_answers_costs_seconds_not_30(tmp_path, caplog, capsys):
    """Before: Mooncake's setup blocked for its 30 s RPC timeout (holding the GIL) before the replay
    ran without the store. Now a probe finds the silent port in about 2 s; with --store-required
    the replay refuses to start instead."""
    import time

    pytest.importorskip("mooncake")
    srv, held = _silent_port()
    url = f"mooncake://127.0.0.1:{srv.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        with caplog.at_level("WARNING"):
            rc = main(["replay", "--limit", "1", "--model", "tiny", "--no-progress", "--store", url])
        assert rc == 0 and time.monotonic() - t0 < 20
        assert any("does not answer" in r.message for r in caplog.records)
        capsys.readouterr()
        rc = main(["replay", "--limit", "1", "--model", "tiny", "--no-progress", "--store", url, "--store-required"])
        err = capsys.readouterr().err
        assert rc == 2 and f"--store-required: store {url} unreachable" in err and "does not answer" in err
    finally:
        srv.close()
        for c in held:
            c.close()


def test_ctrl_c_in_a_replay_writes_what_ran_and_exits_130(tmp_path, monkeypatch, capsys):
    """Before: Ctrl-C printed a traceback and wrote nothing. Now the replay stops, prints and
    writes the figures of the requests admitted so far, says so, and exits 130."""
    from hybridkv.engine.engine import Engine

    step, calls = Engine.step, []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "step", interrupted_step)
    out = tmp_path / "r.json"
    rc = main(["replay", "--model", "tiny", "--limit", "40", "--no-progress", "--json", str(out)])
    err = capsys.readouterr()
    assert rc == 130
    rep = json.loads(out.read_text())
    assert rep["interrupted"] is True and 0 < rep["requests"] < 40
    assert f"interrupted: the report covers the {rep['requests']} requests" in err.err.replace("\n", " ")
    assert "interrupted" in err.out                                         # the table says so too


def test_ctrl_c_to_a_two_instance_replay_stops_every_process(tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group (the runner, the manager
    and both instance processes). The workers return what they measured; the report is written."""
    import os
    import signal
    import time

    out = tmp_path / "r.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "replay", "--model", "tiny", "--limit", "1000",
                             "--instances", "2", "--no-progress", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:     # until the shared store fills:
            time.sleep(0.5)                                            # requests are running
            if sum(1 for p in scratch.glob("hybridkv-store-*/**/*") if p.is_file()) >= 20:
                break
        os.killpg(proc.pid, signal.SIGINT)
        _stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["interrupted"] is True and 0 < rep["requests"] < 1000
    assert "Traceback" not in stderr


@pytest.mark.parametrize(("url", "text"), [("mooncake://127.0.0.1", "needs host:port"),
                                           ("mooncake://127.0.0.1:99999", "'99999' is not a TCP port")])
@pytest.mark.parametrize("required", [True, False])
def test_a_bad_store_url_is_one_error_line_with_or_without_store_required(url, text, required, capsys):
    """A malformed URL is the user's typo, not an unreachable store: refused either way."""
    args = ["replay", "--simulate", "--limit", "3", "--no-progress", "--store", url]
    code = main(args + (["--store-required"] if required else []))
    err = capsys.readouterr()
    assert code == 2
    lines = (err.out + err.err).strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and text in lines[0]


def test_more_instances_than_requests_is_refused_before_any_process_starts(capsys):
    assert main(["replay", "--simulate", "--limit", "3", "--instances", "4", "--no-progress"]) == 2
    err = capsys.readouterr()
    assert "instances=4 is more than the 3 requests" in err.out + err.err


@pytest.mark.parametrize(("args", "text"), [
    (["--simulate", "--limit", "3", "--store", "bogus://x"], "a simulated replay has no tensors to store"),
    (["--simulate", "--all", "--limit", "5"], "--all and --limit 5 contradict"),
])
def test_options_a_replay_would_ignore_are_refused(args, text, capsys):
    assert main(["replay", "--no-progress", *args]) == 2
    err = capsys.readouterr()
    assert text in err.out + err.err


def test_a_json_path_in_a_missing_directory_is_refused_and_not_created(tmp_path, capsys):
    path = tmp_path / "no-such-dir" / "r.json"
    assert main(["replay", "--simulate", "--limit", "3", "--no-progress", "--json", str(path)]) == 2
    err = capsys.readouterr()
    assert "no directory" in " ".join((err.out + err.err).split()) and not path.parent.exists()   # rich wraps


def test_a_fault_asked_without_timed_is_shown_as_written(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--simulate", "--limit", "3", "--no-progress", "--crash", "0@5", "--crash", "1@7.5"])
    assert "--crash 0@5 1@7.5 needs --timed" in capsys.readouterr().err


def test_the_rejected_example_is_the_largest_refusal_however_the_requests_are_split(tmp_path):
    """Each instance keeps its largest refused request; the report keeps the largest of those,
    so the example does not depend on the instance count (a timed replay asks for the trace's
    output lengths, so its requests differ from the untimed ones)."""
    examples = []
    for extra in (["--instances", "1"], ["--instances", "4"], ["--instances", "1", "--timed"],
                  ["--instances", "4", "--timed"]):
        out = tmp_path / f"rej{len(examples)}.json"
        rc = main(["replay", "--no-progress", "--simulate", "--limit", "60", "--kv-pages", "1", "--json", str(out),
                   *extra])
        rep = json.loads(out.read_text())
        assert rc == 1 and rep["rejected"]["requests"] == 60 == sum(rep["rejected"]["reasons"].values())
        examples.append(rep["rejected"]["examples"][REJECT_POOL_TOO_SMALL])
    assert examples[0] == examples[1] and examples[2] == examples[3]


def test_refused_requests_leave_the_oracle_and_a_partial_refusal_is_warned(tmp_path, capsys):
    """Before: the oracle counted every trace request, refused ones included, so refusals lowered
    the oracle fraction, and a run with some refusals said nothing outside its table."""
    full, part = tmp_path / "full.json", tmp_path / "part.json"
    assert main(["replay", "--no-progress", "--simulate", "--limit", "60", "--json", str(full)]) == 0
    capsys.readouterr()
    assert main(["replay", "--no-progress", "--simulate", "--limit", "60", "--kv-pages", "40",
                 "--json", str(part)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    f, p = json.loads(full.read_text()), json.loads(part.read_text())
    refused = p["rejected"]["requests"]
    assert 0 < refused < 60 and p["requests"] == 60 - refused and f["rejected"]["requests"] == 0
    assert f"warning: {refused} of 60 requests were rejected" in err
    assert p["rejected"]["examples"][REJECT_POOL_TOO_SMALL] in err
    assert 0 < p["oracle_reused_tokens"] < f["oracle_reused_tokens"]
    assert 0 <= p["oracle_fraction"] <= 1


def test_hybrid_flags_reach_the_hybrid_router_and_are_refused_where_they_mean_nothing(tmp_path, capsys, monkeypatch):
    """--waiting-weight, --tie-kv-run and --price-restore set the built router's HybridOptions
    (the rest stay at their defaults); each is refused without --timed, for another router,
    and out of range, naming the value."""
    import hybridkv.replay.timed as timed
    from hybridkv.fleet.routers import HybridOptions
    built, make = [], timed.make_router
    monkeypatch.setattr(timed, "make_router", lambda cfg: built.append(make(cfg)) or built[-1])
    out = tmp_path / "hy.json"
    assert main(["replay", "--no-progress", "--simulate", "--timed", "--instances", "4", "--limit", "30",
                 "--waiting-weight", "3", "--tie-kv-run", "off", "--price-restore", "off", "--json", str(out)]) == 0
    assert [r.options for r in built] == [HybridOptions(waiting_weight=3.0, tie_kv_run=False, price_restore=False)]
    capsys.readouterr()
    for argv, message in ((["--waiting-weight", "2"], "--waiting-weight 2 needs --timed"),
                          (["--timed", "--router", "prefix", "--tie-kv-run", "on"],
                           "--tie-kv-run on is an option of the hybrid router, not of prefix"),
                          (["--timed", "--price-restore", "maybe"], "invalid choice: 'maybe'"),
                          (["--timed", "--waiting-weight", "-1"], "'-1' must be a number in [0, 1000]")):
        with pytest.raises(SystemExit) as exc:
            main(["replay", "--simulate", "--limit", "5", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_own_waiting_reaches_the_hybrid_router_and_is_refused_where_it_means_nothing(tmp_path, capsys, monkeypatch):
    import hybridkv.replay.timed as timed
    built, make = [], timed.make_router
    monkeypatch.setattr(timed, "make_router", lambda cfg: built.append(make(cfg)) or built[-1])
    out = tmp_path / "ow.json"
    assert main(["replay", "--no-progress", "--simulate", "--timed", "--instances", "4", "--limit", "50",
                 "--own-waiting", "0.25", "--waiting-weight", "3", "--tie-kv-run", "off", "--price-restore", "off",
                 "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["own_waiting"] == 0.25
    assert (config["waiting_weight"], config["tie_kv_run"], config["price_restore"]) == (3.0, False, False)
    assert [r.options.own_waiting for r in built] == [0.25]
    assert main(["replay", "--no-progress", "--simulate", "--timed", "--instances", "4", "--limit", "50",
                 "--router", "least-load", "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert all(config[k] is None for k in ("own_waiting", "waiting_weight", "tie_kv_run", "price_restore"))
    capsys.readouterr()
    for argv, message in ((["--own-waiting", "0.5"], "--own-waiting 0.5 needs --timed"),
                          (["--timed", "--router", "prefix", "--own-waiting", "0.5"],
                           "--own-waiting 0.5 is an option of the hybrid router, not of prefix"),
                          (["--timed", "--instances", "1", "--own-waiting", "0.5"],
                           "not of round-robin (the default with --instances 1)"),
                          (["--timed", "--own-waiting", "1.5"], "'1.5' must be a fraction in [0, 1]")):
        with pytest.raises(SystemExit) as exc:
            main(["replay", "--simulate", "--limit", "5", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err
