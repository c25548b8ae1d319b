"""`GET /v1/cache/snapshot` in pages: bounded pages, one consistent cut per generation, a cursor
refused once a purge started a new epoch, and `hybridkv router`'s resync reading it page by page
(starting again when the snapshot changes under it).

Real servers on 127.0.0.1 (free ports, the tiny preset) and httpx.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serve_helpers import prompt_ids, wait_router

from hybridkv.replay.timed import CPU_ESTIMATE
from hybridkv.serve.cache_events import SNAPSHOT_KEEP, SNAPSHOT_PAGE_MAX, SnapshotGone, SnapshotPages
from hybridkv.serve.fleet_view import Workers
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.router import RouterService, RouterSettings, create_router_app
from hybridkv.serve.tokenizer import load_codec

TENANTS = ("t0", "t1", "t2")


@pytest.fixture(scope="module")
def filled():
    """A server whose device cache holds two 300-token prompts of each tenant (24 units)."""
    with RunningServer(ServeOptions(port=0, threads=1)) as s:
        for i, tenant in enumerate(TENANTS):
            for j in range(2):
                _cache(s.url, prompt_ids(1000 + 10 * i + j, 300), tenant)
        yield s


def _cache(url: str, ids: list[int], tenant: str) -> None:
    r = httpx.post(f"{url}/v1/completions", headers={"X-Tenant": tenant}, timeout=60,
                   json={"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def _get(url: str, **params) -> httpx.Response:
    return httpx.get(f"{url}/v1/cache/snapshot", params=params, timeout=60)


def _read_all(url: str, limit: int) -> tuple[list[dict], set[str], set[str]]:
    """Every page of one snapshot (``limit`` entries each), and the union of their kv and checkpoints."""
    pages = [_get(url, limit=limit).json()]
    while pages[-1]["next_cursor"]:
        r = _get(url, cursor=pages[-1]["next_cursor"], limit=limit)
        assert r.status_code == 200, r.text
        pages.append(r.json())
    return pages, {k for p in pages for k in p["kv"]}, {k for p in pages for k in p["checkpoints"]}


def test_pages_are_bounded_and_together_are_the_whole_snapshot(filled):
    whole = _get(filled.url).json()                       # the default limit holds all 24
    assert whole["next_cursor"] is None and whole["total"] == len(whole["kv"]) == 24
    pages, kv, checkpoints = _read_all(filled.url, 5)
    assert [len(p["kv"]) for p in pages] == [5, 5, 5, 5, 4]
    assert {p["generation"] for p in pages} == {pages[0]["generation"]}
    assert {p["epoch"] for p in pages} == {whole["epoch"]} and {p["total"] for p in pages} == {24}
    assert kv == set(whole["kv"]) and checkpoints == set(whole["checkpoints"]) and checkpoints <= kv
    assert pages[-1]["next_cursor"] is None


def test_the_cache_changing_between_pages_leaves_the_generation_as_first_read(filled):
    first = _get(filled.url, limit=5).json()
    _cache(filled.url, prompt_ids(2000, 300), "t1")      # four new units, cached after the first page
    rest, cursor = [], first["next_cursor"]
    while cursor:
        page = _get(filled.url, cursor=cursor, limit=5).json()
        rest.append(page)
        cursor = page["next_cursor"]
    assert first["total"] + 4 == _get(filled.url).json()["total"]              # a new read has them
    assert len(set(first["kv"]).union(*(p["kv"] for p in rest))) == first["total"]


def test_a_purge_while_paging_ends_the_generation_with_a_410(filled):
    first = _get(filled.url, limit=5).json()
    r = httpx.post(f"{filled.url}/admin/cache/invalidate", json={"tenant": "t2"}, timeout=60)
    assert r.status_code == 200
    r = _get(filled.url, cursor=first["next_cursor"], limit=5)
    assert r.status_code == 410
    err = r.json()["error"]
    assert err["code"] == "snapshot_gone" and err["param"] == "cursor" and "first page" in err["message"]
    again = _get(filled.url).json()
    assert again["epoch"] != first["epoch"] and again["total"] < first["total"]
    for i in range(2):                                    # t2 again, for the next tests
        _cache(filled.url, prompt_ids(1020 + i, 300), "t2")


@pytest.mark.parametrize(("params", "param", "status"), [
    ({"limit": 0}, "limit", 400), ({"limit": SNAPSHOT_PAGE_MAX + 1}, "limit", 400), ({"limit": "many"}, "limit", 400),
    ({"cursor": "page-two"}, "cursor", 400), ({"cursor": "0123abcd.5"}, "cursor", 400),
    ({"cursor": "0" * 32 + ".5"}, "cursor", 400), ({"cursor": "f" * 32 + ".0"}, "cursor", 400)])
def test_bad_limits_and_cursors_are_refused_naming_them(filled, params, param, status):
    """A made-up cursor (well-formed hex and offset, but no generation this worker gave) is a 400
    naming it, as a malformed one is; 410 is for a cursor of a snapshot that was dropped."""
    r = _get(filled.url, **params)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    if param == "cursor":
        assert "not a cursor this server gave" in r.json()["error"]["message"]


def test_a_cursor_tampered_with_is_made_up_but_one_dropped_is_gone(filled):
    first = _get(filled.url, limit=5).json()
    gen = first["generation"]
    forged = gen[:15] + ("0" if gen[15] != "0" else "1") + gen[16:]          # the nonce changed, the tag kept
    r = _get(filled.url, cursor=f"{forged}.5", limit=5)
    assert r.status_code == 400, r.text
    last = None
    cursor = first["next_cursor"]
    while cursor:                                         # read to its end: the snapshot is dropped
        last = _get(filled.url, cursor=cursor, limit=5)
        assert last.status_code == 200, last.text
        cursor = last.json()["next_cursor"]
    r = _get(filled.url, cursor=first["next_cursor"], limit=5)   # genuine, its snapshot no longer held
    assert r.status_code == 410 and r.json()["error"]["code"] == "snapshot_gone", r.text


def test_a_cursor_of_an_instance_with_the_same_key_is_gone_not_made_up():
    """The tag tells a cursor of any instance with the same key from a made-up one: one whose
    snapshot this instance does not hold is gone (410), one of another key made up (400)."""
    before, after, other = (SnapshotPages(key=b"k" * 32), SnapshotPages(key=b"k" * 32),
                            SnapshotPages(key=b"j" * 32))
    page = before.first(1, [bytes([i]) * 32 for i in range(10)], bytearray(10), 4)
    with pytest.raises(SnapshotGone, match="no longer held"):
        after.resume(page["next_cursor"], 4, 1)
    with pytest.raises(ValueError, match="not a cursor this server gave"):
        other.resume(page["next_cursor"], 4, 1)
    with pytest.raises(ValueError, match="keep=0"):
        SnapshotPages(keep=0)


async def _read_interleaved(url: str, readers: int, limit: int) -> list[int | None]:
    """``readers`` readers of the snapshot at once, each a page at a time in turn (every reader's
    first page, then every reader's second, ...: each holds its snapshot while the others start
    theirs); each reader's total entries, or ``None`` for one answered 410 mid-read."""
    async with httpx.AsyncClient(timeout=60) as client:
        async def page(params):
            return await client.get(f"{url}/v1/cache/snapshot", params=params)

        firsts = await asyncio.gather(*(page({"limit": limit}) for _ in range(readers)))
        got = [r.json() for r in firsts]
        seen = [len(p["kv"]) for p in got]
        cursors: list[str | None] = [p["next_cursor"] for p in got]
        while any(cursors):
            live = [i for i, c in enumerate(cursors) if c]
            answers = await asyncio.gather(*(page({"cursor": cursors[i], "limit": limit}) for i in live))
            for i, r in zip(live, answers):
                if r.status_code == 410:
                    seen[i], cursors[i] = None, None
                    continue
                assert r.status_code == 200, r.text
                seen[i] += len(r.json()["kv"])
                cursors[i] = r.json()["next_cursor"]
        return seen


