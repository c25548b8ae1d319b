"""Upper bound on prefix reuse: an infinite cache with a checkpoint at every block.

For each request, in order, the oracle reuses the longest run of whole
``block_size``-token blocks (from position 0) that some earlier request also
had, capped at ``T - 1`` tokens rounded down to a multiple of ``block_size``
(logits at the last prompt position must be computed; docs/design/design.md section 2).
Then it inserts all of the request's whole blocks. Nothing is ever evicted.

Two entry points compute the same thing:

- :func:`oracle_scan` / :func:`oracle_reused_tokens` compare real token ids;
- :func:`oracle_from_trace` works on hash ids, never materialising tokens, which
  makes the whole trace (~145M tokens at 512 tokens per block) take about a second.
"""

from __future__ import annotations

import itertools

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridkv.cache.groups import reuse_cap
from hybridkv.replay.trace import TRACE_BLOCK_TOKENS, TraceRequest, scaled_input_length


@dataclass(frozen=True, slots=True)
class OracleResult:
    """Per-request and total reuse of the infinite-cache oracle.

    per_request[i]: tokens of request i's prompt the oracle reuses (a multiple of
        block_size, at most prompt_lengths[i] - 1).
    prompt_lengths[i]: prompt length in tokens of request i.
    """

    block_size: int
    per_request: tuple[int, ...]
    prompt_lengths: tuple[int, ...]

    @property
    def reused_tokens(self) -> int:
        return sum(self.per_request)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)

    @property
    def token_hit_rate(self) -> float | None:
        total = self.prompt_tokens
        return self.reused_tokens / total if total else None


class _PrefixTrie:
    """Block-level trie: node id -> children keyed by the block's content key.

    Invariant: node 0 is the empty prefix; a node at depth d stands for exactly one
    prefix of d whole blocks, and two prefixes share a node iff their block keys
    are equal at every depth. Keys are compared with ``==`` (dict semantics), so
    hash collisions cannot produce a false hit.
    """

    __slots__ = ("_edges",)

    def __init__(self) -> None:
        self._edges: dict[tuple[int, object], int] = {}

    def match_then_insert(self, keys: Sequence[object], max_blocks: int) -> int:
        """Whole blocks of ``keys`` already present (at most ``max_blocks``); then insert all."""
        node, matched = 0, 0
        edges = self._edges
        get = edges.get
        for key in keys:
            child = get((node, key))
            if child is None:
                break
            matched += 1
            node = child
        rest = len(keys) - matched
        if rest:       # every key from the first miss on is new: its node gets the next id
            first = len(edges) + 1
            ids = range(first, first + rest)
            edges.update(zip(zip(itertools.chain((node,), ids), keys[matched:]), ids))
        return min(matched, max_blocks)


