"""`hybridkv router` against a real fleet: workers that die mid-answer, load put on workers by
others (clients, a second router), slot counts from ``/server_info``, a tenant-scoped purge, and
bounded ``prefix`` trees.

Real workers (in-process, or ``hybridkv serve`` subprocesses where a worker must die by
SIGKILL), real routers, real clients (``openai``, httpx), on 127.0.0.1 with free ports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import prompt_ids, router_stats as _stats, wait_router as _wait

from hybridkv.fleet.routers import FleetState, InstanceLoad, PrefixOptions, PrefixRouter, RouteRequest
from hybridkv.serve.commands import router_service
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.router import create_router_app

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
START_BOUND_S = 90                       # a hang guard for a subprocess's start


def _router(urls: list[str], policy: str = "hybrid", **extra) -> BackgroundUvicorn:
    args = argparse.Namespace(worker=urls, policy=policy, model="tiny", cost_model=None, poll_interval=0.05,
                              health_every=2, follow_wait=2.0, store_gbps=1.1, store_latency_us=194.0, **extra)
    return BackgroundUvicorn(create_router_app(router_service(args)), "127.0.0.1", 0, lifespan="on")




def _routed(stats: dict) -> list[int]:
    return [w["routed"] for w in stats["workers"]]


def _load(url: str) -> dict:
    return httpx.get(f"{url}/get_load", timeout=10).json()[0]


def _wait_load(url: str, reqs: int, polls: int = 400) -> None:
    for _ in range(polls):
        if _load(url)["num_reqs"] == reqs:
            return
        time.sleep(0.025)
    pytest.fail(f"{url} never had {reqs} requests: {_load(url)}")


class _Subprocess:
    """``hybridkv serve`` / ``hybridkv router`` as a subprocess on a free port (its log in a file),
    so a test can SIGKILL it mid-answer."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", *cmd, "--port", "0"], env=ENV,
                                         stdout=subprocess.DEVNULL, stderr=out)
        deadline = time.monotonic() + START_BOUND_S
        while time.monotonic() < deadline:
            for line in log.read_text().splitlines():
                if " on http://127.0.0.1:" in line and "Ctrl-C stops it" in line:
                    self.url = line.split(" on ")[1].split()[0]
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"{cmd[0]} did not start: {log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


def _worker_process(tmp_path: Path, name: str) -> _Subprocess:
    return _Subprocess(["serve", "--model", "tiny", "--threads", "1"], tmp_path / f"{name}.log")


