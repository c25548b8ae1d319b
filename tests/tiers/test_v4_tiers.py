"""DeepSeek-V4 through the lower tiers: the csa/hca prefix groups of a segment stored as one page
entry under one manifest, the swa boundary state as a state entry, both driven by the group specs.
A second engine (or the same engine after its device cache is cleared) reuses them under each of
the three SWA recovery strategies and reproduces a full prefill at every computed position; a
broken component is a counted miss that installs nothing; purges and quotas cover the entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.groups import tier_entry_shapes
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.cache.swa import SwaRecovery
from hybridkv.cache.purge import PurgeSelector
from hybridkv.cli import main
from hybridkv.engine.build import build_engine, load_model
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request
from hybridkv.engine.v4backend import V4Backend
from hybridkv.tiers.connector import tier_for
from hybridkv.tiers.purge import purge

LOGIT_TOL = 1e-4
"""Largest |Δlogit| allowed between a cached run and a full prefill (fp32; the issue's bound)."""
RECOVERIES = ("window", "periodic=128", "recompute")


@pytest.fixture(scope="module")
def tiny():
    return load_model("v4-tiny", 0)


def _prompts(vocab: int, shared: int = 330, tails=(40, 70), seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, shared)
    return [np.concatenate([base, rng.integers(0, vocab, k)]) for k in tails]


def _engine(model, recovery: str, store: str = "none", host_bytes: int = 0, through: bool = True, **cache):
    cache = {"num_kv_pages": 64, "num_checkpoint_slots": 16, **cache}
    cfg = CacheConfig(block_size=64, prefix_match_unit=64, policy=CheckpointPolicy.parse("branch+tail"), **cache)
    return build_engine(model, cfg, model_name="v4-test", swa_recovery=recovery, store_url=store,
                        host_bytes=host_bytes, host_write_through=through and bool(host_bytes))


def _serve(handle, prompt, name: str) -> Request:
    r = Request(name, prompt, 3, record_logits=True)
    handle.engine.add_request(r)
    handle.engine.run_until_done()
    handle.engine.cache.check_invariants()
    return r


def _check_exact(model, r: Request) -> None:
    """Every computed position within LOGIT_TOL of a full prefill; the same greedy tokens."""
    ids = np.concatenate([r.prompt, np.asarray(r.output[:-1], dtype=np.int64)])
    full = model(torch.from_numpy(ids)[None])[0]
    assert min(r.logits) == r.reused
    for pos, row in r.logits.items():
        assert float((row - full[pos]).abs().max()) <= LOGIT_TOL, pos
    assert full[r.prompt_len - 1:].argmax(-1).tolist() == r.output


def test_tier_entries_follow_the_specs(tiny):
    handle = _engine(tiny, "window")
    try:
        shapes = tier_entry_shapes(handle.backend.tier_family, 64)
    finally:
        handle.close()
    cfg = tiny.config
    n_csa, n_hca = len(cfg.csa_layers), len(cfg.hca_layers)
    assert list(shapes) == ["csa-hca", "swa"]                   # page entry, then state entry
    assert shapes["csa-hca"] == {"csa.kv": ("float32", (n_csa, 64 // cfg.csa_rate, cfg.head_dim)),
                                 "csa.index": ("float32", (n_csa, 64 // cfg.csa_rate, cfg.index_head_dim)),
                                 "hca.kv": ("float32", (n_hca, 64 // cfg.hca_rate, cfg.head_dim))}
    assert shapes["swa"]["window"] == ("float32", (cfg.num_hidden_layers, cfg.sliding_window - 1, cfg.head_dim))


@pytest.mark.parametrize("recovery", RECOVERIES)
def test_a_second_engine_reuses_the_store_exactly(tiny, tmp_path, recovery):
    prompts = _prompts(tiny.config.vocab_size)
    url = f"disk://{tmp_path}/store"
    a = _engine(tiny, recovery, url)
    try:
        _serve(a, prompts[0], "a0")
    finally:
        a.close()
    b = _engine(tiny, recovery, url)
    try:
        r = _serve(b, prompts[1], "b0")
        assert r.reused == 320                                  # every whole unit of the shared 330 tokens
        assert b.store_tier.stats.hit_tokens == 320
        assert b.store_tier.stats.misses["evicted"] == b.store_tier.stats.misses["checksum"] == 0
        if recovery == "recompute":                             # no state entry stored or loaded
            assert r.match.restart < r.match.hit
        _check_exact(tiny, r)
    finally:
        b.close()


class _Engine:
    """An engine over a V4 backend whose only lower tier is ``store`` (any backend), as
    :func:`_serve` takes it."""

    def __init__(self, model, store, recovery: str) -> None:
        rec = SwaRecovery.parse(recovery)
        cfg = CacheConfig(block_size=64, prefix_match_unit=64, num_kv_pages=64, num_checkpoint_slots=16,
                          policy=rec.policy(CheckpointPolicy.parse("branch+tail")))
        backend = V4Backend(model, cfg.num_kv_pages, cfg.block_size, cfg.prefix_match_unit, rec)
        ns = CacheIdentity(model_repo="v4-test", weight_digest=model.weight_digest()).digest()
        self.store_tier = tier_for(store, backend, ns, cfg.prefix_match_unit, cfg.store_boundary)
        self.engine = Engine(cfg, backend, ns, tiers=[self.store_tier])


@pytest.mark.parametrize("recovery", RECOVERIES)
def test_every_store_backend_carries_v4_entries(tiny, store, recovery):
    """memory, disk and Mooncake (the session's master): one engine commits, a fresh one reuses."""
    prompts = _prompts(tiny.config.vocab_size, seed=1)
    _serve(_Engine(tiny, store, recovery), prompts[0], "a0")
    b = _Engine(tiny, store, recovery)
    r = _serve(b, prompts[1], "b0")
    assert r.reused == 320 and b.store_tier.stats.hit_tokens == 320
    _check_exact(tiny, r)


def test_one_manifest_per_page_entry_and_a_broken_component_installs_nothing(tiny, tmp_path):
    prompts = _prompts(tiny.config.vocab_size)
    url = f"disk://{tmp_path}/store"
    a = _engine(tiny, "window", url)
    try:
        _serve(a, prompts[0], "a0")
        keys = a.store_tier.store.list_keys("hkv")
    finally:
        a.close()
    assert {k.split("/")[4] for k in keys} == {"csa-hca", "swa"}
    assert {k.split("/")[-1] for k in keys if "/csa-hca/" in k} == {"csa.kv", "csa.index", "hca.kv", "manifest"}
    b = _engine(tiny, "window", url)
    try:
        # remove one group's component of the page entry of [256, 320): that entry is then evicted
        # (manifest present, component gone) and nothing of it is installed
        h = b.engine.cache.hash_prompt(prompts[1])
        b.store_tier.store.remove([b.store_tier._key(h, 320, "csa-hca", "hca.kv")])
        r = _serve(b, prompts[1], "b0")
        assert b.store_tier.stats.misses["evicted"] >= 1
        assert r.reused < 320
        _check_exact(tiny, r)
    finally:
        b.close()


@pytest.mark.parametrize("recovery", ["window", "recompute"])
def test_the_host_tier_holds_v4_entries(tiny, recovery):
    prompts = _prompts(tiny.config.vocab_size)
    h = _engine(tiny, recovery, host_bytes=64 << 20)
    try:
        _serve(h, prompts[0], "a0")
        host = h.host_tier
        assert host.stats.bytes_saved > 0
        h.engine.cache.clear()                                  # the device forgets; the host keeps
        r = _serve(h, prompts[1], "a1")
        assert r.reused == 320 and host.stats.hit_tokens == 320
        _check_exact(tiny, r)
    finally:
        h.close()


def test_evicted_v4_state_is_written_back_to_the_host_and_reused(tiny):
    """A device pool too small for two prompts: the first one's pages and state are evicted to the
    write-back host tier by an unrelated prompt, and a third prompt sharing the first's prefix
    takes them from the host."""
    first, third = _prompts(tiny.config.vocab_size)
    other = _prompts(tiny.config.vocab_size, seed=7)[0]
    h = _engine(tiny, "window", host_bytes=64 << 20, through=False, num_kv_pages=8, num_checkpoint_slots=1)
    try:
        _serve(h, first, "a0")
        _serve(h, other, "a1")
        host = h.host_tier
        kinds = {grp for _, grp in host._entries}
        assert kinds == {"csa-hca", "swa"}, kinds              # pages and the state went to the host
        r = _serve(h, third, "a2")
        assert r.reused == 320 and host.stats.hit_tokens > 0
        _check_exact(tiny, r)
    finally:
        h.close()


def test_purge_by_owner_removes_v4_entries_of_every_kind(tiny, tmp_path):
    prompts = _prompts(tiny.config.vocab_size)
    h = _engine(tiny, "window", f"disk://{tmp_path}/store", host_bytes=64 << 20)
    try:
        _serve(h, prompts[0], "a0")
        st, host = h.store_tier, h.host_tier
        hashes = h.engine.cache.hash_prompt(prompts[0])
        wanted = [(st.chain_hash(hashes, b), g) for b in (64, 320) for g in ("csa-hca", "swa")]
        assert st.exists(wanted) == [True, False, True, True]   # a saved state at 320 (tail), none at 64
        counts = purge(h.engine.cache, [host, st], PurgeSelector(owners=frozenset({h.namespace})))
        assert counts.tier_entries["store"] > 0 and counts.tier_entries["host"] > 0
        assert st.exists(wanted) == [False] * 4
        assert host.exists(wanted) == [False] * 4
    finally:
        h.close()


def test_a_host_quota_bounds_one_owner(tiny):
    prompts = _prompts(tiny.config.vocab_size)
    h = _engine(tiny, "window", host_bytes=1 << 20, tenant_quota=0.25)
    try:
        _serve(h, prompts[0], "a0")
        host = h.host_tier
        assert 0 < host._bytes <= host.quota_bytes
    finally:
        h.close()


def test_replay_cli_runs_v4_with_a_host_tier_and_a_store_and_refuses_timed(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["replay", "--model", "v4-tiny", "--swa-recovery", "periodic=128", "--limit", "3", "--verify", "1",
               "--store", f"disk://{tmp_path}/s", "--host-mib", "64", "--no-progress", "--json", str(out)])
    assert rc == 0 and out.exists()
    capsys.readouterr()
    rc = main(["replay", "--model", "v4-tiny", "--timed", "--limit", "4"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--timed" in err and "Traceback" not in err
