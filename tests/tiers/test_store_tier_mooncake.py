"""What only a real mooncake_master on 127.0.0.1 shows: S13 with the master or a storage process
killed mid-run, loopback-only sockets, the CLI's purges of a store that cannot list its keys, purge by
age through expiry horizons, and the per-tenant quota under a flood.

The backend-neutral scenarios (S8, S9, S10, prefetch, every purge) run on Mooncake too: the ``store``
fixture in conftest.py has a ``mooncake`` case over the same session-wide master (``mooncake``)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import numpy as np
import pytest
from hkv_helpers import assert_exact, run_one, tokens
from tier_helpers import PrefixedStore, held, instance

from hybridkv.store.faults import FaultyStore
from hybridkv.store.mooncake.client import MooncakeStore
from hybridkv.store.mooncake.support import MooncakeNotInstalled, load_client_class

try:
    load_client_class()
except MooncakeNotInstalled as exc:
    pytest.skip(f"Mooncake not importable: {exc}", allow_module_level=True)

import test_purge

from hybridkv.store.mooncake import loopback, procs, service


@pytest.fixture
def mc_store(mooncake):
    """The session's Mooncake client under a key prefix of this test's own."""
    return PrefixedStore(mooncake[1], f"t{uuid.uuid4().hex[:8]}/")


def test_a_purge_by_age_of_a_store_that_cannot_list_goes_by_horizon(tiny_model, mc_store):
    """Mooncake cannot list keys: a store purge by age alone hides older entries by raising an expiry
    horizon (the backend-neutral test shows no later request hits them), and an engine's purge by age
    removes the device-named entries now and reports the store as hidden."""
    from hybridkv.tiers.purge import read_horizon

    test_purge.test_store_purge_by_age_alone_no_later_request_hits(tiny_model, mc_store)
    assert read_horizon(mc_store, None, None) is not None
    v = tiny_model.config.vocab_size
    fresh = PrefixedStore(mc_store.inner, f"t{uuid.uuid4().hex[:8]}/")
    e, host, st = test_purge.three_tiers(tiny_model, fresh)
    test_purge.run(e, tokens(310, 1100, v), None, "x")
    counts = test_purge.purge(e.cache, [host, st], test_purge.PurgeSelector(created_before=time.time()))
    assert counts.hidden == ["store"] and counts.unlisted == []
    assert counts.tier_entries == {"host": 2, "store": 2}        # the device-named ones removed now


def test_horizon_never_goes_back(mc_store):
    """Two slots: raising keeps the later value; a lower request leaves it; a reader sees the max."""
    from hybridkv.tiers.purge import raise_horizon, read_horizon

    store, owner = mc_store, test_purge.TENANT_A
    assert read_horizon(store, None, owner) is None
    assert raise_horizon(store, None, owner, 1000.0) == 1000.0
    assert raise_horizon(store, None, owner, 2000.0) == 2000.0
    assert raise_horizon(store, None, owner, 1500.0) == 2000.0            # never lowered
    assert raise_horizon(store, None, owner, 3000.0) == 3000.0            # replaces the earlier slot
    assert read_horizon(store, None, owner) == 3000.0 and read_horizon(store, None, None) is None


def test_cli_purges_mooncake_by_namespace_tenant_and_age(tiny_model, mooncake, capsys):
    """``hybridkv cache purge --store mooncake://...`` by --namespace, --tenant and --older-than against
    the real master (keys without a test prefix: no other test of this module writes those)."""
    from hybridkv.cache.namespace import CacheIdentity
    from hybridkv.cli import main

    handle, client = mooncake
    v = tiny_model.config.vocab_size
    url = f"mooncake://{handle.master}"
    digest = tiny_model.weight_digest()
    acme = CacheIdentity(model_repo="tiny", weight_digest=digest, tokenizer_version="hybridkv-byte-v1",
                         chat_template_version="hybridkv-chat-v1", tenant="acme").digest()   # as hybridkv serve
    pa, pb, pc, pd = (tokens(300 + i, 1100, v) for i in range(4))
    e, _, st = test_purge.three_tiers(tiny_model, client)
    test_purge.run(e, pa, test_purge.TENANT_A, "a"), test_purge.run(e, pb, acme, "acme")
    test_purge.run(e, pc, test_purge.TENANT_B, "b")
    assert main(["cache", "purge", "--store", url, "--namespace", test_purge.TENANT_A.hex()]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert main(["cache", "purge", "--store", url, "--model", "tiny", "--weight-digest", digest,
                 "--tenant", "acme"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert test_purge.held_in(st, e, pa, test_purge.TENANT_A) == [False, False]
    assert test_purge.held_in(st, e, pb, acme) == [False, False]
    assert test_purge.held_in(st, e, pc, test_purge.TENANT_B) == [True, True]
    time.sleep(0.2)
    cutoff = time.time()
    time.sleep(0.2)                                   # margin for the CLI's own clock reading
    test_purge.run(e, pd, test_purge.TENANT_B, "b new")
    assert main(["cache", "purge", "--store", url, "--older-than", f"{time.time() - cutoff:.3f}"]) == 0
    out = capsys.readouterr().out
    assert "removed 0 entries" in out and "expired for every reader" in out
    f, _, f_st = test_purge.three_tiers(tiny_model, client)
    assert test_purge.run(f, pc, test_purge.TENANT_B, "b old again").reused == 0
    assert f_st.stats.misses["expired"] >= 2
    assert test_purge.run(f, pd, test_purge.TENANT_B, "b new again").reused == test_purge.BLOCK
    client.remove_prefix("hkv5/")                     # leave the unprefixed keys as they were
    client.remove_prefix("hkv4-horizon/")


def test_s13_master_killed_mid_run_and_restarted(tiny_model, mooncake):
    handle, client = mooncake
    v = tiny_model.config.vocab_size
    store = PrefixedStore(client, f"s13{uuid.uuid4().hex[:8]}/")
    P = tokens(70, 1024, v)
    a, _ = instance(tiny_model, store, policy="tail=1024")
    run_one(a, np.concatenate([P, tokens(71, 100, v)]))
    b, tier_b = instance(tiny_model, store)
    r = run_one(b, np.concatenate([P, tokens(72, 100, v)]))
    assert r.reused == 1024 and tier_b.stats.hit_tokens == 1024          # store in use
    service.kill_master(handle.workdir)                                   # mid-run
    c, tier_c = instance(tiny_model, store)
    for i in range(3):                                                    # keeps serving, as misses
        t0 = time.monotonic()
        r = run_one(c, np.concatenate([P[:512], tokens(73 + i, 600, v)]))
        assert time.monotonic() - t0 < 30                                 # no call blocks for long
        assert_exact(tiny_model, r)
    assert tier_c.stats.misses["unreachable"] >= 1 and tier_c.stats.hit_tokens == 0
    service.restart_master(handle.workdir)                                # forgets every object
    deadline = time.monotonic() + 30
    d, tier_d = instance(tiny_model, store, policy="tail=1024")
    tier_d.retry_seconds = 0.5
    hashes = d.cache.hash_prompt(P)
    for i in range(30):                                                   # store used again after restart
        run_one(d, np.concatenate([P, tokens(80 + i, 100, v)]))           # repairs what a failed put missed
        if held(tier_d, hashes, [1024], "full") == [True] and held(tier_d, hashes, [1024], "kda") == [True]:
            break
        assert time.monotonic() < deadline
        time.sleep(0.5)
    e, tier_e = instance(tiny_model, store)
    r = run_one(e, np.concatenate([P, tokens(200, 100, v)]))
    assert r.reused == 1024 and tier_e.stats.hit_tokens == 1024
    assert_exact(tiny_model, r)


def test_storage_process_killed_mid_run(tiny_model, tmp_path_factory):
    """The process holding the store's memory dies while the master lives: the master still
    answers "exists", every read fails at once (Mooncake transfer error -800). Outputs stay
    exact, the misses count as "unreachable", no call blocks, and nothing is installed."""
    work = tmp_path_factory.mktemp("mc-storage-killed")
    port, metrics = procs.find_free_ports(2)
    handle = service.start_store(port, metrics, 64 << 20, work)
    client = MooncakeStore(handle.master, retry_interval_s=0.0)
    try:
        v = tiny_model.config.vocab_size
        store = FaultyStore(PrefixedStore(client, f"sk{uuid.uuid4().hex[:8]}/"), {}, close_inner=False)  # timing only
        P = tokens(90, 1024, v)
        a, _ = instance(tiny_model, store, policy="tail=1024")
        run_one(a, np.concatenate([P, tokens(91, 100, v)]))
        os.kill(handle.storage_pid, signal.SIGKILL)
        _wait_gone(handle.storage_pid)
        b, tier_b = instance(tiny_model, store)
        for i in range(3):
            t0 = time.monotonic()
            r = run_one(b, np.concatenate([P, tokens(92 + i, 100, v)]))
            assert time.monotonic() - t0 < 30
            assert_exact(tiny_model, r)
        assert tier_b.stats.hit_tokens == 0 and tier_b.stats.misses["unreachable"] >= 1
        assert store.max_call_seconds < 5.0 and client.stats.transfer_failures >= 1
    finally:
        client.close()
        service.stop_store(handle.workdir)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until process ``pid`` no longer runs (reaped here if it is this process's child)."""
    from hybridkv.store.mooncake.procs import alive

    deadline = time.monotonic() + timeout_s
    while alive(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


def test_this_process_listens_on_loopback_only(mooncake):
    import ipaddress
    import os
    addrs = loopback.listen_addresses(os.getpid())
    assert addrs, "a Mooncake client should be listening in this process"
    for host, _port in addrs:
        ip = ipaddress.ip_address(host)
        assert ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback), addrs


