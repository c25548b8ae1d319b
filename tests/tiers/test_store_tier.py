"""StoreTier over the memory and disk byte stores: remote hits (S8, S9, S2 across instances), aligned
boundaries (S7), object integrity (S10), malformed and broken entries, store outages (S13); docs/design/scenarios.md.

The same scenarios against a real Mooncake master: test_store_tier_mooncake.py. The ``store`` fixture
(memory, disk) is in conftest.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hkv_helpers import assert_exact, run_one, tokens
from tier_helpers import held, instance

from hybridkv.store.memory import MemoryStore

# -- remote hits -----------------------------------------------------------------------------------


def test_s8_remote_full_hit(tiny_model, store):
    v = tiny_model.config.vocab_size
    P = tokens(30, 1024, v)
    a, _ = instance(tiny_model, store, policy="tail=1024")
    run_one(a, np.concatenate([P, tokens(31, 300, v)]))
    b, tier_b = instance(tiny_model, store)
    r = run_one(b, np.concatenate([P, tokens(32, 200, v)]))
    assert r.reused == 1024 and tier_b.stats.hit_tokens == 1024
    assert tier_b.stats.bytes_loaded > 0
    assert_exact(tiny_model, r)


def test_s9_remote_partial_group_backfill(tiny_model, store):
    v = tiny_model.config.vocab_size
    P = tokens(33, 1024, v)
    a, _ = instance(tiny_model, store, policy="tail")
    run_one(a, np.concatenate([P, tokens(34, 1024, v)]))           # KV 1024, 2048 and C(P_2048) uploaded
    b, tier_b = instance(tiny_model, store)
    prompt_b = np.concatenate([P, tokens(35, 500, v)])
    rm = tier_b.lookup(b.cache.hash_prompt(prompt_b), 1472)
    assert (rm.kv_length, rm.checkpoint_boundaries, rm.missing_branching_boundary) == (1024, (), 1024)
    rb = run_one(b, prompt_b)
    assert rb.reused == 0 and rb.capture[1024] == "branch"           # computes once to 1024 and uploads
    c, tier_c = instance(tiny_model, store)
    rc = run_one(c, np.concatenate([P, tokens(36, 300, v)]))
    assert rc.reused == 1024 and tier_c.stats.hit_tokens == 1024
    assert_exact(tiny_model, rb)
    assert_exact(tiny_model, rc)


def test_s2_sparse_joint_rule_holds_remotely(tiny_model):
    v = tiny_model.config.vocab_size
    store = MemoryStore()
    P = tokens(90, 4160, v)                                            # S2 at half scale, same ratios
    a, _ = instance(tiny_model, store, policy="hint", block_size=512, alignment=512, pages=16)
    run_one(a, P, max_output_tokens=1, hints=(2048, 4096))             # KV to 4096, C at 2048 and 4096
    b, tier_b = instance(tiny_model, store, block_size=512, alignment=512, pages=16)
    prompt = np.concatenate([P[:3750], tokens(91, 150, v)])
    rm = tier_b.lookup(b.cache.hash_prompt(prompt), 3712)
    assert (rm.kv_length, rm.checkpoint_boundaries, rm.best_joint) == (3584, (2048,), 2048)
    r = run_one(b, prompt)
    assert r.reused == 2048 and tier_b.stats.hit_tokens == 2048
    assert_exact(tiny_model, r)


def test_s7_only_aligned_boundaries_become_remote(tiny_model):
    v = tiny_model.config.vocab_size
    store = MemoryStore()
    P = tokens(44, 6976, v)
    a, tier = instance(tiny_model, store, policy="tail+interval=4096", block_size=4096, alignment=4096, pages=8)
    run_one(a, P, max_output_tokens=1)
    hashes = a.cache.hash_prompt(P)
    local = [n.end for n in a.cache.index.walk(hashes) if n.checkpoint is not None]
    assert local == [4096, 6912, 6976]                      # 6912: the tail's resend companion (11c)
    assert held(tier, hashes, [4096], "kda") == [True]
    keys_6976 = tier._key(hashes, 6976, "kda")
    assert store.exists([keys_6976]) == [False]


# -- integrity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault,reason", [("drop_conv", "evicted"), ("flip_recurrent", "checksum"),
                                          ("drop_manifest", "absent")])
def test_s10_object_integrity(tiny_model, store, fault, reason):
    v = tiny_model.config.vocab_size
    P = tokens(37, 1024, v)
    a, tier_a = instance(tiny_model, store, policy="tail=1024")
    run_one(a, np.concatenate([P, tokens(38, 300, v)]))
    hashes = a.cache.hash_prompt(P)
    key = lambda comp: tier_a._key(hashes, 1024, "kda", comp)
    if fault == "drop_conv":
        store.remove([key("conv.k")])
    elif fault == "drop_manifest":
        store.remove([key("manifest")])
    else:
        blob = bytearray(store.get([key("recurrent")])[0])
        blob[100] ^= 0x01
        store.remove([key("recurrent")])
        store.put([(key("recurrent"), bytes(blob))])
    b, tier_b = instance(tiny_model, store)
    r = run_one(b, np.concatenate([P, tokens(39, 200, v)]))
    assert r.reused == 0 and tier_b.stats.hit_tokens == 0            # never installed
    assert tier_b.stats.misses[reason] >= 1
    assert all(n.checkpoint is None for n in b.cache.index.walk(hashes)) or r.capture.get(1024) == "branch"
    assert_exact(tiny_model, r)


def _populated(model, seed=37):
    store = MemoryStore()
    P = tokens(seed, 1024, model.config.vocab_size)
    a, tier = instance(model, store, policy="tail=1024")
    run_one(a, np.concatenate([P, tokens(seed + 1, 300, model.config.vocab_size)]))
    tier.close()
    return store, P


@pytest.mark.parametrize("tamper", ["float_shape", "list_name", "bool_nbytes", "repeated_component", "oversized"])
def test_malformed_manifest_is_an_incomplete_miss(tiny_model, tamper):
    import json

    store, P = _populated(tiny_model)
    key = next(k for k in store._data if k.endswith("/kda/r0/manifest"))
    m = json.loads(store._data[key])
    if tamper == "float_shape":
        for c in m["components"]:
            c["shape"] = [float(d) for d in c["shape"]]
    elif tamper == "list_name":
        m["components"][0]["name"] = ["recurrent"]
    elif tamper == "bool_nbytes":
        m["components"][0]["nbytes"] = True
    elif tamper == "repeated_component":
        m["components"][1] = m["components"][0]
    blob = json.dumps(m).encode()
    if tamper == "oversized":                                         # never read past the 16 KiB slot
        blob = b'{"abi": 2, "pad": [' + b"0," * (1 << 20) + b'0]}'
    store._data[key] = blob
    b, tier = instance(tiny_model, store)
    r = run_one(b, np.concatenate([P, tokens(99, 200, tiny_model.config.vocab_size)]))
    assert r.reused == 0 and tier.stats.misses["incomplete"] >= 1
    assert_exact(tiny_model, r)
    assert store._data[key] != blob                                   # dropped by the reader, committed again
    c, _ = instance(tiny_model, store)
    rc = run_one(c, np.concatenate([P, tokens(98, 200, tiny_model.config.vocab_size)]))
    assert rc.reused == 1024
    assert_exact(tiny_model, rc)


def test_garbled_manifest_on_disk_is_dropped_and_the_next_instances_reuse(tiny_model, tmp_path):
    """Garbled manifests in a disk store (valid store objects, not a manifest inside): the first
    reader counts them incomplete and removes them, its own upload commits the entries again, and
    every later fresh instance gets the prefix (before: incomplete forever, 0 reuse in a row)."""
    from hybridkv.store.disk import DiskStore

    v = tiny_model.config.vocab_size
    store = DiskStore(tmp_path / "store")
    P = tokens(101, 1024, v)
    a, tier_a = instance(tiny_model, store, policy="tail=1024")
    run_one(a, np.concatenate([P, tokens(102, 100, v)]))
    hashes = a.cache.hash_prompt(P)
    keys = [tier_a._key(hashes, 1024, grp) for grp in ("full", "kda")]
    store.remove(keys)
    store.put([(k, b'{"abi": 3, "layout": "garbled') for k in keys])
    reused, incomplete = [], []
    for i in range(4):
        e, tier = instance(tiny_model, DiskStore(tmp_path / "store"), policy="tail=1024")
        r = run_one(e, np.concatenate([P, tokens(103 + i, 100, v)]))
        reused.append(r.reused)
        incomplete.append(tier.stats.misses["incomplete"])
        assert_exact(tiny_model, r)
    assert reused == [0, 1024, 1024, 1024] and incomplete == [2, 0, 0, 0], (reused, incomplete)


def test_two_writers_of_one_key_never_mix_into_an_install(tiny_model):
    """Every object writer A puts was raced by another writer whose bytes differ in one byte and
    landed first (``FaultyStore`` kind ``two_writers``). The store keeps the other writer's
    objects: reader B must not install them (checksum or incomplete misses, 0 reused, exact),
    drops them, and its own upload commits the entry again, so reader C reuses all of it."""
    from hybridkv.store.faults import FaultyStore

    v = tiny_model.config.vocab_size
    store = MemoryStore()
    P = tokens(120, 1024, v)
    raced = FaultyStore(store, {"two_writers": 1.0}, close_inner=False)
    a, _ = instance(tiny_model, raced, policy="tail=1024")
    run_one(a, np.concatenate([P, tokens(121, 100, v)]))
    assert raced.injected["two_writers"] >= 3                 # components and manifests
    b, tier_b = instance(tiny_model, store, policy="tail=1024")
    rb = run_one(b, np.concatenate([P, tokens(122, 100, v)]))
    assert rb.reused == 0 and tier_b.stats.hit_tokens == 0
    assert tier_b.stats.misses["checksum"] + tier_b.stats.misses["incomplete"] >= 1, tier_b.stats.misses
    assert_exact(tiny_model, rb)
    c, tier_c = instance(tiny_model, store)
    rc = run_one(c, np.concatenate([P, tokens(123, 100, v)]))
    assert rc.reused == 1024 and tier_c.stats.hit_tokens == 1024
    assert_exact(tiny_model, rc)
