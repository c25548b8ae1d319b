"""Active invalidation (hybridkv.tiers.purge): by tenant (namespace), by model version and by age,
from the device, the host tier and the store; no later request hits what was purged; a purge while a
running request holds the entry leaves its output exact."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from hkv_helpers import assert_exact, tokens

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.groups import FULL, KDA
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.cache.purge import PurgeSelector
from hybridkv.engine.backend import TorchBackend
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request, Status
from hybridkv.tiers.connector import host_tier_for, tier_for
from hybridkv.tiers.purge import purge, purge_store, purge_store_detail
from hybridkv.tiers.store_tier import StoreTier

BLOCK = 1024
TENANT_A = CacheIdentity(model_repo="tiny", tenant="a").digest()
TENANT_B = CacheIdentity(model_repo="tiny", tenant="b").digest()
SALT_1 = CacheIdentity(model_repo="tiny", tenant="a", cache_salt="s1").digest()
SALT_2 = CacheIdentity(model_repo="tiny", tenant="a", cache_salt="s2").digest()


def three_tiers(model, store, weight_digest=None, budget=8192):
    """An engine with the device, a write-through host tier and the store (entries every 1024 tokens)."""
    cfg = CacheConfig(block_size=BLOCK, prefix_match_unit=64, num_kv_pages=32, num_checkpoint_slots=8,
                      max_num_batched_tokens=budget,
                      policy=CheckpointPolicy.parse("branch+tail=1024"), store_alignment=BLOCK)
    backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    ns = CacheIdentity(model_repo="tiny", weight_digest=weight_digest or model.weight_digest()).digest()
    host = host_tier_for(64 << 20, backend, ns, 64, BLOCK, write_through=True)
    st = tier_for(store, backend, ns, 64, BLOCK)
    return Engine(cfg, backend, ns, tiers=[host, st]), host, st


def run(engine, prompt, namespace, name):
    r = engine.add_request(Request(name, prompt, 2, namespace=namespace, record_logits=True))
    engine.run_until_done()
    assert r.status == Status.FINISHED, r.reject_reason
    return r


def held_in(tier, engine, prompt, namespace) -> list[bool]:
    """Whether ``tier`` holds the full and kda entries at 1024 tokens of ``prompt``."""
    h = engine.cache.hash_prompt(prompt, namespace)[BLOCK // 64 - 1]
    return tier.exists([(h, FULL), (h, KDA)], namespace)


def test_purge_by_tenant_removes_every_tier_and_no_later_request_hits(tiny_model, store):
    v = tiny_model.config.vocab_size
    pa, pb = tokens(1, 1100, v), tokens(2, 1100, v)
    e, host, st = three_tiers(tiny_model, store)
    run(e, pa, TENANT_A, "a0"), run(e, pb, TENANT_B, "b0")
    for t in (host, st):
        assert held_in(t, e, pa, TENANT_A) == [True, True] and held_in(t, e, pb, TENANT_B) == [True, True]
    counts = purge(e.cache, [host, st], PurgeSelector(owners={TENANT_A}))
    assert counts.device_nodes == 1100 // 64 and counts.held_pages == 0
    assert counts.tier_entries == {"host": 2, "store": 2} and counts.unlisted == []
    for t in (host, st):
        assert held_in(t, e, pa, TENANT_A) == [False, False]      # A's entries are gone ...
        assert held_in(t, e, pb, TENANT_B) == [True, True]        # ... B's stay
    assert e.cache.lookup(pa, TENANT_A, touch=False).kv_hit == 0
    e.cache.check_invariants()
    assert run(e, pa, TENANT_A, "a1").reused == 0                 # no tier serves A's prefix any more
    assert run(e, pb, TENANT_B, "b1").reused == BLOCK


def test_purge_by_model_version_leaves_other_models_entries(tiny_model, store):
    """After an upgrade, every entry of the old weight digest goes, from the store too, even ones
    no running engine knows (found by listing manifests); the new model's entries stay."""
    v = tiny_model.config.vocab_size
    p = tokens(3, 1100, v)
    old, old_host, old_st = three_tiers(tiny_model, store, weight_digest="old-digest")
    new, _, new_st = three_tiers(tiny_model, store)
    run(old, p, None, "o"), run(new, p, None, "n")
    old_ns = CacheIdentity(model_repo="tiny", weight_digest="old-digest").digest()
    counts = purge(old.cache, [old_host, old_st], PurgeSelector(models={old_ns}))
    assert counts.device_nodes == 1100 // 64 and counts.tier_entries == {"host": 2, "store": 2}
    assert held_in(old_st, old, p, None) == [False, False] and held_in(old_host, old, p, None) == [False, False]
    assert held_in(new_st, new, p, None) == [True, True]
    assert run(old, p, None, "o again").reused == 0
    assert purge_store(store, PurgeSelector(models={old_ns})) == 2          # the rerun's entries, store alone
    assert purge_store(store, PurgeSelector(models={old_ns})) == 0          # idempotent
    assert held_in(new_st, new, p, None) == [True, True]