def test_cli_purges_an_older_cache_abi_on_mooncake(tiny_model, mooncake, capsys):
    """``hybridkv cache purge --store mooncake://... --abi-version 3`` (one ``remove_by_regex`` per
    step) against the real master: v3 objects go, v2 and the current ABI's stay (unprefixed keys)."""
    from hybridkv.cli import main

    handle, client = mooncake
    url = f"mooncake://{handle.master}"
    v = tiny_model.config.vocab_size
    pa = tokens(320, 1100, v)
    e, _, st = test_purge.three_tiers(tiny_model, client)
    test_purge.run(e, pa, test_purge.TENANT_A, "v4")
    objs = test_purge._legacy_objects(e.cache.namespace)
    assert all(client.put(objs))
    keys = [k for k, _ in objs]
    try:
        assert main(["cache", "purge", "--store", url, "--abi-version", "3", "--model", "tiny",
                     "--weight-digest", tiny_model.weight_digest()]) == 0
        assert "removed 2 entries of cache ABI v3" in capsys.readouterr().out
        assert client.exists(keys) == [False] * 4 + [True] * 4
        assert main(["cache", "purge", "--store", url, "--abi-version", "3"]) == 0
        assert "removed 1 entries of cache ABI v3" in capsys.readouterr().out
        assert client.exists(keys) == [False] * 6 + [True] * 2
        assert main(["cache", "purge", "--store", url, "--abi-version", "5"]) == 2
        assert "abi_version=5" in capsys.readouterr().err
        assert test_purge.held_in(st, e, pa, test_purge.TENANT_A) == [True, True]
    finally:
        client.remove_prefix("hkv5/")                 # leave the unprefixed keys as they were
        client.remove_prefix("hkv2/")
        client.remove_prefix("hkv3/")