def test_concurrent_readers_each_page_through_their_own_snapshot(filled):
    """More readers at once than the 4 snapshots a worker used to hold: each reads its whole
    snapshot (none is dropped for another reader's), under the default --snapshot-readers."""
    total = _get(filled.url).json()["total"]
    readers = SNAPSHOT_KEEP
    assert readers > 4
    assert asyncio.run(_read_interleaved(filled.url, readers, 5)) == [total] * readers


def test_snapshot_readers_sets_how_many_are_held():
    """With --snapshot-readers 2, a third reader starting while two page drops the least recently
    read snapshot (that reader gets 410); two readers at once both finish."""
    with RunningServer(ServeOptions(port=0, threads=1, snapshot_readers=2)) as s:
        for j in range(2):
            _cache(s.url, prompt_ids(4000 + j, 300), "t0")
        total = _get(s.url).json()["total"]
        assert asyncio.run(_read_interleaved(s.url, 2, 3)) == [total, total]
        seen = asyncio.run(_read_interleaved(s.url, 3, 3))
        assert seen.count(None) >= 1 and all(n in (None, total) for n in seen)


def test_a_cursor_past_the_end_is_refused(filled):
    first = _get(filled.url, limit=5).json()
    r = _get(filled.url, cursor=f"{first['generation']}.100000", limit=5)
    assert r.status_code == 400 and "past the snapshot" in r.json()["error"]["message"]