def _long(prompt, max_tokens: int = 4000, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


@pytest.fixture(scope="module")
def workers():
    with RunningServer(ServeOptions(port=0, threads=1)) as a, RunningServer(ServeOptions(port=0, threads=1)) as b:
        yield [a, b]


# -- a worker that dies mid-answer ----------------------------------------------------------------

def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_and_the_openai_client_raises(tmp_path):
    dying = _worker_process(tmp_path, "dying")
    router = _router([dying.url], "round-robin")
    try:
        _wait(lambda s: s["workers"][0]["healthy"], router)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt=prompt_ids(1, 70), max_tokens=4000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        got = 0
        with pytest.raises(openai.APIError, match="failed mid-answer"):
            for chunk in stream:
                got += len(chunk.choices)
                if got == 5:
                    dying.kill()
        assert got >= 5
    finally:
        router.close()
        dying.kill()


def test_a_split_batch_whose_part_dies_is_an_error_for_the_whole_request(tmp_path, workers):
    dying = _worker_process(tmp_path, "dying")
    ok = workers[0]
    router = _router([dying.url, ok.url], "round-robin")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        lines, indexes = [], set()
        with httpx.stream("POST", f"{router.url}/v1/completions", timeout=120,
                          json=_long([prompt_ids(3, 70), prompt_ids(4, 70)], max_tokens=300, stream=True,
                                     stream_options={"include_usage": True})) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                lines.append(line)
                if line != "data: [DONE]":
                    indexes.update(c["index"] for c in json.loads(line[6:]).get("choices", ()))
                if len(lines) == 10:
                    dying.kill()
        assert indexes == {0, 1}                      # both parts were streaming when one died
        assert "data: [DONE]" not in lines
        last = json.loads(lines[-1][6:])
        assert last["error"]["code"] == "worker_failed"
        assert not any("usage" in json.loads(ln[6:]) and json.loads(ln[6:])["usage"] for ln in lines)
        _wait(lambda s: all(w["in_flight"] == 0 for w in s["workers"]), router)
    finally:
        router.close()
        dying.kill()


def test_a_worker_dying_before_its_first_byte_is_retried_once_on_another(tmp_path, workers):
    """A non-streamed request's first byte is its whole answer: the worker dies while generating
    it, nothing reached the client yet, so the router sends it to the other worker. The worker is
    killed as soon as it reports the request running, with hundreds of tokens still to generate
    (an idle machine makes 80 tokens in well under a second: it could finish before the kill)."""
    MAX_TOKENS = 600
    dying = _worker_process(tmp_path, "dying")
    ok = workers[0]
    router = _router([dying.url, ok.url], "round-robin")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        answer = {}

        def send():
            answer["r"] = httpx.post(f"{router.url}/v1/completions", timeout=120,
                                     json=_long(prompt_ids(5, 70), max_tokens=MAX_TOKENS))

        t = threading.Thread(target=send)
        t.start()
        _wait_load(dying.url, 1)                      # round-robin's first pick is worker 0
        dying.kill()                                  # at once: it is far from done with MAX_TOKENS
        t.join(120)
        r = answer["r"]
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        s = _stats(router)
        assert s["retries"] == 1 and s["workers"][1]["routed"] == 1
    finally:
        router.close()
        dying.kill()


# -- load put on the workers by others ------------------------------------------------------------

@contextlib.contextmanager
def _streams(url: str, prompts: list[list[int]], headers: dict | None = None):
    """Long streams sent to ``url`` (a worker or a router), open until the block ends (the
    client then closes them and the worker cancels them); each has sent its first frame."""
    client = httpx.Client(timeout=60)
    opened = []
    try:
        for p in prompts:
            cm = client.stream("POST", f"{url}/v1/completions", json=_long(p, stream=True), headers=headers)
            r = cm.__enter__()
            lines = r.iter_lines()               # kept: a dropped iterator closes the response
            opened.append((cm, lines))
            assert r.status_code == 200
            next(lines)
        yield
    finally:
        for cm, _lines in opened:
            cm.__exit__(None, None, None)
        client.close()


def test_streams_sent_straight_to_a_worker_steer_the_routers_misses_to_the_other(workers):
    a, b = workers
    router = _router([a.url, b.url], "hybrid")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        with _streams(a.url, [prompt_ids(600 + i, 70) for i in range(4)]):      # every slot of A
            _wait_load(a.url, 4)
            time.sleep(0.3)                                  # a few of the router's load polls (50 ms apart)
            before = _routed(_stats(router))
            for i in range(4):
                r = httpx.post(f"{router.url}/v1/completions", timeout=20,      # on A: behind 4 long streams
                               json={"model": "tiny", "prompt": prompt_ids(700 + i, 70), "max_tokens": 2})
                assert r.status_code == 200
            after = _routed(_stats(router))
        assert [x - y for x, y in zip(after, before, strict=True)] == [0, 4]
    finally:
        router.close()


def test_slot_counts_from_server_info_keep_a_cached_prefix_on_its_worker_beside_one_stream(workers):
    """A 2,048-token prefix cached on one worker which runs one long stream: with its 4 slots (from
    ``/server_info``) one stream leaves room, so the next request sharing the prefix goes there."""
    router = _router([w.url for w in workers], "hybrid")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        prefix = prompt_ids(800, 2048)
        r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prefix + prompt_ids(801, 30), "max_tokens": 1})
        assert r.status_code == 200
        holder = _routed(_stats(router)).index(1)
        _wait(lambda s: s["workers"][holder]["kv_keys"] >= 2048 // 64, router)
        with _streams(router.url, [prefix + prompt_ids(802, 30)]):
            assert _routed(_stats(router))[holder] == 2
            before = _routed(_stats(router))
            r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prefix + prompt_ids(803, 30), "max_tokens": 1})
            after = _routed(_stats(router))
        assert after[holder] - before[holder] == 1
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2048
        s = _stats(router)
        assert [w["slots"] for w in s["workers"]] == [4, 4]
        assert [w["page_size"] for w in s["workers"]] == [64, 64]
        assert all(w["pool_tokens"] >= 65536 for w in s["workers"])
    finally:
        router.close()


