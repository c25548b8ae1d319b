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


def _closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]          # nothing listens once the socket is closed


@pytest.mark.parametrize(("url", "text"), [("http://127.0.0.1:99999", "out of range"),
                                           (None, "cannot read the server's /v1/models")])
def test_bench_serve_names_a_bad_port_or_an_absent_server_in_one_line(url, text, capsys):
    url = url or f"http://127.0.0.1:{_closed_port()}"
    assert main(["bench-serve", "--url", url, "--limit", "1", "--max-seconds", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --url") and text in err and "Traceback" not in err


def test_bench_serve_names_an_unwritable_json_path(server, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "r.json"
    assert main(["bench-serve", "--url", server.url, "--limit", "1", "--json", str(path)]) == 2
    assert f"error: --json {path}" in capsys.readouterr().err