def test_the_router_resyncs_from_the_snapshot_page_by_page(filled):
    total = _get(filled.url).json()["total"]
    settings = RouterSettings("hybrid", CPU_ESTIMATE, poll_interval_s=0.05, health_every=2, snapshot_page=3)
    router = BackgroundUvicorn(create_router_app(RouterService([filled.url], load_codec("tiny", 1024), settings)),
                               "127.0.0.1", 0, lifespan="on")
    try:
        stats = wait_router(lambda s: s["workers"][0]["healthy"] and s["workers"][0]["snapshots"] == 1, router)
        assert stats["workers"][0]["kv_keys"] == total > 3 and stats["workers"][0]["snapshot_restarts"] == 0
        # a purge of t0 starts a new epoch: the router resyncs, and the other tenants' entries stay in
        # its view once the new epoch's events (t1's next prompt) are applied over the snapshot
        assert httpx.post(f"{filled.url}/admin/cache/invalidate", json={"tenant": "t0"}, timeout=60).status_code == 200
        _cache(filled.url, prompt_ids(3000, 300), "t1")
        left = _get(filled.url).json()["total"]
        stats = wait_router(lambda s: s["workers"][0]["snapshots"] == 2 and s["workers"][0]["events_applied"] > 0
                            and s["workers"][0]["kv_keys"] == left, router)
        assert left > 8
    finally:
        router.close()


def test_the_routers_read_starts_again_when_a_purge_ends_the_generation_it_pages(filled):
    """A purge lands after the router's first page: the next page is a 410, and the router reads
    the new epoch's snapshot from its first page."""
    purged = []

    async def run() -> Workers:
        async def purge_after_first_page(response: httpx.Response) -> None:
            if response.url.path == "/v1/cache/snapshot" and "cursor" not in response.url.params and not purged:
                async with httpx.AsyncClient(timeout=60) as admin:
                    r = await admin.post(f"{filled.url}/admin/cache/invalidate", json={"tenant": "t0"})
                purged.append(r.status_code)

        async with httpx.AsyncClient(timeout=60, event_hooks={"response": [purge_after_first_page]}) as client:
            workers = Workers([filled.url], client, health_every=1, snapshot_page=4)
            await workers.poll_once()
            return workers

    w = asyncio.run(run()).states[0]
    after = _get(filled.url).json()
    assert purged == [200] and w.healthy
    assert (w.snapshot_restarts, w.snapshots, w.epoch) == (1, 1, after["epoch"])
    assert w.view.kv == {bytes.fromhex(k) for k in after["kv"]} and len(w.view.kv) == after["total"]


