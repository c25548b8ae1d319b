"""PrefixIndex and BlockNode: lookup, insertion, checkpoint attachment and page eviction, against a plain dict model."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.cache.index import BlockNode, PrefixIndex
from hybridkv.cache.namespace import CacheIdentity, chained_block_hashes
from hybridkv.cache.pools import CheckpointPool, PagePool

NS = CacheIdentity(tenant="index-tests").digest()
UNIT = 4


@cache
def H(*symbols: int) -> tuple[bytes, ...]:
    """Chained unit hashes of a prefix given as one symbol (token id) per unit."""
    return tuple(chained_block_hashes(NS, list(symbols), 1))


def make_index(num_pages: int = 8, num_slots: int = 4, unit: int = UNIT) -> PrefixIndex:
    return PrefixIndex(unit, PagePool(num_pages), CheckpointPool(num_slots))


def insert(index: PrefixIndex, hashes, pages) -> list[BlockNode]:
    """Insert ``hashes`` from the root, unit ``i`` on ``pages[i]`` (pages must be held or cached)."""
    parent, out = index.root, []
    for h, p in zip(hashes, pages):
        parent, _ = index.get_or_insert(parent, h, p)
        out.append(parent)
    return out


def publish_path(index: PrefixIndex, hashes, share: int = 1) -> list[int]:
    """Like a finished request: take pages, publish ``share`` units per page, release; returns the pages."""
    pages = [index.pages.pop_free() for _ in range(-(-len(hashes) // share))]
    insert(index, hashes, [pages[i // share] for i in range(len(hashes))])
    for p in reversed(pages):
        index.pages.unref(p)
    return pages


def check_all(index: PrefixIndex) -> None:
    index.check_invariants()
    index.pages.check_invariants()
    index.checkpoints.check_invariants()


def prefix_of(node: BlockNode) -> tuple[bytes, ...]:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(reversed(keys))


# -- lookup and insertion --------------------------------------------------


def test_empty_index_matches_nothing():
    index = make_index()
    assert index.walk(list(H(1, 2))) == []
    assert index.walk([]) == []
    assert index.num_nodes == 0 and index.root.end == 0 and index.root.parent is None
    check_all(index)


def test_get_or_insert_creates_a_child_one_unit_deeper_on_the_given_page():
    index = make_index()
    page = index.pages.pop_free()
    (k,) = H(7)
    node, created = index.get_or_insert(index.root, k, page)
    assert created
    assert node.key == k and node.parent is index.root and node.end == UNIT and node.page == page
    assert node.checkpoint is None and node.children == {}
    assert index.root.children == {k: node}
    assert index.by_page == {page: [node]}
    assert index.pages.node_count[page] == 1 and index.num_nodes == 1
    check_all(index)


def test_get_or_insert_returns_the_existing_node_and_keeps_its_page():
    index = make_index()
    first, second = index.pages.pop_free(), index.pages.pop_free()
    (k,) = H(7)
    node, _ = index.get_or_insert(index.root, k, first)
    again, created = index.get_or_insert(index.root, k, second)
    assert again is node and not created
    assert node.page == first                     # content is set once
    assert index.pages.node_count[first] == 1 and index.pages.node_count[second] == 0
    assert index.num_nodes == 1
    check_all(index)


def test_nodes_end_at_multiples_of_the_unit():
    index = make_index(unit=64)
    publish_path(index, H(1, 2, 3), share=2)
    assert [n.end for n in index.walk(list(H(1, 2, 3)))] == [64, 128, 192]
    check_all(index)


def test_units_can_share_a_page_and_a_cached_page_can_gain_nodes():
    index = make_index()
    (page,) = publish_path(index, H(1, 2), share=2)
    assert index.pages.node_count[page] == 2 and index.pages.next_victim() == page
    index.get_or_insert(index.walk(list(H(1, 2)))[-1], H(1, 2, 3)[-1], page)   # cached, unreferenced page
    assert index.pages.node_count[page] == 3
    assert [n.page for n in index.walk(list(H(1, 2, 3)))] == [page] * 3
    check_all(index)


def test_a_refused_insert_onto_a_free_page_leaves_the_index_unchanged():
    index = make_index()
    (k,) = H(1)
    with pytest.raises(RuntimeError, match="page 0 is free"):
        index.get_or_insert(index.root, k, 0)
    assert index.walk([k]) == []
    check_all(index)


def test_walk_returns_the_matched_prefix_in_order():
    index = make_index()
    publish_path(index, H(1, 2, 3))
    path = index.walk(list(H(1, 2, 3, 4, 5)))
    assert [n.key for n in path] == list(H(1, 2, 3))
    assert [n.end for n in path] == [4, 8, 12]
    assert all(c.parent is p for p, c in zip([index.root] + path, path))


def test_walk_stops_at_the_first_missing_block_and_never_skips_a_hole():
    index = make_index()
    publish_path(index, H(1, 2, 3))
    a, b, c = H(1, 2, 3)
    assert [n.key for n in index.walk([a, b"missing", b, c])] == [a]
    assert index.walk([b, c]) == []               # unit 2 alone is not a prefix
    assert index.walk([H(9)[0], b, c]) == []


def test_branches_share_their_common_prefix_nodes():
    index = make_index()
    publish_path(index, H(1, 2, 3))
    publish_path(index, H(1, 2, 4))
    left, right = index.walk(list(H(1, 2, 3))), index.walk(list(H(1, 2, 4)))
    assert left[:2] == right[:2] and left[2] is not right[2]
    assert index.num_nodes == 4
    assert len(left[1].children) == 2
    check_all(index)


def test_a_key_only_matches_under_its_own_parent():
    index = make_index()
    publish_path(index, H(1, 2))
    second = H(1, 2)[1]
    assert index.walk([second]) == []
    assert index.walk([H(3)[0], second]) == []


# -- checkpoints -----------------------------------------------------------


def test_attach_checkpoint_publishes_the_slot_on_the_node():
    index = make_index()
    publish_path(index, H(1, 2))
    node = index.walk(list(H(1, 2)))[-1]
    slot = index.checkpoints.take_free()
    index.attach_checkpoint(node, slot)
    assert node.checkpoint == slot and index.slot_node == {slot: node}
    assert index.checkpoints.published[slot] and index.checkpoints.next_victim() == slot
    check_all(index)


def test_a_second_checkpoint_on_one_node_is_refused():
    index = make_index()
    publish_path(index, H(1))
    node = index.walk(list(H(1)))[-1]
    first, second = index.checkpoints.take_free(), index.checkpoints.take_free()
    index.attach_checkpoint(node, first)
    with pytest.raises(RuntimeError, match="node at 4 already has a checkpoint"):
        index.attach_checkpoint(node, second)
    assert node.checkpoint == first and not index.checkpoints.published[second]
    assert index.slot_node == {first: node}


def test_detach_checkpoint_frees_the_slot_and_keeps_the_kv_node():
    index = make_index()
    publish_path(index, H(1, 2))
    node = index.walk(list(H(1, 2)))[-1]
    slot = index.checkpoints.take_free()
    index.attach_checkpoint(node, slot)
    index.detach_checkpoint(node)
    assert node.checkpoint is None and index.slot_node == {}
    assert not index.checkpoints.published[slot] and index.checkpoints.num_free == 4
    assert index.walk(list(H(1, 2)))[-1] is node
    check_all(index)


def test_detaching_a_node_without_checkpoint_changes_nothing():
    index = make_index()
    publish_path(index, H(1))
    node = index.walk(list(H(1)))[-1]
    index.detach_checkpoint(node)
    assert node.checkpoint is None and index.checkpoints.num_free == 4
    check_all(index)


# -- eviction --------------------------------------------------------------


def test_the_root_cannot_be_removed():
    index = make_index()
    with pytest.raises(RuntimeError, match="the root cannot be removed"):
        index.remove_subtree(index.root)


def test_evict_page_removes_its_nodes_with_their_subtrees_on_other_pages():
    index = make_index()
    p1, p2, p3 = publish_path(index, H(1, 2, 3))
    publish_path(index, H(1, 2, 4))               # a branch on its own page under unit 2
    doomed = index.walk(list(H(1, 2, 3)))[1:] + index.walk(list(H(1, 2, 4)))[2:]
    assert index.evict_page(p2) == 3
    assert [n.key for n in index.walk(list(H(1, 2, 3)))] == [H(1)[0]]
    assert index.num_nodes == 1
    assert all(n.parent is None and n.children == {} for n in doomed)   # detached: holders can tell
    assert index.pages.node_count[p2] == 0 and index.pages.node_count[p3] == 0
    assert index.pages.node_count[p1] == 1
    assert index.pages.num_free == 7 and index.pages.next_victim() == p1
    check_all(index)


def test_evict_page_removes_every_node_on_a_shared_page():
    index = make_index()
    (p,) = publish_path(index, H(1, 2), share=2)
    q, = publish_path(index, H(5, 6), share=2)
    assert index.evict_page(p) == 2
    assert index.walk(list(H(1, 2))) == []
    assert len(index.walk(list(H(5, 6)))) == 2 and index.pages.node_count[q] == 2
    assert p not in index.by_page
    check_all(index)


def test_evict_page_handles_a_page_reused_below_its_own_subtree():
    index = make_index()
    a, b = index.pages.pop_free(), index.pages.pop_free()
    insert(index, H(1, 2, 3), [a, b, a])          # page a at depth 1 and again at depth 3
    index.pages.unref(b)
    index.pages.unref(a)
    assert index.evict_page(a) == 3
    assert index.num_nodes == 0 and index.pages.num_free == 8
    check_all(index)


def test_evicting_a_page_without_nodes_removes_nothing():
    index = make_index()
    publish_path(index, H(1, 2))
    assert index.evict_page(7) == 0
    assert index.num_nodes == 2
    check_all(index)


def test_evicting_a_page_a_request_holds_keeps_it_in_use_until_released():
    index = make_index()
    page = index.pages.pop_free()
    insert(index, H(1), [page])
    assert index.evict_page(page) == 1
    assert index.pages.refcount[page] == 1 and index.pages.num_free == 7
    index.pages.unref(page)
    assert index.pages.num_free == 8 and index.pages.num_evictable == 0
    check_all(index)


def test_evict_page_releases_the_checkpoints_of_removed_nodes():
    index = make_index()
    _p1, p2 = publish_path(index, H(1, 2))
    n1, n2 = index.walk(list(H(1, 2)))
    s1, s2 = index.checkpoints.take_free(), index.checkpoints.take_free()
    index.attach_checkpoint(n1, s1)
    index.attach_checkpoint(n2, s2)
    index.checkpoints.ref(s2)                     # a request is copying it out
    index.evict_page(p2)
    assert n1.checkpoint == s1 and index.slot_node == {s1: n1}
    assert not index.checkpoints.published[s2] and index.checkpoints.refcount[s2] == 1
    assert index.checkpoints.num_free == 2        # s2 stays out of the free queue while referenced
    check_all(index)
    index.checkpoints.unref(s2)
    assert index.checkpoints.num_free == 3 and index.checkpoints.next_victim() == s1
    check_all(index)


def test_subtree_nodes_lists_what_evict_page_removes_parents_first_without_changing_anything():
    index = make_index()
    a, b = index.pages.pop_free(), index.pages.pop_free()
    insert(index, H(1, 2, 3), [a, b, a])
    insert(index, H(1, 2, 4, 5), [a, b, b, a])
    insert(index, H(6), [a])
    index.pages.unref(b)
    index.pages.unref(a)
    nodes = index.subtree_nodes(b)
    assert index.num_nodes == 6                   # a pure query
    assert {prefix_of(n) for n in nodes} == {H(1, 2), H(1, 2, 3), H(1, 2, 4), H(1, 2, 4, 5)}
    assert len(nodes) == len(set(map(id, nodes)))
    for i, n in enumerate(nodes):
        assert n.parent not in nodes[i:]          # every parent in the list comes before its child
    assert index.evict_page(b) == len(nodes)
    assert all(n.parent is None for n in nodes)
    assert index.subtree_nodes(b) == []
    check_all(index)


# -- check_invariants detects corruption -----------------------------------


def test_check_invariants_detects_a_wrong_node_count():
    index = make_index()
    publish_path(index, H(1, 2))
    index.num_nodes += 1
    with pytest.raises(AssertionError, match="num_nodes 3 != 2"):
        index.check_invariants()


def test_check_invariants_detects_a_node_missing_from_by_page():
    index = make_index()
    (p,) = publish_path(index, H(1))
    index.by_page[p].clear()
    with pytest.raises(AssertionError, match="missing from by_page"):
        index.check_invariants()


def test_check_invariants_detects_a_page_node_count_out_of_sync():
    index = make_index()
    (p,) = publish_path(index, H(1))
    index.pages.node_count[p] = 2
    with pytest.raises(AssertionError, match=f"page {p} node_count wrong"):
        index.check_invariants()


def test_check_invariants_detects_a_broken_parent_link():
    index = make_index()
    publish_path(index, H(1, 2))
    index.walk(list(H(1, 2)))[-1].parent = index.root
    with pytest.raises(AssertionError, match="broken parent link"):
        index.check_invariants()


def test_check_invariants_detects_one_slot_attached_to_two_nodes():
    index = make_index()
    publish_path(index, H(1, 2))
    n1, n2 = index.walk(list(H(1, 2)))
    slot = index.checkpoints.take_free()
    index.attach_checkpoint(n1, slot)
    index.attach_checkpoint(n2, slot)
    with pytest.raises(AssertionError, match=f"slot {slot} attached twice"):
        index.check_invariants()


def test_check_invariants_detects_a_published_slot_no_node_holds():
    index = make_index()
    index.checkpoints.publish(index.checkpoints.take_free())
    with pytest.raises(AssertionError, match="published slots differ from attached slots"):
        index.check_invariants()


# -- randomized comparison with a plain dict -------------------------------

SYMBOLS = 3                # symbols used for inserted units; queries also use one never inserted


class IndexAgainstDict(RuleBasedStateMachine):
    """Drive a small index (pages and slots scarce) and mirror it in ``prefix -> page`` / ``prefix -> slot`` dicts."""

    def __init__(self):
        super().__init__()
        self.index = make_index(num_pages=6, num_slots=3)
        self.pages, self.ckpts = self.index.pages, self.index.checkpoints
        self.ref: dict[tuple[bytes, ...], int] = {}      # every indexed prefix -> its page
        self.ref_ckpt: dict[tuple[bytes, ...], int] = {}  # prefixes holding a checkpoint -> slot
        self.syms: dict[tuple[bytes, ...], tuple[int, ...]] = {(): ()}
        self.held_pages: list[int] = []                  # page references held by "requests"
        self.held_slots: list[int] = []

    # model helpers
    def ref_longest(self, query: tuple[bytes, ...]) -> int:
        k = 0
        while k < len(query) and query[: k + 1] in self.ref:
            k += 1
        return k

    def node(self, prefix):
        path = self.index.walk(list(prefix))
        assert len(path) == len(prefix)
        return path[-1]

    def model_evict(self, page: int) -> set[tuple[bytes, ...]]:
        gone = {p for p in self.ref if any(self.ref[p[:i]] == page for i in range(1, len(p) + 1))}
        predicted = {prefix_of(n) for n in self.index.subtree_nodes(page)}
        assert predicted == gone
        assert self.index.evict_page(page) == len(gone)
        for p in gone:
            del self.ref[p]
            self.syms.pop(p, None)
            self.ref_ckpt.pop(p, None)
        assert self.pages.node_count[page] == 0
        if self.pages.refcount[page] == 0:
            assert page in self.pages._free and page not in self.pages.order
        return gone

    def evict_checkpoint_lru(self) -> bool:
        victim = self.ckpts.next_victim()
        if victim is None:
            return False
        node = self.index.slot_node[victim]
        prefix = prefix_of(node)
        assert self.ref_ckpt.pop(prefix) == victim
        self.index.detach_checkpoint(node)
        return True

    # operations
    @rule(data=st.data())
    def insert_path(self, data):
        parent_prefix = data.draw(st.sampled_from(sorted(self.syms)), label="parent")
        parent_syms = self.syms[parent_prefix]
        suffix = data.draw(st.lists(st.integers(0, SYMBOLS - 1), min_size=1, max_size=3), label="suffix")
        share = data.draw(st.lists(st.booleans(), min_size=len(suffix), max_size=len(suffix)), label="share")
        parent = self.node(parent_prefix) if parent_prefix else self.index.root
        held = list(dict.fromkeys(n.page for n in self.index.walk(list(parent_prefix))))
        for p in held:                                   # protect the path, as a request does
            self.pages.ref(p)
        prev = parent.page
        need = sum(1 for i, s in enumerate(share) if not (s and (i or prev is not None)))
        while self.pages.num_free < need:
            victim = self.pages.next_victim()
            if victim is None:
                break
            self.model_evict(victim)
        if self.pages.num_free < need:
            assert self.pages.next_victim() is None
            for p in reversed(held):
                self.pages.unref(p)
            return
        assert parent_prefix == () or parent_prefix in self.ref    # held pages kept the path
        fresh = [self.pages.pop_free() for _ in range(need)]
        it = iter(fresh)
        prefix, syms = parent_prefix, parent_syms
        for s, shared in zip(suffix, share):
            page = prev if shared and prev is not None else next(it)
            syms = syms + (s,)
            prefix = H(*syms)
            node, created = self.index.get_or_insert(parent, prefix[-1], page)
            if prefix in self.ref:
                assert not created and node.page == self.ref[prefix]
            else:
                assert created and node.page == page
                self.ref[prefix] = page
                self.syms[prefix] = syms
            assert prefix_of(node) == prefix and node.end == len(prefix) * UNIT
            parent, prev = node, page
        for p in reversed(held + fresh):
            self.pages.unref(p)

    @precondition(lambda self: self.pages.num_evictable > 0)
    @rule(data=st.data(), lru=st.booleans())
    def evict_an_evictable_page(self, data, lru):
        page = self.pages.next_victim() if lru else data.draw(st.sampled_from(sorted(self.pages.order)))
        assert self.pages.refcount[page] == 0 and self.pages.node_count[page] > 0
        self.model_evict(page)

    @precondition(lambda self: bool(self.ref))
    @rule(data=st.data())
    def hold_a_cached_page(self, data):
        page = data.draw(st.sampled_from(sorted(set(self.ref.values()))))
        self.pages.ref(page)
        self.held_pages.append(page)
        assert page not in self.pages.order

    @precondition(lambda self: bool(self.held_pages))
    @rule(data=st.data())
    def release_a_held_page(self, data):
        page = self.held_pages.pop(data.draw(st.integers(0, len(self.held_pages) - 1)))
        self.pages.unref(page)

    @precondition(lambda self: bool(self.ref))
    @rule(data=st.data())
    def touch_a_page(self, data):
        page = data.draw(st.sampled_from(sorted(set(self.ref.values()))))
        self.pages.touch(page)
        if page in self.pages.order:
            assert list(self.pages.order)[-1] == page

    @precondition(lambda self: any(p not in self.ref_ckpt for p in self.ref))
    @rule(data=st.data())
    def attach_a_checkpoint(self, data):
        prefix = data.draw(st.sampled_from(sorted(p for p in self.ref if p not in self.ref_ckpt)))
        slot = self.ckpts.take_free()
        while slot is None:
            if not self.evict_checkpoint_lru():
                assert all(self.ckpts.refcount[s] > 0 or not self.ckpts.published[s]
                           for s in range(self.ckpts.num_slots))
                return
            slot = self.ckpts.take_free()
        if prefix not in self.ref_ckpt:
            self.index.attach_checkpoint(self.node(prefix), slot)
            self.ref_ckpt[prefix] = slot

    @precondition(lambda self: bool(self.ref_ckpt))
    @rule(data=st.data())
    def detach_a_checkpoint(self, data):
        prefix = data.draw(st.sampled_from(sorted(self.ref_ckpt)))
        slot = self.ref_ckpt.pop(prefix)
        self.index.detach_checkpoint(self.node(prefix))
        assert not self.ckpts.published[slot]
        assert (slot in self.ckpts._free) == (self.ckpts.refcount[slot] == 0)

    @precondition(lambda self: bool(self.ref_ckpt))
    @rule(data=st.data())
    def hold_a_checkpoint(self, data):
        slot = data.draw(st.sampled_from(sorted(self.ref_ckpt.values())))
        self.ckpts.ref(slot)
        self.held_slots.append(slot)

    @precondition(lambda self: bool(self.held_slots))
    @rule(data=st.data())
    def release_a_checkpoint(self, data):
        slot = self.held_slots.pop(data.draw(st.integers(0, len(self.held_slots) - 1)))
        self.ckpts.unref(slot)

    @rule(query=st.lists(st.integers(0, SYMBOLS), max_size=6))
    def walk_a_random_query(self, query):
        hashes = H(*query)
        path = self.index.walk(list(hashes))
        assert len(path) == self.ref_longest(hashes)
        assert tuple(n.key for n in path) == hashes[: len(path)]

    @precondition(lambda self: bool(self.ref))
    @rule(data=st.data())
    def walk_an_indexed_prefix_with_a_hole(self, data):
        prefix = data.draw(st.sampled_from(sorted(self.ref)), label="indexed prefix")
        at = data.draw(st.integers(0, len(prefix) - 1), label="hole at")
        junk = data.draw(st.sampled_from([H(SYMBOLS)[0], prefix[at][::-1]]), label="missing key")
        query = prefix[:at] + (junk,) + prefix[at:]      # the rest of the prefix follows the hole
        assert self.ref_longest(query) == at
        assert [n.key for n in self.index.walk(list(query))] == list(prefix[:at])

    # checked after every step
    @invariant()
    def structures_are_consistent(self):
        check_all(self.index)
        assert self.index.num_nodes == len(self.ref)
        assert all(p[:-1] == () or p[:-1] in self.ref for p in self.ref)   # the model is prefix-closed
        for page in range(self.pages.num_pages):
            assert self.pages.node_count[page] == sum(1 for v in self.ref.values() if v == page)
        assert {s for s in self.index.slot_node} == set(self.ref_ckpt.values())

    @invariant()
    def walk_matches_the_dict(self):
        for prefix in self.ref:
            path = self.index.walk(list(prefix))
            assert [n.page for n in path] == [self.ref[prefix[:i]] for i in range(1, len(prefix) + 1)]
            assert path[-1].checkpoint == self.ref_ckpt.get(prefix)
        for prefix, syms in self.syms.items():                # one unit past every indexed prefix
            for s in range(SYMBOLS + 1):
                query = H(*syms, s, 0)
                assert len(self.index.walk(list(query))) == self.ref_longest(query)


IndexAgainstDict.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestIndexAgainstDict = IndexAgainstDict.TestCase


def test_a_nodes_children_behave_as_one_dict_through_one_two_and_none():
    """BlockNode keeps an only child inline and two or more in a dict: adding, looking up,
    removing and dropping children give what one insertion-ordered dict gives, at every step."""
    parent = BlockNode(b"", None, 0, None)
    kids = {k: BlockNode(k, parent, UNIT, 0) for k in (b"a", b"b", b"c", b"d")}
    model: dict[bytes, BlockNode] = {}

    def same():
        assert parent.children == model and list(parent.children) == list(model)
        for k in kids:
            assert parent.child(k) is model.get(k)

    same()
    for step in ["+a", "+b", "-a", "+c", "-b", "-c", "+d", "-d", "+b", "+a", "+c", "-a"]:
        k = step[1:].encode()
        if step[0] == "+":
            parent._add_child(k, kids[k])
            model[k] = kids[k]
        else:
            parent._remove_child(k)
            del model[k]
        same()
    with pytest.raises(KeyError):
        parent._remove_child(b"a")
    assert parent._drop_children() == list(model.values()) == [kids[b"b"], kids[b"c"]]
    assert parent.children == {} and parent.child(b"b") is None
    with pytest.raises(KeyError):
        parent._remove_child(b"b")
    parent._add_child(b"a", kids[b"a"])
    assert parent._drop_children() == [kids[b"a"]] and parent.children == {}