def test_purge_by_age_removes_only_older_entries(tiny_model, store):
    v = tiny_model.config.vocab_size
    pa, pb = tokens(4, 1100, v), tokens(5, 1100, v)
    e, host, st = three_tiers(tiny_model, store)
    run(e, pa, None, "old")
    time.sleep(0.01)                  # separates the two runs' stamps (ms resolution in manifests)
    cutoff = time.time()
    time.sleep(0.01)
    run(e, pb, None, "new")
    counts = purge(e.cache, [host, st], PurgeSelector(created_before=cutoff))
    assert counts.device_nodes == 1100 // 64 and counts.tier_entries == {"host": 2, "store": 2}
    for t in (host, st):
        assert held_in(t, e, pa, None) == [False, False] and held_in(t, e, pb, None) == [True, True]
    assert run(e, pa, None, "old again").reused == 0
    assert run(e, pb, None, "new again").reused == BLOCK


def test_store_purge_by_namespace_alone_reaches_entries_no_engine_names(tiny_model, store):
    """The store alone (as ``hybridkv cache purge`` sees it), by request namespace (a tenant's, a
    salt's): the owner is a key segment (cache ABI v4), so this is a key-prefix removal on every
    backend, Mooncake included. Other namespaces' entries survive; no later request hits."""
    v = tiny_model.config.vocab_size
    p1, p2, pa = tokens(11, 1100, v), tokens(12, 1100, v), tokens(13, 1100, v)
    e, _, st = three_tiers(tiny_model, store)
    run(e, p1, SALT_1, "s1"), run(e, p2, SALT_2, "s2"), run(e, pa, TENANT_A, "a")
    assert purge_store(store, PurgeSelector(owners={SALT_1})) == 2
    assert held_in(st, e, p1, SALT_1) == [False, False]
    assert held_in(st, e, p2, SALT_2) == [True, True] and held_in(st, e, pa, TENANT_A) == [True, True]
    f, _, f_st = three_tiers(tiny_model, store)                  # a fresh engine: only the store remembers
    assert run(f, p1, SALT_1, "s1 again").reused == 0
    assert run(f, p2, SALT_2, "s2 again").reused == BLOCK
    model_ns = CacheIdentity(model_repo="tiny", weight_digest=tiny_model.weight_digest()).digest()
    assert purge_store(store, PurgeSelector(models={model_ns}, owners={TENANT_A})) == 2   # both criteria: one prefix
    assert held_in(st, e, pa, TENANT_A) == [False, False] and held_in(st, e, p2, SALT_2) == [True, True]
    assert purge_store(store, PurgeSelector(owners={TENANT_A})) == 0                      # idempotent


def _stamped_apart(engine, first, second, namespace=None) -> float:
    """Run ``first`` then ``second`` (tuples of prompt, namespace, name) with a cutoff between their stamps."""
    run(engine, *first)
    time.sleep(0.01)                  # manifests stamp ms
    cutoff = time.time()
    time.sleep(0.01)
    run(engine, *second)
    return cutoff


def test_store_purge_by_age_alone_no_later_request_hits(tiny_model, store):
    """The store alone, by age. A backend that lists keys removes the older entries now; one that
    cannot (Mooncake) raises an expiry horizon: every later reader counts the older entries as
    ``expired`` misses and removes them. Either way no later request hits them, and newer ones stay."""
    v = tiny_model.config.vocab_size
    pa, pb = tokens(14, 1100, v), tokens(15, 1100, v)
    e, _, st = three_tiers(tiny_model, store)
    cutoff = _stamped_apart(e, (pa, TENANT_A, "old"), (pb, TENANT_B, "new"))
    got = purge_store_detail(store, PurgeSelector(created_before=cutoff))
    listed = got.hidden_before is None
    assert got.removed == (2 if listed else 0)
    if not listed:
        assert got.hidden_before >= cutoff and got.hidden_before - cutoff < 1e-3     # ms resolution
        assert held_in(st, e, pa, TENANT_A) == [True, True]         # bytes still there, hidden from readers
    f, _, f_st = three_tiers(tiny_model, store)
    assert run(f, pa, TENANT_A, "old again").reused == 0
    expired = f_st.stats.misses["expired"]         # the full and the kda entry at 1024 (a prefetch may read too)
    assert expired == 0 if listed else expired >= 2
    assert run(f, pb, TENANT_B, "new again").reused == BLOCK
    g, _, _ = three_tiers(tiny_model, store)
    assert run(g, pa, TENANT_A, "old, recomputed").reused == BLOCK     # the recompute committed it again


