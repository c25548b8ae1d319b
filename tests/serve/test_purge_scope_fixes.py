"""``POST /admin/cache/invalidate`` refuses what it cannot purge whole: a ``cache_salt`` without a
tenant (its namespaces are digests of tenant and salt, so entries other or earlier processes
stored are out of reach by salt alone), an empty ``cache_salt`` (it would select every tenant's
unsalted entries) and a ``tenant`` or ``cache_salt`` over the 256 characters a completion
request may give; on a worker and on ``hybridkv router`` alike, and before anything is removed."""

from __future__ import annotations

import argparse

import httpx
import pytest
from serve_helpers import prompt_ids

from hybridkv.serve.commands import router_service
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.protocol import MAX_ID_LEN
from hybridkv.serve.router import create_router_app

BODY = {"model": "tiny", "max_tokens": 1}


def _refused(url: str, scope: dict, param: str) -> dict:
    """POST ``scope`` to ``url``'s invalidate route; assert a one-line 400 naming ``param``."""
    r = httpx.post(f"{url}/admin/cache/invalidate", json=scope, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error
    return error


def test_a_salt_alone_is_refused_after_a_restart_and_tenant_with_salt_removes_the_stored_entries(tmp_path):
    """A restarted server once answered ``{"cache_salt": S}`` with 200 and 0 removed while the
    salted store entries an earlier process wrote stayed and were served; now it is a 400 naming
    ``cache_salt`` that removes nothing, and the tenant with the salt removes them."""
    store = f"disk://{tmp_path}"
    ids = prompt_ids(71, 200)
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post("/v1/completions", json={**BODY, "prompt": ids, "cache_salt": "pepper"}, headers={"X-Tenant": "x"})
        assert r.status_code == 200, r.text
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        def cached() -> int:
            r = c.post("/v1/completions", json={**BODY, "prompt": ids + [9], "cache_salt": "pepper"},
                       headers={"X-Tenant": "x"})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        error = _refused(s.url, {"cache_salt": "pepper"}, "cache_salt")
        assert error["code"] == "salt_needs_tenant" and "'pepper'" in error["message"], error
        counts = c.post("/admin/cache/invalidate", json={"tenant": "x", "cache_salt": "pepper"}).json()
        assert counts["namespaces"] == 1 and counts["tier_entries"]["store"] > 0, counts
        assert cached() == 0


def test_an_empty_salt_is_refused_and_every_tenants_unsalted_entries_stay():
    """``{"cache_salt": ""}`` once selected every tenant's unsalted entries."""
    ids = prompt_ids(72, 200)
    with RunningServer(ServeOptions(port=0, threads=1)) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        def cached(tenant: str, extra: list[int]) -> int:
            r = c.post("/v1/completions", json={**BODY, "prompt": ids + extra}, headers={"X-Tenant": tenant})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        cached("a", []), cached("b", [])
        for scope in ({"cache_salt": ""}, {"tenant": "a", "cache_salt": ""}):
            assert _refused(s.url, scope, "cache_salt")["code"] == "empty_cache_salt"
        assert cached("a", [9]) == 192 and cached("b", [9]) == 192       # nothing was removed


def test_overlong_names_and_salt_only_are_refused_by_the_router_before_any_worker_is_asked():
    """The router checks by the workers' rules: a tenant or cache_salt of 257 characters is a 400
    naming the field and its length, as is a salt without a tenant and an empty salt."""
    long = "t" * (MAX_ID_LEN + 1)
    with RunningServer(ServeOptions(port=0, threads=1)) as w:
        args = argparse.Namespace(worker=[w.url], policy="hybrid", model="tiny", cost_model=None,
                                  poll_interval=1.0, health_every=1, follow_wait=0.0, store_gbps=1.1,
                                  store_latency_us=194.0, api_key=None, api_keys_file=None, admin_key=None,
                                  worker_key=None)
        router = BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")
        try:
            for url in (w.url, router.url):
                for name in ("tenant", "cache_salt"):
                    scope = {"tenant": "a", name: long}
                    error = _refused(url, scope, name)
                    assert f"{name} has {MAX_ID_LEN + 1} characters" in error["message"], error
                assert _refused(url, {"cache_salt": "pepper"}, "cache_salt")["code"] == "salt_needs_tenant"
                assert _refused(url, {"cache_salt": ""}, "cache_salt")["code"] == "empty_cache_salt"
            r = httpx.post(f"{router.url}/admin/cache/invalidate", json={"tenant": "a", "cache_salt": "s" * MAX_ID_LEN},
                           timeout=60)
            assert r.status_code == 200, r.text                             # at the cap: accepted
        finally:
            router.close()


@pytest.mark.parametrize("tenant", [None, "x"])
def test_a_salt_with_a_bound_tenant_or_header_is_still_accepted(server, tenant):
    """An ``X-Tenant`` request names its tenant by the header: ``{"cache_salt": S}`` is that
    tenant's entries of S, so it is not refused; without it (and no tenant) it is."""
    headers = {"X-Tenant": tenant} if tenant else {}
    r = httpx.post(f"{server.url}/admin/cache/invalidate", json={"cache_salt": "s"}, headers=headers, timeout=60)
    assert r.status_code == (200 if tenant else 400), r.text
