"""A simulated and a real run of one command line: every value the mode changes is said before the
run and written to the report (``workload_notes``); pinned values leave the two runs the same work."""

from __future__ import annotations

import json

from hybridkv.cli import main


def _run(tmp_path, capsys, *args):
    out = tmp_path / "report.json"
    capsys.readouterr()
    rc = main(["replay", "--no-progress", "--json", str(out), *args])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 0, err
    return json.loads(out.read_text()), err


def _options(rep):
    return [n["option"] for n in rep["workload_notes"]]


def test_simulate_says_every_default_it_changes(tmp_path, capsys):
    """Before: `--simulate` silently replayed 512-token blocks, the whole trace and 1 output token."""
    rep, err = _run(tmp_path, capsys, "--simulate", "--limit", "30")
    assert _options(rep) == ["--block-tokens", "--max-output-tokens", "--checkpoint-slots"]
    assert rep["config"]["block_tokens"] == 512
    note = rep["workload_notes"][0]
    assert note["this_run"].startswith("512") and note["other_mode"].startswith("64")
    assert "note: --block-tokens: 512 tokens per trace hash id" in err
    assert "without --simulate: 64" in err


def test_simulate_without_limit_names_the_limit(tmp_path, capsys):
    rep, err = _run(tmp_path, capsys, "--simulate", "--trace", _small_trace(tmp_path, 12))
    assert _options(rep)[0] == "--limit"
    assert "all 12 requests" in rep["workload_notes"][0]["this_run"]
    rep, _ = _run(tmp_path, capsys, "--simulate", "--all", "--trace", _small_trace(tmp_path, 12))
    assert "--limit" not in _options(rep)


def test_pinned_values_make_the_same_work(tmp_path, capsys):
    """The model run's values given: no note, and the simulated prompts are the model run's."""
    rep, err = _run(tmp_path, capsys, "--simulate", "--limit", "8", "--block-tokens", "64",
                    "--max-output-tokens", "1", "--checkpoint-slots", "40")
    assert rep["workload_notes"] == [] and "note:" not in err
    real, _ = _run(tmp_path, capsys, "--limit", "8", "--model", "tiny", "--block-tokens", "64",
                   "--max-output-tokens", "1", "--checkpoint-slots", "40", "--host-mib", "0")
    assert real["prompt_tokens"] == rep["prompt_tokens"] and real["workload_notes"] == []


def test_timed_simulation_names_pricing_store_and_host_tier(tmp_path, capsys):
    rep, err = _run(tmp_path, capsys, "--simulate", "--timed", "--instances", "2", "--limit", "30",
                    "--block-tokens", "64", "--max-output-tokens", "4", "--checkpoint-slots", "120")
    assert _options(rep) == ["--cost-model", "--store-gbps", "--host-mib"]
    assert "steps priced by h200-kimi-linear-48b" in rep["workload_notes"][0]["this_run"]
    assert "note: --host-mib: no host tier" in err
    rep, _ = _run(tmp_path, capsys, "--simulate", "--timed", "--instances", "2", "--limit", "30",
                  "--block-tokens", "64", "--max-output-tokens", "4", "--checkpoint-slots", "120",
                  "--host-mib", "0", "--store-gbps", "0")
    assert _options(rep) == ["--cost-model"]


def test_real_timed_run_says_its_router_uses_the_flat_estimate(tmp_path, capsys):
    """Before: a real timed run priced routing with a flat 4,000 tokens/s and said nothing."""
    args = ("--timed", "--limit", "2", "--model", "tiny", "--instances", "2", "--router", "hybrid",
            "--host-mib", "0")
    rep, err = _run(tmp_path, capsys, *args)
    assert _options(rep) == ["--cost-model"]
    assert "flat 4000 prefill tokens/s" in rep["workload_notes"][0]["this_run"]
    assert "note: --cost-model: the router prices prefill with flat 4000" in err
    rep, err = _run(tmp_path, capsys, *args, "--cost-model", "h200-kimi-linear-48b")
    assert rep["workload_notes"] == [] and "note:" not in err
    assert "H200" in rep["cost_model"]          # the router priced with the model given


def test_report_gives_peak_rss(tmp_path, capsys):
    rep, _ = _run(tmp_path, capsys, "--simulate", "--limit", "10")
    assert rep["peak_rss_bytes"] > 10 * 2**20


def _small_trace(tmp_path, n: int) -> str:
    from hybridkv.replay.trace import _bundled_path
    lines = [line for line in _bundled_path().read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)
