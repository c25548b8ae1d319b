"""Prefix index: a tree of chained-hash blocks, one node per ``prefix_match_unit`` (DESIGN §4).

Each node is the unit of tokens ``[end - G, end)`` of some cached prefix. It
records the physical page that holds that unit and, optionally, the checkpoint
slot holding ``C(P_end)``. Lookup walks parent to child and stops at the first
missing block; it never skips a hole.
"""

from __future__ import annotations

from operator import attrgetter

from hybridkv.cache.pools import CheckpointPool, PagePool

_END = attrgetter("end")


class BlockNode:
    """One cached unit of a prefix.

    Attributes:
        key: chained hash of the prefix ``[0, end)`` (unique in the tree).
        parent: node of ``[0, end - G)``; ``None`` only for the root.
        end: boundary in tokens (``depth * prefix_match_unit``).
        page: physical page holding this unit. Invariant: that page holds valid
            latents for every position from its page start up to ``end``.
        checkpoint: checkpoint-pool slot holding ``C(P_end)`` or ``None``.
        children: key -> child node (read-only: a new dict; :class:`PrefixIndex` changes them).
        owner: request namespace digest the prefix was cached under (quotas, purge); inherited
            from the parent, ``None`` when unknown (installed from a lower tier at the root).
        created: when the node was made, in seconds on the coordinator's clock (purge by age).

    The children are held as ``one_key`` / ``one`` while there is one (nearly every node: a
    chain's units each have one child, its next unit), as ``many`` (a dict of them all, the
    first two and more) from the second on, so a new node allocates no dict. Nodes compare by
    identity. :meth:`PrefixIndex._insert_runs` makes most nodes without ``__init__`` (it sets
    every slot itself): a slot added here must be set there too.
    """

    __slots__ = ("key", "parent", "end", "page", "checkpoint", "owner", "created", "one_key", "one", "many")

    def __init__(self, key: bytes, parent: BlockNode | None, end: int, page: int | None,
                 checkpoint: int | None = None, owner: bytes | None = None, created: float = 0.0) -> None:
        self.key = key
        self.parent = parent
        self.end = end
        self.page = page
        self.checkpoint = checkpoint
        self.owner = owner
        self.created = created
        self.one_key: bytes | None = None       # the only child's key (None: none, or many)
        self.one: BlockNode | None = None
        self.many: dict[bytes, BlockNode] | None = None

    def __repr__(self) -> str:
        return f"BlockNode(end={self.end}, page={self.page}, checkpoint={self.checkpoint})"

    @property
    def children(self) -> dict[bytes, BlockNode]:
        """key -> child node, as a new dict."""
        if self.one is not None:
            return {self.one_key: self.one}
        return dict(self.many) if self.many else {}

    def child(self, key: bytes) -> BlockNode | None:
        """The child with ``key`` or ``None``."""
        if self.one_key == key:
            return self.one
        many = self.many
        return many.get(key) if many else None

    def _add_child(self, key: bytes, node: BlockNode) -> None:
        """Hang ``node`` under ``key`` (absent)."""
        if self.one is None and not self.many:
            self.one_key, self.one = key, node
            return
        if self.one is not None:                 # the second child: both in a dict from now on
            self.many = {self.one_key: self.one}
            self.one_key = self.one = None
        self.many[key] = node

    def _remove_child(self, key: bytes) -> None:
        """Unhang the child with ``key``; ``KeyError`` when there is none."""
        if self.one is not None and self.one_key == key:
            self.one_key = self.one = None
            return
        if not self.many:
            raise KeyError(key)
        del self.many[key]

    def _drop_children(self) -> list[BlockNode]:
        """Every child, unhung (the node keeps none)."""
        if self.one is not None:
            out = [self.one]
            self.one_key = self.one = None
            return out
        many, self.many = self.many, None
        return list(many.values()) if many else []

    @property
    def has_kv(self) -> bool:
        """The node's page holds its unit's KV (every node but the root)."""
        return self.page is not None

    @property
    def has_checkpoint(self) -> bool:
        """A published checkpoint ``C(P_end)`` hangs here."""
        return self.checkpoint is not None


