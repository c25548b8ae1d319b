"""``hybridkv bench-serve`` against a live server: bounded, loopback only, reports what it saw."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.serve.bench import check_loopback


def test_bench_serve_replays_the_first_trace_requests(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench-serve", "--url", server.url, "--limit", "6", "--time-scale", "0.001", "--max-tokens", "2",
               "--max-seconds", "120", "--json", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["sent"] == 6 and summary["completed"] == 6 and summary["errors"] == {}
    assert summary["prompt_tokens"] > 6 * 64 and 0 <= summary["cached_tokens"] <= summary["prompt_tokens"]
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    assert "TTFT ms" in capsys.readouterr().out


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "https://127.0.0.1:8000", "http://example.com"])
def test_bench_serve_refuses_a_non_loopback_url(url, capsys):
    with pytest.raises(ValueError, match="only talks to"):
        check_loopback(url)
    assert main(["bench-serve", "--url", url, "--limit", "1"]) == 2
    assert "error:" in capsys.readouterr().err
