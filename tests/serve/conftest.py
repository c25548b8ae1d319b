"""Live servers on 127.0.0.1 (free ports, the tiny preset) for the serve tests."""

from __future__ import annotations

import pytest

from hybridkv.serve.launch import RunningServer, ServeOptions


@pytest.fixture(scope="session")
def server():
    """The main server: cache on, 4 sequences at once."""
    with RunningServer(ServeOptions(port=0, threads=1)) as s:
        yield s


@pytest.fixture(scope="session")
def server_off():
    """The same model with reuse off (policy ``none``): the reference for exactness."""
    with RunningServer(ServeOptions(port=0, threads=1, policy="none")) as s:
        yield s
