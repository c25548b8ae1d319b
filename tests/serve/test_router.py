"""`hybridkv router` in front of two live workers (in-process uvicorn on 127.0.0.1, the tiny preset).

Real workers, real router, real HTTP: the router's views come from the workers' cache events only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
from serve_helpers import prompt_ids, wait_idle, router_stats as _stats, wait_router as _wait

from hybridkv.serve.commands import router_service
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.router import create_router_app

PREFIX = 320                                   # 5 units of 64 tokens


def _router(urls: list[str], policy: str, poll_interval: float = 0.05, follow_wait: float = 2.0,
            store_gbps: float = 1.1) -> BackgroundUvicorn:
    args = argparse.Namespace(worker=urls, policy=policy, model="tiny", cost_model=None, poll_interval=poll_interval,
                              health_every=2, follow_wait=follow_wait, store_gbps=store_gbps, store_latency_us=194.0)
    return BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")




def _complete(router: BackgroundUvicorn, ids: list[int], **extra) -> dict:
    r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def workers():
    with RunningServer(ServeOptions(port=0, threads=1)) as a, RunningServer(ServeOptions(port=0, threads=1)) as b:
        yield [a, b]


def _shared_prefix_pair(seed: int) -> tuple[list[int], list[int]]:
    prefix = prompt_ids(seed, PREFIX)
    return prefix + prompt_ids(seed + 1, 20), prefix + prompt_ids(seed + 2, 20)


def _routed(stats: dict) -> list[int]:
    return [w["routed"] for w in stats["workers"]]


POLICY_SEEDS = {"hybrid": 10, "kv-overlap": 12, "prefix": 14, "round-robin": 20, "least-load": 22}


@pytest.mark.parametrize("policy", list(POLICY_SEEDS))
def test_second_request_sharing_a_prefix(workers, policy):
    """Cache-aware policies send the second request to the worker holding the prefix; the
    load-only ones send it to the other (idle, fewer requests routed) worker."""
    first, second = _shared_prefix_pair(POLICY_SEEDS[policy])
    router = _router([w.url for w in workers], policy)
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        u1 = _complete(router, first)["usage"]
        before = _routed(_stats(router))
        holder = before.index(1)
        _wait(lambda s: s["workers"][holder]["kv_keys"] >= PREFIX // 64, router)   # its events arrived
        u2 = _complete(router, second)["usage"]
        after = _routed(_stats(router))
        second_to = [a - b for a, b in zip(after, before, strict=True)].index(1)
    finally:
        router.close()
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    if policy in ("hybrid", "kv-overlap", "prefix"):
        assert second_to == holder
        assert u2["prompt_tokens_details"]["cached_tokens"] >= PREFIX - 64
    else:
        assert second_to != holder
        assert u2["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_router_hashes_an_adapters_requests_in_the_adapters_namespace(workers):
    """A request naming an adapter is predicted (and routed) within that adapter's namespace,
    as the workers cache it: the same adapter goes to the holder and reuses; a prediction made
    without the adapter would have found nothing."""
    first, second = _shared_prefix_pair(30)
    router = _router([w.url for w in workers], "hybrid")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        lora = {"adapter": "lora-a", "adapter_version": "3"}
        assert _complete(router, first, **lora)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        before = _routed(_stats(router))
        holder = before.index(max(before))
        _wait(lambda s: s["workers"][holder]["kv_keys"] >= PREFIX // 64, router)
        u2 = _complete(router, second, **lora)["usage"]
        after = _routed(_stats(router))
        second_to = [a - b for a, b in zip(after, before, strict=True)].index(1)
    finally:
        router.close()
    assert second_to == holder
    assert u2["prompt_tokens_details"]["cached_tokens"] >= PREFIX - 64


def test_streaming_through_the_router_with_the_openai_client(workers):
    router = _router([w.url for w in workers], "hybrid")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chunks = list(client.completions.create(model="tiny", prompt="hello router", max_tokens=4,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        plain = client.completions.create(model="tiny", prompt="hello router", max_tokens=4, temperature=0)
        assert text == plain.choices[0].text
        assert chunks[-1].usage.completion_tokens == 4
        chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=3, temperature=0, stream=True))
        assert chat[-1].choices[0].finish_reason in ("length", "stop")
        with httpx.stream("POST", f"{router.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "gone", "max_tokens": 500, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")            # then the client goes away
        idle = _wait(lambda s: all(w["in_flight"] == 0 for w in s["workers"]), router)
        assert all(w["outstanding_tokens"] == 0 for w in idle["workers"])
        for w in workers:                                              # the worker cancelled it too
            assert wait_idle(w)["page_refs"] == 0
    finally:
        router.close()


def test_a_killed_worker_is_routed_around():
    a = RunningServer(ServeOptions(port=0, threads=1))
    b = RunningServer(ServeOptions(port=0, threads=1))
    b_url = b.url
    router = _router([a.url, b_url], "round-robin")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        for i in range(2):
            _complete(router, prompt_ids(100 + i, 70))
        b.close()                                   # killed mid-run: its port refuses connections
        b = None
        usages = [_complete(router, prompt_ids(200 + i, 70))["usage"] for i in range(6)]
        assert all(u["completion_tokens"] == 2 for u in usages)
        s = _stats(router)
        assert s["workers"][1]["healthy"] is False and s["workers"][1]["kv_keys"] == 0
        assert s["workers"][0]["routed"] == 1 + 6
        assert s["unroutable"] == 0
        health = httpx.get(f"{router.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["workers_in_rotation"] == 1
        old_epoch = _stats(router)["workers"][0]["epoch"]
        b = RunningServer(ServeOptions(port=int(b_url.rsplit(":", 1)[1]), threads=1))   # restarted, same port
        back = _wait(lambda s: s["workers"][1]["healthy"], router)
        assert back["workers"][1]["epoch"] is not None and back["workers"][1]["epoch"] != old_epoch
        assert back["workers"][1]["failures"] == 1 and back["workers"][1]["last_error"]   # one departure, kept
        assert [_complete(router, prompt_ids(300 + i, 70))["usage"]["completion_tokens"] for i in range(2)] == [2, 2]
        assert _routed(_stats(router))[1] >= 2
    finally:
        router.close()
        a.close()
        if b is not None:
            b.close()


def test_start_up_checks_of_a_late_worker_leave_no_failures():
    """A router started before its worker: the checks that fail until the worker is up are not
    failures of a worker in rotation, and their connection error is cleared when it comes in."""
    with socket.socket() as sock:                   # a free port nobody listens on (yet)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    a = RunningServer(ServeOptions(port=0, threads=1))
    router = _router([a.url, f"http://127.0.0.1:{port}"], "round-robin")
    late = None
    try:
        down = _wait(lambda s: s["workers"][1]["last_error"] != "", router)
        assert down["workers"][1]["healthy"] is False and down["workers"][1]["failures"] == 0
        late = RunningServer(ServeOptions(port=port, threads=1))
        up = _wait(lambda s: s["workers"][1]["healthy"], router)["workers"][1]
        assert up["failures"] == 0 and up["last_error"] == ""
        assert _stats(router)["workers"][0]["failures"] == 0
    finally:
        router.close()
        a.close()
        if late is not None:
            late.close()


def test_a_bad_worker_list_is_refused_naming_it():
    args = argparse.Namespace(worker=["http://127.0.0.1:1", "http://127.0.0.1:1/"], policy="hybrid", model="tiny",
                              cost_model=None, poll_interval=0.05, health_every=2)
    with pytest.raises(ValueError, match="given twice"):
        router_service(args)


def test_a_refused_connection_is_retried_on_another_worker():
    """Polling slowed to once an hour and no long polls: the router learns of the dead worker from
    the refused connection itself, takes it out of rotation and retries the request elsewhere."""
    a = RunningServer(ServeOptions(port=0, threads=1))
    b = RunningServer(ServeOptions(port=0, threads=1))
    router = _router([a.url, b.url], "round-robin", poll_interval=3600, follow_wait=0)
    try:
        assert all(w["healthy"] for w in _stats(router)["workers"])      # the startup round
        b.close()
        b = None
        usages = [_complete(router, prompt_ids(400 + i, 70))["usage"] for i in range(3)]
        assert [u["completion_tokens"] for u in usages] == [2, 2, 2]
        s = _stats(router)
        assert s["retries"] == 1 and s["workers"][1]["healthy"] is False
        assert "connection failed" in s["workers"][1]["last_error"]
        assert s["workers"][0]["routed"] == 3
    finally:
        router.close()
        a.close()
        if b is not None:
            b.close()


def test_worker_events_page_and_epochs(workers):
    """``/v1/cache/events`` pages through the worker's events; a purge starts a new epoch."""
    w = workers[0]
    _ = httpx.post(f"{w.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt_ids(7, 200), "max_tokens": 1, "temperature": 0})
    info = httpx.get(f"{w.url}/v1/cache/info", timeout=10).json()
    assert info["prefix_match_unit"] == 64 and len(bytes.fromhex(info["binding"])) > 0
    page = httpx.get(f"{w.url}/v1/cache/events", params={"epoch": info["epoch"], "after": -1, "limit": 1},
                     timeout=10).json()
    assert page["epoch"] == info["epoch"] and len(page["events"]) == 1 and page["more"] and not page["gap"]
    assert page["events"][0]["seq"] == 0 and all(len(k) == 64 for k in page["events"][0]["keys"])
    rest = httpx.get(f"{w.url}/v1/cache/events", params={"epoch": info["epoch"], "after": 0}, timeout=10).json()
    assert rest["events"][0]["seq"] == 1 and not rest["more"]
    assert httpx.get(f"{w.url}/v1/cache/events", params={"limit": 0}, timeout=10).status_code == 400
    assert httpx.post(f"{w.url}/admin/cache/invalidate", json={"all": True}, timeout=30).status_code == 200
    after = httpx.get(f"{w.url}/v1/cache/events", params={"epoch": info["epoch"], "after": rest["next"] - 1},
                      timeout=10).json()
    assert after["epoch"] == info["epoch"] + 1
    assert [e["kind"] for e in after["events"]] == ["all_cleared"]


def test_the_router_command_refuses_bad_options(capsys):
    from hybridkv.cli import main
    assert main(["router", "--worker", "http://127.0.0.1:1", "--worker", "http://127.0.0.1:1"]) == 2
    assert "given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["router", "--worker", "http://127.0.0.1:1", "--policy", "nearest"])
    assert "nearest" in capsys.readouterr().err


def test_a_store_entry_written_by_one_worker_is_a_store_hit_for_the_other(tmp_path):
    """Two workers writing through to one disk store: the prefix worker A wrote reaches the
    router as ``medium: store`` events, and the router's ``hybrid`` score for worker B (whose own
    cache is empty) counts it as a store hit; with A gone, B serves the prefix from the store."""
    from hybridkv.fleet.routers import FleetState, make_router

    url = f"disk://{tmp_path}"
    a = RunningServer(ServeOptions(port=0, threads=1, store=url))
    b = RunningServer(ServeOptions(port=0, threads=1, store=url))
    args = argparse.Namespace(worker=[a.url, b.url], policy="hybrid", model="tiny", cost_model=None,
                              poll_interval=0.05, health_every=2, follow_wait=2.0, store_gbps=1.1,
                              store_latency_us=194.0)
    service = router_service(args)
    router = BackgroundUvicorn(create_router_app(service), "127.0.0.1", 0, lifespan="on")
    first, second = _shared_prefix_pair(30)
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        info = httpx.get(f"{a.url}/v1/cache/info", timeout=10).json()["store"]
        assert info is not None and info["alignment"] == 64 and info["checkpoint_bytes"] > 0
        _complete(router, first)
        holder = _routed(_stats(router)).index(1)
        other = 1 - holder
        s = _wait(lambda s: s["stores"].get(info["id"], {}).get("checkpoint_entries", 0) >= 1
                  and s["stores"][info["id"]]["kv_entries"] >= PREFIX // 64, router)
        assert s["workers"][holder]["store_events_applied"] >= 2 and s["workers"][other]["store_events_applied"] == 0
        assert s["workers"][other]["kv_keys"] == 0

        (req,) = service.route_requests({"model": "tiny", "prompt": second}, {}, chat=False)
        view, store_info = service.workers.shared_store([0, 1])
        store_hit = view.match(req.hashes, req.limit).hit
        assert store_hit >= PREFIX - 64                       # the prefix's entries, checkpoint included
        hybrid = make_router(service._config(64, 64, store_info))
        states = service.workers.states
        fleet = FleetState([w.view for w in states], [w.load for w in states], view)
        _, hit_other = hybrid.score(req, fleet, other, store_hit)
        no_store = FleetState(fleet.views, fleet.loads, None)
        assert hit_other == store_hit                        # a store hit for B, at transfer cost
        assert hybrid.score(req, fleet, other, store_hit)[0] > hybrid.score(req, no_store, other, 0)[0]

        (a if holder == 0 else b).close()                     # the holder goes away: B must use the store
        usage = _complete(router, second)["usage"]
        s = _stats(router)
        assert s["workers"][other]["routed"] == 1
        assert s["workers"][other]["predicted_store_hit_tokens_routed"] == store_hit
        assert usage["prompt_tokens_details"]["cached_tokens"] == store_hit
    finally:
        router.close()
        for w in (a, b):
            w.close()                                         # closing twice is harmless


def test_a_batch_is_split_across_workers_and_put_back_in_order(workers):
    """Each prompt of a completion batch is routed on its own; choices come back in prompt order
    with the texts single requests give, ``usage`` summed, streamed or not."""
    router = _router([w.url for w in workers], "hybrid")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        first, second = _shared_prefix_pair(40)
        _complete(router, first)
        holder = _routed(_stats(router)).index(1)
        _wait(lambda s: s["workers"][holder]["kv_keys"] >= PREFIX // 64, router)
        fresh = prompt_ids(43, 90)
        alone = [_complete(router, p) for p in (fresh, second)]           # what each prompt gives alone
        before = _routed(_stats(router))
        _wait(lambda s: all(w["in_flight"] == 0 for w in s["workers"]), router)
        out = _complete(router, [second, fresh, "a text prompt"])
        after = _stats(router)
        assert after["split_batches"] == 1 and sum(_routed(after)) - sum(before) == 3
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert out["choices"][0]["text"] == alone[1]["choices"][0]["text"]
        assert out["choices"][1]["text"] == alone[0]["choices"][0]["text"]
        u = out["usage"]
        text_tokens = _complete(router, "a text prompt")["usage"]["prompt_tokens"]
        assert u["prompt_tokens"] == len(second) + len(fresh) + text_tokens
        assert u["completion_tokens"] == 6 and u["total_tokens"] == u["prompt_tokens"] + 6
        assert u["prompt_tokens_details"]["cached_tokens"] >= PREFIX + 64         # second again, fresh's first unit

        with httpx.stream("POST", f"{router.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": [second, fresh], "max_tokens": 3, "temperature": 0,
                                "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        texts = {0: "", 1: ""}
        for c in chunks:
            for ch in c["choices"]:
                texts[ch["index"]] += ch["text"]
        plain = _complete(router, [second, fresh], max_tokens=3)
        assert texts == {0: plain["choices"][0]["text"], 1: plain["choices"][1]["text"]}
        (last,) = [c for c in chunks if c.get("usage")]
        assert last["usage"]["prompt_tokens"] == len(second) + len(fresh) and last["usage"]["completion_tokens"] == 6

        bad = httpx.post(f"{router.url}/v1/completions", timeout=60,
                         json={"model": "tiny", "prompt": [fresh, [5, 10 ** 9]], "max_tokens": 2})
        assert bad.status_code == 400 and "error" in bad.json()
        _wait(lambda s: all(w["in_flight"] == 0 and w["outstanding_tokens"] == 0 for w in s["workers"]), router)
    finally:
        router.close()


def test_events_reach_the_router_by_long_poll_without_a_poll_period(workers):
    """Periodic polls once an hour: a prefix cached on a worker after the router's first round
    still reaches the router's view, through the long poll (``wait``) on the worker's events."""
    router = _router([w.url for w in workers], "hybrid", poll_interval=3600)
    try:
        s = _stats(router)
        assert all(w["healthy"] for w in s["workers"])                # the startup round
        keys = s["workers"][1]["kv_keys"]
        r = httpx.post(f"{workers[1].url}/v1/completions", timeout=60,           # straight to the worker
                       json={"model": "tiny", "prompt": prompt_ids(50, PREFIX + 10), "max_tokens": 1})
        assert r.status_code == 200
        _wait(lambda s: s["workers"][1]["kv_keys"] >= keys + PREFIX // 64, router)
    finally:
        router.close()
    for bad in (-1, 31):
        r = httpx.get(f"{workers[0].url}/v1/cache/events", params={"wait": bad}, timeout=10)
        assert r.status_code == 400 and "wait" in r.json()["error"]["message"]


def test_the_shared_store_view_follows_entries_at_aligned_boundaries():
    """KV entries contiguous from token 0 up to the deepest checkpoint entry at or below them;
    removals and ``all_cleared`` apply; epochs do not (the store outlives workers)."""
    from hybridkv.fleet.events import CacheEvent, EventKind
    from hybridkv.serve.fleet_view import SharedStoreView

    unit, align = 64, 128
    hashes = [bytes([i]) * 32 for i in range(8)]                  # 8 units: boundaries 64 .. 512
    key = {b: hashes[b // unit - 1] for b in range(align, 513, align)}
    view = SharedStoreView(unit, align)

    def ev(kind, *bounds, epoch=0):
        return CacheEvent(0, epoch, 0, kind, tuple(key[b] for b in bounds))

    view.apply(ev(EventKind.BLOCKS_STORED, 128, 256, 512))        # 384 missing: KV runs to 256
    view.apply(ev(EventKind.CHECKPOINTS_STORED, 128, 512))
    assert view.kv_run(hashes, 511) == 256
    assert view.match(hashes, 511).hit == 128                      # the checkpoint at or below the run
    view.apply(ev(EventKind.BLOCKS_STORED, 384, epoch=7))          # another worker, another epoch
    assert view.kv_run(hashes, 511) == 384
    assert view.match(hashes, 511).hit == 128                      # no checkpoint at 384; 512 is past the limit
    assert view.match(hashes, 512).hit == 512
    view.apply(ev(EventKind.CHECKPOINTS_REMOVED, 512))
    assert view.match(hashes, 512).hit == 128
    view.apply(ev(EventKind.BLOCKS_REMOVED, 128))
    assert view.match(hashes, 512).hit == 0 and view.kv_run(hashes, 512) == 0
    view.apply(CacheEvent(0, 0, 0, EventKind.ALL_CLEARED, ()))
    assert not view.kv and not view.checkpoints and view.events_applied == 6
    with pytest.raises(ValueError, match="alignment 96"):
        SharedStoreView(64, 96)


def test_a_split_batchs_error_names_the_prompt_by_its_index_in_the_clients_batch(workers):
    # Each part of a split batch is a one-prompt request, so a worker names its prompt "prompt 0".
    router = _router([w.url for w in workers], "round-robin")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        for prompt, index in (([prompt_ids(44, 70), prompt_ids(45, 70), [5, 10 ** 9]], 2),
                              ([[5, 10 ** 9], prompt_ids(44, 70)], 0)):
            bad = httpx.post(f"{router.url}/v1/completions", timeout=60,
                             json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert bad.status_code == 400
            msg = bad.json()["error"]["message"]
            assert msg.startswith(f"prompt {index}: token id 1000000000"), msg
        _wait(lambda s: all(w["in_flight"] == 0 and w["outstanding_tokens"] == 0 for w in s["workers"]), router)
    finally:
        router.close()


def test_a_long_poll_of_events_gets_a_read_timeout_longer_than_its_wait():
    # The router's control client reads for 5 s at most; a --follow-wait of 5 s or more made every
    # long poll of an idle worker time out, and the worker was taken out of rotation for it.
    import asyncio

    from hybridkv.serve.fleet_view import Workers

    seen: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append({"wait": request.url.params.get("wait"), "read": request.extensions["timeout"]["read"]})
        return httpx.Response(200, json={"epoch": 7, "gap": False, "events": [], "next": 0, "more": False})

    async def pull():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), timeout=httpx.Timeout(5.0)) as client:
            workers = Workers(["http://w0"], client)
            await workers._pull(workers.states[0], 20.0)
            await workers._pull(workers.states[0])

    asyncio.run(pull())
    assert float(seen[0]["wait"]) == pytest.approx(20.0) and seen[0]["read"] > 20.0
    assert seen[1]["wait"] is None and seen[1]["read"] == pytest.approx(5.0)


def test_the_router_refuses_a_follow_wait_beyond_the_workers_longest_long_poll(capsys):
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["router", "--worker", "http://127.0.0.1:1", "--follow-wait", "31"])
    assert exc.value.code == 2 and "--follow-wait 31.0" in capsys.readouterr().err


def test_a_ticket_counts_waiting_and_decode_tokens_until_each_part_ends():
    from hybridkv.serve.fleet_view import WorkerState
    from hybridkv.serve.router import _Ticket
    w = WorkerState("http://127.0.0.1:1")
    a, b = _Ticket(w, 100, 17, 0.5), _Ticket(w, 50, 1, 0.25)
    assert (w.load.waiting, w.load.decode_tokens, w.load.outstanding_tokens) == (2, 16, 150)
    a.first_byte()
    a.first_byte()                                   # once only
    assert (w.load.waiting, w.load.decode_tokens, w.load.outstanding_tokens) == (1, 16, 50)
    a.done()
    b.done()                                         # done without a first byte returns both parts
    b.done()
    assert (w.load.waiting, w.load.decode_tokens, w.load.outstanding_tokens, w.load.in_flight) == (0, 0, 0, 0)
    # kv-overlap's counts: two whole pages and a partial one held until done, 513 prefill tokens until the first byte
    c = _Ticket(w, 1025, 1, 0.0, ([b"page1", b"page2"], True, 513))
    assert (w.load.prefill_tokens, w.load.active_pages) == (513, 3)
    c.first_byte()
    assert (w.load.prefill_tokens, w.load.active_pages) == (0, 3)
    c.done()
    assert (w.load.prefill_tokens, w.load.active_pages, w.load.pages) == (0, 0, {})


def test_two_x_tenant_headers_are_refused_by_the_router(workers):
    """The router hashed a request under its first ``X-Tenant`` and forwarded only the last one;
    a request with two names no single tenant and is refused (400) before it reaches a worker."""
    router = _router([w.url for w in workers], "prefix")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        headers = [("X-Tenant", "victim"), ("X-Tenant", "me"), ("Content-Type", "application/json")]
        r = httpx.post(f"{router.url}/v1/completions", timeout=60, headers=headers,
                       content=json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 1}).encode())
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tenant" and "X-Tenant" in r.json()["error"]["message"]
        assert sum(w["routed"] for w in _stats(router)["workers"]) == 0
    finally:
        router.close()


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8001", "127.0.0.1:8001", "http://", "http://127.0.0.1:notaport"])
def test_a_worker_url_that_is_not_http_is_refused_naming_it(url):
    """Before, the router started with such a worker, logged nothing and never had it in rotation."""
    args = argparse.Namespace(worker=[url], policy="hybrid", model="tiny", cost_model=None, poll_interval=0.05,
                              health_every=2)
    with pytest.raises(ValueError, match="--worker") as info:
        router_service(args)
    assert repr(url) in str(info.value)


def test_hybrid_flags_reach_the_hybrid_policy_and_its_stats_and_are_refused_for_another():
    args = argparse.Namespace(worker=["http://127.0.0.1:1"], policy="hybrid", model="tiny", cost_model=None,
                              poll_interval=0.05, health_every=2, waiting_weight=3.0, tie_kv_run="off",
                              price_restore="off")
    service = router_service(args)
    try:
        h = service.settings.hybrid
        assert (h.waiting_weight, h.tie_kv_run, h.price_restore, h.own_waiting) == (3.0, False, False, 0.0)
        assert service._config(64, 512).hybrid == h
        stats = asyncio.run(service.stats())
        assert (stats["waiting_weight"], stats["tie_kv_run"], stats["price_restore"]) == (3.0, False, False)
    finally:
        asyncio.run(service.stop())
    args.policy = "prefix"
    with pytest.raises(ValueError, match="--waiting-weight 3 is an option of the hybrid policy, not of prefix"):
        router_service(args)


def test_own_waiting_reaches_the_hybrid_policy_and_is_refused_for_another():
    args = argparse.Namespace(worker=["http://127.0.0.1:1"], policy="hybrid", model="tiny", cost_model=None,
                              poll_interval=0.05, health_every=2, own_waiting=0.25)
    service = router_service(args)
    try:
        assert service.settings.hybrid.own_waiting == 0.25
        assert service._config(64, 512).hybrid.own_waiting == 0.25
        stats = asyncio.run(service.stats())
        assert stats["policy"] == "hybrid" and stats["own_waiting"] == 0.25      # an operator can see it
    finally:
        asyncio.run(service.stop())
    args.policy = "least-load"
    with pytest.raises(ValueError, match="--own-waiting 0.25 is an option of the hybrid policy"):
        router_service(args)