def test_store_purge_by_tenant_and_age_leaves_other_tenants(tiny_model, store):
    v = tiny_model.config.vocab_size
    pa, pb, pa2 = tokens(16, 1100, v), tokens(17, 1100, v), tokens(18, 1100, v)
    e, _, st = three_tiers(tiny_model, store)
    run(e, pb, TENANT_B, "b")
    cutoff = _stamped_apart(e, (pa, TENANT_A, "a old"), (pa2, TENANT_A, "a new"))
    purge_store_detail(store, PurgeSelector(owners={TENANT_A}, created_before=cutoff))
    f, _, _ = three_tiers(tiny_model, store)
    assert run(f, pa, TENANT_A, "a old again").reused == 0
    assert run(f, pa2, TENANT_A, "a new again").reused == BLOCK
    assert run(f, pb, TENANT_B, "b again").reused == BLOCK          # older, but another tenant's


def test_a_standing_max_age_expires_entries_on_read(tiny_model, store):
    """``StoreTier(max_age_s=...)``: an entry older than that is an ``expired`` miss and is removed."""
    v = tiny_model.config.vocab_size
    p = tokens(19, 1100, v)
    e, _, st = three_tiers(tiny_model, store)
    run(e, p, None, "write")
    f, _, f_st = three_tiers(tiny_model, store)
    f_st.max_age_s = 1e-3
    time.sleep(0.01)
    assert run(f, p, None, "read").reused == 0 and f_st.stats.misses["expired"] >= 2   # a prefetch may read too
    with pytest.raises(ValueError, match="max_age_s=0"):
        StoreTier(store, f.cache.namespace, 64, BLOCK, f_st.shapes, max_age_s=0)


def test_purge_while_a_running_request_holds_the_entry_keeps_its_output_exact(tiny_model, store):
    v = tiny_model.config.vocab_size
    prefix = tokens(6, 1100, v)
    e, host, st = three_tiers(tiny_model, store, budget=256)      # the reader's prefill takes 4 steps
    run(e, prefix, TENANT_A, "warm")
    r = e.add_request(Request("reader", np.concatenate([prefix[:BLOCK], tokens(7, 900, v)]), 3,
                              namespace=TENANT_A, record_logits=True))
    e.step()                                                   # admitted: it holds the pages of the hit
    assert r.status == Status.PREFILL and r.reused == BLOCK    # mid-prefill
    counts = purge(e.cache, [host, st], PurgeSelector(owners={TENANT_A}))
    assert counts.device_nodes > 0 and counts.held_pages >= 1            # detached, not torn
    e.cache.check_invariants()
    e.run_until_done()
    assert r.status == Status.FINISHED
    assert_exact(tiny_model, r)                                # tolerance 1e-4 (hkv_helpers)
    e.cache.check_invariants()
    assert all(rc == 0 for rc in e.cache.pages.refcount)       # every held page came back


def test_a_purge_needs_a_criterion():
    with pytest.raises(ValueError, match="owners, models, created_before or abi_version"):
        PurgeSelector()
    with pytest.raises(ValueError, match="owners="):
        PurgeSelector(owners=b"abc")


