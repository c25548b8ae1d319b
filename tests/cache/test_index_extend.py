"""PrefixIndex.extend with several units per page (the simulator's publication path) builds
what one get_or_insert per key builds: the tree, the pool's node counts, by_page and the
eviction order's descriptions; a free page mid-chain raises with the keys before it inserted."""

import hashlib

import pytest

from hybridkv.cache.index import PrefixIndex
from hybridkv.cache.pools import CheckpointPool, PagePool

UNIT = 8
PER_PAGE = 4          # units per page, as block_size // prefix_match_unit


def _keys(tag: bytes, n: int) -> list[bytes]:
    return [hashlib.sha256(tag + bytes([i])).digest() for i in range(n)]


def _state(index: PrefixIndex, pool: PagePool):
    nodes, stack = [], [index.root]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        nodes.append((n.end, n.key, n.page, n.owner, n.created, n.parent.key if n.parent else None))
    by_page = {p: sorted(n.key for n in ns) for p, ns in index.by_page.items()}
    described = {p: (pool.order.info[p].depth, pool.order.info[p].owner) for p in pool.order.info}
    return sorted(nodes), list(pool.node_count), by_page, described, index.num_nodes


def _build(mode: str, split: int = 3):
    pool = PagePool(16)
    index = PrefixIndex(UNIT, pool, CheckpointPool(2))
    shared = _keys(b"s", 6)
    chains = [shared + _keys(b"a", 7), shared[:5] + _keys(b"b", 9), shared + _keys(b"a", 10)]
    for ks in chains:
        table = [pool.pop_free() for _ in range(-(-len(ks) // PER_PAGE))]
        pages = [table[i // PER_PAGE] for i in range(len(ks))]
        if mode == "extend":
            nodes = index.extend(index.root, ks, pages, owner=b"o", now=2.0)
        elif mode == "table":          # in two calls, the second starting at unit ``split``
            nodes = index.extend_table(index.root, ks[:split], table, 0, PER_PAGE, owner=b"o", now=2.0)
            index.extend_table(nodes[-1] if nodes else index.root, ks[split:], table, min(split, len(ks)),
                               PER_PAGE, owner=b"o", now=2.0, out=nodes)
        else:
            parent, nodes = index.root, []
            for k, p in zip(ks, pages):
                parent, _ = index.get_or_insert(parent, k, p, owner=b"o", now=2.0)
                nodes.append(parent)
        assert [n.key for n in nodes] == ks
        assert [n.end for n in nodes] == [UNIT * (i + 1) for i in range(len(ks))]
        for p in table:
            pool.unref(p)
    index.check_invariants()
    pool.check_invariants()
    return _state(index, pool)


def test_extend_over_page_runs_equals_get_or_insert():
    assert _build("extend") == _build("single")


@pytest.mark.parametrize("split", range(0, 18))
def test_extend_table_equals_get_or_insert(split):
    """Whatever unit the second call starts at (mid-page, on a page boundary, past the end):
    the same tree as one get_or_insert per key."""
    assert _build("table", split) == _build("single")


def test_extend_table_refuses_a_table_too_short_and_changes_nothing():
    pool = PagePool(4)
    index = PrefixIndex(UNIT, pool, CheckpointPool(2))
    table = [pool.pop_free()]
    with pytest.raises(ValueError, match="do not fit a table of 1 pages"):
        index.extend_table(index.root, _keys(b"x", PER_PAGE), table, 1, PER_PAGE)
    assert index.num_nodes == 0 and pool.node_count[table[0]] == 0
    index.check_invariants()


def test_extend_raises_on_a_free_page_after_inserting_the_keys_before_it():
    pool = PagePool(4)
    index = PrefixIndex(UNIT, pool, CheckpointPool(2))
    held = pool.pop_free()
    free_page = 3                      # never taken: free
    keys = _keys(b"x", 6)
    out = []
    with pytest.raises(RuntimeError, match="page 3 is free"):
        index.extend(index.root, keys, [held] * 4 + [free_page] * 2, out=out)
    assert [n.key for n in out] == keys[:4]
    assert index.num_nodes == 4 and pool.node_count[held] == 4 and pool.node_count[free_page] == 0
    assert index.walk(keys) == out
    pool.unref(held)
    index.check_invariants()
    pool.check_invariants()
