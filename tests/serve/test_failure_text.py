"""A worker read that times out is logged with the call it was making (an httpx timeout's text may be empty)."""
import socket

import httpx

from hybridkv.serve.fleet_view import failure_text

TIMEOUT_S = 0.3


def test_timeout_names_the_call() -> None:
    with socket.socket() as srv:                 # accepts, never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        try:
            httpx.get(f"http://127.0.0.1:{port}/get_load", timeout=TIMEOUT_S)
        except httpx.ReadTimeout as exc:
            text = failure_text(exc)
        else:  # pragma: no cover - the socket never answers
            raise AssertionError("expected a read timeout")
    assert text.startswith("ReadTimeout: ") and text.endswith("(GET /get_load)")


def test_text_kept_and_bounded() -> None:
    assert failure_text(ValueError("bad json")) == "ValueError: bad json"
    assert len(failure_text(KeyError("k" * 500))) == 200
    assert failure_text(httpx.ReadTimeout("")) == "ReadTimeout: no detail"
