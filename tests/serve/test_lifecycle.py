"""What a server does around requests: a client that goes away is cancelled and released, a full
waiting queue answers 503 with Retry-After, invalidation by tenant / salt / all, and /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import engine_idle, prompt_ids, wait_idle

from hybridkv.serve.launch import RunningServer, ServeOptions

LONG = {"model": "tiny", "max_tokens": 4000, "stream": True, "ignore_eos": True, "temperature": 0}


def test_a_client_leaving_mid_stream_is_cancelled_and_frees_everything(server):
    baseline = wait_idle(server)
    with httpx.Client(base_url=server.url, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json={**LONG, "prompt": prompt_ids(30, 200)}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]                # a few tokens arrived: it runs
        assert any(line.startswith("data: {") for line in got)
        assert engine_idle(server)["running"] == 1
    state = wait_idle(server)
    assert state == baseline
    assert state["running"] == 0 and state["page_refs"] == 0 and state["slot_refs"] == 0
    assert state["pages_accounted"] and state["connector_requests"] == 0
    assert server.server.handle.engine.stats.cancelled >= 1


@pytest.fixture(scope="module")
def narrow():
    """One sequence at a time and one waiting request allowed."""
    with RunningServer(ServeOptions(port=0, threads=1, max_num_seqs=1, max_waiting=1)) as s:
        yield s


def test_a_full_waiting_queue_answers_503_with_retry_after(narrow):
    with httpx.Client(base_url=narrow.url, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json={**LONG, "prompt": prompt_ids(31, 100)}) as running:
        lines = running.iter_lines()                         # kept: a dropped line iterator closes the stream
        next(lines)                                          # admitted and generating
        with c.stream("POST", "/v1/completions", json={**LONG, "prompt": prompt_ids(32, 100)}):
            assert narrow.server.worker.queue_depth == 1       # waits behind the running one
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 1})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_overloaded"
    state = wait_idle(narrow)
    assert state["page_refs"] == 0 and state["slot_refs"] == 0 and state["pages_accounted"]
    with httpx.Client(base_url=narrow.url, timeout=60) as c:          # and it serves again
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 1}).status_code == 200


def test_a_batch_answered_503_counts_no_cancellation():
    """One sequence at a time, two waiting requests: a batch of two prompts meeting one free slot
    is refused whole, and nothing of it is counted as cancelled."""
    with RunningServer(ServeOptions(port=0, threads=1, max_num_seqs=1, max_waiting=2)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json={**LONG, "prompt": prompt_ids(34, 100)}) as running:
        lines = running.iter_lines()                         # kept: a dropped line iterator closes the stream
        next(lines)                                          # admitted and generating
        with c.stream("POST", "/v1/completions", json={**LONG, "prompt": prompt_ids(35, 100)}):
            assert s.server.worker.queue_depth == 1          # one slot of two left
            before = _scrape(s)[("hybridkv_requests_cancelled_total", ())]
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": [[5, 6], [7, 8]], "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
            assert s.server.worker.queue_depth == 1          # nothing of the batch was queued
            after = _scrape(s)
            assert after[("hybridkv_requests_cancelled_total", ())] == before == 0
            assert s.server.handle.engine.stats.cancelled == 0


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    """A server with a host tier and a disk store."""
    store = tmp_path_factory.mktemp("store")
    with RunningServer(ServeOptions(port=0, threads=1, host_mib=16, store=f"disk://{store}")) as s:
        yield s


def test_invalidate_by_tenant_salt_and_all_across_tiers(tiered):
    ids = prompt_ids(40, 300)
    with httpx.Client(base_url=tiered.url, timeout=60) as c:
        def cached(prompt, tenant=None, **extra) -> int:
            headers = {"X-Tenant": tenant} if tenant else {}
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra}
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(ids) == 0 and cached(ids + [9]) == 256
        assert cached(ids, "b") == 0 and cached(ids + [9], "b") == 256           # tenants do not share
        assert cached(ids + [9], cache_salt="s1") == 0                            # nor do salts
        assert cached(ids + [9], tenant="b", cache_salt="s1") == 0
        counts = c.post("/admin/cache/invalidate", json={"tenant": "default"}).json()
        assert counts["namespaces"] == 2 and counts["device_nodes"] >= 4
        assert counts["tier_entries"]["store"] > 0
        assert cached(ids + [9]) == 0 and cached(ids + [9], "b") == 256
        counts = c.post("/admin/cache/invalidate", json={"tenant": "b", "cache_salt": "s1"}).json()
        assert counts["namespaces"] == 1 and cached(ids + [9], tenant="b", cache_salt="s1") == 0
        counts = c.post("/admin/cache/invalidate", json={"all": True}).json()
        assert counts["device_nodes"] > 0 and counts["tier_entries"]["store"] > 0
        assert cached(ids + [9], "b") == 0
    state = wait_idle(tiered)
    assert state["page_refs"] == 0 and state["pages_accounted"]


def test_invalidate_by_abi_version_removes_only_that_older_abis_objects(tiered):
    """``{"abi_version": 3}`` removes this server's model's ``hkv3/`` objects (manifests first) and
    nothing else: another model's v3 objects, v2 objects and every current entry stay (the current
    entry still hits); ``{"abi_version": 2}`` then removes the ``hkv2/`` ones."""
    from hybridkv.store.disk import DiskStore

    root = tiered.server.handle.store_tier.store.root
    model = tiered.server.handle.namespace.hex()
    mine = [f"hkv3/{model}/{'ab' * 32}/full/r0/{c}" for c in ("manifest", "latents")] + \
           [f"hkv3/{model}/{'cd' * 32}/kda/r0/{c}" for c in ("manifest", "rec")]
    other = [f"hkv3/{'ee' * 32}/{'ab' * 32}/full/r0/{c}" for c in ("manifest", "latents")]
    v2 = [f"hkv2/{'ab' * 32}/kv/r0/{c}" for c in ("manifest", "latents")]
    old = DiskStore(root)                                       # another process's view of the same directory
    assert old.put([(k, b"old bytes") for k in mine + other + v2]) == [True] * 8
    ids = prompt_ids(41, 300)
    with httpx.Client(base_url=tiered.url, timeout=60) as c:
        def cached(prompt) -> int:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(ids) == 0
        current = [k for k in old.list_keys("hkv5/")]
        assert current
        r = c.post("/admin/cache/invalidate", json={"abi_version": 3})
        assert r.status_code == 200, r.text
        counts = r.json()
        assert counts["namespaces"] == 0 and counts["device_nodes"] == 0
        assert counts["tier_entries"]["store"] == 2 and counts["tier_bytes"]["store"] is None
        assert old.exists(mine) == [False] * 4 and old.exists(other + v2) == [True] * 4
        assert set(old.list_keys("hkv5/")) >= set(current)      # current entries untouched
        assert cached(ids + [9]) == 256
        counts = c.post("/admin/cache/invalidate", json={"abi_version": 2}).json()
        assert counts["tier_entries"]["store"] == 1 and old.exists(v2) == [False, False]
        assert old.exists(other) == [True, True]


def _scrape(s) -> dict:
    text = httpx.get(s.url + "/metrics", timeout=60).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            assert "tenant" not in sample.labels
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_parse_and_move(server):
    before = _scrape(server)
    ids = prompt_ids(50, 200)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 2})
        c.post("/v1/completions", json={"model": "tiny", "prompt": ids + [7], "max_tokens": 2})
        c.post("/v1/completions", json={"model": "nope", "prompt": ids})
    after = _scrape(server)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)
    assert moved("hybridkv_requests_total") == 2 and moved("hybridkv_reused_tokens_total") == 192
    assert moved("hybridkv_requests_with_hit_total") == 1 and moved("hybridkv_prompt_tokens_total") == 401
    assert moved("hybridkv_time_to_first_token_seconds_count") == 2
    assert moved("hybridkv_reused_prompt_tokens_count") == 2 and moved("hybridkv_reused_prompt_tokens_sum") == 192
    assert moved("hybridkv_http_errors_total", (("code", "404"),)) == 1
    assert moved("hybridkv_engine_step_seconds_count") > 0
    assert after[("hybridkv_tier_held_bytes", (("tier", "device"),))] > 0
    assert after[("hybridkv_tier_capacity_bytes", (("tier", "device"),))] > 0
    assert after[("hybridkv_queue_depth", ())] == 0
    assert moved("hybridkv_checkpoints_created_total", (("policy", "tail"),)) >= 1
    # cache operation histograms: two admissions looked up the device; the hit saved measured prefill time
    assert moved("hybridkv_cache_lookup_seconds_count", (("tier", "device"),)) >= 2
    assert moved("hybridkv_saved_prefill_seconds_count") == 1 and moved("hybridkv_saved_prefill_seconds_sum") > 0
    for weight in ("token", "request", "byte"):
        assert 0 < after[("hybridkv_hit_rate", (("weight", weight),))] <= 1


def test_a_client_leaving_a_non_streamed_request_cancels_it(server):
    baseline = wait_idle(server)
    cancelled = server.server.handle.engine.stats.cancelled
    body = {**LONG, "stream": False, "prompt": prompt_ids(33, 150)}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.5)) as c, \
            pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)                 # gives up long before 4,000 tokens
    state = wait_idle(server)
    assert state == baseline and server.server.handle.engine.stats.cancelled == cancelled + 1


def test_a_stopped_engine_answers_503_and_health_says_so():
    with RunningServer(ServeOptions(port=0, threads=1)) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        assert c.get("/health").json() == {"status": "ok"}
        s.server.worker.stop()
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
        assert c.get("/metrics").status_code == 200


def test_metrics_time_a_load_from_the_store(tiered):
    ids = prompt_ids(51, 300)
    with httpx.Client(base_url=tiered.url, timeout=60) as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1}).status_code == 200
        tiered.server.worker.call(lambda h: h.store_tier.submit(lambda: None).result()).result(timeout=60)
        assert c.post("/flush_cache").json()["device_nodes"] > 0         # only the store holds it now
        before = _scrape(tiered)
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": ids + [9], "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    after = _scrape(tiered)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    store = (("tier", "store"),)
    assert moved("hybridkv_tier_hit_tokens_total", store) == 256
    for name in ("hybridkv_cache_lookup_seconds", "hybridkv_tier_load_seconds", "hybridkv_tier_transfer_seconds",
                 "hybridkv_tier_install_seconds"):
        assert moved(f"{name}_count", store) >= 1, name
        assert moved(f"{name}_sum", store) > 0, name
    assert moved("hybridkv_saved_prefill_seconds_count") == 1


def test_a_tenant_header_confines_invalidation_to_that_tenant(tiered):
    """A request carrying ``X-Tenant: b`` (a gateway's tenant identity) may purge b's entries and
    read b's counts only: another tenant's scope, ``all``, ``abi_version`` and ``/flush_cache``
    are refused (403) and change nothing; without a tenant field the header's tenant is the scope."""
    ids = prompt_ids(41, 300)
    with httpx.Client(base_url=tiered.url, timeout=60) as c:
        def cached(prompt, tenant) -> int:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            r = c.post("/v1/completions", json=body, headers={"X-Tenant": tenant})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(ids, "a") == 0 and cached(ids, "b") == 0
        for body in ({"tenant": "a"}, {"all": True}, {"abi_version": 3}, {"tenant": "a", "cache_salt": ""}):
            r = c.post("/admin/cache/invalidate", json=body, headers={"X-Tenant": "b"})
            assert r.status_code == 403, (body, r.text)
            err = r.json()["error"]
            assert "X-Tenant" in err["message"] and "namespaces" not in r.text
        r = c.post("/flush_cache", headers={"X-Tenant": "b"})
        assert r.status_code == 403 and "X-Tenant" in r.json()["error"]["message"]
        assert cached(ids + [9], "a") == 256 and cached(ids + [9], "b") == 256    # nothing was purged
        counts = c.post("/admin/cache/invalidate", json={}, headers={"X-Tenant": "b"})
        assert counts.status_code == 200, counts.text
        assert counts.json()["namespaces"] == 1                                  # b's own, by the header
        assert cached(ids + [9], "b") == 0 and cached(ids + [9], "a") == 256
        r = c.post("/admin/cache/invalidate", json={"tenant": "b"}, headers={"X-Tenant": "b"})
        assert r.status_code == 200, r.text


def test_invalidate_by_tenant_removes_what_an_earlier_server_process_stored(tmp_path):
    """The ledger of a restarted server knows no tenant yet; ``{"tenant": T}`` (and with a
    ``cache_salt``) still removes T's store entries an earlier process wrote, selected by the
    namespace the tenant's requests use, so T gets no hit from them afterwards."""
    store = f"disk://{tmp_path}"
    ids = prompt_ids(42, 300)
    body = {"model": "tiny", "max_tokens": 1}
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        for tenant, salt in (("x", ""), ("x", "s"), ("y", "")):
            r = c.post("/v1/completions", json={**body, "prompt": ids, "cache_salt": salt}, headers={"X-Tenant": tenant})
            assert r.status_code == 200, r.text
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        def cached(tenant, salt="") -> int:
            r = c.post("/v1/completions", json={**body, "prompt": ids + [9], "cache_salt": salt},
                       headers={"X-Tenant": tenant})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        counts = c.post("/admin/cache/invalidate", json={"tenant": "x"}).json()
        assert counts["namespaces"] == 1 and counts["tier_entries"]["store"] > 0, counts
        counts = c.post("/admin/cache/invalidate", json={"tenant": "x", "cache_salt": "s"}).json()
        assert counts["namespaces"] == 1 and counts["tier_entries"]["store"] > 0, counts
        assert cached("x") == 0 and cached("x", "s") == 0
        assert cached("y") == 256                                   # another tenant's entries stay


def test_an_invalidation_matching_nothing_still_names_the_servers_tiers(tiered):
    """docs/how-to/serve.md: ``tier_entries`` names the tiers the server was started with; a scope that
    matched no namespace answered ``{}`` as if there were none."""
    r = httpx.post(f"{tiered.url}/admin/cache/invalidate", json={"tenant": "nobody", "cache_salt": "never used"},
                   timeout=60)
    assert r.status_code == 200, r.text
    counts = r.json()
    assert counts["device_nodes"] == 0 and counts["tier_entries"] == {"host": 0, "store": 0}, counts
    assert set(counts["tier_bytes"]) == {"host", "store"}, counts


def test_a_tenant_header_cannot_read_the_cache_event_feed(tiered):
    """``/v1/cache/events`` lists every tenant's entry keys (for ``hybridkv router``, which sends no
    ``X-Tenant``): a request a gateway marked with a tenant is refused (403) rather than shown the
    other tenants' keys, from which a guessed prompt's presence could be checked."""
    r = httpx.get(f"{tiered.url}/v1/cache/events", headers={"X-Tenant": "b"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_scope", r.text
    assert "events" not in r.json()
    assert httpx.get(f"{tiered.url}/v1/cache/events", timeout=30).status_code == 200