def test_a_tenant_purge_keeps_the_other_tenants_affinity(workers):
    router = _router([w.url for w in workers], "hybrid")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        prefix = prompt_ids(900, 2048)
        x = {"X-Tenant": "x"}

        def send(prompt, headers):
            r = httpx.post(f"{router.url}/v1/completions", timeout=60, headers=headers,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        send(prefix + prompt_ids(901, 30), x)
        holder = _routed(_stats(router)).index(1)
        url = workers[holder].url
        keys = _wait(lambda s: s["workers"][holder]["kv_keys"] >= 2048 // 64, router)["workers"][holder]["kv_keys"]
        y = httpx.post(f"{url}/v1/completions", timeout=60, headers={"X-Tenant": "y"},
                       json={"model": "tiny", "prompt": prompt_ids(902, 300), "max_tokens": 1})
        assert y.status_code == 200
        epoch = _stats(router)["workers"][holder]["epoch"]
        purge = httpx.post(f"{url}/admin/cache/invalidate", json={"tenant": "y"}, timeout=60)
        assert purge.status_code == 200, purge.text
        s = _wait(lambda s: s["workers"][holder]["epoch"] != epoch and s["workers"][holder]["kv_keys"] >= keys,
                  router)
        assert s["workers"][holder]["kv_keys"] == keys             # x's entries, y's gone
        for i in range(2):
            before = _stats(router)
            cached = send(prefix + prompt_ids(910 + i, 30), x)
            after = _stats(router)
            w0, w1 = before["workers"][holder], after["workers"][holder]
            assert w1["routed"] - w0["routed"] == 1
            assert w1["predicted_hit_tokens_routed"] - w0["predicted_hit_tokens_routed"] == 2048
            assert cached == 2048
    finally:
        router.close()


def test_two_router_replicas_see_each_others_load_through_the_workers(workers):
    a, b = workers
    r1 = _router([a.url, b.url], "least-load")
    r2 = _router([a.url, b.url], "least-load")
    try:
        for r in (r1, r2):
            _wait(lambda s: all(w["healthy"] for w in s["workers"]), r)
        with _streams(r1.url, [prompt_ids(1000 + i, 70) for i in range(3)]):
            placed = _routed(_stats(r1))
            assert sorted(placed) == [1, 2]
            busy = placed.index(2)
            _wait_load(workers[busy].url, 2)
            _wait_load(workers[1 - busy].url, 1)
            time.sleep(0.3)                                  # a few of r2's load polls (50 ms apart)
            before = _routed(_stats(r2))
            r = httpx.post(f"{r2.url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt_ids(1010, 70), "max_tokens": 2})
            assert r.status_code == 200
            after = _routed(_stats(r2))
        assert after[1 - busy] - before[1 - busy] == 1
    finally:
        r1.close()
        r2.close()


def test_killing_one_router_replica_loses_no_request_of_the_other(workers, tmp_path):
    urls = [w.url for w in workers]
    doomed = _Subprocess(["router", "--model", "tiny", *[f"--worker={u}" for u in urls]], tmp_path / "r1.log")
    survivor = _router(urls, "hybrid")
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), survivor)
        codes: list[int] = []
        lock = threading.Lock()

        def client(i: int, url: str, sink):
            r = httpx.post(f"{url}/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": prompt_ids(1100 + i, 70), "max_tokens": 40,
                                 "temperature": 0, "ignore_eos": True})
            with lock:
                sink.append(r.status_code)

        lost: list = []

        def doomed_client(i):
            with contextlib.suppress(httpx.HTTPError):
                client(i, doomed.url, lost)

        threads = [threading.Thread(target=client, args=(i, survivor.url, codes)) for i in range(8)]
        threads += [threading.Thread(target=doomed_client, args=(50 + i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        doomed.kill()
        for t in threads:
            t.join(120)
        assert codes == [200] * 8
    finally:
        survivor.close()
        doomed.kill()


# -- bounded prefix trees ------------------------------------------------------------------------

def test_prefix_trees_stay_bounded_after_20000_unique_requests():
    unit, cap = 64, 4096
    router = PrefixRouter(unit, PrefixOptions(max_tree_tokens=cap * unit))
    fleet = FleetState([None, None], [InstanceLoad(), InstanceLoad()])
    for i in range(20000):
        hashes = [i.to_bytes(4, "little") + j.to_bytes(2, "little") for j in range(8)]
        router.route(RouteRequest(hashes, 8 * unit, 8 * unit), fleet)
    assert all(len(t.kv) <= cap for t in router.trees)
    assert sum(len(t.kv) for t in router.trees) >= cap               # it did fill up
    # the most recent prompts are kept whole, the oldest gone
    last = [19999 .to_bytes(4, "little") + j.to_bytes(2, "little") for j in range(8)]
    first = [0 .to_bytes(4, "little") + j.to_bytes(2, "little") for j in range(8)]
    assert any(t.kv_run(last, 8 * unit) == 8 * unit for t in router.trees)
    assert all(t.kv_run(first, 8 * unit) == 0 for t in router.trees)


def test_prefix_tree_eviction_keeps_a_shared_prefix_while_it_is_used():
    """Leaves go first: a prompt's own units are touched leaf first, so its shared first unit is
    the most recent of them and outlives the leaves of older prompts."""
    unit = 64
    router = PrefixRouter(unit, PrefixOptions(max_tree_tokens=6 * unit))
    fleet = FleetState([None], [InstanceLoad()])
    shared = b"shared"
    for i in range(10):
        router.route(RouteRequest([shared, b"leaf-%d" % i], 2 * unit, 2 * unit), fleet)
    (tree,) = router.trees
    assert len(tree.kv) == 6 and shared in tree.kv
    assert tree.kv_run([shared, b"leaf-9"], 2 * unit) == 2 * unit


def test_the_router_bounds_its_prefix_trees_with_its_option(workers):
    router = _router([w.url for w in workers], "prefix", max_tree_tokens=5 * 64)
    try:
        _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
        for i in range(6):
            r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt_ids(1200 + i, 200), "max_tokens": 1})
            assert r.status_code == 200
        s = _stats(router)
        assert s["max_tree_tokens"] == 320
        assert all(n <= 5 for n in s["tree_nodes"]) and sum(s["tree_nodes"]) >= 5
    finally:
        router.close()


def test_max_tree_tokens_is_refused_for_a_policy_without_trees():
    args = argparse.Namespace(worker=["http://127.0.0.1:9"], policy="hybrid", model="tiny", cost_model=None,
                              poll_interval=0.05, health_every=2, max_tree_tokens=1024)
    with pytest.raises(ValueError, match="--max-tree-tokens 1024 is an option of the prefix and prefix-smg"):
        router_service(args)
    with pytest.raises(ValueError, match="max_tree_tokens=0 must be a positive number of tokens"):
        PrefixOptions(max_tree_tokens=0)