class PrefixIndex:
    """Tree of :class:`BlockNode` over the page and checkpoint pools.

    The index owns node membership (``PagePool.node_count``) and checkpoint
    publication (``CheckpointPool.published``); requests own page refcounts.

    Args:
        unit: ``prefix_match_unit`` in tokens.
        pages: the page pool whose pages nodes point at.
        checkpoints: the checkpoint pool whose slots nodes hold.
    """

    def __init__(self, unit: int, pages: PagePool, checkpoints: CheckpointPool) -> None:
        self.unit = unit
        self.pages = pages
        self.checkpoints = checkpoints
        self.root = BlockNode(key=b"", parent=None, end=0, page=None)
        # page -> the nodes pointing at it, in insertion order (a list: a page holds a few
        # consecutive units of one chain, so a list is smaller and quicker to build than a set)
        self.by_page: dict[int, list[BlockNode]] = {}
        self.slot_node: dict[int, BlockNode] = {}
        self.num_nodes = 0

    def walk(self, hashes: list[bytes]) -> list[BlockNode]:
        """Nodes matching ``hashes`` from the root, stopping at the first miss."""
        path: list[BlockNode] = []
        self._walk_chain(self.root, hashes, len(hashes), path)
        return path

    def get_or_insert(self, parent: BlockNode, key: bytes, page: int, owner: bytes | None = None,
                      now: float = 0.0) -> tuple[BlockNode, bool]:
        """The child of ``parent`` with ``key``; created pointing at ``page`` if absent.

        An existing node keeps its page (content is set once). A new node's ``owner`` is
        ``owner`` or else its parent's; ``now`` (seconds, the caller's clock) is its ``created``.

        Returns:
            ``(node, created)``.

        Raises:
            RuntimeError: ``page`` is free (no request holds it); the index is unchanged.
        """
        node = parent.child(key)
        if node is not None:
            return node, False
        return self._insert(parent, key, page, owner if owner is not None else parent.owner, now), True

    def _insert(self, parent: BlockNode, key: bytes, page: int, owner: bytes | None, now: float) -> BlockNode:
        """A new child of ``parent`` (``key`` absent there) at ``page``; the pool is told first."""
        end = parent.end + self.unit
        self.pages.add_node(page, end, owner, key)     # raises before the tree changes
        node = BlockNode(key, parent, end, page, None, owner, now)
        parent._add_child(key, node)
        nodes = self.by_page.get(page)
        if nodes is None:
            self.by_page[page] = [node]
        else:
            nodes.append(node)
        self.num_nodes += 1
        return node

    def extend(self, parent: BlockNode, keys: list[bytes], pages: list[int], owner: bytes | None = None,
               now: float = 0.0, out: list[BlockNode] | None = None) -> list[BlockNode]:
        """:meth:`get_or_insert` down a chain: ``keys[i]`` (at ``pages[i]``) under the node of
        ``keys[i - 1]``, the first under ``parent``; the same as calling it once per key.

        Args:
            parent: node the chain hangs under.
            keys: chained unit hashes, parent to child.
            pages: page of each key's unit (``len(pages) >= len(keys)``).
            owner: as :meth:`get_or_insert` (``None``: each new node inherits its parent's).
            now: ``created`` of new nodes, seconds.
            out: list the nodes are appended to (a new one when ``None``).

        Returns:
            ``out`` with the node of each key appended, in order.

        Raises:
            RuntimeError: a new node's page is free; the nodes of the keys before it stay
                inserted (and appended to ``out``).
        """
        if out is None:
            out = []
        n = min(len(keys), len(pages))
        parent, i = self._walk_chain(parent, keys, n, out)
        runs, j = [], i                              # (page, end of its run of keys)
        while j < n:
            page = pages[j]
            j += 1
            while j < n and pages[j] == page:
                j += 1
            runs.append((page, j))
        return self._insert_runs(parent, keys, i, runs, owner, now, out)

    def extend_table(self, parent: BlockNode, keys: list[bytes], table: list[int], first: int,
                     per_page: int, owner: bytes | None = None, now: float = 0.0,
                     out: list[BlockNode] | None = None) -> list[BlockNode]:
        """:meth:`extend` with the pages given as a request's block table: ``keys[i]`` is unit
        ``first + i`` of the prompt, on page ``table[(first + i) // per_page]`` (``per_page``:
        units a page, ``block_size // prefix_match_unit``); no page list a unit is made.

        Raises:
            ValueError: ``table`` holds fewer than ``first + len(keys)`` units (nothing changes).
            RuntimeError: as :meth:`extend`.
        """
        n = len(keys)
        if first < 0 or per_page < 1 or first + n > len(table) * per_page:
            raise ValueError(f"units {first}..{first + n} do not fit a table of {len(table)} pages "
                             f"of {per_page} units")
        if out is None:
            out = []
        parent, i = self._walk_chain(parent, keys, n, out)
        if i >= n:
            return out
        if per_page == 1:                            # a unit a page: every run is one key
            return self._insert_singles(parent, keys, i, table, first, owner, now, out)
        # (page, end of its run of keys) for the pages p0..p1 of keys[i:], built in C: a page's
        # run ends where the next page starts, the last at n
        p0, p1 = (first + i) // per_page, (first + n - 1) // per_page
        ends = list(range((p0 + 1) * per_page - first, n, per_page))
        ends.append(n)
        return self._insert_runs(parent, keys, i, list(zip(table[p0:p1 + 1], ends)), owner, now, out)

    @staticmethod
    def _walk_chain(parent: BlockNode, keys: list[bytes], n: int, out: list[BlockNode]) -> tuple[BlockNode, int]:
        """Walk ``keys[:n]`` down from ``parent`` to the first miss, appending the nodes found to
        ``out``; returns ``(deepest node found or parent, number found)``."""
        append, i = out.append, 0
        while i < n:            # the only child compared first (nearly every node has one)
            key = keys[i]
            if parent.one_key == key:
                node = parent.one
            else:
                many = parent.many
                if many is None:
                    break
                node = many.get(key)
                if node is None:
                    break
            append(node)
            parent = node
            i += 1
        return parent, i

    def _insert_runs(self, parent: BlockNode, keys: list[bytes], i: int, runs: list[tuple[int, int]],
                     owner: bytes | None, now: float, out: list[BlockNode]) -> list[BlockNode]:
        """Insert ``keys[i:]`` up to the last run's end as new nodes under ``parent`` (the node
        of ``keys[i - 1]``), appending them to ``out``.

        Every key from ``i`` on is new (its parent is new or has no child of that key), so this
        is pure insertion; each run ``(page, j)`` covers the keys from the previous run's end
        (``i`` for the first) to ``j``, all on ``page``, and tells the pool once (the
        simulator's hot loop: about 150 new nodes a request)."""
        if not runs:
            return out
        append = out.append
        own = owner if owner is not None else parent.owner
        add_nodes, by_page, unit = self.pages.add_nodes, self.by_page, self.unit
        end = parent.end
        # nodes are made as BlockNode(key, parent, end, page, None, own, now) would make them,
        # with the slots set here (no __init__ frame a node: 1.45 M nodes on the whole trace)
        cls, make = BlockNode, object.__new__
        first = True
        for page, j in runs:
            add_nodes(page, end + unit, own, j - i, keys[i])   # raises before the tree changes
            start, k = len(out), i
            if first and i < j:                      # the first hangs under a node that may have children
                end += unit
                node = cls(keys[i], parent, end, page, None, own, now)
                parent._add_child(keys[i], node)
                append(node)
                parent, k, first = node, i + 1, False
            for key in keys[k:j]:                    # the rest under a new node: its only child
                end += unit
                node = make(cls)
                node.key = key
                node.parent = parent
                node.end = end
                node.page = page
                node.checkpoint = None
                node.owner = own
                node.created = now
                node.one_key = None
                node.one = None
                node.many = None
                parent.one_key = key
                parent.one = node
                append(node)
                parent = node
            nodes = by_page.get(page)
            if nodes is None:
                by_page[page] = out[start:]
            else:
                nodes.extend(out[start:])
            self.num_nodes += j - i
            i = j
        return out

    def _insert_singles(self, parent: BlockNode, keys: list[bytes], i: int, table: list[int], first: int,
                        owner: bytes | None, now: float, out: list[BlockNode]) -> list[BlockNode]:
        """:meth:`_insert_runs` of ``keys[i:]`` when each key has a page of its own (``keys[m]`` on
        ``table[first + m]``): the same nodes, pool calls and ``by_page`` lists, in the same order,
        without the runs made."""
        append = out.append
        own = owner if owner is not None else parent.owner
        add_nodes, by_page, unit = self.pages.add_nodes, self.by_page, self.unit
        get = by_page.get
        end = parent.end
        cls, make = BlockNode, object.__new__
        n = len(keys)
        pages = table[first + i:first + n]
        key, page = keys[i], pages[0]
        add_nodes(page, end + unit, own, 1, key)     # raises before the tree changes
        end += unit                                  # the first hangs under a node that may have children
        node = cls(key, parent, end, page, None, own, now)
        parent._add_child(key, node)
        append(node)
        nodes = get(page)
        if nodes is None:
            by_page[page] = [node]
        else:
            nodes.append(node)
        self.num_nodes += 1
        parent = node
        for key, page in zip(keys[i + 1:], pages[1:]):   # the rest under a new node: its only child
            add_nodes(page, end + unit, own, 1, key)
            end += unit
            node = make(cls)
            node.key = key
            node.parent = parent
            node.end = end
            node.page = page
            node.checkpoint = None
            node.owner = own
            node.created = now
            node.one_key = None
            node.one = None
            node.many = None
            parent.one_key = key
            parent.one = node
            append(node)
            nodes = get(page)
            if nodes is None:
                by_page[page] = [node]
            else:
                nodes.append(node)
            self.num_nodes += 1
            parent = node
        return out

    def attach_checkpoint(self, node: BlockNode, slot: int) -> None:
        """Publish ``slot`` (already written) as ``C(P_node.end)``."""
        if node.checkpoint is not None:
            raise RuntimeError(f"node at {node.end} already has a checkpoint")
        node.checkpoint = slot
        self.slot_node[slot] = node
        self.checkpoints.publish(slot, node.end, node.owner, node.key)

    def detach_checkpoint(self, node: BlockNode) -> None:
        """Remove the node's checkpoint (eviction); the KV part stays."""
        slot = node.checkpoint
        if slot is not None:
            node.checkpoint = None
            del self.slot_node[slot]
            self.checkpoints.unpublish(slot)

    def remove_subtree(self, node: BlockNode) -> int:
        """Remove ``node`` and all its descendants; returns the number removed."""
        if node.parent is None:
            raise RuntimeError("the root cannot be removed")
        node.parent._remove_child(node.key)
        stack, removed = [node], 0
        by_page, remove_node = self.by_page, self.pages.remove_node
        while stack:                                 # the simulator's eviction loop: calls inlined
            n = stack.pop()
            one = n.one                              # n._drop_children()
            if one is not None:
                stack.append(one)
                n.one_key = n.one = None
            else:
                many, n.many = n.many, None
                if many:
                    stack.extend(many.values())
            if n.checkpoint is not None:
                self.detach_checkpoint(n)
            page = n.page
            nodes = by_page[page]
            nodes.remove(n)                          # by identity (nodes compare by identity)
            if not nodes:
                del by_page[page]
            remove_node(page)
            n.parent = None
            removed += 1
        self.num_nodes -= removed
        return removed

    def subtree_nodes(self, page: int) -> list[BlockNode]:
        """Every node that :meth:`evict_page` would remove, shallowest first."""
        nodes = self.by_page.get(page, ())
        if len(nodes) == 1:                          # most pages evicted: one node (a unit a page), a leaf
            n = nodes[0]
            if n.one is None and not n.many:
                return [n]
        out, seen = [], set()
        stack = sorted(nodes, key=_END, reverse=True)    # deepest first, stable
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            out.append(n)
            if n.one is not None:                    # n.children.values(), without the dict made
                stack.append(n.one)
            elif n.many:
                stack.extend(n.many.values())
        return out

    def evict_page(self, page: int) -> int:
        """Remove every node pointing at ``page`` (with subtrees); returns nodes removed."""
        by_page = self.by_page
        nodes = by_page.get(page)
        if nodes is not None and len(nodes) == 1:    # most victims (a unit a page): one leaf, as
            n = nodes[0]                             # remove_subtree would take it, without its stack
            parent = n.parent
            if parent is not None and n.one is None and not n.many:
                parent._remove_child(n.key)
                if n.checkpoint is not None:
                    self.detach_checkpoint(n)
                del by_page[page]
                self.pages.remove_node(page)
                n.parent = None
                self.num_nodes -= 1
                return 1
        removed = 0
        for node in list(self.by_page.get(page, ())):
            if node.parent is not None:      # not already removed with an ancestor
                removed += self.remove_subtree(node)
        return removed

    def check_invariants(self) -> None:
        """Rebuild the derived maps from the tree and compare; ``AssertionError`` on mismatch."""
        seen_pages: dict[int, int] = {}
        seen_slots: set[int] = set()
        count = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            for key, c in n.children.items():
                assert c.key == key and c.parent is n, f"broken parent link at {c.end}"
                assert c.end == n.end + self.unit, f"node end {c.end} != parent {n.end} + unit"
                assert c in self.by_page.get(c.page, ()), f"node at {c.end} missing from by_page"
                seen_pages[c.page] = seen_pages.get(c.page, 0) + 1
                if c.checkpoint is not None:
                    assert c.checkpoint not in seen_slots, f"slot {c.checkpoint} attached twice"
                    seen_slots.add(c.checkpoint)
                    assert self.checkpoints.published[c.checkpoint], f"slot {c.checkpoint} not published"
                stack.append(c)
                count += 1
        assert count == self.num_nodes, f"num_nodes {self.num_nodes} != {count}"
        assert {p: len(s) for p, s in self.by_page.items()} == seen_pages, "by_page out of sync"
        for p in range(self.pages.num_pages):
            assert self.pages.node_count[p] == seen_pages.get(p, 0), f"page {p} node_count wrong"
        published = {s for s in range(self.checkpoints.num_slots) if self.checkpoints.published[s]}
        assert published == seen_slots, "published slots differ from attached slots"
        assert set(self.slot_node) == seen_slots, "slot_node out of sync"
        for s, n in self.slot_node.items():
            assert n.checkpoint == s, f"slot_node[{s}] points at a node without it"
