"""HybridCacheCoordinator over bookkeeping-only pools (no model, ``copy_page=None``): lookups, the
acquire / publish / release cycle, what publish reports, supersede, the ``T - 1`` cap, eviction
callbacks, checkpoint reads, and a randomized sequence that must hand every reference back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.coordinator import EvictedEntry, HybridCacheCoordinator
from hybridkv.cache.groups import FULL, KDA, KDASpec, reuse_cap
from hybridkv.cache.pools import CheckpointPool
from hybridkv.engine.backend import KDA_CODEC
from hybridkv.model.state import KDACheckpoint
from hybridkv.store.eviction import LRUOrder, RecencyOrder

NS = b"n" * 32
UNIT, BLOCK = 64, 128


def make_cache(*, pages: int = 16, slots: int = 8, policy: str = "branch+tail", block_size: int = BLOCK,
               unit: int = UNIT, on_evict=None, pool: CheckpointPool | None = None) -> HybridCacheCoordinator:
    cfg = CacheConfig(block_size=block_size, prefix_match_unit=unit, num_kv_pages=pages, num_checkpoint_slots=slots,
                      policy=CheckpointPolicy.parse(policy))
    pool = pool if pool is not None else CheckpointPool(slots, slot_bytes=1000)
    return HybridCacheCoordinator(cfg, NS, pool, page_bytes=4096, copy_page=None, on_evict=on_evict)


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


def serve(cache, prompt, checkpoints=(), label="tail", extra=8, release=True):
    """Look up, acquire, publish the whole prompt with checkpoints at ``checkpoints`` and release."""
    match = cache.lookup(prompt)
    alloc = cache.acquire(match, len(prompt) + extra)
    assert alloc is not None
    result = cache.publish(alloc, match.hashes, len(prompt), {b: (None, label) for b in checkpoints})
    if release:
        cache.release(alloc)
    cache.check_invariants()
    return match, alloc, result


def assert_idle(cache) -> None:
    """No request holds anything: every page and slot is free or cached."""
    cache.check_invariants()
    assert all(rc == 0 for rc in cache.pages.refcount)
    assert all(rc == 0 for rc in cache.checkpoints.refcount)
    assert cache.pages.num_free + cache.pages.num_evictable == cache.pages.num_pages


# -- lookup, acquire, publish, release -------------------------------------------------------------


def test_lookup_on_an_empty_cache_hits_nothing():
    cache = make_cache()
    prompt = tokens(1, 300)
    m = cache.lookup(prompt)
    assert (m.hit, m.kv_hit, m.checkpoint_hit, m.branching_boundary) == (0, 0, 0, None)
    assert m.per_group == {FULL: 0, KDA: 0} and m.path == []
    assert m.hashes == cache.hash_prompt(prompt) and len(m.hashes) == 300 // UNIT
    assert cache.lookup(prompt[:10]).hashes == []
    assert_idle(cache)


def test_acquire_publish_release_with_numpy_token_ids():
    cache = make_cache()
    prompt = tokens(2, 300)
    m = cache.lookup(prompt)
    alloc = cache.acquire(m, 300 + 20)
    assert alloc.start == 0 and alloc.state is None and alloc.nodes == []
    assert len(alloc.block_table) == -(-320 // BLOCK) and len(set(alloc.block_table)) == 3
    assert all(cache.pages.refcount[p] == 1 for p in alloc.block_table)
    result = cache.publish(alloc, m.hashes, 300, {128: (None, "branch"), 256: (None, "tail")})
    assert result.created == [(128, "branch"), (256, "tail")] and result.skipped == [] and result.superseded == 0
    assert [n.end for n in alloc.nodes] == [64, 128, 192, 256]                 # whole units of [0, 300)
    assert [n.page for n in alloc.nodes] == [alloc.block_table[0]] * 2 + [alloc.block_table[1]] * 2
    cache.check_invariants()
    cache.release(alloc)
    assert alloc.block_table == [] and alloc.nodes == []
    assert_idle(cache)
    assert cache.pages.num_evictable == 2 and cache.pages.num_free == 14       # the third page held no whole unit

    again = cache.lookup(np.concatenate([prompt, tokens(3, 50)]))
    assert (again.hit, again.kv_hit, again.checkpoint_hit, again.branching_boundary) == (256, 256, 256, None)
    assert cache.lookup(list(prompt) + [1] * 50).hit == 256                    # same ids as a list: same hashes
    branch = cache.lookup(np.concatenate([prompt[:200], tokens(4, 100)]))
    assert (branch.hit, branch.kv_hit, branch.branching_boundary) == (128, 192, 192)


def test_acquire_shares_full_pages_and_copies_a_partial_last_page():
    cache = make_cache()
    prompt = tokens(5, 400)
    _, first, _ = serve(cache, prompt, checkpoints=[192, 384], release=False)
    m = cache.lookup(np.concatenate([prompt[:200], tokens(6, 100)]))
    assert m.hit == 192                                                         # mid-page: copy-on-write
    alloc = cache.acquire(m, 300)
    assert alloc.block_table[0] == first.block_table[0]                         # [0, 128) shared
    assert alloc.block_table[1] not in first.block_table                        # [128, 192) copied
    assert cache.pages.refcount[first.block_table[0]] == 2
    assert alloc.start == 192 and [n.end for n in alloc.nodes] == [64, 128, 192]
    cache.release(alloc)
    cache.release(first)
    assert_idle(cache)


def test_a_second_publish_at_the_same_boundary_is_skipped():
    cache = make_cache()
    prompt = tokens(7, 300)
    _, _, first = serve(cache, prompt, checkpoints=[256])
    assert first.created == [(256, "tail")]
    m = cache.lookup(prompt)                                                    # T - 1 = 299: hit 256
    alloc = cache.acquire(m, 310)
    result = cache.publish(alloc, m.hashes, 300, {128: (None, "branch"), 256: (None, "tail")})
    assert result.created == [(128, "branch")] and result.skipped == [256] and result.superseded == 0
    again = cache.publish(alloc, m.hashes, 300, {128: (None, "branch")})       # same request, same boundary
    assert again.created == [] and again.skipped == [128]
    cache.release(alloc)
    assert_idle(cache)


def test_publish_refuses_a_boundary_off_the_unit_or_beyond_the_prompt():
    cache = make_cache()
    prompt = tokens(8, 300)
    m = cache.lookup(prompt)
    alloc = cache.acquire(m, 310)
    with pytest.raises(ValueError, match="100 is not a positive multiple of prefix_match_unit=64"):
        cache.publish(alloc, m.hashes, 300, {100: (None, "tail")})
    with pytest.raises(ValueError, match="0 is not a positive multiple of prefix_match_unit=64"):
        cache.publish(alloc, m.hashes, 300, {0: (None, "tail")})
    with pytest.raises(ValueError, match="boundary 320 lies beyond the 300 computed tokens"):
        cache.publish(alloc, m.hashes, 300, {320: (None, "tail")})      # past the prompt's last whole unit
    cache.release(alloc)
    assert_idle(cache)


def test_publish_refuses_a_checkpoint_beyond_what_was_computed():
    cache = make_cache()
    prompt = tokens(8, 300)
    m = cache.lookup(prompt)
    alloc = cache.acquire(m, 310)
    try:
        with pytest.raises(ValueError, match="boundary 256 lies beyond the 128 computed tokens"):
            cache.publish(alloc, m.hashes, 128, {256: (None, "tail")})
        assert alloc.nodes == [] and cache.index.num_nodes == 0          # refused before anything changed
    finally:
        cache.release(alloc)


def test_a_full_checkpoint_pool_evicts_its_least_recently_used_slot():
    cache = make_cache(slots=1)
    a, b = tokens(9, 200), tokens(10, 200)
    serve(cache, a, checkpoints=[128])
    _, _, result = serve(cache, b, checkpoints=[128])
    assert result.created == [(128, "tail")] and cache.evicted_checkpoints == 1
    assert cache.lookup(a).checkpoint_hit == 0 and cache.lookup(b).checkpoint_hit == 128
    assert_idle(cache)


# -- supersede -------------------------------------------------------------------------------------


def conversation(cache, label="tail"):
    """Turn 1 publishes a tail at 256; turn 2 continues from it and publishes a tail at 512."""
    turn1 = tokens(11, 300)
    serve(cache, turn1, checkpoints=[256], label=label)
    turn2 = np.concatenate([turn1, tokens(12, 300)])
    m, alloc, result = serve(cache, turn2, checkpoints=[512], label=label)
    assert m.hit == 256 and alloc.start == 256
    return turn1, turn2, result


def test_supersede_retires_the_tail_a_request_started_from():
    cache = make_cache(policy="branch+tail+supersede")
    turn1, turn2, result = conversation(cache)
    assert result.created == [(512, "tail")] and result.superseded == 1
    assert cache.lookup(np.concatenate([turn1, tokens(13, 50)])).checkpoint_hit == 0   # the old tail is gone
    assert cache.lookup(np.concatenate([turn2, tokens(14, 50)])).hit == 512
    assert cache.lookup(np.concatenate([turn1, tokens(15, 50)])).kv_hit == 256        # its KV stays
    assert_idle(cache)


def test_without_supersede_the_old_tail_stays():
    cache = make_cache(policy="branch+tail")
    turn1, _, result = conversation(cache)
    assert result.superseded == 0
    assert cache.lookup(np.concatenate([turn1, tokens(13, 50)])).hit == 256
    assert_idle(cache)


def test_supersede_keeps_a_checkpoint_published_under_another_label():
    cache = make_cache(policy="branch+tail+supersede")
    turn1 = tokens(11, 300)
    serve(cache, turn1, checkpoints=[256], label="branch")
    m, _, result = serve(cache, np.concatenate([turn1, tokens(12, 300)]), checkpoints=[512])
    assert m.hit == 256 and result.created == [(512, "tail")] and result.superseded == 0
    assert cache.lookup(np.concatenate([turn1, tokens(13, 50)])).hit == 256
    assert_idle(cache)


def test_supersede_keeps_a_tail_another_request_is_reading():
    cache = make_cache(policy="branch+tail+supersede")
    turn1 = tokens(11, 300)
    serve(cache, turn1, checkpoints=[256])
    turn2 = np.concatenate([turn1, tokens(12, 300)])
    m = cache.lookup(turn2)
    alloc = cache.acquire(m, 610)
    slot = alloc.nodes[-1].checkpoint
    cache.checkpoints.ref(slot)                                        # someone is copying it right now
    result = cache.publish(alloc, m.hashes, 600, {512: (None, "tail")})
    assert result.superseded == 0 and alloc.nodes[3].checkpoint == slot
    cache.checkpoints.unref(slot)
    cache.release(alloc)
    assert_idle(cache)


# -- the T - 1 cap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300, 511, 512, 513])
def test_the_joint_hit_never_exceeds_t_minus_one(length):
    cache = make_cache(policy="interval=64", slots=16)
    base = tokens(16, 640)
    serve(cache, base, checkpoints=range(64, 641, 64))                   # KV and a checkpoint at every unit
    m = cache.lookup(base[:length])
    cap = reuse_cap(length, UNIT)
    assert m.hit == m.kv_hit == cap <= length - 1
    assert m.branching_boundary is None
    assert_idle(cache)


def test_a_prompt_equal_to_a_cached_prefix_recomputes_its_last_unit():
    cache = make_cache()
    prompt = tokens(17, 256)
    serve(cache, prompt, checkpoints=[256])
    m = cache.lookup(prompt)
    assert (m.hit, m.kv_hit, m.checkpoint_hit, m.branching_boundary) == (0, 192, 0, 192)
    assert cache.lookup(np.concatenate([prompt, tokens(18, 1)])).hit == 256
    assert_idle(cache)


# -- eviction callbacks ----------------------------------------------------------------------------


def test_on_evict_hears_of_pages_evicted_under_pressure_with_parent_keys():
    seen: list[list[EvictedEntry]] = []
    cache = make_cache(pages=4, slots=4, on_evict=seen.append)
    a = tokens(19, 256)
    ma, _, _ = serve(cache, np.concatenate([a, tokens(20, 10)]), checkpoints=[256], extra=0)
    assert seen == [] and cache.pages.num_evictable == 2
    serve(cache, tokens(21, 300), extra=100)                           # needs all 4 pages: evicts both of a's
    assert cache.evicted_pages == 2 and cache.lookup(a).kv_hit == 0
    entries = [e for batch in seen for e in batch]
    by_end = {e.end: e for e in entries}
    assert sorted(by_end) == [64, 128, 192, 256] and len(entries) == 4
    h = ma.hashes
    for end, e in by_end.items():
        assert e.key == h[end // UNIT - 1]
        expect_parent = h[(end - BLOCK) // UNIT - 1] if end > BLOCK else None
        assert e.parent_key == expect_parent, end                        # the prefix one block shorter
        assert e.page is not None
    assert by_end[256].checkpoint is not None and by_end[192].checkpoint is None
    assert by_end[192].page == by_end[256].page != by_end[64].page == by_end[128].page
    assert seen[0][0].end == 192                                        # the tail page goes first (LRU)
    assert_idle(cache)


def test_on_evict_hears_of_a_checkpoint_evicted_alone():
    seen: list[list[EvictedEntry]] = []
    cache = make_cache(slots=1, on_evict=seen.append)
    a = tokens(22, 200)
    ma, _, _ = serve(cache, a, checkpoints=[128])
    serve(cache, tokens(23, 200), checkpoints=[128])
    assert len(seen) == 1 and len(seen[0]) == 1
    e = seen[0][0]
    assert (e.key, e.parent_key, e.end, e.page) == (ma.hashes[1], None, 128, None)
    assert e.checkpoint == 0
    assert cache.lookup(a).kv_hit == 192                                # its KV stays (T - 1 = 199)
    assert_idle(cache)


def test_a_request_never_evicts_the_pages_of_its_own_hit():
    cache = make_cache(pages=3)
    p = tokens(24, 256)
    serve(cache, np.concatenate([p, tokens(25, 10)]), checkpoints=[256], extra=0)
    m = cache.lookup(np.concatenate([p, tokens(26, 100)]))
    assert m.hit == 256
    alloc = cache.acquire(m, 256 + 200)                                # 2 shared + 2 fresh: one page short
    assert alloc is None
    assert cache.lookup(np.concatenate([p, tokens(26, 100)])).hit == 256
    assert_idle(cache)
    alloc = cache.acquire(cache.lookup(np.concatenate([p, tokens(26, 100)])), 256 + 100)
    assert alloc is not None and alloc.start == 256
    cache.release(alloc)
    assert_idle(cache)


# -- checkpoint_at / read_checkpoint ---------------------------------------------------------------


def tensor_pool(slots: int) -> CheckpointPool:
    spec = KDASpec(num_layers=1, num_heads=1, head_dim=2, conv_dim=6, conv_width=3)
    return CheckpointPool(slots, spec=spec.group_spec(), codec=KDA_CODEC)


def ckpt(value: float, boundary: int) -> KDACheckpoint:
    return KDACheckpoint(torch.full((1, 1, 2, 2), value), torch.full((1, 6, 3), -value), boundary)


def test_checkpoint_at_reads_a_copy_of_the_published_checkpoint_on_the_requests_path():
    cache = make_cache(slots=2, pool=tensor_pool(2))
    prompt = tokens(27, 300)
    m = cache.lookup(prompt)
    alloc = cache.acquire(m, 310)
    assert cache.checkpoint_at(alloc, 128) is None                      # nothing published yet
    cache.publish(alloc, m.hashes, 300, {128: (ckpt(1.5, 128), "branch")})
    got = cache.checkpoint_at(alloc, 128)
    assert got.boundary == 128 and torch.equal(got.recurrent, ckpt(1.5, 128).recurrent)
    assert torch.equal(got.conv, ckpt(1.5, 128).conv)
    got.recurrent.zero_()                                               # a copy: the slot keeps its bytes
    assert torch.equal(cache.checkpoint_at(alloc, 128).recurrent, ckpt(1.5, 128).recurrent)
    slot = alloc.nodes[1].checkpoint
    assert torch.equal(cache.read_checkpoint(slot, 128).conv, ckpt(1.5, 128).conv)
    for boundary in (0, 64, 100, 192, 320, 1024):                       # no checkpoint / off the unit / beyond
        assert cache.checkpoint_at(alloc, boundary) is None, boundary
    cache.release(alloc)
    assert cache.checkpoint_at(alloc, 128) is None                      # a released allocation has no path

    resumed = cache.acquire(cache.lookup(np.concatenate([prompt, tokens(28, 10)])), 320)
    assert resumed.start == 128 and torch.equal(resumed.state.recurrent, ckpt(1.5, 128).recurrent)
    cache.release(resumed)
    assert_idle(cache)


def test_a_published_checkpoint_keeps_the_captured_tensors_and_a_misfit_frees_its_slot_again():
    """``publish`` hands the captured state to its slot (no second copy of a capture); a state that
    does not fit the spec is refused naming the component, and the slot taken for it is free
    again, with nothing attached and nothing else lost."""
    cache = make_cache(slots=2, pool=tensor_pool(2))
    prompt = tokens(31, 300)
    m = cache.lookup(prompt)
    alloc = cache.acquire(m, 310)
    good = ckpt(0.5, 128)
    cache.publish(alloc, m.hashes, 300, {128: (good, "branch")})
    slot = alloc.nodes[1].checkpoint
    assert cache.checkpoints.held(slot)["recurrent"].data_ptr() == good.recurrent.data_ptr()
    free = cache.checkpoints.num_free
    misfit = KDACheckpoint(torch.zeros(1, 1, 2, 3), torch.zeros(1, 6, 3), 256)
    with pytest.raises(ValueError, match="'recurrent' has shape"):
        cache.publish(alloc, m.hashes, 300, {256: (misfit, "tail")})
    assert cache.checkpoints.num_free == free and alloc.nodes[3].checkpoint is None
    assert torch.equal(cache.checkpoint_at(alloc, 128).recurrent, good.recurrent)
    cache.release(alloc)
    assert_idle(cache)


def test_a_misfit_state_is_refused_before_a_full_pool_evicts_a_checkpoint_for_it():
    """A full checkpoint pool evicts nothing for a state it then refuses: the stored checkpoint
    stays attached and readable (publish and install alike)."""
    cache = make_cache(slots=1, pool=tensor_pool(1))
    first = tokens(33, 300)
    serve_alloc = cache.acquire(cache.lookup(first), 310)
    cache.publish(serve_alloc, cache.lookup(first).hashes, 300, {128: (ckpt(0.5, 128), "branch")})
    cache.release(serve_alloc)                                   # the pool's one slot: cached, evictable
    other = tokens(34, 300)
    m = cache.lookup(other)
    alloc = cache.acquire(m, 310)
    misfit = KDACheckpoint(torch.zeros(1, 1, 2, 3), torch.zeros(1, 6, 3), 128)
    with pytest.raises(ValueError, match="'recurrent' has shape"):
        cache.publish(alloc, m.hashes, 300, {128: (misfit, "branch")})
    with pytest.raises(ValueError, match="needs checkpoint tensors"):
        cache.install_checkpoint(m.hashes, None, 256)
    assert cache.evicted_checkpoints == 0 and alloc.nodes[1].checkpoint is None
    assert cache.lookup(np.concatenate([first, tokens(35, 10)])).hit == 128   # still stored
    cache.release(alloc)
    resumed = cache.acquire(cache.lookup(np.concatenate([first, tokens(35, 10)])), 320)
    assert resumed.start == 128 and torch.equal(resumed.state.recurrent, ckpt(0.5, 128).recurrent)
    cache.release(resumed)
    assert_idle(cache)


def test_checkpoint_at_is_none_once_the_checkpoint_was_evicted():
    cache = make_cache(slots=1, pool=tensor_pool(1))
    prompt = tokens(29, 200)
    m = cache.lookup(prompt)
    alloc = cache.acquire(m, 210)
    cache.publish(alloc, m.hashes, 200, {128: (ckpt(2.0, 128), "tail")})
    other = tokens(30, 200)
    mo = cache.lookup(other)
    ao = cache.acquire(mo, 210)
    assert cache.publish(ao, mo.hashes, 200, {128: (ckpt(3.0, 128), "tail")}).created == [(128, "tail")]
    assert cache.checkpoint_at(alloc, 128) is None                      # evicted for the other request's
    assert torch.equal(cache.checkpoint_at(ao, 128).recurrent, ckpt(3.0, 128).recurrent)
    cache.release(ao)
    cache.release(alloc)
    assert_idle(cache)


# -- randomized sequences --------------------------------------------------------------------------

STEM = tokens(40, 640)
BRANCHES = [tokens(41 + i, 256) for i in range(3)]

cut = st.one_of(st.sampled_from([0, 128, 192, 256, 300, 512, 640]), st.integers(0, 640))
prompt_spec = st.tuples(cut, st.integers(0, 2), st.integers(1, 256))                # stem cut, branch, tail
label = st.sampled_from(["tail", "branch", "interval"])
op = st.one_of(
    st.tuples(st.just("serve"), prompt_spec, label),                   # a whole request, tail checkpoint
    st.tuples(st.just("start"), prompt_spec, st.integers(0, 200)),
    st.tuples(st.just("step"), st.integers(0, 7), st.integers(1, 400), st.sets(st.integers(0, 13), max_size=3),
              label),
    st.tuples(st.just("step"), st.integers(0, 7), st.integers(1, 400), st.sets(st.integers(0, 13), max_size=3),
              label),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("clear")),
)


def check_held(cache, running) -> None:
    """Every page reference belongs to a running allocation; no checkpoint slot stays referenced."""
    cache.check_invariants()
    expect = [0] * cache.pages.num_pages
    for alloc, *_ in running:
        for p in alloc.block_table:
            expect[p] += 1
    assert cache.pages.refcount == expect
    assert all(rc == 0 for rc in cache.checkpoints.refcount)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op, min_size=10, max_size=40))
def test_random_acquire_publish_release_keeps_invariants_and_returns_every_reference(ops):
    evicted: list[EvictedEntry] = []
    cache = make_cache(pages=8, slots=3, policy="branch+tail+supersede", on_evict=evicted.extend)
    running: list[list] = []                                  # [alloc, hashes, prompt length, computed]
    for o in ops:
        if o[0] == "serve":
            (cut, branch, tail), lab = o[1], o[2]
            prompt = np.concatenate([STEM[:cut], BRANCHES[branch][:tail]])
            m = cache.lookup(prompt)
            alloc = cache.acquire(m, len(prompt) + 4)
            if alloc is not None:
                end = len(prompt) // UNIT * UNIT
                tail_ckpt = {end: (None, lab)} if end > m.hit else {}
                result = cache.publish(alloc, m.hashes, len(prompt), tail_ckpt)
                assert len(result.created) + len(result.skipped) == len(tail_ckpt)
                cache.release(alloc)
        elif o[0] == "start":
            (cut, branch, tail), extra = o[1], o[2]
            prompt = np.concatenate([STEM[:cut], BRANCHES[branch][:tail]])
            m = cache.lookup(prompt)
            assert m.hit <= m.kv_hit <= reuse_cap(len(prompt), UNIT) and m.hit % UNIT == 0
            alloc = cache.acquire(m, len(prompt) + extra)
            if alloc is not None:
                assert alloc.start == m.hit and len(alloc.block_table) == -(-(len(prompt) + extra) // BLOCK)
                running.append([alloc, m.hashes, len(prompt), alloc.start])
        elif o[0] == "step" and running:
            _, i, advance, marks, lab = o
            entry = running[i % len(running)]
            alloc, hashes, length, computed = entry
            new = min(length, computed + advance)
            candidates = [b for b in range(computed // UNIT * UNIT + UNIT, new + 1, UNIT) if b > computed]
            boundaries = sorted({candidates[k % len(candidates)] for k in marks}) if candidates else []
            result = cache.publish(alloc, hashes, new, {b: (None, lab) for b in boundaries})
            assert sorted([b for b, _ in result.created] + result.skipped) == boundaries
            assert all(got == lab for _, got in result.created)
            assert len(alloc.nodes) >= new // UNIT
            entry[3] = new
        elif o[0] == "release" and running:
            cache.release(running.pop(o[1] % len(running))[0])
        elif o[0] == "clear":
            cache.clear()
        check_held(cache, running)
    for e in evicted:
        assert e.end % UNIT == 0 and e.end > 0
        assert (e.parent_key is None) == (e.end <= BLOCK)
        assert e.page is not None or e.checkpoint is not None
    while running:
        cache.release(running.pop()[0])
    check_held(cache, running)
    cache.clear()
    assert cache.pages.num_free == cache.pages.num_pages
    assert cache.checkpoints.num_free == cache.checkpoints.num_slots
    assert cache.index.num_nodes == 0
    cache.check_invariants()


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(prompt_spec, st.integers(0, 200), st.booleans()), min_size=5, max_size=30))
def test_an_lru_page_pool_without_quotas_evicts_as_a_described_lru_pool(ops):
    """Without ``tenant_quota`` the page pool's ``lru`` order keeps no descriptions
    (:class:`RecencyOrder`); under eviction pressure it gives the same hits, victims, evicted
    entries and free pages, request by request, as the described :class:`LRUOrder`."""
    evicted: list[list[EvictedEntry]] = [[], []]
    caches = [make_cache(pages=8, slots=3, on_evict=evicted[0].extend),
              make_cache(pages=8, slots=3, on_evict=evicted[1].extend)]
    assert isinstance(caches[0].pages.order, RecencyOrder)
    caches[1].pages.order = LRUOrder()                   # nothing cached yet: the same state, described
    held: list[list] = [[], []]
    for (cut, branch, tail), extra, keep in ops:
        prompt = np.concatenate([STEM[:cut], BRANCHES[branch][:tail]])
        seen = []
        for cache, running in zip(caches, held):
            m = cache.lookup(prompt)
            alloc = cache.acquire(m, len(prompt) + extra)
            if alloc is not None:
                end = len(prompt) // UNIT * UNIT
                cache.publish(alloc, m.hashes, len(prompt), {end: (None, "tail")} if end > m.hit else {})
                (running.append if keep and len(running) < 2 else cache.release)(alloc)
            cache.check_invariants()
            seen.append((m.hit, m.kv_hit, alloc is not None and alloc.block_table, list(cache.pages.order),
                         cache.pages.num_free, cache.evicted_pages, cache.index.num_nodes))
        assert seen[0] == seen[1]
    assert evicted[0] == evicted[1]


def test_a_page_pool_with_quotas_keeps_its_descriptions():
    cfg = CacheConfig(block_size=BLOCK, prefix_match_unit=UNIT, num_kv_pages=16, num_checkpoint_slots=8,
                      tenant_quota=0.5)
    cache = HybridCacheCoordinator(cfg, NS, CheckpointPool(8, slot_bytes=1000), page_bytes=4096)
    assert isinstance(cache.pages.order, LRUOrder)
    serve(cache, tokens(15, 300), checkpoints=[256])
    assert cache.pages.order.owner_bytes == {NS: 2 * 4096}            # two whole pages of 128 tokens


def test_publish_refuses_a_boundary_past_the_prompts_whole_units_before_changing_anything():
    cache = make_cache()
    prompt = tokens(11, 150)                                            # two whole units
    m = cache.lookup(prompt)
    alloc = cache.acquire(m, 160)
    with pytest.raises(ValueError, match="boundary 192 lies beyond the prompt's 2 whole units"):
        cache.publish(alloc, m.hashes[:2], 200, {64: (None, "tail"), 192: (None, "tail")})
    assert alloc.nodes == [] and cache.checkpoints.num_free == cache.checkpoints.num_slots
    cache.release(alloc)
    assert_idle(cache)


def test_a_failing_eviction_callback_leaks_no_page_reference():
    """Write-back that raises (Ctrl-C, a failed host allocation) propagates, but the pages the
    acquire held for the hit path are handed back, so later requests still fit."""
    calls = []

    def on_evict(entries):
        calls.append(entries)
        raise KeyboardInterrupt("write-back interrupted")

    cache = make_cache(pages=4, on_evict=on_evict)
    a = tokens(12, 256)
    serve(cache, a, checkpoints=[128])                                  # 2 pages cached
    with pytest.raises(KeyboardInterrupt):
        m = cache.lookup(np.concatenate([a[:128], tokens(13, 300)]))   # shares page 0, needs 3 more
        cache.acquire(m, 428)
    assert calls
    assert_idle(cache)


def test_remove_prefix_purges_one_namespace_tree_and_keeps_the_other():
    cache = make_cache()
    prompt = tokens(40, 300)
    other_ns = b"o" * 32
    serve(cache, prompt, checkpoints=[128, 256])
    m = cache.lookup(prompt, other_ns)
    alloc = cache.acquire(m, 320)
    cache.publish(alloc, m.hashes, 300, {256: (None, "tail")})
    with pytest.raises(RuntimeError, match="hold references"):
        cache.remove_prefix(m.hashes[0])
    cache.release(alloc)
    assert cache.remove_prefix(cache.hash_prompt(prompt)[0]) == 4              # units 64..256 of the first tree
    assert cache.lookup(prompt).hit == 0 and cache.lookup(prompt, other_ns).hit == 256
    assert cache.remove_prefix(cache.hash_prompt(prompt)[0]) == 0              # already gone
    assert_idle(cache)
    assert cache.checkpoints.num_free == cache.checkpoints.num_slots - 1       # only the other tree's tail left