class _BlockRunTrie:
    """A :class:`_PrefixTrie` over cache blocks whose key is their trace block's id, kept per trace
    block: ``per`` consecutive cache blocks share one id, so one node stands for the run of them
    in one trace block and remembers the most of them any inserted prompt covered (``cover``).

    Invariant: node 0 is the empty prefix; node ``n`` at depth ``d`` stands for the prefixes
    whose first ``d`` trace ids are its path; the cache-block trie :class:`_PrefixTrie` would
    hold the first ``cover[n]`` cache blocks of trace block ``d - 1`` under that path, and a
    child exists only below a node with ``cover == per`` (a prompt reached past its block).
    So :meth:`match_then_insert` answers what :class:`_PrefixTrie` would for the keys
    ``[ids[j // per] for j in range(n_blocks)]``, with one dict lookup per trace block.
    """

    __slots__ = ("_edges", "_cover")

    def __init__(self) -> None:
        self._edges: dict[tuple[int, object], int] = {}
        self._cover: list[int] = [0]

    def match_then_insert(self, ids: Sequence[object], n_blocks: int, per: int, max_blocks: int) -> int:
        """Whole cache blocks of the prompt already present (at most ``max_blocks``); then insert
        all ``n_blocks`` (cache block ``j`` keyed by ``ids[j // per]``)."""
        edges, cover = self._edges, self._cover
        get = edges.get
        node, matched, b = 0, 0, 0
        n_trace = -(-n_blocks // per)                 # trace blocks the prompt's cache blocks touch
        walking = True
        while b < n_trace:
            mine = n_blocks - b * per                 # cache blocks of trace block b (at most per)
            if mine > per:
                mine = per
            child = get((node, ids[b])) if walking else None
            if child is None:                         # new from here on
                walking = False
                child = len(cover)
                edges[(node, ids[b])] = child
                cover.append(mine)
            else:
                have = cover[child]
                matched += have if have < mine else mine
                if have < mine:                       # nothing lies deeper (no prompt got past it)
                    cover[child] = mine
                    walking = False
                elif have < per:                      # the walk ends inside this trace block
                    walking = False
            node = child
            b += 1
        return min(matched, max_blocks)


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def _cap_blocks(length: int, block_size: int) -> int:
    return reuse_cap(length, block_size) // block_size


def oracle_scan(token_lists_in_order: Iterable[Sequence[int]], block_size: int) -> OracleResult:
    """Token-level oracle over prompts given as token-id sequences, in arrival order."""
    _check_block_size(block_size)
    trie = _PrefixTrie()
    per_request: list[int] = []
    lengths: list[int] = []
    for tokens in token_lists_in_order:
        n_whole = len(tokens) // block_size
        keys = [tuple(tokens[j * block_size : (j + 1) * block_size]) for j in range(n_whole)]
        blocks = trie.match_then_insert(keys, _cap_blocks(len(tokens), block_size))
        per_request.append(blocks * block_size)
        lengths.append(len(tokens))
    return OracleResult(block_size, tuple(per_request), tuple(lengths))


def oracle_reused_tokens(token_lists_in_order: Iterable[Sequence[int]], block_size: int) -> int:
    """Total tokens the infinite-cache oracle reuses; see :func:`oracle_scan` for per request."""
    return oracle_scan(token_lists_in_order, block_size).reused_tokens


def oracle_from_trace(
    requests: Iterable[TraceRequest],
    block_tokens: int,
    block_size: int,
    *,
    trace_block_tokens: int = TRACE_BLOCK_TOKENS,
) -> OracleResult:
    """The oracle on trace requests scaled to ``block_tokens`` per hash id, from hash ids alone.

    Works for any ``block_size`` (a multiple of ``block_tokens`` or not): cache block
    ``j`` covers tokens ``[j*block_size, (j+1)*block_size)``; its content is fixed by
    the hash ids of the trace blocks it overlaps and by ``j`` (a trie depth), so the
    tuple of those ids is its key. A scaled, partial last trace block holds the first
    tokens of its id's block, so that key stays exact for it too.

    Equal to ``oracle_scan(request_token_ids(...))`` except when two different id
    tuples under the same prefix happen to synthesise identical tokens for one cache
    block; negligible unless blocks are only a few tokens long and the vocabulary
    is small.
    """
    _check_block_size(block_size)
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    trie, runs = _PrefixTrie(), _BlockRunTrie()    # the one that fits the block sizes is used
    per_request: list[int] = []
    lengths: list[int] = []
    aligned = block_size % block_tokens == 0
    step = block_size // block_tokens
    for req in requests:
        length = scaled_input_length(req, block_tokens, trace_block_tokens=trace_block_tokens)
        n_whole = length // block_size
        ids = req.hash_ids
        if aligned and step == 1:
            keys: Sequence[object] = ids[:n_whole]
        elif aligned:
            keys = [ids[j * step : (j + 1) * step] for j in range(n_whole)]
        elif block_tokens % block_size == 0:      # each cache block inside one trace block: its id is the key
            per = block_tokens // block_size
            blocks = runs.match_then_insert(ids, n_whole, per, _cap_blocks(length, block_size))
            per_request.append(blocks * block_size)
            lengths.append(length)
            continue
        else:
            keys = [
                ids[(j * block_size) // block_tokens : ((j + 1) * block_size - 1) // block_tokens + 1]
                for j in range(n_whole)
            ]
        blocks = trie.match_then_insert(keys, _cap_blocks(length, block_size))
        per_request.append(blocks * block_size)
        lengths.append(length)
    return OracleResult(block_size, tuple(per_request), tuple(lengths))
