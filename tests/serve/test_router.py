"""`hybridkv router` in front of two live workers (in-process uvicorn on 127.0.0.1, the tiny preset).

Real workers, real router, real HTTP: the router's views come from the workers' cache events only.
"""

from __future__ import annotations

import argparse
import time

import httpx
import openai
import pytest

from hybridkv.serve.commands import router_service
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.router import create_router_app
from serve_helpers import prompt_ids, wait_idle

PREFIX = 320                                   # 5 units of 64 tokens


def _router(urls: list[str], policy: str, poll_interval: float = 0.05, follow_wait: float = 2.0,
            store_gbps: float = 1.1) -> BackgroundUvicorn:
    args = argparse.Namespace(worker=urls, policy=policy, model="tiny", cost_model=None, poll_interval=poll_interval,
                              health_every=2, follow_wait=follow_wait, store_gbps=store_gbps, store_latency_us=194.0)
    return BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")


def _stats(router: BackgroundUvicorn) -> dict:
    return httpx.get(f"{router.url}/router/stats", timeout=10).json()


def _wait(pred, router: BackgroundUvicorn, polls: int = 400) -> dict:
    """Poll the router's stats until ``pred(stats)`` (at most ``polls`` polls, 25 ms apart)."""
    for _ in range(polls):
        s = _stats(router)
        if pred(s):
            return s
        time.sleep(0.025)
    pytest.fail(f"router never reached the expected state: {s}")


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
        assert [_complete(router, prompt_ids(300 + i, 70))["usage"]["completion_tokens"] for i in range(2)] == [2, 2]
        assert _routed(_stats(router))[1] >= 2
    finally:
        router.close()
        a.close()
        if b is not None:
            b.close()


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
