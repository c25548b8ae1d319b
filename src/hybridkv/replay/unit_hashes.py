"""A simulated timed replay's unit hashes, made when a request is routed rather than all at once.

:meth:`~hybridkv.replay.trace.TraceUnits.hashes_all` hashes every request of a trace before the
run and keeps every list: about 14 KB a request on the bundled trace (190 units of 73 bytes), 14 GB
for a million requests. :class:`UnitHasher` gives the same hashes one request at a time, through a
memo of whole blocks in two generations: when the current one passes ``max_blocks`` entries it
becomes the previous one (the one before is dropped), and a request's blocks found only in the
previous generation are carried into the current one before it is chained, so a prefix in use
stays while blocks not asked for since two generations are forgotten (the hashes do not depend on
the memo: a block missing from it is hashed again). The fleet drops a request's list when it
finishes (:attr:`~hybridkv.fleet.simulator.Fleet.hash_request`).
"""

from __future__ import annotations

from hybridkv.replay.trace import TraceRequest, TraceUnits

DEFAULT_MEMO_BLOCKS = 1 << 17
"""Whole blocks a memo generation holds before it becomes the previous one (about 0.6 KB each: two
generations, 150 MB at most; the bundled trace has 182,790 distinct blocks, so its memo turns over
once)."""

_ROOT = b"hybridkv.root"
"""The hash before a prompt's first unit (:func:`~hybridkv.cache.namespace.chain_payloads`'s)."""


class UnitHasher:
    """``hasher(req)``: :meth:`TraceUnits.hashes <hybridkv.replay.trace.TraceUnits.hashes>` of one
    trace request under ``cache``'s namespace, the same hashes as ``hashes_all`` gives it.

    Args:
        units: the replay's unit description.
        cache: the coordinator whose namespace binds the hashes (every instance binds the same).
        max_blocks: memo entries before it is emptied (at least 1).

    Raises:
        ValueError: ``max_blocks`` below 1; a request's units as :meth:`TraceUnits.hashes` raises.
    """

    def __init__(self, units: TraceUnits, cache, max_blocks: int = DEFAULT_MEMO_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks={max_blocks!r} must be at least 1")
        self.units, self.cache, self.max_blocks = units, cache, max_blocks
        self._memo = None
        self._previous: dict = {}            # the memo's previous generation
        self.emptied = 0                     # times the memo passed max_blocks (a new generation)
        self.carried = 0                     # blocks carried from the previous generation

    def __call__(self, req: TraceRequest) -> list[bytes]:
        units = self.units
        if units.block_tokens % units.unit:
            return units.hashes(req, self.cache)
        heads, tails, n = units.periodic(req)
        memo = self._memo
        if memo is None:
            memo = self._memo = self.cache.periodic_memo(heads)
        elif len(memo.blocks) > self.max_blocks:
            self._previous, memo.blocks = memo.blocks, {}
            self.emptied += 1
        previous = self._previous
        if previous:                         # this prompt's whole blocks, in chain order, into the current one
            blocks, prev = memo.blocks, _ROOT
            for tail in tails[:n // len(heads)]:
                key = (prev, tail)
                done = blocks.get(key)
                if done is None:
                    done = previous.get(key)
                    if done is None:
                        break
                    blocks[key] = done
                    self.carried += 1
                prev = done[-1]
        return self.cache.chain_periodic_units(heads, tails, n, memo=memo)
