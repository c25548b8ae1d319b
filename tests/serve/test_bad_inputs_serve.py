"""Bad inputs to ``serve``, ``router`` and ``bench-serve`` end in a clear error, in bounded time:
a server that never answers, unknown or missing request fields, and a port already taken
(Ctrl-C with an open stream: test_shutdown.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import threading
import time

import httpx
import pytest

from hybridkv.cli import main


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


# -- request bodies: one field schema on the server and the router ----------------------------------

GOOD = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

FIELD_ERRORS = [
    ("best_of 3", "/v1/completions", {**GOOD, "best_of": 3}, "best_of", "best_of=3 is not supported"),
    ("best_of on chat", "/v1/chat/completions", {**CHAT, "best_of": 3}, "best_of", "unknown field 'best_of'"),
    ("unknown field", "/v1/completions", {**GOOD, "bogus": 1}, "bogus", "unknown field 'bogus'"),
    ("unknown null field", "/v1/chat/completions", {**CHAT, "bogus": None}, "bogus", "unknown field 'bogus'"),
    ("penalty", "/v1/completions", {**GOOD, "frequency_penalty": 1.5}, "frequency_penalty",
     "frequency_penalty=1.5 is not supported"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools", "tools=[{"),
    ("user not text", "/v1/completions", {**GOOD, "user": 5}, "user", "user=5 must be a string"),
    ("max_tokens disagree", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 3}, "max_completion_tokens",
     "disagree"),
    ("no model", "/v1/completions", {"prompt": [5, 6], "max_tokens": 1}, "model", "missing required field model"),
    ("no model chat", "/v1/chat/completions", {"messages": CHAT["messages"]}, "model",
     "missing required field model"),
    ("model null", "/v1/completions", {**GOOD, "model": None}, "model", "missing required field model"),
    ("model number", "/v1/completions", {**GOOD, "model": 5}, "model", "model=5 (int) must be a string"),
]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


@pytest.mark.parametrize(("what", "path", "body", "param", "text"), FIELD_ERRORS, ids=[f[0] for f in FIELD_ERRORS])
def test_a_field_the_server_cannot_honour_is_a_400_naming_it(server, what, path, body, param, text):
    r = _post(server.url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and text in err["message"]


ACCEPTED = [("/v1/completions", {**GOOD, "user": "u-1", "best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0,
                                 "logit_bias": {}, "suffix": None, "n": 1, "logprobs": None, "echo": False,
                                 "metadata": {"k": "v"}, "store": False, "max_completion_tokens": 1}),
            ("/v1/chat/completions", {**CHAT, "user": "u-1", "tools": [], "tool_choice": "none",
                                      "parallel_tool_calls": True, "response_format": {"type": "text"},
                                      "top_logprobs": 0, "logprobs": False, "max_tokens": None,
                                      "max_completion_tokens": 1})]


@pytest.mark.parametrize(("path", "body"), ACCEPTED, ids=["completions", "chat"])
def test_ignored_fields_and_neutral_values_are_accepted(server, path, body):
    r = _post(server.url, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


# What sglang-router 0.3.2 sends for a client's minimal request: it re-serializes the body from its
# typed request, so its non-optional fields always arrive (checked against the router itself).
SGLANG_ROUTER = [("/v1/completions", {**GOOD, "stream": False, "echo": False, "no_stop_trim": False,
                                      "ignore_eos": False, "skip_special_tokens": True,
                                      "return_hidden_states": False}),
                 ("/v1/chat/completions", {**CHAT, "logprobs": False, "stream": False, "no_stop_trim": False,
                                           "ignore_eos": False, "continue_final_message": False,
                                           "skip_special_tokens": True, "separate_reasoning": True,
                                           "stream_reasoning": True, "return_hidden_states": False})]


@pytest.mark.parametrize(("path", "body"), SGLANG_ROUTER, ids=["completions", "chat"])
def test_the_bodies_sglang_router_sends_are_accepted(server, path, body):
    r = _post(server.url, path, body)
    assert r.status_code == 200, r.text
    refused = _post(server.url, path, {**body, "skip_special_tokens": False})          # it would change the text
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "skip_special_tokens"


def test_the_openai_client_defaults_and_its_common_options_are_accepted(server):
    import openai
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=1).choices[0].finish_reason
    out = c.completions.create(model="tiny", prompt="hi", max_tokens=1, user="u", n=1, best_of=1, echo=False,
                               frequency_penalty=0, presence_penalty=0, seed=3, temperature=0.5, top_p=0.9,
                               stop=["x"], logit_bias={}, suffix="")
    assert out.usage.completion_tokens == 1
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_completion_tokens=2, stream=True, user="u",
                                            stream_options={"include_usage": True}, metadata={"run": "t"}))
    assert chunks[-1].usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="tiny", prompt="hi", max_tokens=1, best_of=3)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "best_of"


def test_invalidate_refuses_an_unknown_field(server):
    """A misspelt scope field (``cache_slat``) would otherwise widen the purge to the whole tenant."""
    r = httpx.post(f"{server.url}/admin/cache/invalidate", json={"tenant": "t-x", "cache_slat": "s"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "cache_slat" and "unknown field 'cache_slat'" in err["message"]


def _router(worker_urls: list[str]):
    import argparse

    from hybridkv.serve.commands import router_service
    from hybridkv.serve.launch import BackgroundUvicorn
    from hybridkv.serve.router import create_router_app
    args = argparse.Namespace(worker=worker_urls, policy="hybrid", model="tiny", cost_model=None, poll_interval=0.05,
                              health_every=2, follow_wait=0.0, store_gbps=1.1, store_latency_us=194.0)
    service = router_service(args)
    return BackgroundUvicorn(create_router_app(service), "127.0.0.1", 0, lifespan="on",
                             end_running=service.end_running)


def test_the_router_answers_the_same_400s_as_its_workers(server):
    router = _router([server.url])
    try:
        for what, path, body, param, text in FIELD_ERRORS:
            direct, routed = _post(server.url, path, body), _post(router.url, path, body)
            assert routed.status_code == direct.status_code == 400, what
            assert routed.json() == direct.json(), what
        batch = {**GOOD, "prompt": [[5, 6], [7, 8]], "best_of": 2}          # a batch the router would split
        r = _post(router.url, "/v1/completions", batch)
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
        assert _post(router.url, "/v1/completions", {**GOOD, "user": "u"}).status_code == 200
    finally:
        router.close()


def test_the_router_refuses_a_bad_field_with_no_worker_in_rotation():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = s.getsockname()[1]                       # nothing listens once it is closed
    router = _router([f"http://127.0.0.1:{gone}"])
    try:
        r = _post(router.url, "/v1/completions", {"prompt": [5], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert _post(router.url, "/v1/completions", GOOD).status_code == 503       # a good body: no worker
    finally:
        router.close()


# -- a taken port; --port 0 ---------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", [["serve", "--model", "tiny", "--threads", "1"],
                                 ["router", "--worker", "http://127.0.0.1:9"]], ids=["serve", "router"])
def test_a_taken_port_is_named_at_start(cmd, capsys):
    with socket.socket() as holder:                     # another process's server on the port
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        rc = main([*cmd, "--port", str(port)])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --port {port}: 127.0.0.1:{port} is already in use by another process; choose another port with "
        "--port N, or --port 0 for a free one (printed at start)")


def test_port_0_picks_a_free_port_and_prints_it():
    from serve_helpers import EXIT_BOUND_S, running_cli

    with running_cli(["router", "--worker", "http://127.0.0.1:9"]) as (proc, url):
        assert not url.endswith(":0")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503       # listening; no worker in rotation
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=EXIT_BOUND_S) == 0
        assert "Traceback" not in proc.stderr.read()


class _Records(logging.Handler):
    """Collects the log records of a logger (uvicorn's do not propagate to pytest's handler)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        """Messages of the records at ERROR or above."""
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR]


