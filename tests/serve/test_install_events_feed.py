"""A worker's event feed announces what it installs from its host tier: the router's view of the
worker (:class:`~hybridkv.serve.fleet_view.Workers`, fed over HTTP) then matches the worker's
own ``/v1/cache/snapshot``.

A real server on 127.0.0.1 (free port, the tiny preset, a host tier and a small device pool),
httpx for the requests and the router's reader.
"""

from __future__ import annotations

import asyncio

import httpx
from serve_helpers import prompt_ids

from hybridkv.serve.fleet_view import Workers
from hybridkv.serve.launch import RunningServer, ServeOptions


def _complete(url: str, ids: list[int]) -> int:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_routers_view_holds_entries_the_worker_installed_from_its_host_tier():
    with RunningServer(ServeOptions(port=0, threads=1, kv_pages=12, checkpoint_slots=4, host_mib=16,
                                    max_model_len=768)) as s:
        url = s.url

        async def run() -> tuple[set[bytes], set[bytes], dict]:
            async with httpx.AsyncClient(timeout=60) as client:
                workers = Workers([url], client, health_every=1)
                await workers.poll_once()                 # in rotation, its view from the snapshot
                p = prompt_ids(9001, 300)
                assert await asyncio.to_thread(_complete, url, p) == 0
                for i in range(3):                        # push p's pages out of the 12-page pool
                    await asyncio.to_thread(_complete, url, prompt_ids(9100 + i, 300))
                await workers.poll_once()
                w = workers.states[0]
                before = set(w.view.kv)
                cached = await asyncio.to_thread(_complete, url, p + prompt_ids(9002, 20))
                await workers.poll_once()
                snap = (await client.get(f"{url}/v1/cache/snapshot")).json()
                return before, set(w.view.kv), {"cached": cached, "snap": snap, "synced": w.snapshots}

        before, view, got = asyncio.run(run())
        host = s.server.handle.host_tier.stats
        assert host.hit_tokens > 0 and got["cached"] >= 256, (host, got["cached"])   # served from the host tier
        assert got["synced"] == 1                         # no new epoch: the view followed the events alone
        truth = {bytes.fromhex(k) for k in got["snap"]["kv"]}
        assert view == truth and len(view - before) >= 4  # p's four units, announced when installed
