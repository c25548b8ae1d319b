import json

import pytest
from rich.console import Console

from hybridkv.replay.report import (
    REPORT_KEYS,
    ReplayReport,
    VerifyReport,
    ratio,
    render_summary,
)

EXPECTED_KEYS = [
    "requests",
    "prompt_tokens",
    "computed_prompt_tokens",
    "reused_tokens",
    "token_hit_rate",
    "request_hit_rate",
    "byte_weighted_hit_rate",
    "oracle_reused_tokens",
    "oracle_fraction",
    "checkpoints_created",
    "branch_recompute_tokens",
    "checkpoint_bytes_peak",
    "kv_bytes_peak",
    "verify",
    "wall_seconds",
    "prefill_tokens_per_second",
]


def make(verify=None, **extra) -> ReplayReport:
    return ReplayReport(
        requests=12_031,
        prompt_tokens=144_793_823,
        computed_prompt_tokens=100_000_000,
        reused_tokens=44_793_823,
        token_hit_rate=ratio(44_793_823, 144_793_823),
        request_hit_rate=0.5,
        byte_weighted_hit_rate=0.3,
        oracle_reused_tokens=54_063_104,
        oracle_fraction=ratio(44_793_823, 54_063_104),
        checkpoints_created={"branch": 10, "every_block": 3},
        branch_recompute_tokens=2048,
        checkpoint_bytes_peak=41 << 20,
        kv_bytes_peak=3 << 30,
        verify=verify,
        wall_seconds=12.5,
        prefill_tokens_per_second=8e6,
        **extra,
    )


def test_keys_exact_and_ordered():
    assert list(REPORT_KEYS) == EXPECTED_KEYS
    data = json.loads(make().to_json())
    assert list(data) == EXPECTED_KEYS
    assert data["verify"] is None
    assert data["checkpoints_created"] == {"branch": 10, "every_block": 3}


def test_optional_keys_follow_required():
    report = make(VerifyReport(4, 1.5e-6, 0), mode="real", config={"block_size": 64}, skipped_lines=2)
    data = json.loads(report.to_json())
    assert list(data)[: len(EXPECTED_KEYS)] == EXPECTED_KEYS
    assert list(data)[len(EXPECTED_KEYS) :] == ["mode", "config", "skipped_lines"]
    assert data["verify"] == {"requests": 4, "max_abs_logit_diff": 1.5e-6, "greedy_mismatches": 0}


def test_round_trip_and_write(tmp_path):
    report = make(VerifyReport(2, 0.0, 1), mode="simulate")
    path = report.write_json(tmp_path / "sub" / "report.json")
    assert ReplayReport.from_json(path.read_text()) == report
    assert ReplayReport.from_json(make().to_json()) == make()
    with pytest.raises(ValueError, match="missing keys"):
        ReplayReport.from_dict({"requests": 1})


def test_null_rates_and_ratio():
    assert ratio(1, 0) is None and ratio(1, 4) == 0.25
    report = make()
    report.token_hit_rate = None
    report.oracle_fraction = None
    data = json.loads(report.to_json())
    assert data["token_hit_rate"] is None and data["oracle_fraction"] is None
    report.wall_seconds = float("nan")
    with pytest.raises(ValueError):
        report.to_json()


def test_render_summary_formats():
    console = Console(record=True, width=100, color_system=None)
    render_summary(make(VerifyReport(4, 1.5e-6, 0), skipped_lines=3), console)
    text = console.export_text()
    assert "144,793,823" in text
    assert "30.94%" in text  # token hit rate
    assert "82.85%" in text  # oracle fraction
    assert "41.00 MiB" in text and "3.00 GiB" in text
    assert "every_block" in text and "skipped" in text
    assert "1.5e-06" in text
    sim = Console(record=True, width=100, color_system=None)
    render_summary(make(), sim)
    assert "off" in sim.export_text()
