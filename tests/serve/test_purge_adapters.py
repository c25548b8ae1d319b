"""``POST /admin/cache/invalidate`` names an adapter: a tenant's adapter entries in a persistent
store are purged after a restart, when the new process has never served that adapter.

Real servers on 127.0.0.1 (free ports, the tiny preset) over one disk store, one after the other
(a restart), and httpx.
"""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import prompt_ids, router_args

from hybridkv.serve.launch import RunningServer, ServeOptions

ADAPTER = {"adapter": "lora-support", "adapter_version": "v3"}


def _complete(url: str, ids: list[int], **fields) -> int:
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"X-Tenant": "acme"},
                   json={"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _purge(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/admin/cache/invalidate", json=body, timeout=60)


def test_a_restarted_server_purges_a_tenants_adapter_entries_it_never_served(tmp_path):
    store = f"disk://{tmp_path / 'store'}"
    p = prompt_ids(8101, 300)
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as first:
        assert _complete(first.url, p, **ADAPTER) == 0
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as again:     # the restart
        r = _purge(again.url, {"tenant": "acme"})          # the tenant's own namespace only: not the adapter's
        assert r.status_code == 200 and r.json()["tier_entries"]["store"] == 0, r.text
        assert r.json()["earlier_adapters_unreached"] is True, r.text       # and the answer says so
        r = _purge(again.url, {"tenant": "acme", **ADAPTER})
        assert r.status_code == 200, r.text
        assert r.json()["namespaces"] == 1 and r.json()["tier_entries"]["store"] > 0, r.text
        assert _complete(again.url, p, **ADAPTER) == 0                  # nothing left to load
        # served in this process: a purge naming the adapter without its version reaches it too
        assert _complete(again.url, p, **ADAPTER) > 0
        r = _purge(again.url, {"tenant": "acme", "adapter": ADAPTER["adapter"]})
        assert r.status_code == 200 and r.json()["device_nodes"] > 0, r.text
        assert _complete(again.url, p, **ADAPTER) == 0


def test_after_a_restart_an_adapter_without_its_version_is_refused_not_answered_200(tmp_path):
    """A restarted server has served no version of the adapter: a purge naming it without
    ``adapter_version`` could reach only version ``""``, so it is a 400 naming ``adapter_version``
    and loses nothing; once this process has served a version, the purge reaches that one and
    says that versions stored before it started may remain."""
    store = f"disk://{tmp_path / 'store'}"
    p = prompt_ids(8111, 300)
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as first:
        assert _complete(first.url, p, **ADAPTER) == 0
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as again:     # the restart
        r = _purge(again.url, {"tenant": "acme", "adapter": ADAPTER["adapter"]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "adapter_version" and err["code"] == "adapter_version_needed", err
        assert "lora-support" in err["message"], err
        assert _complete(again.url, p, **ADAPTER) > 0                   # nothing was lost
        r = _purge(again.url, {"tenant": "acme", "adapter": ADAPTER["adapter"]})
        assert r.status_code == 200 and r.json()["tier_entries"]["store"] > 0, r.text
        assert r.json()["earlier_adapters_unreached"] is True, r.text
        r = _purge(again.url, {"tenant": "acme", **ADAPTER})            # a version named: nothing unreached
        assert r.status_code == 200 and r.json()["earlier_adapters_unreached"] is False, r.text


def test_without_a_lasting_store_an_unknown_adapter_is_simply_nothing_to_purge():
    """No store outlives the process: nothing of an earlier process can remain, so the purge
    answers 200 with zero entries and nothing unreached."""
    with RunningServer(ServeOptions(port=0, threads=1)) as s:
        r = _purge(s.url, {"tenant": "acme", "adapter": "never-served"})
    assert r.status_code == 200 and r.json()["earlier_adapters_unreached"] is False, r.text
    assert r.json()["device_nodes"] == 0, r.text


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"adapter": "lora"}, "adapter", "adapter_needs_tenant"),
    ({"tenant": "acme", "adapter": ""}, "adapter", "empty_adapter"),
    ({"tenant": "acme", "adapter_version": "v1"}, "adapter_version", None),
    ({"tenant": "acme", "adapter": 7}, "adapter", None),
    ({"tenant": "acme", "adapter": "a" * 257}, "adapter", None),
    ({"all": True, "adapter": "lora"}, None, None)])
def test_bad_adapter_scopes_are_refused_naming_them(body, param, code):
    with RunningServer(ServeOptions(port=0, threads=1)) as s:
        r = _purge(s.url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err


def test_the_router_passes_an_adapter_scope_to_its_workers():
    """Through ``hybridkv router`` (no keys): an ``X-Tenant`` purge naming the adapter reaches the
    worker's entries of that adapter, and the tenant's answer names no worker."""
    from hybridkv.serve.commands import router_service
    from hybridkv.serve.launch import BackgroundUvicorn
    from hybridkv.serve.router import create_router_app

    p = prompt_ids(8201, 300)
    with RunningServer(ServeOptions(port=0, threads=1)) as w:
        args = router_args([w.url])
        router = BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")
        try:
            _complete(w.url, p, **ADAPTER)
            r = httpx.post(f"{router.url}/admin/cache/invalidate", json={"adapter": ADAPTER["adapter"]},
                           headers={"X-Tenant": "acme"}, timeout=60)
            assert r.status_code == 200 and r.json()["device_nodes"] == 4, r.text
            assert "workers" not in r.json() and w.url not in r.text
            assert _complete(w.url, p, **ADAPTER) == 0
        finally:
            router.close()


def test_the_router_passes_on_the_adapter_version_refusal_and_the_unreached_flag(tmp_path):
    """Through ``hybridkv router``: a worker with a disk store that has served no version of the
    adapter refuses it without ``adapter_version``; the router answers that 400 (not a 502 that
    says "send it again"), and a tenant purge carries ``earlier_adapters_unreached``."""
    from hybridkv.serve.commands import router_service
    from hybridkv.serve.launch import BackgroundUvicorn
    from hybridkv.serve.router import create_router_app

    with RunningServer(ServeOptions(port=0, threads=1, store=f"disk://{tmp_path / 'store'}")) as w:
        args = router_args([w.url])
        router = BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")
        try:
            r = httpx.post(f"{router.url}/admin/cache/invalidate", json={"adapter": ADAPTER["adapter"]},
                           headers={"X-Tenant": "acme"}, timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "adapter_version" and w.url not in r.text, r.text
            r = httpx.post(f"{router.url}/admin/cache/invalidate", json={}, headers={"X-Tenant": "acme"}, timeout=60)
            assert r.status_code == 200 and r.json()["earlier_adapters_unreached"] is True, r.text
        finally:
            router.close()
