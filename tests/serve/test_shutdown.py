"""``hybridkv serve`` stops on SIGINT / SIGTERM even while long generations stream."""

from __future__ import annotations

import json
import signal
import socket

import pytest
from serve_helpers import EXIT_BOUND_S, running_cli


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_cleanly_without_waiting_for_running_streams(sig):
    """The open stream ends with an error chunk (``server_shutdown``) and ``[DONE]`` after the
    grace, the process exits 0, and its log says it shut down cleanly, without a traceback (an
    ASGI ``CancelledError`` was logged before). ``--port 0``: the startup line names the port
    picked."""
    with running_cli(["serve", "--model", "tiny", "--threads", "1"]) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        assert port != 0
        body = json.dumps({"model": "tiny", "prompt": [5] * 300, "max_tokens": 60_000, "stream": True,
                           "ignore_eos": True, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as client:   # stays connected
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            seen = b""
            while b"data: " not in seen:                           # generation is under way
                chunk = client.recv(65536)
                assert chunk, seen
                seen += chunk
            proc.send_signal(sig)
            rest = b""
            while chunk := client.recv(65536):                      # the server ends the stream
                rest += chunk
            assert proc.wait(timeout=EXIT_BOUND_S) == 0
            err = proc.stderr.read()
    assert b'"code": "server_shutdown"' in rest and b"data: [DONE]" in rest
    assert "Traceback" not in err and "CancelledError" not in err and "ERROR" not in err, err
    assert f"shut down cleanly on {sig.name}: 1 running request(s) ended" in err
