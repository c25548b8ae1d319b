"""The replay's default device page pool (``--kv-pages`` left out) is sized for every page of
the trace and keeps no eviction order (``CacheConfig.kv_pages_hold_all``): its figures are those
of a pool of the same policy that is large enough never to evict."""

from __future__ import annotations

import pytest

from hybridkv.replay.runner import ReplayOptions, run_replay

MACHINE = ("wall_seconds", "cpu_seconds", "requests_per_second", "requests_per_cpu_second",
           "prefill_tokens_per_second", "config")


@pytest.mark.parametrize("extra", [
    {"timed": True, "instances": 4, "router": "hybrid"},
    {"eviction": "value"},
])
def test_the_default_page_pool_replays_as_a_pool_that_never_evicts(extra):
    opts = {"limit": 300, "simulate": True, "progress": False, **extra}
    default = run_replay(ReplayOptions(**opts)).to_dict()
    large = run_replay(ReplayOptions(**opts, num_kv_pages=10**6)).to_dict()
    assert default["config"]["num_kv_pages"] < 10**6
    assert default["reused_tokens"] > 0 and default["evictions"]["device"]["kv_pages"] == 0
    assert ({k: v for k, v in default.items() if k not in MACHINE}
            == {k: v for k, v in large.items() if k not in MACHINE})
