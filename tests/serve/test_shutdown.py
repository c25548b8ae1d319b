"""``hybridkv serve`` stops on SIGINT / SIGTERM even while long generations stream."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
EXIT_BOUND_S = 60          # a hang guard: the streams below would need minutes to reach max_tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_server_without_waiting_for_running_streams(sig):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", "--model", "tiny", "--port", str(port),
                             "--threads", "1"], env={**os.environ, "PYTHONPATH": str(SRC)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(600):                               # up to 60 s for the model to load
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
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
            assert proc.wait(timeout=EXIT_BOUND_S) in (0, -sig)     # uvicorn re-raises the signal it caught
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
