"""Per-owner quotas in the disk store (``disk:///PATH?capacity=..&quota=F``): a tenant flood evicts
the flooding tenant's own entries (whole, manifest first) while the other tenant's entries stay and
still hit; owner accounting survives a reopen; bad quota values are refused by name."""

from __future__ import annotations

import json

import pytest
from hkv_helpers import tokens
from tier_helpers import instance

from hybridkv.cache.abi import KEY_PREFIX
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.request import Request, Status
from hybridkv.store.disk import DiskStore
from hybridkv.store.url import open_store

TENANT_A = CacheIdentity(model_repo="tiny", tenant="a").digest()
TENANT_B = CacheIdentity(model_repo="tiny", tenant="b").digest()
PROMPT_TOKENS = 1100  # one 1024-token store boundary per prompt: one full + one kda entry
QUOTA = 0.5
POLICY = "branch+tail=1024"  # a checkpoint at the 1024-token boundary, so the entries can hit


def run(engine, prompt, namespace, name):
    r = engine.add_request(Request(name, prompt, 1, namespace=namespace))
    engine.run_until_done()
    assert r.status == Status.FINISHED, r.reject_reason
    return r


def prompt_bytes(model, path) -> int:
    """Store bytes one prompt's entries take (measured on an unbounded store)."""
    store = DiskStore(path)
    e, _ = instance(model, store, policy=POLICY)
    run(e, tokens(999, PROMPT_TOKENS, model.config.vocab_size), TENANT_B, "probe")
    used = store.used_bytes
    store.close()
    assert used > 0
    return used


def whole_entries(store) -> bool:
    """Every manifest left names only components that are still there (no torn entry)."""
    for key in store.list_keys(f"{KEY_PREFIX}/"):
        if key.endswith("/manifest"):
            (blob,) = store.get([key])
            comps = [c["key"] for c in json.loads(blob)["components"]]
            if not all(store.exists(comps)):
                return False
    return True


def flood(model, store, v):
    """Tenant B caches two prompts, then tenant A caches twelve distinct ones; B's prompts and the
    store bytes B held before the flood."""
    e, _ = instance(model, store, policy=POLICY)
    pb = [tokens(100 + i, PROMPT_TOKENS, v) for i in range(2)]
    for i, p in enumerate(pb):
        run(e, p, TENANT_B, f"b{i}")
    b_bytes = store.owner_bytes(TENANT_B) if store.quota is not None else None
    for i in range(12):
        run(e, tokens(200 + i, PROMPT_TOKENS, v), TENANT_A, f"a{i}")
    return pb, b_bytes


def test_quota_holds_under_a_tenant_flood_and_the_other_tenant_still_hits(tiny_model, tmp_path):
    v = tiny_model.config.vocab_size
    per = prompt_bytes(tiny_model, tmp_path / "probe")
    capacity = 8 * per

    # Without a quota the flood pushes tenant B out (capacity eviction is global LRU).
    plain = DiskStore(tmp_path / "plain", capacity_bytes=capacity)
    pb, _ = flood(tiny_model, plain, v)
    fresh, tier = instance(tiny_model, plain)
    assert run(fresh, pb[0], TENANT_B, "b0-again").reused == 0 and tier.stats.hit_tokens == 0

    store = DiskStore(tmp_path / "quota", capacity_bytes=capacity, quota=QUOTA)
    pb, b_bytes = flood(tiny_model, store, v)
    store.check_invariants()                       # owner bytes <= quota_bytes, entry index coherent
    assert store.quota_bytes == int(QUOTA * capacity)
    assert 0 < store.owner_bytes(TENANT_A) <= store.quota_bytes
    assert store.quota_evictions > 0
    assert b_bytes > 0 and store.owner_bytes(TENANT_B) == b_bytes  # none of B's objects was evicted
    assert whole_entries(store)                    # quota evictions remove entries manifest first, whole
    for i, p in enumerate(pb):                     # B's entries still hit from a fresh engine
        fresh, tier = instance(tiny_model, store)
        assert run(fresh, p, TENANT_B, f"b{i}-again").reused == 1024 and tier.stats.hit_tokens == 1024
    # A's most recent prompt stayed (its own oldest went first), its first one did not.
    fresh, tier = instance(tiny_model, store)
    assert run(fresh, tokens(211, PROMPT_TOKENS, v), TENANT_A, "a11-again").reused == 1024
    fresh, tier = instance(tiny_model, store)
    assert run(fresh, tokens(200, PROMPT_TOKENS, v), TENANT_A, "a0-again").reused == 0


