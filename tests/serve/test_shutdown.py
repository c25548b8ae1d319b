"""``hybridkv serve`` stops on SIGINT / SIGTERM even while long generations stream."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
EXIT_BOUND_S = 60          # a hang guard: the streams below would need minutes to reach max_tokens


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_cleanly_without_waiting_for_running_streams(sig):
    """The open stream ends with an error chunk (``server_shutdown``) and ``[DONE]`` after the
    grace, the process exits 0, and its log says it shut down cleanly, without a traceback (an
    ASGI ``CancelledError`` was logged before). ``--port 0``: the startup line names the port
    picked."""
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", "--model", "tiny", "--port", "0",
                             "--threads", "1"], env={**os.environ, "PYTHONPATH": str(SRC)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        started = next((line for line in proc.stderr if "serving tiny on http://127.0.0.1:" in line), "")
        assert started.rstrip().endswith("(Ctrl-C stops it)"), started
        port = int(started.split("http://127.0.0.1:")[1].split()[0])
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
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