def test_mooncake_quota_holds_under_a_tenant_flood_and_the_other_tenant_still_hits(tiny_model, mooncake):
    """The disk store's flood (test_store_quota.py) on Mooncake with ``quota_bytes`` of four prompts'
    entries: tenant B caches two prompts, tenant A twelve; A's own oldest entries go (whole), none
    of B's, and B's entries all hit from a fresh store tier on a fresh client (another process's
    view, no ledger)."""
    from test_store_quota import POLICY, PROMPT_TOKENS, TENANT_A, TENANT_B, run

    handle, plain = mooncake
    v = tiny_model.config.vocab_size
    with MooncakeStore(handle.master, quota_bytes=1 << 40) as probe:          # one prompt's bytes
        e, _ = instance(tiny_model, PrefixedStore(probe, f"p{uuid.uuid4().hex[:8]}/"), policy=POLICY)
        run(e, tokens(999, PROMPT_TOKENS, v), TENANT_B, "probe")
        per = probe.owner_bytes(TENANT_B)
    assert per > 0
    prefix = f"q{uuid.uuid4().hex[:8]}/"
    with MooncakeStore(handle.master, quota_bytes=4 * per) as quota:
        e, _ = instance(tiny_model, PrefixedStore(quota, prefix), policy=POLICY)
        pb = [tokens(100 + i, PROMPT_TOKENS, v) for i in range(2)]
        for i, p in enumerate(pb):
            run(e, p, TENANT_B, f"b{i}")
        b_bytes = quota.owner_bytes(TENANT_B)
        for i in range(12):
            run(e, tokens(200 + i, PROMPT_TOKENS, v), TENANT_A, f"a{i}")
        quota.check_ledger()                                                    # A at or under its quota
        assert b_bytes > per and quota.owner_bytes(TENANT_B) == b_bytes         # none of B's evicted
        assert 0 < quota.owner_bytes(TENANT_A) <= 4 * per and quota.quota_evictions > 0
    store = PrefixedStore(plain, prefix)                                        # a fresh client's view
    for i, p in enumerate(pb):
        fresh, tier = instance(tiny_model, store)
        assert run(fresh, p, TENANT_B, f"b{i}-again").reused == 1024 and tier.stats.hit_tokens == 1024
    fresh, tier = instance(tiny_model, store)                                   # A's newest stayed
    assert run(fresh, tokens(211, PROMPT_TOKENS, v), TENANT_A, "a11-again").reused == 1024
    fresh, tier = instance(tiny_model, store)                                   # A's oldest went
    assert run(fresh, tokens(200, PROMPT_TOKENS, v), TENANT_A, "a0-again").reused == 0