def test_owner_accounting_survives_a_reopen(tiny_model, tmp_path):
    v = tiny_model.config.vocab_size
    capacity = 8 * prompt_bytes(tiny_model, tmp_path / "probe")
    store = DiskStore(tmp_path / "s", capacity_bytes=capacity, quota=QUOTA)
    pb, _ = flood(tiny_model, store, v)
    before = {o: store.owner_bytes(o) for o in (TENANT_A, TENANT_B)}
    store.close()

    again = DiskStore(tmp_path / "s", capacity_bytes=capacity, quota=QUOTA)
    assert {o: again.owner_bytes(o) for o in (TENANT_A, TENANT_B)} == before
    again.check_invariants()
    e, _ = instance(tiny_model, again, policy=POLICY)            # A keeps flooding after the restart
    for i in range(6):
        run(e, tokens(300 + i, PROMPT_TOKENS, v), TENANT_A, f"a{i}")
    again.check_invariants()
    assert again.owner_bytes(TENANT_A) <= again.quota_bytes
    assert again.owner_bytes(TENANT_B) == before[TENANT_B] and whole_entries(again)
    fresh, tier = instance(tiny_model, again)
    assert run(fresh, pb[1], TENANT_B, "b1-again").reused == 1024


@pytest.mark.parametrize("quota", [0, -0.5, 1.5, float("nan"), "half", True])
def test_a_bad_quota_is_refused_by_name(tmp_path, quota):
    with pytest.raises(ValueError, match=f"quota={quota!r}"):
        DiskStore(tmp_path / "s", capacity_bytes=1 << 20, quota=quota)


def test_a_quota_needs_a_capacity_and_urls_name_bad_values(tmp_path):
    with pytest.raises(ValueError, match="quota=0.5 needs a capacity"):
        DiskStore(tmp_path / "s", quota=0.5)
    base = f"disk://{tmp_path / 'u'}"
    for bad in ("abc", "0", "2", "-1"):
        with pytest.raises(ValueError, match=f"quota='{bad}'"):
            open_store(f"{base}?capacity=4096&quota={bad}")
    with pytest.raises(ValueError, match="needs capacity=BYTES"):
        open_store(f"{base}?quota=0.5")


def test_the_url_quota_overrides_the_config_default(tmp_path):
    base = f"disk://{tmp_path / 'u'}"
    assert open_store(f"{base}?capacity=4096", quota=0.25).quota_bytes == 1024      # CacheConfig.tenant_quota
    assert open_store(f"{base}?capacity=4096&quota=0.5", quota=0.25).quota_bytes == 2048
    assert open_store(base, quota=0.25).quota is None                               # no capacity: no quota


def test_an_owner_must_be_a_digest(tmp_path):
    store = DiskStore(tmp_path / "s", capacity_bytes=1 << 20, quota=0.5)
    with pytest.raises(ValueError, match="owner 'a/b'"):
        store.put_owned([("k", b"x")], "a/b")
    assert store.put_owned([("k", b"x")], TENANT_A) == [True]
    assert store.owner_bytes(TENANT_A) > 0 and store.get(["k"]) == [b"x"]


