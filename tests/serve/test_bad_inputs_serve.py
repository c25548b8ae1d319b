"""Bad inputs to ``serve``, ``router`` and ``bench-serve`` end in a clear error, in bounded time:
a server that never answers, unknown or missing request fields, Ctrl-C with an open stream, and
a port already taken."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hybridkv.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers; yields its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(0.1)
    stop, held = threading.Event(), []

    def accept():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(sock.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for c in held:
            c.close()
        sock.close()


# -- bench-serve: a server that accepts and never answers ------------------------------------------

def test_bench_serve_names_a_server_that_never_answers_after_the_probe_timeout(capsys):
    with silent_server() as port:
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        rc = main(["bench-serve", "--url", url, "--limit", "1", "--probe-timeout", "0.5", "--max-seconds", "600"])
        waited = time.monotonic() - started
    err = capsys.readouterr().err
    assert rc == 2
    assert waited < 60                                  # a hang guard: --max-seconds (600) is not what bounds it
    assert f"timed out after 0.5 s waiting for {url}/v1/models" in err
    assert "--probe-timeout" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_serve_probe_timeout_must_be_a_finite_positive_number(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench-serve", "--probe-timeout", "0"])
    assert exit_.value.code == 2 and "--probe-timeout" in capsys.readouterr().err