def test_cli_purges_a_disk_store_by_namespace_then_by_model_version(tiny_model, tmp_path, capsys):
    from hybridkv.cli import main
    from hybridkv.store.disk import DiskStore

    v = tiny_model.config.vocab_size
    pa, pb = tokens(8, 1100, v), tokens(9, 1100, v)
    store = DiskStore(tmp_path / "s")
    e, _, st = three_tiers(tiny_model, store)
    run(e, pa, TENANT_A, "a"), run(e, pb, TENANT_B, "b")
    url = f"disk://{tmp_path / 's'}"
    assert main(["cache", "purge", "--store", url, "--namespace", TENANT_A.hex()]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert held_in(st, e, pa, TENANT_A) == [False, False] and held_in(st, e, pb, TENANT_B) == [True, True]
    assert main(["cache", "purge", "--store", url, "--model", "tiny", "--weight-digest",
                 tiny_model.weight_digest()]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert held_in(st, e, pb, TENANT_B) == [False, False]
    assert main(["cache", "purge", "--store", url, "--namespace", "zz"]) == 2       # bad input: named, nothing done
    assert "'zz'" in capsys.readouterr().err
    assert main(["cache", "purge", "--store", url]) == 2                            # no criterion


def test_store_purge_by_age_through_horizons_on_any_backend(tiny_model, store):
    """The horizon path (Mooncake's) over memory and disk too, as a store that cannot list."""
    from tier_helpers import UnlistedStore

    if getattr(store, "lists_keys", False):
        store = UnlistedStore(store)
    test_store_purge_by_age_alone_no_later_request_hits(tiny_model, store)
    test_store_purge_by_tenant_and_age_leaves_other_tenants(tiny_model, store)


@pytest.mark.parametrize("digest", ["", "ab", "00" * 31, "00" * 33])
def test_cli_purge_refuses_a_namespace_that_is_not_a_whole_digest(tmp_path, capsys, digest):
    # A truncated or empty digest selects nothing: the purge must not report success (removed 0).
    from hybridkv.cli import main

    assert main(["cache", "purge", "--store", f"disk://{tmp_path / 's'}", "--namespace", digest]) == 2
    err = capsys.readouterr().err
    assert repr(digest) in err and "32 bytes" in err


@pytest.mark.parametrize("seconds", ["inf", "1e400"])
def test_cli_purge_refuses_an_infinite_age(tmp_path, capsys, seconds):
    # --older-than inf puts the cutoff at -inf: nothing can be older, yet the purge would report success.
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["cache", "purge", "--store", f"disk://{tmp_path / 's'}", "--older-than", seconds])
    assert exc.value.code == 2 and "inf" in capsys.readouterr().err


def test_a_horizon_reading_is_reused_for_horizon_refresh_s(tiny_model, store):
    """``horizon_refresh_s``: a tier that read an owner's horizons reuses that reading meanwhile
    (so a purge by age reaches it after at most that time); 0 reads them in every load."""
    from tier_helpers import UnlistedStore

    from hybridkv.tiers.purge import raise_horizon

    if getattr(store, "lists_keys", False):
        store = UnlistedStore(store)                 # horizons are read only where keys cannot be listed
    v = tiny_model.config.vocab_size
    p = tokens(20, 1100, v)
    e, _, _ = three_tiers(tiny_model, store)
    run(e, p, None, "write")
    f, _, f_st = three_tiers(tiny_model, store)
    f_st.horizon_refresh_s = 3600.0
    assert run(f, p, None, "read, horizons read now").reused == BLOCK
    raise_horizon(store, None, None, time.time())      # as a purge by age of a store that cannot list
    g, _, g_st = three_tiers(tiny_model, store)
    g_st._horizons, g_st.horizon_refresh_s = f_st._horizons, 3600.0    # g shares f's reading: stale
    assert run(g, p, None, "read, stale reading").reused == BLOCK
    h, _, h_st = three_tiers(tiny_model, store)                        # reads them: expired
    assert run(h, p, None, "read again").reused == 0 and h_st.stats.misses["expired"] >= 2
    with pytest.raises(ValueError, match="horizon_refresh_s=-1"):
        StoreTier(store, f.cache.namespace, 64, BLOCK, f_st.shapes, horizon_refresh_s=-1)


def test_a_lost_expiry_horizon_fails_closed(tiny_model, store):
    """An expiry horizon object that goes missing (evicted, removed) while entries it expired are
    still in the store. Before, the next load read no horizon and served the purged entry again.
    Now a reader that saw the horizon keeps applying it (the older entry is an ``expired`` miss and
    is removed), writes it back, and so a fresh reader is refused the other older entries too."""
    from tier_helpers import UnlistedStore

    from hybridkv.tiers.layout import HORIZON_SLOTS, horizon_key
    from hybridkv.tiers.purge import read_horizon

    if getattr(store, "lists_keys", False):
        store = UnlistedStore(store)                 # horizons are written only where keys cannot be listed
    v = tiny_model.config.vocab_size
    pa, pc, pb = tokens(30, 1100, v), tokens(31, 1100, v), tokens(32, 1100, v)
    e, _, st = three_tiers(tiny_model, store)
    run(e, pa, TENANT_A, "old a")
    cutoff = _stamped_apart(e, (pc, TENANT_A, "old c"), (pb, TENANT_A, "new"))
    assert purge_store_detail(store, PurgeSelector(created_before=cutoff)).hidden_before == cutoff
    f, _, f_st = three_tiers(tiny_model, store)
    assert run(f, pb, TENANT_A, "new: the horizon is read").reused == BLOCK
    store.remove([horizon_key(None, None, s) for s in HORIZON_SLOTS])     # the horizon is lost
    assert read_horizon(store, None, None) is None
    assert held_in(st, e, pa, TENANT_A) == [True, True]                   # the purged entries are still there
    assert run(f, pa, TENANT_A, "old a after the loss").reused == 0       # never served again
    assert f_st.stats.misses["expired"] >= 2 and f_st.horizons_restored >= 1
    assert read_horizon(store, None, None) >= cutoff                      # written back
    g, _, g_st = three_tiers(tiny_model, store)                           # never saw it
    assert run(g, pc, TENANT_A, "old c, a fresh reader").reused == 0
    assert g_st.stats.misses["expired"] >= 2 and g_st.horizons_restored == 0
    assert run(g, pb, TENANT_A, "new still served").reused == BLOCK


def test_an_engines_own_purge_by_age_is_remembered_if_the_horizon_is_lost(tiny_model, store):
    """The tier that raised a horizon applies it from then on even if it never reads the object."""
    from tier_helpers import UnlistedStore

    from hybridkv.tiers.layout import HORIZON_SLOTS, horizon_key

    if getattr(store, "lists_keys", False):
        store = UnlistedStore(store)
    v = tiny_model.config.vocab_size
    pa = tokens(33, 1100, v)
    e, _, _ = three_tiers(tiny_model, store)
    run(e, pa, TENANT_A, "old")
    time.sleep(0.01)
    f, _, f_st = three_tiers(tiny_model, store)
    counts = purge(None, [f_st], PurgeSelector(created_before=time.time()))
    assert counts.hidden == ["store"]
    store.remove([horizon_key(None, None, s) for s in HORIZON_SLOTS])     # lost before f ever read it
    assert run(f, pa, TENANT_A, "old after the loss").reused == 0 and f_st.stats.misses["expired"] >= 2


def test_a_tiers_purge_returns_what_it_removed_and_hid(tiny_model, store):
    """``Tier.purge`` returns a :class:`TierPurge`: entries and payload bytes removed now, and the
    expiry horizon it raised (by age on a store that cannot list), as :func:`purge` reports them."""
    from tier_helpers import UnlistedStore

    from hybridkv.tiers.base import TierPurge

    v = tiny_model.config.vocab_size
    pa, pb, pc = tokens(34, 1100, v), tokens(35, 1100, v), tokens(36, 1100, v)
    e, host, st = three_tiers(tiny_model, store)
    pair = st.entry_nbytes(FULL) + st.entry_nbytes(KDA)
    run(e, pa, TENANT_A, "a")
    assert host.purge(PurgeSelector(owners={TENANT_A})) == TierPurge(2, pair)
    assert st.purge(PurgeSelector(owners={TENANT_A})) == TierPurge(2, None)     # by key prefix: not read
    cutoff = _stamped_apart(e, (pb, TENANT_B, "old"), (pc, TENANT_B, "new"))
    listed = getattr(store, "lists_keys", False)
    assert st.purge(PurgeSelector(created_before=cutoff)) == (TierPurge(2, pair) if listed   # read, removed
                                                              else TierPurge(0, 0, cutoff, 1))
    unlisted = UnlistedStore(store, "u/")
    f, _, f_st = three_tiers(tiny_model, unlisted)
    cutoff = _stamped_apart(f, (pb, TENANT_B, "u old"), (pc, TENANT_B, "u new"))
    assert f_st.purge(PurgeSelector(created_before=cutoff)) == TierPurge(0, 0, cutoff, 1)
    counts = purge(f.cache, [f_st], PurgeSelector(owners={TENANT_B}, created_before=time.time()))
    assert counts.hidden == ["store"] and counts.tier_entries == {"store": 4}     # device-named: removed now
    assert counts.tier_bytes == {"store": 2 * pair}


def _legacy_objects(model: bytes) -> list[tuple[str, bytes]]:
    """Objects as engines of cache ABI v3 (``hkv3/<model>/<chain>/...``) and v2 (``hkv2/<chain>/...``)
    wrote them: two v3 entries of ``model``, one v3 entry of another model, one v2 entry."""
    other = bytes(32)
    objs = []
    for prefix, n in ((f"hkv3/{model.hex()}/", 2), (f"hkv3/{other.hex()}/", 1), ("hkv2/", 1)):
        for i in range(n):
            entry = f"{prefix}{(bytes([i + 1]) * 32).hex()}/full/r0/"
            objs += [(entry + "manifest", b'{"abi": 3}'), (entry + "latents", b"\x01" * 64)]
    return objs


def test_store_purge_of_an_older_cache_abi_removes_only_its_objects(tiny_model, store):
    """``PurgeSelector(abi_version=3)``: every ``hkv3/`` object (manifests first), none of the current ABI or v2;
    with ``models`` only that model's v3 objects. Through the engine's purge too (device and host
    hold only current entries: nothing removed there)."""
    v = tiny_model.config.vocab_size
    pa = tokens(37, 1100, v)
    e, host, st = three_tiers(tiny_model, store)
    run(e, pa, TENANT_A, "v4 entry")
    objs = _legacy_objects(e.cache.namespace)
    assert all(store.put(objs))
    keys = [k for k, _ in objs]
    got = purge_store_detail(store, PurgeSelector(abi_version=3, models={e.cache.namespace}))
    assert (got.removed, got.hidden_before) == (2, None)
    assert store.exists(keys) == [False] * 4 + [True] * 4                  # the other model's v3, and v2, stay
    counts = purge(e.cache, [host, st], PurgeSelector(abi_version=3))
    assert counts.tier_entries == {"host": 0, "store": 1} and counts.device_nodes == 0 and counts.hidden == []
    assert store.exists(keys) == [False] * 6 + [True] * 2
    assert purge_store(store, PurgeSelector(abi_version=2)) == 1 and store.exists(keys) == [False] * 8
    assert held_in(st, e, pa, TENANT_A) == [True, True]                   # current entries untouched
    f, _, _ = three_tiers(tiny_model, store)
    assert run(f, pa, TENANT_A, "v4 still served").reused == BLOCK


@pytest.mark.parametrize("kwargs, named", [
    ({"abi_version": 5}, "abi_version=5"), ({"abi_version": 0}, "abi_version=0"),
    ({"abi_version": True}, "abi_version=True"), ({"abi_version": "3"}, "abi_version='3'"),
    ({"abi_version": 3, "owners": {TENANT_A}}, "carry no owner"),
    ({"abi_version": 3, "created_before": 1.0}, "carry no owner"),
    ({"abi_version": 2, "models": {TENANT_A}}, "carry no model"),
])
def test_an_abi_version_purge_refuses_bad_input_naming_it(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        PurgeSelector(**kwargs)


def test_cli_purges_an_older_cache_abi(tiny_model, tmp_path, capsys):
    from hybridkv.cli import main
    from hybridkv.store.disk import DiskStore

    path = tmp_path / "s"
    store = DiskStore(path)
    ns = CacheIdentity(model_repo="tiny", weight_digest=tiny_model.weight_digest()).digest()
    objs = _legacy_objects(ns)
    store.put(objs)
    store.close()
    url = f"disk://{path}"
    assert main(["cache", "purge", "--store", url, "--abi-version", "3", "--model", "tiny",
                 "--weight-digest", tiny_model.weight_digest()]) == 0
    assert "removed 2 entries of cache ABI v3" in capsys.readouterr().out
    assert main(["cache", "purge", "--store", url, "--abi-version", "3"]) == 0
    assert "removed 1 entries of cache ABI v3" in capsys.readouterr().out
    for bad, named in ((["--abi-version", "5"], "abi_version=5"),
                       (["--abi-version", "3", "--namespace", TENANT_A.hex()], "combines only with models"),
                       (["--abi-version", "3", "--older-than", "60"], "combines only with models")):
        assert main(["cache", "purge", "--store", url, *bad]) == 2
        assert named in capsys.readouterr().err.replace("\n", " ")
    with pytest.raises(SystemExit):
        main(["cache", "purge", "--store", url, "--abi-version", "v3"])
    assert "'v3'" in capsys.readouterr().err
    store = DiskStore(path)
    assert store.exists([k for k, _ in objs]) == [False] * 6 + [True] * 2    # v2 left
    store.close()


def test_entries_installed_from_the_store_belong_to_the_requests_tenant(tiny_model, store):
    """A prefix a fresh engine installs from the store is owned by the request's namespace on the
    device too, so a purge by that tenant removes it there and no later request hits it."""
    v = tiny_model.config.vocab_size
    pa = tokens(21, 1100, v)
    e, _, _ = three_tiers(tiny_model, store)
    run(e, pa, TENANT_A, "write")
    f, f_host, f_st = three_tiers(tiny_model, store)
    assert run(f, pa, TENANT_A, "install").reused == BLOCK          # installed from the store
    counts = purge(f.cache, [f_host, f_st], PurgeSelector(owners={TENANT_A}))
    assert counts.device_nodes == 1100 // 64                          # the installed units included
    assert f.cache.lookup(pa, TENANT_A, touch=False).kv_hit == 0
    assert run(f, pa, TENANT_A, "after").reused == 0


@pytest.mark.parametrize("cutoff", [float("nan"), float("inf"), float("-inf")])
def test_a_purge_by_age_refuses_a_cutoff_that_is_not_finite(tiny_model, store, cutoff):
    # NaN compared false with every stamp, so PurgeSelector(created_before=nan) selected every entry
    # (a listing store lost them all); inf crashed the horizon path with an unnamed OverflowError.
    v = tiny_model.config.vocab_size
    p = tokens(22, 1100, v)
    e, _, st = three_tiers(tiny_model, store)
    run(e, p, TENANT_A, "write")
    with pytest.raises(ValueError, match=f"created_before={cutoff!r}"):
        PurgeSelector(owners={TENANT_A}, created_before=cutoff)
    assert held_in(st, e, p, TENANT_A) == [True, True]


def test_a_horizon_in_the_future_is_refused_and_a_stored_one_ignored(tiny_model, store):
    # A horizon never goes back and nothing removes one, so a cutoff in the future (a stamp in ms
    # instead of s: year ~58000) expired every entry of its scope for good, ones written later
    # included; a garbage object ("1e308") under a horizon key did the same, and made a real purge
    # by age believe its horizon was already raised.
    from tier_helpers import UnlistedStore

    from hybridkv.tiers.layout import HORIZON_MAX_AHEAD_S, horizon_key
    from hybridkv.tiers.purge import raise_horizon, read_horizon

    if getattr(store, "lists_keys", False):
        store = UnlistedStore(store)
    ms = time.time() * 1000
    with pytest.raises(ValueError, match="in the future"):
        raise_horizon(store, None, None, ms)
    with pytest.raises(ValueError, match="in the future"):
        purge_store_detail(store, PurgeSelector(created_before=ms))
    assert store.exists([horizon_key(None, None, s) for s in "ab"]) == [False, False]   # nothing written
    store.put([(horizon_key(None, None, "a"), b"1e308"),
               (horizon_key(None, None, "b"), f"{time.time() + 2 * HORIZON_MAX_AHEAD_S:.3f}".encode())])
    assert read_horizon(store, None, None) is None
    v = tiny_model.config.vocab_size
    p, q = tokens(23, 1100, v), tokens(24, 1100, v)
    e, _, _ = three_tiers(tiny_model, store)
    cutoff = _stamped_apart(e, (p, None, "old"), (q, None, "new"))
    f, _, f_st = three_tiers(tiny_model, store)
    assert run(f, q, None, "read").reused == BLOCK and f_st.stats.misses["expired"] == 0   # garbage ignored
    assert raise_horizon(store, None, None, cutoff) >= cutoff      # a real purge by age replaces garbage
    g, _, g_st = three_tiers(tiny_model, store)
    assert run(g, p, None, "old again").reused == 0 and g_st.stats.misses["expired"] >= 2
    assert run(g, q, None, "new again").reused == BLOCK


def test_an_engines_own_purge_by_age_reaches_its_next_load_despite_a_cached_horizon_reading(tiny_model, store):
    # With horizon_refresh_s > 0 the tier reused its last reading (no horizon) after raising one itself,
    # so the engine that ran the purge still installed a purged entry no device of its held.
    from tier_helpers import UnlistedStore

    if getattr(store, "lists_keys", False):
        store = UnlistedStore(store)
    v = tiny_model.config.vocab_size
    p, q = tokens(25, 1100, v), tokens(26, 1100, v)
    e, _, _ = three_tiers(tiny_model, store)
    run(e, p, None, "write p"), run(e, q, None, "write q")
    f, f_host, f_st = three_tiers(tiny_model, store)
    f_st.horizon_refresh_s = 3600.0
    assert run(f, p, None, "read p: horizons read and kept").reused == BLOCK
    time.sleep(0.01)
    counts = purge(f.cache, [f_host, f_st], PurgeSelector(created_before=time.time()))
    assert counts.hidden == ["store"]
    assert run(f, q, None, "q after the purge").reused == 0 and f_st.stats.misses["expired"] >= 2


@pytest.mark.parametrize("field", ["owners", "models"])
def test_an_empty_digest_is_refused_not_read_as_every_model_or_owner(field):
    # horizon_key wrote an empty digest as "all": PurgeSelector(models={b""}, created_before=t) on a
    # store that cannot list raised the horizon of every model (every entry older than t expired).
    from hybridkv.tiers.layout import horizon_key

    with pytest.raises(ValueError, match=f"{field}="):
        PurgeSelector(**{field: {b""}}, created_before=time.time())
    assert horizon_key(b"", None, "a") != horizon_key(None, None, "a")
    assert horizon_key(None, b"", "a") != horizon_key(None, None, "a")


def test_cli_purge_by_tenant_reaches_the_namespace_hybridkv_serve_gives_that_tenant(tiny_model, tmp_path, capsys):
    # hybridkv serve puts its tokenizer's identity (the byte tokenizer's by default) into every
    # request namespace; --tenant left it out, so it named a namespace no server ever used and
    # reported "removed 0 entries" while the tenant's entries stayed.
    from hybridkv.cli import main
    from hybridkv.serve.tokenizer import ByteTokenizer
    from hybridkv.store.disk import DiskStore

    tok, template = ByteTokenizer().identity
    digest = tiny_model.weight_digest()
    served = {t: CacheIdentity(model_repo="tiny", weight_digest=digest, tokenizer_version=tok,
                               chat_template_version=template, tenant=t).digest() for t in ("acme", "other")}
    v = tiny_model.config.vocab_size
    pa, pb = tokens(27, 1100, v), tokens(28, 1100, v)
    store = DiskStore(tmp_path / "s")
    e, _, st = three_tiers(tiny_model, store)
    run(e, pa, served["acme"], "acme"), run(e, pb, served["other"], "other")
    url = f"disk://{tmp_path / 's'}"
    assert main(["cache", "purge", "--store", url, "--model", "tiny", "--weight-digest", digest,
                 "--tenant", "acme"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert held_in(st, e, pa, served["acme"]) == [False, False]
    assert held_in(st, e, pb, served["other"]) == [True, True]
    hf = CacheIdentity(model_repo="tiny", weight_digest=digest, tokenizer_version="hf-0123", chat_template_version="ab",
                       tenant="other").digest()                  # a server with another tokenizer: named by flags
    run(e, pa, hf, "hf")
    assert main(["cache", "purge", "--store", url, "--model", "tiny", "--weight-digest", digest, "--tenant", "other",
                 "--tokenizer-version", "hf-0123", "--chat-template-version", "ab"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert held_in(st, e, pa, hf) == [False, False] and held_in(st, e, pb, served["other"]) == [True, True]


def test_cli_purge_by_tenant_and_namespace_keeps_the_model_restriction_for_both(tiny_model, tmp_path, capsys):
    # --tenant with --namespace dropped --model's restriction for the --namespace owners too, so a
    # purge naming another weight digest removed that namespace's entries of every model
    from hybridkv.cli import main
    from hybridkv.serve.tokenizer import ByteTokenizer
    from hybridkv.store.disk import DiskStore

    tok, template = ByteTokenizer().identity
    ns = CacheIdentity(model_repo="tiny", weight_digest=tiny_model.weight_digest(), tokenizer_version=tok,
                       chat_template_version=template, tenant="acme").digest()
    v = tiny_model.config.vocab_size
    pa = tokens(29, 1100, v)
    store = DiskStore(tmp_path / "s")
    e, _, st = three_tiers(tiny_model, store)
    run(e, pa, ns, "acme")
    assert held_in(st, e, pa, ns) == [True, True]
    assert main(["cache", "purge", "--store", f"disk://{tmp_path / 's'}", "--model", "tiny",
                 "--weight-digest", "0" * 64, "--tenant", "acme", "--namespace", ns.hex()]) == 0
    assert "removed 0 entries" in capsys.readouterr().out
    assert held_in(st, e, pa, ns) == [True, True]              # another model version's purge: kept


def test_the_clis_default_tokenizer_identity_is_the_byte_tokenizers():
    from hybridkv.cli import _BYTE_IDENTITY
    from hybridkv.serve.tokenizer import ByteTokenizer

    assert _BYTE_IDENTITY == ByteTokenizer().identity


def test_a_purge_of_an_unreachable_store_does_not_report_an_earlier_purges_horizon(tiny_model):
    # The tier's last_purge_hidden attribute (now TierPurge.hidden_before, of each purge's own
    # result) kept the horizon of the previous purge when the store was unreachable, so a
    # purge by tenant that removed nothing (-1) still reported the store as purged by horizon.
    from tier_helpers import UnlistedStore

    from hybridkv.store.memory import MemoryStore

    inner = MemoryStore()
    e, host, st = three_tiers(tiny_model, UnlistedStore(inner))
    run(e, tokens(29, 1100, tiny_model.config.vocab_size), TENANT_A, "a")
    assert purge(e.cache, [host, st], PurgeSelector(created_before=time.time())).hidden == ["store"]
    inner.available = False
    counts = purge(e.cache, [host, st], PurgeSelector(owners={TENANT_B}))
    assert counts.tier_entries["store"] == -1 and counts.hidden == []


def test_a_prefetch_loaded_before_a_purge_by_horizon_is_not_installed_after_it(tiny_model, store):
    # A waiting request's prefetch read an entry before a purge by age raised the horizon; the
    # admission lookup (existence only: the bytes stay until a reader removes them) still named the
    # same boundary, so the prefetched, purged entry was installed and reused after the purge.
    from tier_helpers import UnlistedStore, instance

    if getattr(store, "lists_keys", False):
        store = UnlistedStore(store)
    v = tiny_model.config.vocab_size
    P = tokens(30, 2048, v)
    a, _ = instance(tiny_model, store, policy="tail=2048")
    run(a, np.concatenate([P, tokens(31, 100, v)]), None, "write")
    b, tier_b = instance(tiny_model, store, max_num_seqs=1)
    q0 = b.add_request(Request("q0", tokens(32, 300, v), 2, record_logits=True))
    q1 = b.add_request(Request("q1", np.concatenate([P, tokens(33, 50, v)]), 2, record_logits=True))
    b.step()                                                    # admits q0; q1's loads start
    assert b.connector.prefetching(q1)
    for job in b.connector._requests[q1].prefetch.jobs.values():
        job.result()                                            # q1's entries are loaded now
    time.sleep(0.01)
    counts = purge(b.cache, [tier_b], PurgeSelector(created_before=time.time()))
    assert counts.hidden == ["store"]
    b.run_until_done()
    assert q0.status == q1.status == Status.FINISHED
    assert q1.reused == 0 and b.connector.prefetch_used == 0    # purged: recomputed, not installed
    assert_exact(tiny_model, q1)
    assert b.connector.prefetch_held_bytes == 0
    b.cache.check_invariants()


def test_cli_purge_of_a_disk_store_that_does_not_exist_is_an_error_not_removed_0(tmp_path, capsys):
    # A mistyped path opened (created) a new empty store and reported "removed 0 entries", exit 0,
    # while the real store kept the tenant's entries; memory:// is a new empty store every time.
    from hybridkv.cli import main

    missing = tmp_path / "typo"
    assert main(["cache", "purge", "--store", f"disk://{missing}", "--older-than", "5"]) == 2
    assert str(missing) in capsys.readouterr().err and not missing.exists()
    assert main(["cache", "purge", "--store", "memory://", "--older-than", "5"]) == 2
    assert "memory://" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "text"), [
    (["--model", "tiny", "--weight-digest", "deadbeef"], "--weight-digest 'deadbeef' is not a weight digest"),
    ([], "say what to purge: --tenant or --namespace"),
])
def test_cli_purge_names_a_short_weight_digest_and_a_purge_of_nothing(tmp_path, capsys, args, text):
    from hybridkv.cli import main

    (tmp_path / "s").mkdir()
    assert main(["cache", "purge", "--store", f"disk://{tmp_path / 's'}", *args]) == 2
    got = capsys.readouterr()
    assert text in " ".join((got.out + got.err).split())             # rich may wrap the line
