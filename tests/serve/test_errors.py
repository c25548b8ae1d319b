"""Bad input answers 4xx with an OpenAI error body, names the offending value, and loses nothing
already cached."""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest
from serve_helpers import prompt_ids

GOOD = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}

BAD = [
    ("malformed JSON", b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, None, "JSON object"),
    ("nested too deeply", b"[" * 100_000 + b"]" * 100_000, 400, None, "nested too deeply"),
    ("unknown model", {**GOOD, "model": "gpt-9"}, 404, "model", "'gpt-9' does not exist"),
    ("id beyond vocab", {**GOOD, "prompt": [5, 1024]}, 400, "prompt", "token id 1024"),
    ("negative id", {**GOOD, "prompt": [-1]}, 400, "prompt", "token id -1"),
    ("too long", {**GOOD, "prompt": [5] * 65536}, 400, "prompt", "exceeds the model's limit"),
    ("max_tokens 0", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "max_tokens=0"),
    ("max_tokens text", {**GOOD, "max_tokens": "5"}, 400, "max_tokens", "max_tokens='5'"),
    ("prompt number", {**GOOD, "prompt": 5}, 400, "prompt", "prompt must be"),
    ("float id", {**GOOD, "prompt": [5, 6.5]}, 400, "prompt", "integer"),
    ("empty prompt", {**GOOD, "prompt": []}, 400, "prompt", "prompt must be"),
    ("no prompt", {"model": "tiny"}, 400, "prompt", "prompt is required"),
    ("temperature text", {**GOOD, "temperature": "hot"}, 400, "temperature", "temperature='hot'"),
    ("top_p 0", {**GOOD, "top_p": 0}, 400, "top_p", "top_p=0"),
    ("stream not bool", {**GOOD, "stream": "yes"}, 400, "stream", "stream='yes'"),
    ("echo", {**GOOD, "echo": True}, 400, "echo", "echo"),
    ("bad hint", {**GOOD, "cache_hints": [10]}, 400, "cache_hints", "multiples of 64"),
    ("tenant clash", {**GOOD, "tenant": 7}, 400, "tenant", "tenant"),
    ("batch over the slots and queue", {**GOOD, "prompt": [[5]] * 69}, 400, "prompt",
     "a batch of 69 prompts exceeds this server's limit of 68 requests at once"),
    ("n true", {**GOOD, "n": True}, 400, "n", "n=True"),
    ("n float", {**GOOD, "n": 1.0}, 400, "n", "n=1.0"),
    ("include_usage text", {**GOOD, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options", "include_usage='yes'"),
    ("seed beyond int64", {**GOOD, "temperature": 1, "seed": 2**64}, 400, "seed", f"seed={2**64}"),
    ("seed below int64", {**GOOD, "temperature": 1, "seed": -2**63 - 1}, 400, "seed", f"seed={-2**63 - 1}"),
    # A lone surrogate escape is valid JSON but no Unicode text: the tokenizer and the namespace
    # digest could not encode it (500 Internal Server Error before).
    ("lone surrogate prompt", b'{"model": "tiny", "prompt": "a\\udc80b", "max_tokens": 1}', 400, None, "surrogate"),
    ("lone surrogate salt", b'{"model": "tiny", "prompt": "ab", "cache_salt": "\\ud800"}', 400, None, "surrogate"),
]


@pytest.mark.parametrize(("what", "body", "status", "param", "text"), BAD, ids=[b[0] for b in BAD])
def test_bad_completion_input_is_a_4xx_with_an_error_body(server, what, body, status, param, text):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = c.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and text in err["message"]


def test_bad_chat_messages_and_unknown_routes(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
        assert r.status_code == 400 and "wizard" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": "hello"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = c.post("/admin/cache/invalidate", json={})
        assert r.status_code == 400 and "exactly one scope" in r.json()["error"]["message"]


INVALIDATE_BAD = [({"tenant": 5}, "tenant", "tenant=5 must be a string"),
                  ({"cache_salt": ["s"]}, "cache_salt", "cache_salt=['s'] must be a string"),
                  ({"tenant": "nobody", "cache_salt": None}, None, None),     # null: not given (valid)
                  ({"all": "yes"}, "all", "all='yes' must be a boolean"),
                  ({"abi_version": 5}, "abi_version", "abi_version=5 must be an older cache ABI version"),
                  ({"abi_version": 0}, "abi_version", "abi_version=0 must be an older cache ABI version"),
                  ({"abi_version": "3"}, "abi_version", "abi_version='3' must be an older cache ABI version"),
                  ({"abi_version": True}, "abi_version", "abi_version=True must be an older cache ABI version"),
                  ({"abi_version": 2.0}, "abi_version", "abi_version=2.0 must be an older cache ABI version"),
                  ({"abi_version": 3, "all": True}, None, "give exactly one scope"),
                  ({"abi_version": 3, "tenant": "a"}, None, "give exactly one scope"),
                  ({"abi_version": 3}, None, None)]                           # valid (no store: nothing to remove)


@pytest.mark.parametrize(("body", "param", "text"), INVALIDATE_BAD, ids=[str(b[0]) for b in INVALIDATE_BAD])
def test_a_bad_invalidate_field_is_refused_naming_the_field_and_value(server, body, param, text):
    r = httpx.post(f"{server.url}/admin/cache/invalidate", json=body, timeout=60)
    if text is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err


def test_errors_lose_nothing_cached(server):
    ids = prompt_ids(21, 300)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/v1/completions", json={**GOOD, "prompt": ids})
        for _, body, *_ in BAD:
            c.post("/v1/completions", content=body if isinstance(body, bytes) else json.dumps(body).encode())
        again = c.post("/v1/completions", json={**GOOD, "prompt": ids + [9]}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 256


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_gets_a_completion_and_an_error(server):
    def curl(body: str) -> dict:
        out = subprocess.run(["curl", "-sS", "-H", "Content-Type: application/json", "-d", body,
                              server.url + "/v1/completions"], capture_output=True, text=True, timeout=60, check=True)
        return json.loads(out.stdout)
    ok = curl('{"model": "tiny", "prompt": "Say hi", "max_tokens": 3, "temperature": 0}')
    assert ok["choices"][0]["finish_reason"] in ("length", "stop") and ok["usage"]["prompt_tokens"] == 6
    assert curl('{"model": "tiny", "prompt": "x", "max_tokens": -1}')["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_names_a_port_outside_0_65535_in_one_line(port, capsys):
    from hybridkv.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", port])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --port: {port}" in err or f"argument --port: '{port}'" in err
    assert "Traceback" not in err


def test_two_x_tenant_headers_are_refused_not_served_as_the_first(server):
    """A request with two ``X-Tenant`` headers (a client's own and a gateway's appended one) names
    no single tenant: it is refused (400, param ``tenant``) on completions, chat and invalidate,
    never served in the first header's namespace."""
    headers = [("X-Tenant", "victim"), ("X-Tenant", "me"), ("Content-Type", "application/json")]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", chat),
                           ("/admin/cache/invalidate", {})):
            r = c.post(path, content=json.dumps(body).encode(), headers=headers)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == "tenant" and "X-Tenant" in err["message"] and "2" in err["message"]


def test_a_body_over_the_limit_is_refused_413_without_being_read_whole(server):
    """A body larger than ``MAX_BODY_BYTES`` (64 MiB) is refused with a 413 naming the limit, whether
    its length is declared or it comes chunked; the server still serves and has lost nothing."""
    from hybridkv.serve.protocol import MAX_BODY_BYTES

    ids = prompt_ids(22, 300)
    big = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    with httpx.Client(base_url=server.url, timeout=120) as c:
        c.post("/v1/completions", json={**GOOD, "prompt": ids})
        r = c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text[:200]
        assert str(MAX_BODY_BYTES) in r.json()["error"]["message"]

        def chunks():
            for i in range(0, len(big), 1 << 20):
                yield big[i:i + (1 << 20)]
        r = c.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text[:200]
        again = c.post("/v1/completions", json={**GOOD, "prompt": ids + [9]}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 256


@pytest.mark.parametrize(("query", "param"), [("after=abc", "after"), ("epoch=1.5", "epoch"), ("limit=x", "limit")])
def test_a_query_parameter_of_the_wrong_type_is_an_openai_error_naming_it(server, query, param):
    """FastAPI's own 422 ``{"detail": [...]}`` answered these; every refusal has the OpenAI body."""
    r = httpx.get(f"{server.url}/v1/cache/events?{query}", timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and query.split("=")[1] in err["message"]


def test_a_lone_surrogate_in_chat_or_invalidate_is_refused_and_a_pair_is_text(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for path, raw in (("/v1/chat/completions",
                           b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc80"}], "max_tokens": 1}'),
                          ("/admin/cache/invalidate", b'{"tenant": "\\udfff"}')):
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], (path, r.text)
        pair = b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1}'          # an emoji, escaped
        r = c.post("/v1/completions", content=pair, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4, r.text