def test_the_routers_read_starts_again_when_the_worker_restarts_at_the_same_url():
    """The worker restarts at the same port after the router's first page: the new process did
    not give the cursor (400 naming ``cursor``), and the router reads the new process's snapshot
    from its first page instead of giving the read up."""
    restarted: list[RunningServer] = []
    first = RunningServer(ServeOptions(port=0, threads=1)).__enter__()
    url = first.url
    try:
        for j in range(3):
            _cache(url, prompt_ids(5000 + j, 300), "t0")
        port = int(url.rsplit(":", 1)[1])

        async def run() -> Workers:
            async def restart_after_first_page(response: httpx.Response) -> None:
                if response.url.path == "/v1/cache/snapshot" and "cursor" not in response.url.params \
                        and not restarted:
                    first.__exit__(None, None, None)
                    second = RunningServer(ServeOptions(port=port, threads=1)).__enter__()
                    restarted.append(second)
                    _cache(url, prompt_ids(6000, 300), "t1")

            async with httpx.AsyncClient(timeout=60, event_hooks={"response": [restart_after_first_page]}) as client:
                workers = Workers([url], client, health_every=1, snapshot_page=4)
                await workers.poll_once()
                return workers

        w = asyncio.run(run()).states[0]
        after = _get(url).json()
        assert len(restarted) == 1 and w.healthy
        assert (w.snapshot_restarts, w.snapshots) == (1, 1)
        assert w.view.kv == {bytes.fromhex(k) for k in after["kv"]} and len(w.view.kv) == after["total"] > 0
    finally:
        if restarted:
            restarted[0].__exit__(None, None, None)
        else:
            first.__exit__(None, None, None)


@pytest.mark.parametrize(("value", "named"), [("99999999999999999999", "exceeds 1024"), ("1025", "exceeds 1024"),
                                              ("0", "must be positive")])
def test_a_bad_snapshot_readers_is_named(value, named, capsys):
    """``--snapshot-readers`` past 1024 (or under 1) is refused in one line naming the option."""
    from hybridkv.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--snapshot-readers", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--snapshot-readers" in err and named in err and "Traceback" not in err


def test_a_cursor_forged_from_the_public_identity_is_made_up(filled):
    """The tag key is a secret of the worker process: a cursor tagged under a key anyone can derive
    from ``GET /v1/cache/info`` (the namespace of its identity) is a 400, as any made-up one is."""
    import hashlib
    import hmac

    from hybridkv.cache.namespace import CacheIdentity
    from hybridkv.serve.cache_events import CURSOR_TAG_BYTES

    identity = httpx.get(f"{filled.url}/v1/cache/info", timeout=60).json()["identity"]
    namespace = CacheIdentity(model_repo=identity["model_repo"], weight_digest=identity["weight_digest"]).digest()
    key = hashlib.sha256(b"hybridkv snapshot cursor\0" + namespace).digest()
    nonce = "0123456789abcdef"
    tag = hmac.new(key, nonce.encode("ascii"), hashlib.sha256).hexdigest()[:2 * CURSOR_TAG_BYTES]
    r = _get(filled.url, cursor=f"{nonce}{tag}.5", limit=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cursor", r.text
    assert "not a cursor this server gave" in r.json()["error"]["message"]


def test_a_cursor_of_another_server_process_of_the_same_model_is_made_up(filled):
    """Another process of the same model and weights (as after a restart) holds another secret: a
    genuine cursor of the first is a 400 there, and still a 200 where it was given."""
    cursor = _get(filled.url, limit=5).json()["next_cursor"]
    assert cursor
    with RunningServer(ServeOptions(port=0, threads=1)) as other:
        assert httpx.get(f"{other.url}/v1/cache/info", timeout=60).json()["identity"] == \
            httpx.get(f"{filled.url}/v1/cache/info", timeout=60).json()["identity"]
        r = _get(other.url, cursor=cursor, limit=5)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cursor", r.text
    r = _get(filled.url, cursor=cursor, limit=5)
    assert r.status_code == 200, r.text
