"""PagePool and CheckpointPool bookkeeping: refcounts, free queues, LRU of evictable entries, misuse errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache.groups import BOUNDARY, PREFIX, GroupSpec, KDASpec
from hybridkv.cache.pools import CheckpointPool, PagePool
from hybridkv.engine.backend import KDA_CODEC
from hybridkv.model.state import KDACheckpoint


def cached_page(pool: PagePool) -> int:
    """A page that an index node points at and no request holds (evictable)."""
    page = pool.pop_free()
    pool.add_node(page)
    pool.unref(page)
    return page


def published_slot(pool: CheckpointPool) -> int:
    """A slot that is published and unreferenced (evictable)."""
    slot = pool.take_free()
    pool.publish(slot)
    return slot


# -- PagePool ------------------------------------------------------------


def test_new_page_pool_has_every_page_free_and_nothing_evictable():
    pool = PagePool(4)
    assert pool.num_pages == 4
    assert pool.num_free == 4
    assert pool.num_evictable == 0
    assert pool.next_victim() is None
    assert pool.refcount == [0] * 4 and pool.node_count == [0] * 4
    pool.check_invariants()


def test_pop_free_hands_out_pages_in_order_with_one_reference_then_none():
    pool = PagePool(3)
    assert [pool.pop_free() for _ in range(3)] == [0, 1, 2]
    assert pool.refcount == [1, 1, 1]
    assert pool.num_free == 0
    assert pool.pop_free() is None
    pool.check_invariants()


def test_unreferenced_page_without_nodes_returns_to_the_back_of_the_free_queue():
    pool = PagePool(3)
    page = pool.pop_free()
    pool.unref(page)
    assert pool.refcount[page] == 0
    assert pool.num_free == 3 and pool.num_evictable == 0
    assert [pool.pop_free() for _ in range(3)] == [1, 2, 0]
    pool.check_invariants()


def test_page_published_while_held_becomes_evictable_not_free_on_release():
    pool = PagePool(2)
    page = pool.pop_free()
    pool.add_node(page)
    assert pool.num_evictable == 0              # held by a request: not evictable yet
    pool.unref(page)
    assert pool.num_free == 1 and pool.num_evictable == 1
    assert pool.next_victim() == page
    pool.check_invariants()


def test_referencing_a_cached_page_takes_it_off_the_evictable_list():
    pool = PagePool(2)
    page = cached_page(pool)
    pool.ref(page)
    assert pool.refcount[page] == 1
    assert pool.num_evictable == 0
    assert pool.next_victim() is None         # a referenced page is never offered for eviction
    pool.check_invariants()


def test_page_stays_referenced_until_its_last_reference_is_dropped():
    pool = PagePool(2)
    page = cached_page(pool)
    pool.ref(page)
    pool.ref(page)
    pool.unref(page)
    assert pool.refcount[page] == 1 and pool.next_victim() is None
    pool.unref(page)
    assert pool.refcount[page] == 0 and pool.next_victim() == page
    pool.check_invariants()


def test_lru_evictable_follows_release_order():
    pool = PagePool(4)
    pages = [pool.pop_free() for _ in range(4)]
    for p in pages:
        pool.add_node(p)
    for p in [2, 0, 3, 1]:
        pool.unref(p)
    assert list(pool.order) == [2, 0, 3, 1]
    assert pool.next_victim() == 2


def test_touch_makes_a_cached_page_most_recently_used():
    pool = PagePool(3)
    a, b, c = (cached_page(pool) for _ in range(3))
    pool.touch(a)
    assert pool.next_victim() == b
    assert list(pool.order) == [b, c, a]


def test_re_released_page_becomes_most_recently_used():
    pool = PagePool(3)
    a, b, c = (cached_page(pool) for _ in range(3))
    pool.ref(a)
    pool.unref(a)
    assert list(pool.order) == [b, c, a]


def test_touch_ignores_free_and_referenced_pages():
    pool = PagePool(3)
    held = pool.pop_free()
    pool.add_node(held)
    cached = cached_page(pool)
    pool.touch(held)                            # referenced: must not become evictable
    pool.touch(2)                               # free: must not become evictable
    assert list(pool.order) == [cached]
    assert pool.num_free == 1
    pool.check_invariants()


def test_ref_of_a_free_page_is_refused():
    pool = PagePool(2)
    with pytest.raises(RuntimeError, match="PagePool item 1 is not cached"):
        pool.ref(1)
    assert pool.refcount[1] == 0 and pool.num_free == 2
    pool.check_invariants()


def test_unref_below_zero_is_refused():
    pool = PagePool(2)
    with pytest.raises(RuntimeError, match="PagePool item 0 refcount would go below zero"):
        pool.unref(0)
    page = cached_page(pool)
    with pytest.raises(RuntimeError, match="refcount would go below zero"):
        pool.unref(page)
    assert pool.refcount[page] == 0 and pool.next_victim() == page
    pool.check_invariants()


def test_publishing_a_free_page_is_refused():
    pool = PagePool(2)
    with pytest.raises(RuntimeError, match="page 1 is free; publish it while a request holds it"):
        pool.add_node(1)
    assert pool.node_count[1] == 0
    pool.check_invariants()


def test_a_cached_page_can_gain_more_nodes_without_a_reference():
    pool = PagePool(2)
    page = cached_page(pool)
    pool.add_node(page)
    assert pool.node_count[page] == 2
    assert pool.next_victim() == page
    pool.check_invariants()


def test_removing_a_node_that_does_not_exist_is_refused():
    pool = PagePool(2)
    with pytest.raises(RuntimeError, match="page 0 has no node to remove"):
        pool.remove_node(0)
    assert pool.node_count[0] == 0


def test_removing_the_last_node_of_an_unreferenced_page_frees_it():
    pool = PagePool(2)
    page = cached_page(pool)
    pool.add_node(page)
    pool.remove_node(page)
    assert pool.next_victim() == page         # one node left: still cached
    pool.remove_node(page)
    assert pool.num_evictable == 0 and pool.num_free == 2
    assert [pool.pop_free(), pool.pop_free()] == [1, page]
    pool.check_invariants()


def test_removing_the_last_node_of_a_held_page_keeps_it_in_use_until_released():
    pool = PagePool(2)
    page = pool.pop_free()
    pool.add_node(page)
    pool.remove_node(page)
    assert pool.refcount[page] == 1 and pool.num_free == 1 and pool.num_evictable == 0
    pool.unref(page)
    assert pool.num_free == 2 and pool.num_evictable == 0
    pool.check_invariants()


def test_page_pool_check_invariants_detects_a_duplicate_in_the_free_queue():
    pool = PagePool(3)
    pool._free.append(0)
    with pytest.raises(AssertionError, match="duplicate page in free queue"):
        pool.check_invariants()


def test_page_pool_check_invariants_detects_a_referenced_page_in_the_free_queue():
    pool = PagePool(3)
    pool.refcount[1] = 1
    with pytest.raises(AssertionError, match="page 1: free-queue membership wrong"):
        pool.check_invariants()


def test_page_pool_check_invariants_detects_a_held_page_on_the_evictable_list():
    pool = PagePool(3)
    page = pool.pop_free()
    pool.add_node(page)
    pool.order.add(page)
    with pytest.raises(AssertionError, match=f"page {page}: evictable membership wrong"):
        pool.check_invariants()


def test_page_pool_check_invariants_detects_a_negative_count():
    pool = PagePool(2)
    pool.node_count[1] = -1
    with pytest.raises(AssertionError, match="page 1: negative count"):
        pool.check_invariants()


# Randomized: the pool against a plain model of page states and LRU order.
_page_ops = st.lists(
    st.tuples(st.sampled_from(["pop", "ref", "unref", "add", "remove", "touch"]), st.integers(0, 4)),
    max_size=60)


@settings(max_examples=80, deadline=None)
@given(_page_ops)
def test_page_pool_matches_a_reference_model(ops):
    n = 5
    pool = PagePool(n)
    rc, nc = [0] * n, [0] * n
    free, lru = list(range(n)), []            # free queue order; evictable LRU order (oldest first)
    for op, p in ops:
        if op == "pop":
            got = pool.pop_free()
            if not free:
                assert got is None
                continue
            assert got == free.pop(0)
            rc[got] = 1
        elif op == "ref":
            if rc[p] == 0 and nc[p] == 0:
                with pytest.raises(RuntimeError, match="is not cached"):
                    pool.ref(p)
                continue
            pool.ref(p)
            if rc[p] == 0:
                lru.remove(p)
            rc[p] += 1
        elif op == "unref":
            if rc[p] == 0:
                with pytest.raises(RuntimeError, match="below zero"):
                    pool.unref(p)
                continue
            pool.unref(p)
            rc[p] -= 1
            if rc[p] == 0:
                (lru if nc[p] else free).append(p)
        elif op == "add":
            if rc[p] == 0 and nc[p] == 0:
                with pytest.raises(RuntimeError, match="is free"):
                    pool.add_node(p)
                continue
            pool.add_node(p)
            nc[p] += 1
        elif op == "remove":
            if nc[p] == 0:
                with pytest.raises(RuntimeError, match="no node to remove"):
                    pool.remove_node(p)
                continue
            pool.remove_node(p)
            nc[p] -= 1
            if nc[p] == 0 and rc[p] == 0:
                lru.remove(p)
                free.append(p)
        else:
            pool.touch(p)
            if p in lru:
                lru.remove(p)
                lru.append(p)
        pool.check_invariants()
        assert pool.refcount == rc and pool.node_count == nc
        assert list(pool._free) == free and list(pool.order) == lru
        assert pool.num_free == len(free) and pool.num_evictable == len(lru)
        assert pool.next_victim() == (lru[0] if lru else None)
        assert all(rc[q] == 0 for q in lru)   # referenced pages are never evictable


# -- CheckpointPool ------------------------------------------------------


def test_bookkeeping_only_checkpoint_pool_has_no_storage():
    pool = CheckpointPool(3, slot_bytes=1234)
    assert pool.num_slots == 3 and pool.num_free == 3
    assert not pool.tensor_backed and pool.spec is None and pool.held(0) is None
    assert pool.slot_bytes == 1234
    assert pool.published == [False] * 3
    assert pool.next_victim() is None
    pool.check_invariants()


def test_bookkeeping_only_pool_accepts_writes_without_tensors_and_reads_none():
    pool = CheckpointPool(2)
    slot = pool.take_free()
    pool.write(slot, None)
    pool.publish(slot)
    assert pool.read(slot, 64) is None


def test_take_free_reserves_slots_in_order_without_publishing_them():
    pool = CheckpointPool(2)
    assert pool.take_free() == 0
    assert pool.take_free() == 1
    assert pool.take_free() is None
    assert pool.num_free == 0
    assert pool.published == [False, False] and pool.refcount == [0, 0]
    assert pool.next_victim() is None         # reserved, not yet published: not evictable
    pool.check_invariants()


def test_publish_makes_a_slot_evictable_in_publication_order():
    pool = CheckpointPool(3)
    slots = [pool.take_free() for _ in range(3)]
    for s in [1, 2, 0]:
        pool.publish(s)
    assert all(pool.published[s] for s in slots)
    assert list(pool.order) == [1, 2, 0]
    assert pool.next_victim() == 1
    pool.check_invariants()


def test_touch_makes_a_published_slot_most_recently_used():
    pool = CheckpointPool(3)
    a, b, c = (published_slot(pool) for _ in range(3))
    pool.touch(a)
    assert list(pool.order) == [b, c, a]
    pool.ref(b)
    pool.touch(b)                               # referenced: touching must not make it evictable
    assert list(pool.order) == [c, a]


def test_referenced_checkpoint_slot_is_not_evictable_until_released():
    pool = CheckpointPool(2)
    a, b = published_slot(pool), published_slot(pool)
    pool.ref(a)
    assert pool.next_victim() == b
    assert list(pool.order) == [b]
    pool.unref(a)
    assert list(pool.order) == [b, a]      # released: most recently used
    pool.check_invariants()


def test_ref_of_an_unpublished_slot_is_refused():
    pool = CheckpointPool(2)
    with pytest.raises(RuntimeError, match="CheckpointPool item 0 is not cached"):
        pool.ref(0)
    slot = pool.take_free()                     # reserved but not yet published
    with pytest.raises(RuntimeError, match=f"CheckpointPool item {slot} is not cached"):
        pool.ref(slot)
    assert pool.refcount == [0, 0]


def test_checkpoint_unref_below_zero_is_refused():
    pool = CheckpointPool(2)
    slot = published_slot(pool)
    with pytest.raises(RuntimeError, match=f"CheckpointPool item {slot} refcount would go below zero"):
        pool.unref(slot)
    assert pool.refcount[slot] == 0 and pool.next_victim() == slot


def test_unpublishing_an_unreferenced_slot_frees_it():
    pool = CheckpointPool(2)
    slot = published_slot(pool)
    pool.unpublish(slot)
    assert not pool.published[slot]
    assert pool.next_victim() is None
    assert pool.num_free == 2
    assert [pool.take_free(), pool.take_free()] == [1, slot]
    pool.check_invariants()


def test_unpublishing_a_referenced_slot_frees_it_only_on_release():
    pool = CheckpointPool(2)
    slot = published_slot(pool)
    pool.ref(slot)
    pool.unpublish(slot)
    assert pool.num_free == 1 and pool.refcount[slot] == 1
    pool.check_invariants()
    pool.unref(slot)
    assert pool.num_free == 2
    assert pool.next_victim() is None         # no longer published: freed, not evictable
    pool.check_invariants()


def test_checkpoint_pool_check_invariants_detects_a_published_slot_in_the_free_queue():
    pool = CheckpointPool(2)
    pool.published[1] = True
    with pytest.raises(AssertionError, match="slot 1: evictable membership wrong"):
        pool.check_invariants()
    pool.order.add(1)
    with pytest.raises(AssertionError, match="slot 1: free but in use"):
        pool.check_invariants()


def test_checkpoint_pool_check_invariants_detects_a_duplicate_in_the_free_queue():
    pool = CheckpointPool(2)
    pool._free.append(1)
    with pytest.raises(AssertionError, match="duplicate slot in free queue"):
        pool.check_invariants()


def test_checkpoint_pool_check_invariants_detects_a_referenced_slot_on_the_evictable_list():
    pool = CheckpointPool(2)
    slot = published_slot(pool)
    pool.refcount[slot] = 1
    with pytest.raises(AssertionError, match=f"slot {slot}: evictable membership wrong"):
        pool.check_invariants()


# Tensor-backed pool: tiny shapes, only for what needs storage.


def _tensor_pool(num_slots=2, conv_dtype=torch.float16):
    spec = KDASpec(num_layers=1, num_heads=2, head_dim=3, conv_dim=18, conv_width=2,
                   conv_dtype=str(conv_dtype).removeprefix("torch."))
    return CheckpointPool(num_slots, spec=spec.group_spec(), codec=KDA_CODEC)


def _kda_ckpt(boundary=64, conv_dtype=torch.float16):
    return KDACheckpoint(torch.arange(18, dtype=torch.float32).reshape(1, 2, 3, 3),
                         torch.full((1, 18, 2), 0.5, dtype=conv_dtype), boundary)


def test_tensor_backed_pool_sizes_slot_bytes_from_its_spec_and_holds_nothing_before_a_write():
    pool = _tensor_pool(conv_dtype=torch.float16)
    assert pool.tensor_backed and pool.slot_bytes == 18 * 4 + 36 * 2 == pool.spec.bytes_per_entry
    slot = pool.take_free()
    assert pool.held(slot) is None
    with pytest.raises(RuntimeError, match=f"slot {slot} holds no state"):
        pool.read(slot, 64)
    pool.write(slot, _kda_ckpt())
    held = pool.held(slot)
    assert held["recurrent"].shape == (1, 2, 3, 3) and held["recurrent"].dtype == torch.float32
    for third in ("conv.q", "conv.k", "conv.v"):
        assert held[third].shape == (1, 6, 2) and held[third].dtype == torch.float16
    assert sum(t.numel() * t.element_size() for t in held.values()) == pool.slot_bytes


def test_an_owned_write_keeps_the_captured_tensors_and_a_plain_write_copies():
    """``own=True`` (the engine's fresh captures) keeps the state's tensors, so a capture is not
    copied a second time; a component of another dtype is still converted; without ``own`` the
    slot holds copies; a freed slot drops what it held."""
    pool = _tensor_pool(num_slots=3)
    ckpt = _kda_ckpt()
    owned, copied, cast = pool.take_free(), pool.take_free(), pool.take_free()
    pool.write(owned, ckpt, own=True)
    assert pool.held(owned)["recurrent"].data_ptr() == ckpt.recurrent.data_ptr()
    assert pool.held(owned)["conv.q"].data_ptr() == ckpt.conv.data_ptr()
    pool.write(copied, ckpt)
    assert all(t.data_ptr() != ckpt.recurrent.data_ptr() for t in pool.held(copied).values())
    pool.write(cast, _kda_ckpt(conv_dtype=torch.float32), own=True)       # the spec's conv is float16
    assert pool.held(cast)["conv.v"].dtype == torch.float16
    assert torch.equal(pool.read(owned, 64).conv, pool.read(cast, 64).conv)
    pool.publish(owned, 64)
    pool.unpublish(owned)                                                    # unreferenced: freed
    assert pool.held(owned) is None and owned in list(pool._free)


def test_a_write_of_a_state_that_does_not_fit_the_spec_names_the_component_and_keeps_the_slot():
    pool = _tensor_pool(num_slots=1)
    slot = pool.take_free()
    bad = KDACheckpoint(torch.zeros(1, 2, 3, 4), torch.zeros(1, 18, 2, dtype=torch.float16), 64)
    with pytest.raises(ValueError, match=r"'recurrent' has shape \(1, 2, 3, 4\), the spec's is \(1, 2, 3, 3\)"):
        pool.write(slot, bad, own=True)
    assert pool.held(slot) is None
    raw = CheckpointPool(1, spec=pool.spec)                 # no codec: states are component dicts
    with pytest.raises(ValueError, match="no component 'conv.k'"):
        raw.write(raw.take_free(), {"recurrent": torch.zeros(1, 2, 3, 3), "conv.q": torch.zeros(1, 6, 2)})


def test_a_pool_built_from_a_spec_stores_any_boundary_groups_components_without_a_codec():
    spec = GroupSpec("swa", BOUNDARY, 64, (("window", "bfloat16", (2, 3, 4)), ("tails", "float32", (2, 5))))
    pool = CheckpointPool(1, spec=spec)
    assert pool.slot_bytes == 2 * 3 * 4 * 2 + 2 * 5 * 4
    state = {"window": torch.full((2, 3, 4), 1.5, dtype=torch.bfloat16), "tails": torch.arange(10.0).reshape(2, 5)}
    slot = pool.take_free()
    pool.write(slot, state)
    got = pool.read(slot, 128)
    assert set(got) == {"window", "tails"} and torch.equal(got["tails"], state["tails"])
    assert torch.equal(got["window"], state["window"])
    with pytest.raises(ValueError, match="not prefix group 'full'"):
        CheckpointPool(1, spec=GroupSpec("full", PREFIX))


def test_tensor_backed_pool_refuses_a_write_without_tensors():
    pool = _tensor_pool()
    slot = pool.take_free()
    with pytest.raises(ValueError, match="needs checkpoint tensors"):
        pool.write(slot, None)


def test_tensor_backed_pool_reads_back_a_private_copy_of_what_was_written():
    pool = _tensor_pool()
    slot = pool.take_free()
    ckpt = KDACheckpoint(torch.arange(18, dtype=torch.float32).reshape(1, 2, 3, 3),
                         torch.full((1, 18, 2), 0.5, dtype=torch.float16), 64)
    pool.write(slot, ckpt)
    ckpt.recurrent.zero_()                      # the slot holds its own bytes
    got = pool.read(slot, 64)
    assert got.boundary == 64
    assert torch.equal(got.recurrent, torch.arange(18, dtype=torch.float32).reshape(1, 2, 3, 3))
    assert torch.equal(got.conv, torch.full((1, 18, 2), 0.5, dtype=torch.float16))
    got.recurrent.zero_()                       # the reader gets a copy, not a view
    assert torch.equal(pool.read(slot, 64).recurrent, torch.arange(18, dtype=torch.float32).reshape(1, 2, 3, 3))
    assert pool.held(1 - slot) is None                      # other slots untouched


def _pool_state(pool: PagePool):
    return list(pool.refcount), list(pool.order), list(pool._free), list(pool.node_count)


def test_ref_many_and_unref_many_equal_one_call_per_page():
    """The batch calls leave refcounts, the eviction order and the free queue as the per-page
    calls do (cached pages become evictable in release order, uncached ones free), and raise at
    the same page with the pages before it done."""
    pools = [PagePool(8), PagePool(8)]
    for pool in pools:
        pages = [pool.pop_free() for _ in range(6)]
        for p in pages[:4]:
            pool.add_node(p)                      # cached: evictable when unreferenced
    one, many = pools
    for p in [5, 4, 3, 2, 1, 0]:
        one.unref(p)
    many.unref_many([5, 4, 3, 2, 1, 0])
    assert _pool_state(one) == _pool_state(many)
    for p in [2, 0, 3]:
        one.ref(p)
    many.ref_many([2, 0, 3])
    assert _pool_state(one) == _pool_state(many)
    with pytest.raises(RuntimeError, match="not cached"):
        many.ref_many([1, 5])                     # 5 is free: 1 referenced first
    one.ref(1)
    assert _pool_state(one) == _pool_state(many)
    with pytest.raises(RuntimeError, match="below zero"):
        many.unref_many([1, 4])                   # 4 is free: 1 released first
    one.unref(1)
    assert _pool_state(one) == _pool_state(many)
    one.check_invariants()
    many.check_invariants()


def test_touch_many_equals_one_touch_a_page():
    """Cached and held pages are refreshed in the order given, free ones skipped, as by
    :meth:`touch` once a page."""
    pools = [PagePool(8), PagePool(8)]
    for pool in pools:
        pages = [pool.pop_free() for _ in range(5)]
        for p in pages[:4]:
            pool.add_node(p)
        for p in pages[:3]:
            pool.unref(p)                         # 0, 1, 2 evictable; 3 held and cached; 4 held
    one, many = pools
    for p in [2, 7, 0, 3, 4]:
        one.touch(p)
    many.touch_many([2, 7, 0, 3, 4])
    assert _pool_state(one) == _pool_state(many)
    assert list(many.order) == [1, 2, 0]
    assert [many.order.info[p].hits for p in (0, 1, 2, 3)] == [1, 0, 1, 1]


@pytest.mark.parametrize("case", ["lru", "lru_owner_queues", "value"])
def test_page_batch_calls_equal_one_call_a_page_under_each_order(case):
    """PagePool's touch_many / unref_many (an inline path under lru without per-owner queues,
    the shared one otherwise) leave the order, its descriptions (hits, owner bytes), refcounts
    and the free queue as touch / unref once a page do, with owned pages and a repeated page."""
    pools = [PagePool(10, eviction="value" if case == "value" else "lru") for _ in range(2)]
    for pool in pools:
        pages = [pool.pop_free() for _ in range(8)]
        for k, p in enumerate(pages[:6]):
            pool.add_node(p, end=64 * (k + 1), owner=b"t%d" % (k % 2))
        pool.ref(pages[1])                        # held twice: its first unref leaves it held
        for p in pages[:3]:
            pool.unref(p)
        if case == "lru_owner_queues":
            assert pool.next_victim(b"t0") == 0   # builds the per-owner queues
    one, many = pools

    def state(pool):
        info = {p: (i.hits, i.owner) for p, i in pool.order.info.items()}
        return _pool_state(pool), info, dict(pool.order.owner_bytes), pool.order.total_bytes

    for p in [2, 9, 0, 3, 6, 0]:
        one.touch(p)
    many.touch_many([2, 9, 0, 3, 6, 0])
    assert state(one) == state(many)
    one.touch(1, count=False)                     # a refresh that counts no use
    many.touch_many([1], count=False)
    assert state(one) == state(many)
    for p in [5, 1, 4, 6, 7, 3]:
        one.unref(p)
    many.unref_many([5, 1, 4, 6, 7, 3])
    assert state(one) == state(many)
    one.ref(0)
    many.ref(0)
    with pytest.raises(RuntimeError, match="below zero"):
        many.unref_many([0, 7])                   # 7 is free now: 0 released first
    one.unref(0)
    assert state(one) == state(many)
    assert [one.order.victim(), one.order.victim(b"t1")] == [many.order.victim(), many.order.victim(b"t1")]
    one.check_invariants()
    many.check_invariants()
