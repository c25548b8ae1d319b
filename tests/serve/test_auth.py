"""API keys, the admin key and tenants bound to keys, on `hybridkv serve` and `hybridkv router`.

Real servers on 127.0.0.1 (free ports, the tiny preset), the `openai` client and httpx.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import prompt_ids

from hybridkv.serve.auth import KeyRing, keyring_from_options
from hybridkv.serve.commands import main, router_service
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.router import create_router_app

KEYS = {"sk-plain-0001": None, "sk-tenant-x-0002": "x", "sk-tenant-y-0003": "y"}
ADMIN = "sk-admin-0004"


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed():
    with RunningServer(ServeOptions(port=0, threads=1, auth=KeyRing(KEYS, (ADMIN,)))) as s:
        yield s


def _complete(url: str, key: str | None, prompt, **extra) -> httpx.Response:
    headers = {**(_bearer(key) if key else {}), **extra.pop("headers", {})}
    return httpx.post(f"{url}/v1/completions", timeout=60, headers=headers,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_missing_or_wrong_key_is_refused_with_an_openai_shaped_401(keyed):
    for headers in ({}, _bearer("sk-wrong"), {"Authorization": "Basic c2stcGxhaW4tMDAwMQ=="}):
        r = httpx.post(f"{keyed.url}/v1/completions", headers=headers, timeout=30,
                       json={"model": "tiny", "prompt": [5, 6], "max_tokens": 1})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        assert "sk-" not in err["message"]                             # the key is never echoed
    assert httpx.get(f"{keyed.url}/v1/models", timeout=30).status_code == 401
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="tiny", prompt=[5, 6], max_tokens=1)


def test_health_stays_open_and_metrics_count_refusals(keyed):
    assert httpx.get(f"{keyed.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{keyed.url}/v1/models", timeout=30).status_code == 401

    def refused() -> float:
        r = httpx.get(f"{keyed.url}/metrics", headers=_bearer(ADMIN), timeout=30)
        assert r.status_code == 200
        return sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
                   if s.name == "hybridkv_http_errors_total" and s.labels.get("code") == "401")

    before = refused()
    assert httpx.get(f"{keyed.url}/v1/models", timeout=30).status_code == 401
    assert refused() == before + 1


def test_a_key_bound_to_tenant_x_claiming_tenant_y_is_refused_and_learns_nothing(keyed):
    """y caches a prompt; x's key naming y (header or field) gets a 403 with no usage, and x's
    own requests of the same prompt reuse nothing of y's."""
    ids = prompt_ids(500, 300)
    y = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-tenant-y-0003", max_retries=0)
    x = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-tenant-x-0002", max_retries=0)
    y.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0)
    hit = y.completions.create(model="tiny", prompt=ids + [9], max_tokens=1, temperature=0)
    assert hit.usage.prompt_tokens_details.cached_tokens == 256                 # y's cache holds it
    with pytest.raises(openai.PermissionDeniedError) as header_claim:
        x.completions.create(model="tiny", prompt=ids + [9], max_tokens=1, extra_headers={"X-Tenant": "y"})
    with pytest.raises(openai.PermissionDeniedError) as field_claim:
        x.completions.create(model="tiny", prompt=ids + [9], max_tokens=1, extra_body={"tenant": "y"})
    for exc in (header_claim.value, field_claim.value):
        body = exc.response.json()
        assert set(body) == {"error"} and body["error"]["code"] == "tenant_mismatch"
        assert body["error"]["type"] == "permission_error"
    with pytest.raises(openai.PermissionDeniedError):                    # chat is bound the same way
        x.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                  extra_headers={"X-Tenant": "y"})
    own = x.completions.create(model="tiny", prompt=ids + [9], max_tokens=1, temperature=0,
                               extra_headers={"X-Tenant": "x"})               # naming its own tenant is fine
    assert own.usage.prompt_tokens_details.cached_tokens == 0                # nothing of y's reached x
    assert _cached(_complete(keyed.url, "sk-tenant-y-0003", ids + [8])) == 256
    # a key bound to no tenant, and the admin key, may name any tenant (a trusted gateway)
    assert _cached(_complete(keyed.url, "sk-plain-0001", ids + [7], headers={"X-Tenant": "y"})) == 256
    assert _cached(_complete(keyed.url, ADMIN, ids + [6], tenant="y")) == 256


