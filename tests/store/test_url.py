"""open_store: a store URL opens its backend with the query parameters converted."""

from __future__ import annotations

import pytest
from mooncake_helpers import require_mooncake, start

from hybridkv.store.disk import DiskStore
from hybridkv.store.mooncake.client import MooncakeStore
from hybridkv.store.url import open_store


@pytest.fixture(scope="module")
def mooncake_service(tmp_path_factory):
    require_mooncake()
    from hybridkv.store.mooncake import service  # needs mooncake

    handle = start(tmp_path_factory, segment_mb=16)
    yield handle
    service.stop_store(handle.workdir)


def test_open_store_url(tmp_path):
    store = open_store(f"disk://{tmp_path}/u?capacity=1000")
    assert isinstance(store, DiskStore) and store.capacity_bytes == 1000
    assert store.put([("a", b"1")]) == [True]


def test_open_store_url_converts_query_strings(mooncake_service):
    with open_store(f"{mooncake_service.url}?timeout_s=3&retry_interval_s=0.5&setup_retries=1") as s:
        assert isinstance(s, MooncakeStore)
        assert (s.timeout_s, s.retry_interval_s, s.setup_retries) == (3.0, 0.5, 1)
        assert s.exists(["t/none"]) == [False]


@pytest.mark.parametrize("query, named", [
    ("capacity=", "parameter 'capacity' has no value"),          # before: silently unlimited
    ("capacity=1000&quota=", "parameter 'quota' has no value"),  # before: silently no quota
    ("capacity=1000&quota=0.5&quota=0.7", "parameter 'quota' given 2 times"),  # before: the last won
])
def test_a_blank_or_repeated_parameter_is_named(tmp_path, query, named):
    with pytest.raises(ValueError, match=named):
        open_store(f"disk://{tmp_path}?{query}")
