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


@pytest.mark.parametrize("query, named", [
    ("quota_bytes=abc", "quota_bytes='abc'"),
    ("quota_bytes=0", "quota_bytes='0'"),
    ("quota_bytes=-3", "quota_bytes='-3'"),
    ("quota_bytes=1.5", "quota_bytes='1.5'"),
    ("capacity=4096&quota=2", "quota='2'"),
    ("capacity=4096&quota=half", "quota='half'"),
    ("quota=0.5", "quota='0.5' needs capacity=BYTES"),
    ("capacity=abc&quota=0.5", "capacity='abc'"),
    ("capacity=0&quota=0.5", "capacity='0'"),
    ("quota_bytes=100&capacity=4096&quota=0.5", "quota_bytes=N or capacity=BYTES&quota=F, not both"),
])
def test_a_bad_mooncake_quota_is_refused_naming_it(query, named):
    """Refused before any connection (port 1: no master there)."""
    with pytest.raises(ValueError, match=named):
        open_store(f"mooncake://127.0.0.1:1?{query}")


def test_mooncake_quota_from_the_url_or_the_config_default(mooncake_service):
    url = mooncake_service.url
    cases = [("?quota_bytes=777", None, 777), ("?capacity=4096&quota=0.5", 0.25, 2048),
             ("?capacity=4096", 0.25, 1024),          # CacheConfig.tenant_quota, as for disk
             ("", 0.25, None)]                         # no capacity stated: no quota
    for query, default, want in cases:
        with open_store(url + query, quota=default) as s:
            assert s.quota_bytes == want, query


@pytest.mark.parametrize(("url", "named"), [("memory://?capasity=10", "'capasity'"),
                                            ("memory://?capacity=10&quota=0.5", "'quota'"),
                                            ("memory://host/path", "'host/path'"),
                                            ("memory://?capacity=-1", "capacity='-1'")])
def test_a_memory_url_with_an_unknown_part_is_refused_naming_it(url, named):
    """``memory://`` takes ``capacity`` only; anything else was accepted and ignored (a mistyped
    capacity gave an unbounded store), as ``disk://`` refuses it."""
    with pytest.raises(ValueError, match=named.replace("?", r"\?")) as info:
        open_store(url)
    assert repr(url) in str(info.value)
