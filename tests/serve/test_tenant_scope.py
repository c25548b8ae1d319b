"""What a key bound to a tenant may see and do on `hybridkv serve` and `hybridkv router`: its own
tenant's load figures and purges, never another tenant's; an empty tenant name is refused.

Real servers on 127.0.0.1 (free ports, the tiny preset), the `openai` client and httpx.
"""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
from serve_helpers import prompt_ids, wait_idle, wait_router, wait_running

from hybridkv.replay.timed import CPU_ESTIMATE
from hybridkv.serve.auth import KeyRing, keyring_from_options
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.router import RouterService, RouterSettings, create_router_app
from hybridkv.serve.tokenizer import load_codec

KEYS = {"sk-plain-0101": None, "sk-x-0102": "x", "sk-y-0103": "y"}
ADMIN = "sk-admin-0104"
UNIT_HIT = 256              # a 300-token prompt resent: four 64-token units reused


def _bearer(key: str, **headers: str) -> dict:
    return {"Authorization": f"Bearer {key}", **headers}


@pytest.fixture(scope="module")
def keyed():
    with RunningServer(ServeOptions(port=0, threads=1, auth=KeyRing(KEYS, (ADMIN,)))) as s:
        yield s


def _complete(url: str, key: str, prompt, **extra) -> httpx.Response:
    headers = _bearer(key, **extra.pop("headers", {}))
    return httpx.post(f"{url}/v1/completions", timeout=60, headers=headers,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@contextlib.contextmanager
def _long_stream(url: str, key: str):
    """One long stream of the key's tenant, open (its first frame read) until the block ends; the
    client then closes it and the server cancels it."""
    body = {"model": "tiny", "prompt": prompt_ids(7, 70), "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body, headers=_bearer(key)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        yield


def _load(url: str, key: str, **headers: str) -> dict:
    r = httpx.get(f"{url}/get_load", headers=_bearer(key, **headers), timeout=30)
    assert r.status_code == 200, r.text
    (rank,) = r.json()
    return rank


# -- /get_load ------------------------------------------------------------------------------------

def test_get_load_shows_a_bound_key_its_own_tenants_figures_only(keyed):
    wait_idle(keyed)
    with _long_stream(keyed.url, "sk-y-0103"):
        wait_running(keyed)
        own = _load(keyed.url, "sk-y-0103")
        assert own["num_reqs"] == 1 and own["num_tokens"] >= 70 and own["num_decode_tokens"] > 0
        other = _load(keyed.url, "sk-x-0102")                  # x sees nothing of y's stream
        assert {k: v for k, v in other.items() if k != "dp_rank"} == {
            "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "num_waiting_tokens": 0, "num_decode_tokens": 0}
        assert _load(keyed.url, ADMIN)["num_reqs"] == 1                 # the whole worker: a router's key
        assert _load(keyed.url, "sk-plain-0101")["num_reqs"] == 1       # a gateway's key, naming no tenant
        assert _load(keyed.url, "sk-plain-0101", **{"X-Tenant": "x"})["num_reqs"] == 0
        assert _load(keyed.url, ADMIN, **{"X-Tenant": "y"})["num_reqs"] == 1
        r = httpx.get(f"{keyed.url}/get_load", headers=_bearer("sk-x-0102", **{"X-Tenant": "y"}), timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_mismatch"


def test_the_routers_worker_key_still_reads_the_whole_workers_load(keyed):
    """A router given the worker's admin key as its worker key counts a stream a tenant sent
    straight to the worker as others' load."""
    settings = RouterSettings("hybrid", CPU_ESTIMATE, poll_interval_s=0.05, health_every=2, worker_key=ADMIN)
    router = BackgroundUvicorn(create_router_app(RouterService([keyed.url], load_codec("tiny", 1024), settings)),
                               "127.0.0.1", 0, lifespan="on")
    try:
        wait_router(lambda s: s["workers"][0]["healthy"], router)
        wait_idle(keyed)
        with _long_stream(keyed.url, "sk-x-0102"):
            wait_running(keyed)
            stats = wait_router(lambda s: s["workers"][0]["worker_reqs"] == 1, router)
            assert stats["workers"][0]["others_reqs"] == 1
        for extra in ({"headers": {"X-Tenant": ""}}, {"tenant": ""}):      # the router refuses an empty tenant
            r = httpx.post(f"{router.url}/v1/completions", timeout=60, headers=extra.pop("headers", {}),
                           json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1, **extra})
            assert r.status_code == 400 and r.json()["error"]["code"] == "empty_tenant", r.text
    finally:
        router.close()


# -- purges by a bound key ------------------------------------------------------------------------

def _invalidate(url: str, key: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/cache/invalidate", json=body, headers=_bearer(key, **headers), timeout=60)


def test_a_bound_key_purges_its_own_tenants_entries_and_never_anothers(keyed):
    ids = prompt_ids(900, 300)
    for key in ("sk-x-0102", "sk-y-0103"):
        _complete(keyed.url, key, ids)
        assert _cached(_complete(keyed.url, key, ids + [9])) == UNIT_HIT
    for body, headers in (({"tenant": "y"}, {}), ({"all": True}, {}), ({"abi_version": 1}, {}),
                          ({"tenant": "y", "cache_salt": ""}, {})):
        r = _invalidate(keyed.url, "sk-x-0102", body, **headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_scope", (body, r.text)
        assert "'y'" not in r.text
    r = _invalidate(keyed.url, "sk-x-0102", {}, **{"X-Tenant": "y"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_mismatch"
    r = _invalidate(keyed.url, "sk-plain-0101", {"tenant": "x"})          # a key bound to no tenant
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = httpx.post(f"{keyed.url}/flush_cache", headers=_bearer("sk-x-0102"), timeout=60)     # every tenant's
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert _cached(_complete(keyed.url, "sk-x-0102", ids + [8])) == UNIT_HIT                   # nothing purged
    r = _invalidate(keyed.url, "sk-x-0102", {})                            # its own tenant: the scope by default
    assert r.status_code == 200, r.text
    assert r.json()["namespaces"] >= 1 and r.json()["device_nodes"] >= 4
    assert _cached(_complete(keyed.url, "sk-x-0102", ids + [7])) == 0
    assert _cached(_complete(keyed.url, "sk-y-0103", ids + [7])) == UNIT_HIT                   # y keeps its own
    _complete(keyed.url, "sk-x-0102", ids, cache_salt="s1")
    r = _invalidate(keyed.url, "sk-x-0102", {"tenant": "x", "cache_salt": "s1"})   # naming itself, narrowed
    assert r.status_code == 200 and r.json()["device_nodes"] >= 4
    assert _cached(_complete(keyed.url, "sk-y-0103", ids + [6])) == UNIT_HIT


# -- empty tenant names ---------------------------------------------------------------------------

def test_an_empty_tenant_is_refused_with_a_400_naming_the_field(keyed):
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-plain-0101", max_retries=0)
    for extra in ({"extra_body": {"tenant": ""}}, {"extra_headers": {"X-Tenant": ""}}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=1, **extra)
        err = exc.value.response.json()["error"]
        assert err["param"] == "tenant" and err["code"] == "empty_tenant", err
        assert "is empty" in err["message"] and ("tenant field" in err["message"] or "X-Tenant" in err["message"])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"tenant": ""})
    bound = _complete(keyed.url, "sk-x-0102", [5, 6, 7], tenant="")     # a bound key: the same 400, not a 403
    assert bound.status_code == 400 and bound.json()["error"]["code"] == "empty_tenant"
    for body, headers in (({"tenant": ""}, {}), ({}, {"X-Tenant": ""})):
        r = _invalidate(keyed.url, ADMIN, body, **headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tenant", r.text
    r = httpx.get(f"{keyed.url}/get_load", headers=_bearer(ADMIN, **{"X-Tenant": ""}), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "empty_tenant"


def test_an_empty_tenant_in_the_keys_file_is_refused_naming_the_entry(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-ok-0201": "x", "sk-empty-0202": ""}))
    with pytest.raises(ValueError) as exc:
        keyring_from_options(None, str(keys), None, environ={})
    assert str(exc.value) == (f"--api-keys-file {keys}: entry 2: the tenant is empty (''); give a tenant of 1 to "
                              "256 characters, or null for a key bound to no tenant")
    assert "0202" not in str(exc.value)


# -- /metrics -------------------------------------------------------------------------------------

def test_metrics_of_every_tenant_are_refused_to_a_bound_key_and_open_only_without_api_keys(keyed, server):
    """/metrics holds every tenant's counts and timings: with API keys it takes the admin key or a
    key bound to no tenant (a Prometheus scrape's bearer token), never a tenant's key."""
    url = f"{keyed.url}/metrics"
    r = httpx.get(url, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url, headers=_bearer("sk-x-0102"), timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_scope"
    assert "hybridkv_" not in r.text
    for key in (ADMIN, "sk-plain-0101"):
        r = httpx.get(url, headers=_bearer(key), timeout=30)
        assert r.status_code == 200 and "hybridkv_requests_total" in r.text
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200      # a server without keys
    assert httpx.get(f"{keyed.url}/health", timeout=30).status_code == 200
