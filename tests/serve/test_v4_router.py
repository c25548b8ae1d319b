"""``hybridkv router`` in front of DeepSeek-V4 workers: the router learns the workers' cache groups
and SWA recovery strategy from ``/v1/cache/info``, its views and its shared-store view follow the
events of each group (``csa``, ``hca``, ``swa``), and a request sharing a prefix goes to the worker
holding it (or to an idle one that loads it from the shared store) and reuses it."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest
from serve_helpers import prompt_ids, router_stats as _stats, wait_router as _wait

from hybridkv.cache.groups import KIMI_LINEAR, RecomputeCone, SavedEvery
from hybridkv.serve.commands import router_service
from hybridkv.serve.fleet_view import family_from_groups
from hybridkv.serve.launch import BackgroundUvicorn, RunningServer, ServeOptions
from hybridkv.serve.router import create_router_app

PREFIX = 256                                   # 4 units of 64 tokens




def _complete(router: BackgroundUvicorn, ids: list[int]) -> dict:
    r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                   json={"model": "v4-tiny", "prompt": ids, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_the_family_is_read_from_the_groups_a_worker_lists():
    assert family_from_groups(None) is KIMI_LINEAR
    kimi = [{"name": "full", "kind": "paged", "unit": 1}, {"name": "kda", "kind": "state", "unit": 1,
                                                           "restore": {"kind": "saved_at_hit"}}]
    assert family_from_groups(kimi) is KIMI_LINEAR
    v4 = family_from_groups([{"name": "csa", "kind": "paged", "unit": 4}, {"name": "hca", "kind": "paged", "unit": 16},
                             {"name": "swa", "kind": "state", "unit": 64,
                              "restore": {"kind": "saved_every", "period": 128}}])
    assert v4.prefix_names == ("csa", "hca") and v4.boundary == (("swa", SavedEvery(128)),)
    with pytest.raises(ValueError, match="'swa' has kind 'pages'"):
        family_from_groups([{"name": "swa", "kind": "pages", "unit": 4}])


def test_a_v4_fleet_is_routed_by_its_groups_and_reuses_through_the_store(tmp_path):
    store = f"disk://{tmp_path}/store"
    opts = dict(model="v4-tiny", port=0, threads=1, kv_pages=64, checkpoint_slots=8, swa_recovery="recompute",
                store=store)
    with RunningServer(ServeOptions(**opts)) as a, RunningServer(ServeOptions(**opts)) as b:
        args = argparse.Namespace(worker=[a.url, b.url], policy="hybrid", model="v4-tiny", cost_model=None,
                                  poll_interval=0.05, health_every=2, follow_wait=2.0, store_gbps=1.1,
                                  store_latency_us=194.0)
        service = router_service(args)
        router = BackgroundUvicorn(create_router_app(service), "127.0.0.1", 0, lifespan="on")
        prefix = prompt_ids(40, PREFIX)
        first, second = prefix + prompt_ids(41, 20), prefix + prompt_ids(42, 30)
        try:
            _wait(lambda s: all(w["healthy"] for w in s["workers"]), router)
            family = service.workers.fleet.family
            assert family.prefix_names == ("csa", "hca") and isinstance(family.boundary[0][1], RecomputeCone)
            assert _complete(router, first)["prompt_tokens_details"]["cached_tokens"] == 0
            holder = [w["routed"] for w in _stats(router)["workers"]].index(1)
            _wait(lambda s: s["workers"][holder]["kv_keys"] >= PREFIX // 64, router)     # its events arrived
            view = service.workers.states[holder].view
            assert view.family is family and view.held["csa"] == view.held["hca"] and not view.held["swa"]
            (req,) = service.route_requests({"model": "v4-tiny", "prompt": second}, {}, chat=False)
            local = view.match(req.hashes, req.limit)
            assert local.hit == PREFIX and local.restart < local.hit        # the cone is recomputed
            store_view, _ = service.workers.shared_store([0, 1])
            _wait(lambda s: store_view.kv_run(req.hashes, req.limit) == PREFIX, router)
            assert store_view.match(req.hashes, req.limit).hit == PREFIX   # no saved state needed
            usage = _complete(router, second)
            to = [w["routed"] for w in _stats(router)["workers"]]
            chosen = _stats(router)["workers"][holder if to[holder] == 2 else 1 - holder]
            # the holder from its device, or the idle worker from the store: the prefix either way
            assert chosen["predicted_hit_tokens_routed"] + chosen["predicted_store_hit_tokens_routed"] == PREFIX
            assert usage["prompt_tokens_details"]["cached_tokens"] == PREFIX
        finally:
            router.close()
