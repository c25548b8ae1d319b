"""``hybridkv router``'s purge routes: ``POST /admin/cache/invalidate`` and ``/flush_cache`` sent
to every worker, under the workers' key and tenant-scope rules, the counts summed, a worker that
cannot be reached named in a 502, and the router's views read again before it answers.

Real workers (the tiny preset, in-process, one stopped mid-test), a real router on 127.0.0.1 with
free ports, real HTTP clients (httpx, ``openai``).
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import httpx
import openai
import pytest
from serve_helpers import prompt_ids

from hybridkv.serve.auth import KeyRing
from hybridkv.serve.commands import router_service
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.router import create_router_app

WORKER_KEY = "sk-test-worker-admin"
ROUTER_ADMIN = "sk-test-router-admin"
KEY_X, KEY_Y = "sk-test-tenant-x", "sk-test-tenant-y"
PROMPT_TOKENS = 300
"""Each tenant's prompt: 4 whole 64-token units cached per worker (tokens)."""
UNITS = PROMPT_TOKENS // 64


def _router(urls: list[str], tmp_path, poll_interval: float = 1.0) -> BackgroundUvicorn:
    """A router with bound keys for tenants ``x`` and ``y``, an admin key and the workers' admin
    key; its events are read by periodic polls only (every ``poll_interval`` seconds, no long
    poll), so its views lag the workers unless a purge reads them again itself."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY_X: "x", KEY_Y: "y"}))
    args = argparse.Namespace(worker=urls, policy="hybrid", model="tiny", cost_model=None,
                              poll_interval=poll_interval, health_every=1, follow_wait=0.0, store_gbps=1.1,
                              store_latency_us=194.0, api_key=None, api_keys_file=str(keys), admin_key=ROUTER_ADMIN,
                              worker_key=WORKER_KEY)
    return BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


WAIT_S = 60.0
"""The longest wait for the router to see a worker's state (seconds)."""


def _stats(router) -> dict:
    return httpx.get(f"{router.url}/router/stats", headers=_bearer(ROUTER_ADMIN), timeout=10).json()


def _wait(pred, router) -> dict:
    """Poll the router's stats (with its admin key) until ``pred(stats)``, 25 ms apart for at most
    :data:`WAIT_S` seconds (a loaded machine polls its workers late); fails the test with the last
    stats otherwise."""
    s: dict = {}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        s = _stats(router)
        if pred(s):
            return s
        time.sleep(0.025)
    pytest.fail(f"router never reached the expected state: {s}")


def _cached(url: str, tenant: str, prompt: list[int]) -> int:
    """Cached prompt tokens of a 1-token completion of ``prompt`` sent straight to a worker as
    ``tenant`` (the worker's admin key, ``X-Tenant``)."""
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={**_bearer(WORKER_KEY), "X-Tenant": tenant},
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def workers():
    ring = KeyRing(admin_keys=(WORKER_KEY,))
    with RunningServer(ServeOptions(port=0, threads=1, auth=ring)) as a, \
            RunningServer(ServeOptions(port=0, threads=1, auth=ring)) as b:
        yield [a, b]


def _fill(urls: list[str], px: list[int], py: list[int]) -> None:
    """Cache ``px`` as tenant x and ``py`` as tenant y on every worker of ``urls``."""
    for url in urls:
        _cached(url, "x", px)
        _cached(url, "y", py)


def test_a_tenant_purge_through_the_router_reaches_every_worker_and_keeps_the_other_tenant(workers, tmp_path):
    urls = [w.url for w in workers]
    px, py = prompt_ids(7001, PROMPT_TOKENS), prompt_ids(7002, PROMPT_TOKENS)
    router = _router(urls, tmp_path)
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        _fill(urls, px, py)
        _wait(lambda s: all(w["kv_keys"] == 2 * UNITS for w in s["workers"]), router)
        r = httpx.post(f"{router.url}/admin/cache/invalidate", json={"tenant": "x"}, headers=_bearer(KEY_X),
                       timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        # entries: the copies removed, summed; namespaces: what one worker matched (a sum would count workers)
        assert got["device_nodes"] == 2 * UNITS and got["namespaces"] == 1
        assert "workers" not in got and not any(url in r.text for url in urls)   # a tenant sees no fleet layout
        # the views were read again before the answer: x's entries are gone from them now, y's kept
        # (the router's own polls come once a second, so a stale view would still hold x's)
        assert [w["kv_keys"] for w in _stats(router)["workers"]] == [UNITS, UNITS]
        before = _stats(router)["workers"]
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY_X, max_retries=0)
        out = client.completions.create(model="tiny", prompt=px, max_tokens=1)
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        after = _stats(router)["workers"]
        routed = [a["routed"] - b["routed"] for a, b in zip(after, before, strict=True)]
        assert sorted(routed) == [0, 1]
        assert sum(a["predicted_hit_tokens_routed"] - b["predicted_hit_tokens_routed"]
                   for a, b in zip(after, before, strict=True)) == 0
        other = urls[routed.index(0)]                    # x's entries are gone from the other worker too
        assert _cached(other, "x", px) == 0
        for url in urls:                                 # y's entries survive on both workers
            assert _cached(url, "y", py) == UNITS * 64
    finally:
        router.close()