@pytest.fixture
def uvicorn_log():
    """uvicorn's error log records while the test runs (a :class:`_Records`)."""
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        yield records
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)


@pytest.fixture
def stopping_router(server, uvicorn_log):
    """A router in front of ``server``, its worker in rotation; the test stops it (closed again at
    the end, which does nothing then)."""
    router = _router([server.url])
    try:
        for _ in range(200):
            if httpx.get(f"{router.url}/health", timeout=10).status_code == 200:
                break
            time.sleep(0.05)
        yield router
    finally:
        router.close()


def test_a_stopping_router_ends_the_stream_it_relays_cleanly(server, stopping_router, uvicorn_log):
    """The router's stream is ended with an error chunk and ``[DONE]`` after the grace; uvicorn
    cancels nothing (it logged an ASGI ``CancelledError`` before) and the worker's job is cancelled."""
    from serve_helpers import wait_idle

    body = {"model": "tiny", "prompt": [5] * 100, "max_tokens": 60_000, "stream": True, "ignore_eos": True,
            "temperature": 0}
    with httpx.stream("POST", f"{stopping_router.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))          # generation under way
        closing = threading.Thread(target=stopping_router.close)
        closing.start()
        rest = [line for line in lines if line]
        closing.join(30)
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "server_shutdown"
    assert not uvicorn_log.errors()
    assert wait_idle(server)["running"] == 0


def test_a_stopping_server_answers_a_running_non_streaming_request_503(uvicorn_log):
    """After the grace, a non-streaming request still generating is answered 503
    (``server_shutdown``) instead of being cancelled with its connection; nothing is logged as an
    error."""
    from serve_helpers import wait_running

    from hybridkv.serve.launch import RunningServer, ServeOptions

    answers: list[httpx.Response] = []
    s = RunningServer(ServeOptions(port=0, threads=1))
    try:
        body = {"model": "tiny", "prompt": [5] * 100, "max_tokens": 60_000, "ignore_eos": True, "temperature": 0}
        client = threading.Thread(target=lambda: answers.append(_post(s.url, "/v1/completions", body)))
        client.start()
        wait_running(s)
    finally:
        s.close()
    client.join(30)
    (r,) = answers
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown", r.text
    assert "the server is shutting down" in r.json()["error"]["message"]
    assert not uvicorn_log.errors()


def test_a_stopping_router_answers_a_request_still_waiting_for_its_worker_503(server, stopping_router, uvicorn_log):
    """A non-streaming request whose worker has not answered yet when the router stops gets a
    503 (``server_shutdown``), and the worker's job is cancelled."""
    from serve_helpers import wait_idle, wait_running

    answers: list[httpx.Response] = []
    body = {"model": "tiny", "prompt": [7] * 100, "max_tokens": 60_000, "ignore_eos": True, "temperature": 0}
    client = threading.Thread(target=lambda: answers.append(_post(stopping_router.url, "/v1/completions", body)))
    client.start()
    wait_running(server)
    stopping_router.close()
    client.join(30)
    (r,) = answers
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown", r.text
    assert not uvicorn_log.errors()
    assert wait_idle(server)["running"] == 0
