"""SGLang-style endpoints of a worker (serve/compat.py): server and model info under both names,
/get_load in the shape sglang-router reads, and /flush_cache dropping device entries without
tearing a request that runs meanwhile."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import prompt_ids, wait_idle
from starlette.datastructures import Headers

from hybridkv.engine.build import load_model
from hybridkv.serve.launch import RunningServer, ServeOptions

LONG = {"model": "tiny", "max_tokens": 4000, "stream": True, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def worker():
    """A server of its own: the flush below empties its device cache."""
    with RunningServer(ServeOptions(port=0, threads=1)) as s:
        yield s


def _cached(c: httpx.Client, prompt: list[int], max_tokens: int = 1) -> tuple[int, list[int]]:
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0, "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["token_ids"]


def test_server_and_model_info_under_both_names(worker):
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        info = c.get("/server_info").json()
        assert c.get("/get_server_info").json() == info
        assert info["model_id"] == "tiny" and info["served_model_name"] == "tiny"
        assert info["dp_size"] == 1 and info["tp_size"] == 1
        assert info["tokenizer_path"] is None                       # the preset's byte tokenizer
        assert info["context_length"] == info["max_total_tokens"] == 65536
        model = c.get("/model_info").json()
        assert c.get("/get_model_info").json() == model
        assert model["is_generation"] is True and model["model_path"] == "tiny"
        assert model["architectures"] == ["KimiLinearForCausalLM"]


def test_server_info_and_cache_info_give_the_weight_digest_purge_needs(worker):
    """``hybridkv cache purge --model M --weight-digest D`` needs the served weights' digest: both
    ``/server_info`` and ``/v1/cache/info`` give it, the same as the model's own ``weight_digest()``."""
    expected = load_model("tiny", 0).weight_digest()              # ServeOptions' default seed
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        info = c.get("/server_info").json()
        cache = c.get("/v1/cache/info").json()
    assert info["weight_digest"] == expected and len(bytes.fromhex(expected)) == 32
    assert cache["identity"]["weight_digest"] == expected
    assert cache["model"] == cache["identity"]["model_repo"] == info["model_id"] == "tiny"


def test_get_load_counts_queued_and_running_work(worker):
    wait_idle(worker)
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        assert c.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0,
                                                    "num_waiting_tokens": 0, "num_decode_tokens": 0}]
        with c.stream("POST", "/v1/completions", json={**LONG, "prompt": prompt_ids(70, 150)}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):                 # generating
                pass
            (load,) = c.get("/get_load").json()
            assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0
            assert load["num_tokens"] >= 151                            # the prompt plus a generated token
    wait_idle(worker)
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        assert c.get("/get_load").json()[0]["num_reqs"] == 0