def test_a_misplaced_file_naming_another_tenants_entry_does_not_take_it_on_eviction(tmp_path):
    """A file whose header names tenant B's entry key (owner A) but sits under another key's
    name: the reopen scan must not group it into B's entry, or A's quota eviction of it would
    delete B's objects. Before: B's manifest and component were evicted; after: they stay."""
    from hybridkv.store.disk_files import encode_object, object_digest, object_path
    owner_a, owner_b = "aa" * 32, "bb" * 32
    store = DiskStore(tmp_path, capacity_bytes=100_000, quota=QUOTA)
    b_keys = ["nsB/e1/g/r0/manifest", "nsB/e1/g/r0/c0"]
    assert store.put_owned([(b_keys[0], b"m" * 100), (b_keys[1], b"c" * 1000)], owner=owner_b) == [True, True]
    b_bytes = store.owner_bytes(owner_b)
    misplaced = object_path(str(tmp_path), object_digest(b"some/other/key"))
    with open(misplaced, "wb") as f:
        f.write(encode_object("nsB/e1/g/r0/x", b"z" * 100, owner=owner_a))
    reopened = DiskStore(tmp_path, capacity_bytes=100_000, quota=QUOTA)
    assert reopened.owner_bytes(owner_b) == b_bytes
    for i in range(60):  # tenant A floods well past its quota: its own (and unowned) files go
        reopened.put_owned([(f"nsA/e{i}/g/r0/c0", b"a" * 1000)], owner=owner_a)
    assert reopened.exists(b_keys) == [True, True]
    assert reopened.owner_bytes(owner_b) == b_bytes
    reopened.check_invariants()


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_an_entry_larger_than_the_quota_is_refused_not_published_without_its_components(tmp_path, eviction):
    """Three 400-byte components and a manifest under a 1000-byte quota, each object smaller than
    the quota. Before: the third component evicted the first two (its own entry) and the manifest
    was then published naming components gone for good; after: the third component and the
    manifest are refused, so no reader sees a manifest of the entry."""
    owner = "aa" * 32
    store = DiskStore(tmp_path, capacity_bytes=10_000, quota=0.1, eviction=eviction)
    comps = [(f"ns/e1/g/r0/c{i}", b"x" * 400) for i in range(3)]
    assert store.put_owned(comps, owner=owner) == [True, True, False]
    assert store.put_owned([("ns/e1/g/r0/manifest", b"m" * 50)], owner=owner) == [False]
    assert store.exists(["ns/e1/g/r0/manifest"]) == [False]
    assert store.exists([k for k, _ in comps[:2]]) == [True, True]
    store.check_invariants()
    # the next entry of the owner evicts the refused entry's leftovers, whole
    assert store.put_owned([("ns/e2/g/r0/c0", b"y" * 400), ("ns/e2/g/r0/manifest", b"m" * 50)], owner=owner) == [True, True]
    assert store.exists([k for k, _ in comps[:2]]) == [False, False]
    store.check_invariants()


def test_a_manifest_is_refused_once_its_entrys_components_were_evicted(tmp_path):
    """Two entries' components in one put (as the store tier batches them), then their manifests,
    under a quota that holds one entry. Before: the second entry's components evicted the first
    entry, whose manifest was then published (True) naming components gone, and the second's
    manifest was refused; after: the first manifest is refused, the second entry is complete."""
    owner = "aa" * 32
    store = DiskStore(tmp_path, capacity_bytes=10_000, quota=0.1)
    comps = [(f"ns/e{e}/g/r0/c{i}", b"x" * 300) for e in (1, 2) for i in range(2)]
    assert store.put_owned(comps, owner=owner) == [True] * 4
    manifests = [(f"ns/e{e}/g/r0/manifest", b"m" * 20) for e in (1, 2)]
    assert store.put_owned(manifests, owner=owner) == [False, True]
    assert store.exists([k for k, _ in comps]) == [False, False, True, True]
    store.check_invariants()
    # the first entry put again (components, then manifest) is published
    assert store.put_owned(comps[:2], owner=owner) == [True, True]
    assert store.put_owned(manifests[:1], owner=owner) == [True]
    assert store.exists([k for k, _ in comps[:2]] + [manifests[0][0]]) == [True, True, True]


def test_two_writers_of_one_tenant_do_not_cost_another_tenant_its_entries(tmp_path):
    """Two store objects (per-process accounting, as two engine processes) each fill tenant A's
    quota, so A holds twice its quota on disk and the directory is over capacity at the next open.
    Before: that open trimmed for capacity in LRU order and evicted all of tenant B's (older)
    entries, leaving A at twice its quota; after: A's own objects go first, B keeps every entry."""
    owner_a, owner_b = "aa" * 32, "bb" * 32
    cap = 200_000
    b_store = DiskStore(tmp_path, capacity_bytes=cap, quota=QUOTA)
    b_keys = [f"nsB/e{i}/g/r0/{c}" for i in range(50) for c in ("c0", "manifest")]
    for i in range(50):
        b_store.put_owned([(f"nsB/e{i}/g/r0/c0", b"b" * 900), (f"nsB/e{i}/g/r0/manifest", b"m" * 50)], owner=owner_b)
    writers = [DiskStore(tmp_path, capacity_bytes=cap, quota=QUOTA) for _ in range(2)]
    for w, tag in zip(writers, ("nsA", "nsA2")):
        for i in range(150):
            w.put_owned([(f"{tag}/e{i}/g/r0/c0", b"a" * 900), (f"{tag}/e{i}/g/r0/manifest", b"m" * 50)], owner=owner_a)
        assert w.owner_bytes(owner_a) <= QUOTA * cap
    reopened = DiskStore(tmp_path, capacity_bytes=cap, quota=QUOTA)
    assert reopened.exists(b_keys) == [True] * len(b_keys)
    assert reopened.owner_bytes(owner_a) <= QUOTA * cap
    reopened.check_invariants()
