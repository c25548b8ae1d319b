"""A simulated timed replay's unit hashes, made when a request is routed rather than all at once.

:meth:`~hybridkv.replay.trace.TraceUnits.hashes_all` hashes every request of a trace before the
run and keeps every list: about 14 KB a request on the bundled trace (190 units of 73 bytes), 14 GB
for a million requests. :class:`UnitHasher` gives the same hashes one request at a time, through a
memo of whole blocks that is emptied when it passes ``max_blocks`` entries (the hashes do not
depend on it: a block missing from the memo is hashed again), and the fleet drops a request's list
when it finishes (:attr:`~hybridkv.fleet.simulator.Fleet.hash_request`).
"""

from __future__ import annotations

from hybridkv.replay.trace import TraceRequest, TraceUnits

DEFAULT_MEMO_BLOCKS = 1 << 18
"""Whole blocks the memo holds before it is emptied (about 0.6 KB each: 150 MB at most; the bundled
trace has 182,790 distinct blocks, so it is never emptied there)."""


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
        self.emptied = 0                     # times the memo passed max_blocks

    def __call__(self, req: TraceRequest) -> list[bytes]:
        units = self.units
        if units.block_tokens % units.unit:
            return units.hashes(req, self.cache)
        heads, tails, n = units.periodic(req)
        memo = self._memo
        if memo is None:
            memo = self._memo = self.cache.periodic_memo(heads)
        elif len(memo.blocks) > self.max_blocks:
            memo.blocks.clear()
            self.emptied += 1
        return self.cache.chain_periodic_units(heads, tails, n, memo=memo)