def test_admin_routes_need_the_admin_key(keyed):
    url = keyed.url
    for path, body in (("/admin/cache/invalidate", {"tenant": "x"}), ("/flush_cache", None)):
        assert httpx.post(url + path, json=body, timeout=30).status_code == 401
        r = httpx.post(url + path, json=body, headers=_bearer("sk-plain-0001"), timeout=30)    # bound to none
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert httpx.post(url + path, json=body, headers=_bearer(ADMIN), timeout=30).status_code == 200
    for path in ("/v1/cache/events", "/v1/cache/info", "/v1/cache/snapshot"):
        assert httpx.get(url + path, headers=_bearer("sk-plain-0001"), timeout=30).status_code == 403
        assert httpx.get(url + path, headers=_bearer(ADMIN), timeout=30).status_code == 200
    assert httpx.get(url + "/get_load", timeout=30).status_code == 401
    assert httpx.get(url + "/get_load", headers=_bearer("sk-plain-0001"), timeout=30).status_code == 200


def test_bench_serve_sends_its_api_key(keyed, capsys, tmp_path):
    summary = tmp_path / "bench.json"
    assert main(["bench-serve", "--url", keyed.url, "--limit", "3", "--time-scale", "0.001", "--max-tokens", "1",
                 "--api-key", "sk-tenant-x-0002", "--json", str(summary)]) == 0
    got = json.loads(summary.read_text())
    assert got["sent"] == got["completed"] == 3 and got["errors"] == {}
    capsys.readouterr()
    assert main(["bench-serve", "--url", keyed.url, "--limit", "3", "--api-key", "sk-wrong"]) == 2
    err = capsys.readouterr().err
    assert "answered HTTP 401" in err and "sk-wrong" not in err


def test_a_server_with_api_keys_but_no_admin_key_refuses_its_admin_routes():
    with RunningServer(ServeOptions(port=0, threads=1, auth=KeyRing({"sk-only-0005": None}))) as s:
        r = httpx.post(f"{s.url}/admin/cache/invalidate", json={"all": True}, headers=_bearer("sk-only-0005"),
                       timeout=30)
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
        assert _cached(_complete(s.url, "sk-only-0005", [5, 6, 7])) == 0


def test_keys_come_from_a_json_or_yaml_file_and_bad_ones_are_refused_without_showing_them(tmp_path):
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"sk-file-x": "x", "sk-file-any": None}))
    y = tmp_path / "keys.yaml"
    y.write_text("sk-yaml-x: x\nsk-yaml-y: y\n")
    ring = keyring_from_options(["sk-cli"], str(j), "sk-adm", environ={})
    assert repr(ring) == "KeyRing(3 API keys, 1 bound to a tenant, 1 admin keys)"
    assert keyring_from_options(None, str(y), None, environ={}).bound == 2
    assert keyring_from_options(None, None, None, environ={"HYBRIDKV_API_KEY": "sk-env"}).api_open is False
    bad = tmp_path / "bad.json"
    for content, needle in (('{"sk-secret-1": 5}', "entry 1: the tenant must be"),
                            ('{"sk secret 2": "x"}', "printable ASCII without spaces"),
                            ("[]", "non-empty mapping"), ("{: [", "neither valid JSON nor valid YAML")):
        bad.write_text(content)
        with pytest.raises(ValueError, match=re.escape(needle)) as exc:
            keyring_from_options(None, str(bad), None, environ={})
        assert "secret" not in str(exc.value)
    with pytest.raises(ValueError, match="also given as an API key") as exc:
        keyring_from_options(["sk-same-3"], None, "sk-same-3", environ={})
    assert "sk-same" not in str(exc.value)