def test_x_cannot_purge_y_and_a_request_without_a_key_is_refused(workers, tmp_path):
    urls = [w.url for w in workers]
    py = prompt_ids(7102, PROMPT_TOKENS)
    router = _router(urls, tmp_path, poll_interval=0.05)
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        for url in urls:
            _cached(url, "y", py)
        epochs = [w["epoch"] for w in _stats(router)["workers"]]
        inv = f"{router.url}/admin/cache/invalidate"
        for body in ({"tenant": "y"}, {"all": True}, {"abi_version": 1}):
            r = httpx.post(inv, json=body, headers=_bearer(KEY_X), timeout=30)
            assert r.status_code == 403, (body, r.text)
            assert r.json()["error"]["code"] == "tenant_scope"
        r = httpx.post(inv, json={}, headers={**_bearer(KEY_X), "X-Tenant": "y"}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_mismatch"
        r = httpx.post(inv, json={"tenant": "x"}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(inv, json={"tenant": "x"}, headers=_bearer("sk-test-wrong"), timeout=30)
        assert r.status_code == 401
        r = httpx.post(inv, json={"tenant": ""}, headers=_bearer(ROUTER_ADMIN), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "empty_tenant"
        r = httpx.post(inv, json={"tenant": "x", "cache_slat": "s"}, headers=_bearer(ROUTER_ADMIN), timeout=30)
        assert r.status_code == 400 and "'cache_slat'" in r.json()["error"]["message"]
        r = httpx.post(f"{router.url}/flush_cache", headers=_bearer(KEY_X), timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        # no worker was asked: their epochs are unchanged and y's entries are still cached
        assert [w["epoch"] for w in _stats(router)["workers"]] == epochs
        for url in urls:
            assert _cached(url, "y", py) == UNITS * 64
        # y's own key purges y; the admin key flushes everything on every worker
        r = httpx.post(inv, json={}, headers=_bearer(KEY_Y), timeout=120)
        assert r.status_code == 200 and r.json()["device_nodes"] >= 2 * UNITS, r.text
        assert "workers" not in r.json()
        # the admin key's purge of a tenant lists each worker's own answer (the operator's view)
        r = httpx.post(inv, json={"tenant": "y"}, headers=_bearer(ROUTER_ADMIN), timeout=120)
        assert r.status_code == 200 and [w["url"] for w in r.json()["workers"]] == urls, r.text
        assert [w["status"] for w in r.json()["workers"]] == [200, 200]
        r = httpx.post(f"{router.url}/flush_cache", headers=_bearer(ROUTER_ADMIN), timeout=120)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert [w["status"] for w in r.json()["workers"]] == [200, 200]
        assert [w["kv_keys"] for w in _stats(router)["workers"]] == [0, 0]
    finally:
        router.close()


def test_a_dead_worker_is_named_and_the_live_one_is_purged(workers, tmp_path):
    live = workers[0].url
    px = prompt_ids(7201, PROMPT_TOKENS)
    # an in-process worker stopped mid-test: its port closes, as a killed process's does (a
    # `hybridkv serve` subprocess takes over 10 s to start on a loaded 2-core machine)
    doomed = RunningServer(ServeOptions(port=0, threads=1, auth=KeyRing(admin_keys=(WORKER_KEY,))))
    dead = doomed.url
    router = _router([dead, live], tmp_path, poll_interval=0.05)
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        _fill([dead, live], px, prompt_ids(7202, PROMPT_TOKENS))
        doomed.close()
        r = httpx.post(f"{router.url}/admin/cache/invalidate", json={"tenant": "x"}, headers=_bearer(KEY_X),
                       timeout=120)
        assert r.status_code == 502, r.text                 # the tenant: told, no worker named
        assert r.json()["error"]["code"] == "purge_incomplete" and "send it again" in r.json()["error"]["message"]
        assert dead not in r.text and live not in r.text and "workers" not in r.json()
        assert r.json()["device_nodes"] == UNITS
        _fill([live], px, prompt_ids(7202, PROMPT_TOKENS))
        r = httpx.post(f"{router.url}/admin/cache/invalidate", json={"tenant": "x"}, headers=_bearer(ROUTER_ADMIN),
                       timeout=120)
        assert r.status_code == 502, r.text
        got = r.json()
        assert got["error"]["code"] == "purge_incomplete"
        assert f"worker {dead}: cannot be reached" in got["error"]["message"]
        assert live not in got["error"]["message"]
        by_url = {w["url"]: w for w in got["workers"]}
        assert by_url[dead]["status"] is None and "cannot be reached" in by_url[dead]["error"]
        assert by_url[live]["status"] == 200 and by_url[live]["device_nodes"] == UNITS
        assert got["device_nodes"] == UNITS
        assert not _stats(router)["workers"][0]["healthy"]      # out of rotation, its view cleared
        assert _cached(live, "x", px) == 0
        r = httpx.post(f"{router.url}/flush_cache", headers=_bearer(ROUTER_ADMIN), timeout=120)
        assert r.status_code == 502 and r.json()["success"] is False, r.text    # not flushed everywhere
    finally:
        router.close()
        doomed.close()


def test_a_worker_refusing_the_purge_is_named_even_out_of_rotation(workers, tmp_path):
    """A router with a wrong ``--worker-key``: no worker enters rotation, yet a purge is still sent
    to each (one out of rotation may hold entries), and their 401s make it a 502 naming them."""
    urls = [w.url for w in workers]
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY_X: "x"}))
    args = argparse.Namespace(worker=urls, policy="hybrid", model="tiny", cost_model=None, poll_interval=0.05,
                              health_every=1, follow_wait=0.0, store_gbps=1.1, store_latency_us=194.0, api_key=None,
                              api_keys_file=str(keys), admin_key=ROUTER_ADMIN, worker_key="sk-test-not-the-workers")
    router = BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")
    try:
        _wait(lambda s: all("401" in w["last_error"] for w in s["workers"]), router)
        r = httpx.post(f"{router.url}/admin/cache/invalidate", json={}, headers=_bearer(KEY_X), timeout=60)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "purge_incomplete" and not any(url in r.text for url in urls)
        r = httpx.post(f"{router.url}/admin/cache/invalidate", json={"tenant": "x"}, headers=_bearer(ROUTER_ADMIN),
                       timeout=60)
        assert r.status_code == 502, r.text
        got = r.json()
        assert got["error"]["code"] == "purge_incomplete"
        assert all(f"worker {url}: answered 401" in got["error"]["message"] for url in urls)
        assert [w["status"] for w in got["workers"]] == [401, 401]
        assert "device_nodes" not in got                   # no worker purged: no counts
    finally:
        router.close()


def test_a_hung_worker_is_reported_failed_after_the_purge_timeout(workers, tmp_path):
    """A worker whose process is stopped: the kernel completes the router's connection (the listen
    backlog) and nothing answers. The purge is answered once ``--purge-timeout`` passes (well
    before the client's own timeout), naming that worker to the admin, and the live worker's
    entries are purged."""
    live = workers[0].url
    px = prompt_ids(7301, PROMPT_TOKENS)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)                                   # never accepted, never answered
        stuck = f"http://127.0.0.1:{hung.getsockname()[1]}"
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({KEY_X: "x"}))
        args = argparse.Namespace(worker=[live, stuck], policy="hybrid", model="tiny", cost_model=None,
                                  poll_interval=0.05, health_every=1, follow_wait=0.0, store_gbps=1.1,
                                  store_latency_us=194.0, api_key=None, api_keys_file=str(keys),
                                  admin_key=ROUTER_ADMIN, worker_key=WORKER_KEY, purge_timeout=1.0)
        router = BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")
        try:
            _wait(lambda s: s["workers"][0]["healthy"], router)
            _cached(live, "x", px)
            r = httpx.post(f"{router.url}/admin/cache/invalidate", json={"tenant": "x"},
                           headers=_bearer(ROUTER_ADMIN), timeout=30)       # the old wait was 60 s
            assert r.status_code == 502, r.text
            got = r.json()
            assert f"worker {stuck}: did not answer within 1 s (--purge-timeout)" in got["error"]["message"]
            by_url = {w["url"]: w for w in got["workers"]}
            assert by_url[stuck]["status"] is None and by_url[live]["status"] == 200
            assert got["device_nodes"] >= UNITS and _cached(live, "x", px) == 0
            r = httpx.post(f"{router.url}/admin/cache/invalidate", json={}, headers=_bearer(KEY_X), timeout=30)
            assert r.status_code == 502 and stuck not in r.text and live not in r.text, r.text
        finally:
            router.close()


@pytest.mark.parametrize(("value", "named"), [("0", "must be positive"), ("nan", "is not a number"),
                                              ("601", "exceeds 600 seconds"),
                                              ("1e-300", "is under 0.1 s"), ("0.09", "is under 0.1 s")])
def test_a_bad_purge_timeout_is_named(value, named, capsys):
    from hybridkv.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["router", "--worker", "http://127.0.0.1:9", "--purge-timeout", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--purge-timeout" in err and named in err and "Traceback" not in err