def test_flush_cache_drops_device_entries_and_spares_a_running_request(worker):
    ids = prompt_ids(71, 300)
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        assert _cached(c, ids)[0] == 0
        assert _cached(c, ids + [9])[0] == 256
        before = c.get("/metrics").text
        assert "hybridkv_cache_flushes_total 0.0" in before
        out = c.post("/flush_cache")
        assert out.status_code == 200 and out.json()["success"] is True
        assert out.json()["device_nodes"] >= 4 and out.json()["held_pages"] == 0
        assert _cached(c, ids + [9])[0] == 0                             # nothing of it is left
        assert "hybridkv_cache_flushes_total 1.0" in c.get("/metrics").text

        # a flush while a request decodes: it finishes with the tokens of an undisturbed run
        other = prompt_ids(72, 200)
        _, reference = _cached(c, other, max_tokens=200)
        c.post("/flush_cache")
        body = {"model": "tiny", "prompt": other, "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            flushed = c.post("/flush_cache").json()
            rest = [line for line in lines if line.startswith("data: {")]
        assert flushed["held_pages"] >= 1                                 # its pages were detached, not freed
        last = json.loads(rest[-1][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length" and first
        assert last["choices"][0]["token_ids"] == reference
    state = wait_idle(worker)
    assert state["page_refs"] == 0 and state["slot_refs"] == 0 and state["pages_accounted"]


def test_flush_cache_keeps_events_the_engine_published_after_the_purge():
    # The engine keeps stepping once the purge is done; what it stores before the event loop resumes
    # belongs to the new epoch. Resetting the feed on the loop afterwards dropped those events, so
    # routers never learned of entries the worker holds.
    import asyncio
    from concurrent.futures import Future
    from types import SimpleNamespace

    from hybridkv.serve import compat
    from hybridkv.serve.cache_events import EventFeed

    feed = EventFeed()
    key = bytes(32)

    class Worker:
        alive = True

        def call(self, fn):
            fut: Future = Future()
            result = fn(None)                               # the purge, between two engine steps
            feed.stored([key], [], [])                      # the next step caches a unit
            fut.set_result(result)
            return fut

    server = SimpleNamespace(worker=Worker(), events=feed, metrics=SimpleNamespace(flushes=SimpleNamespace(inc=lambda: None)),
                             _check_alive=lambda: None)
    real = compat.flush_device
    compat.flush_device = lambda handle: {"device_nodes": 0, "device_checkpoints": 0, "held_pages": 0}
    try:
        before = feed.epoch
        asyncio.run(compat.CompatRoutes(server).flush_cache(SimpleNamespace(headers=Headers())))
    finally:
        compat.flush_device = real
    page = feed.page(None, -1)
    assert page["epoch"] != before
    assert any(e["kind"] == "blocks_stored" and e["keys"] == [key.hex()] for e in page["events"])


def test_invalidate_keeps_events_the_engine_published_after_the_purge(monkeypatch):
    # As for /flush_cache: held jobs enter and the engine steps as soon as the purge is done, before
    # the event loop resumes; the feed must start its new epoch before them, not after.
    import asyncio
    from types import SimpleNamespace

    from hybridkv.serve import worker as worker_mod
    from hybridkv.serve.app import Server
    from hybridkv.serve.cache_events import EventFeed
    from hybridkv.serve.purge import PurgeCounts

    feed = EventFeed()
    key = bytes(32)
    monkeypatch.setattr(worker_mod, "purge", lambda *a: PurgeCounts())
    w = worker_mod.EngineWorker(SimpleNamespace(), 4, on_purge=feed.reset)      # thread not started: driven here

    async def body():
        yield b'{"all": true}'

    server = SimpleNamespace(worker=w, events=feed, _check_alive=lambda: None)

    async def scenario():
        task = asyncio.ensure_future(Server.invalidate(server, SimpleNamespace(stream=body, headers=Headers())))
        for _ in range(5):
            await asyncio.sleep(0)                      # the request waits on the engine thread now
        w._drain_inbox(block=False)                     # the engine thread: the purge...
        w._run_purges()
        feed.stored([key], [], [])                      # ...then its next step caches a unit
        return await task

    before = feed.epoch
    asyncio.run(scenario())
    page = feed.page(None, -1)
    assert page["epoch"] != before
    assert any(e["kind"] == "blocks_stored" and e["keys"] == [key.hex()] for e in page["events"])


def test_the_published_digest_purges_a_tenants_store_entries_offline(tmp_path, capsys):
    """What ``/server_info`` publishes is what ``hybridkv cache purge --model --weight-digest
    --tenant`` needs: with it, the offline purge removes the entries the server wrote."""
    from hybridkv.cli import main
    store = f"disk://{tmp_path}"
    with RunningServer(ServeOptions(port=0, threads=1, store=store)) as s:
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompt_ids(61, 300), "max_tokens": 1})
        assert r.status_code == 200, r.text
        info = httpx.get(f"{s.url}/server_info", timeout=60).json()
    argv = ["cache", "purge", "--store", store, "--model", info["model_id"],
            "--weight-digest", info["weight_digest"], "--tenant", "default"]
    capsys.readouterr()
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert "removed" in first and "removed 0 entries" not in first
    assert "removed 0 entries" in capsys.readouterr().out