def _serve(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", "--port", "0", "--threads", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _url_of(proc: subprocess.Popen, log: list[str]) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        log.append(line)
        m = re.search(r"on (http://127\.0\.0\.1:\d+) \(Ctrl-C", line)
        if m:
            return m.group(1)
    pytest.fail("the server did not start: " + "".join(log))


def test_the_command_says_at_start_what_is_open_and_never_logs_a_key(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-file-bound-7777": "x"}))
    proc = _serve(["--api-key", "sk-cli-key-8888", "--api-keys-file", str(keys)],
                  env={"HYBRIDKV_ADMIN_KEY": "sk-env-admin-9999"})
    log: list[str] = []
    try:
        url = _url_of(proc, log)
        for key in ("sk-cli-key-8888", "sk-file-bound-7777", "sk-env-admin-9999", "sk-wrong-key-6666"):
            httpx.post(f"{url}/v1/completions", headers=_bearer(key), timeout=60,
                       json={"model": "tiny", "prompt": [5, 6], "max_tokens": 1})
        assert httpx.post(f"{url}/v1/completions", headers={**_bearer("sk-file-bound-7777"), "X-Tenant": "y"},
                          json={"model": "tiny", "prompt": [5, 6], "max_tokens": 1}, timeout=60).status_code == 403
        assert httpx.post(f"{url}/flush_cache", headers=_bearer("sk-env-admin-9999"), timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    text = "".join(log) + out
    assert proc.returncode == 0, text
    assert "the API takes 2 API key(s), 1 bound to a tenant; the admin routes take the admin key" in text
    assert "401" in text and "403" in text                                 # the access log has the refusals
    for key in ("8888", "7777", "9999", "6666"):
        assert key not in text



def test_without_keys_the_start_line_says_everything_is_open():
    line = KeyRing().describe()
    assert line.startswith("the API is OPEN: no --api-key") and "the admin routes are OPEN" in line
    assert "/health and /metrics are open" in line


def test_the_command_refuses_a_bad_keys_file_naming_it(tmp_path, capsys):
    bad = tmp_path / "keys.json"
    bad.write_text('{"sk-bad-5555": ["x"]}')
    assert main(["serve", "--api-keys-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --api-keys-file {bad}: entry 1: the tenant must be")
    assert "5555" not in err and "Traceback" not in err
    assert main(["router", "--worker", "http://127.0.0.1:1", "--port", "0", "--worker-key", "two words"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --worker-key: a key must be printable ASCII") and "words" not in err


# -- the router ------------------------------------------------------------------------------------

def test_the_router_binds_a_keys_tenant_authenticates_to_workers_and_passes_the_tenant_on(tmp_path):
    """Workers take only their own keys; the router holds their admin key as --worker-key (its
    event feeds and every forwarded request use it) and its own client keys bound to x and y."""
    workers = KeyRing({"sk-worker-api": None}, ("sk-worker-admin",))
    keys = tmp_path / "router-keys.yaml"
    keys.write_text("sk-rx: x\nsk-ry: y\n")
    with RunningServer(ServeOptions(port=0, threads=1, auth=workers)) as a, \
            RunningServer(ServeOptions(port=0, threads=1, auth=workers)) as b:
        args = argparse.Namespace(worker=[a.url, b.url], policy="hybrid", model="tiny", cost_model=None,
                                  poll_interval=0.05, health_every=2, follow_wait=2.0, store_gbps=1.1,
                                  store_latency_us=194.0, api_key=None, api_keys_file=str(keys),
                                  admin_key="sk-router-admin", worker_key="sk-worker-admin")
        service = router_service(args)
        router = BackgroundUvicorn(create_router_app(service), "127.0.0.1", 0, lifespan="on")
        try:
            for _ in range(400):                                # both workers in rotation (by the worker key)
                if httpx.get(f"{router.url}/health", timeout=10).json()["workers_in_rotation"] == 2:
                    break
                time.sleep(0.025)
            else:
                pytest.fail("the workers never entered rotation")
            ids = prompt_ids(600, 300)
            assert _complete(router.url, None, ids).status_code == 401
            y = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-ry", max_retries=0)
            y.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0)
            with pytest.raises(openai.PermissionDeniedError):
                openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-rx", max_retries=0).completions.create(
                    model="tiny", prompt=ids + [9], max_tokens=1, extra_headers={"X-Tenant": "y"})
            assert _cached(_complete(router.url, "sk-rx", ids + [9])) == 0             # x's namespace
            for _ in range(400):                                # y's entries reach the router's views
                got = _cached(_complete(router.url, "sk-ry", ids + [9]))
                if got:
                    break
                time.sleep(0.025)
            assert got == 256
            # the workers saw tenant y: asked directly for y, one of them holds the prefix
            direct = [_cached(_complete(w.url, "sk-worker-admin", ids + [8], headers={"X-Tenant": "y"}))
                      for w in (a, b)]
            assert 256 in direct
            assert httpx.get(f"{router.url}/router/stats", headers=_bearer("sk-ry"), timeout=10).status_code == 403
            assert httpx.get(f"{router.url}/router/stats", headers=_bearer("sk-router-admin"),
                             timeout=10).status_code == 200
            assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
        finally:
            router.close()
