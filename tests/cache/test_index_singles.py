"""PrefixIndex with one unit a page (``--prefix-match-unit`` equal to the block size, the
simulator's large runs): extend_table's one-key-a-page path builds what get_or_insert builds,
and evict_page's lone-leaf path removes what remove_subtree removes."""

import hashlib

import pytest

from hybridkv.cache.index import PrefixIndex
from hybridkv.cache.pools import CheckpointPool, PagePool

UNIT = 16


def _keys(tag: bytes, n: int) -> list[bytes]:
    return [hashlib.sha256(tag + bytes([i])).digest() for i in range(n)]


def _state(index: PrefixIndex, pool: PagePool):
    nodes, stack = [], [index.root]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        nodes.append((n.end, n.key, n.page, n.owner, n.created, n.checkpoint, n.parent.key if n.parent else None))
    by_page = {p: [n.key for n in ns] for p, ns in index.by_page.items()}
    described = {p: (pool.order.info[p].depth, pool.order.info[p].owner) for p in pool.order.info}
    slots = {s: n.key for s, n in index.slot_node.items()}
    published = list(index.checkpoints.published)
    return (sorted(nodes), list(pool.node_count), by_page, described, index.num_nodes, slots, published,
            pool.num_free, list(pool.order.info))


CHAINS = [_keys(b"s", 4) + _keys(b"a", 5), _keys(b"s", 3) + _keys(b"b", 6), _keys(b"s", 4) + _keys(b"a", 8)]


def _build(mode: str, split: int = 2):
    pool = PagePool(40)
    ckpts = CheckpointPool(4)
    index = PrefixIndex(UNIT, pool, ckpts)
    for ks in CHAINS:
        table = [pool.pop_free() for _ in ks]
        if mode == "table":                         # in two calls, the second starting at unit ``split``
            nodes = index.extend_table(index.root, ks[:split], table, 0, 1, owner=b"o", now=3.0)
            index.extend_table(nodes[-1] if nodes else index.root, ks[split:], table, min(split, len(ks)), 1,
                               owner=b"o", now=3.0, out=nodes)
        else:
            parent, nodes = index.root, []
            for k, p in zip(ks, table):
                parent, _ = index.get_or_insert(parent, k, p, owner=b"o", now=3.0)
                nodes.append(parent)
        assert [n.key for n in nodes] == ks
        for p in table:
            pool.unref(p)
    index.check_invariants()
    pool.check_invariants()
    return index, pool


@pytest.mark.parametrize("split", range(0, 11))
def test_extend_table_one_unit_a_page_equals_get_or_insert(split):
    a, pa = _build("table", split)
    b, pb = _build("single")
    assert _state(a, pa) == _state(b, pb)


def _evict_by_subtrees(index: PrefixIndex, page: int) -> int:
    """evict_page as a walk of remove_subtree over the page's nodes (its general path)."""
    removed = 0
    for node in list(index.by_page.get(page, ())):
        if node.parent is not None:
            removed += index.remove_subtree(node)
    return removed


def test_evict_page_of_lone_leaves_equals_remove_subtree():
    """Every page evicted in turn (leaves, inner pages with subtrees, a leaf with a checkpoint):
    the same nodes removed, pool counts, by_page, free pages and published slots at each step."""
    a, pa = _build("single")
    b, pb = _build("single")
    for index in (a, b):                            # a checkpoint on a leaf and one inside a chain
        for chain, at in ((CHAINS[2], -1), (CHAINS[1], 2)):
            index.attach_checkpoint(index.walk(chain)[at], index.checkpoints.take_free())
    assert _state(a, pa) == _state(b, pb)
    leaves = 0
    pages = sorted(a.by_page)
    order = sorted(pages, key=lambda p: -a.by_page[p][0].end)[:3] + pages    # three leaves, then roots first
    for page in order:
        if page not in a.by_page:
            continue
        nodes = a.by_page[page]
        leaves += len(nodes) == 1 and nodes[0].one is None and not nodes[0].many
        assert a.evict_page(page) == _evict_by_subtrees(b, page)
        assert _state(a, pa) == _state(b, pb)
        a.check_invariants()
        pa.check_invariants()
    assert leaves >= 3 and a.num_nodes == 0


def test_extend_table_one_unit_a_page_raises_on_a_free_page_after_the_keys_before_it():
    pool = PagePool(8)
    index = PrefixIndex(UNIT, pool, CheckpointPool(2))
    table = [pool.pop_free() for _ in range(3)] + [7]          # page 7 never taken: free
    keys = _keys(b"x", 4)
    out = []
    with pytest.raises(RuntimeError, match="page 7 is free"):
        index.extend_table(index.root, keys, table, 0, 1, out=out)
    assert [n.key for n in out] == keys[:3]
    assert index.num_nodes == 3 and index.walk(keys) == out and pool.node_count[7] == 0
    for p in table[:3]:
        pool.unref(p)
    index.check_invariants()
    pool.check_invariants()
