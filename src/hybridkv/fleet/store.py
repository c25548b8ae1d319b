"""The shared store as the fleet sees it: which entries it holds (a view fed by every
instance's events) and what loading from it costs.

The store holds what instances write through to it: KV in segments of ``alignment``
tokens and checkpoints at those boundaries (the store tier's entry layout,
``CacheConfig.store_boundary``). It is modelled without eviction and it outlives
instance restarts, so removals and epochs do not touch it. Loading ``[start, end)``
costs one object round trip per KV segment plus one for the checkpoint, each with its
manifest (two objects an entry), and the bytes over the store's bandwidth. The
defaults are this project's Mooncake measurements (docs/benchmarks.md, docs/mooncake.md):
1.1 GB/s loads at the Kimi-48B entry sizes through the storage process, 194 µs a
``get_into``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.cache.groups import EntryPresence, JointHit, joint_hit
from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView

MOONCAKE_LOAD_BYTES_PER_S = 1.1e9
"""Measured Mooncake load bandwidth at Kimi-48B entry sizes (docs/benchmarks.md), bytes/s."""
MOONCAKE_GET_LATENCY_S = 194e-6
"""Measured Mooncake ``get_into`` time of a small object (docs/benchmarks.md), seconds."""


@dataclass(frozen=True, slots=True)
class StoreCost:
    """Cost of loading from the shared store.

    Attributes:
        bytes_per_s: load bandwidth, bytes/s.
        latency_s: seconds per object fetched.
        alignment: tokens per KV entry (store entries exist at multiples of it).
        kv_bytes_per_token: KV bytes of one token over all MLA layers.
        checkpoint_bytes: bytes of one KDA checkpoint.
    """

    bytes_per_s: float
    latency_s: float
    alignment: int
    kv_bytes_per_token: int
    checkpoint_bytes: int

    def load_bytes(self, start: int, end: int) -> int:
        """Bytes of the KV of ``[start, end)`` and the checkpoint at ``end``."""
        return (end - start) * self.kv_bytes_per_token + self.checkpoint_bytes

    def transfer_seconds(self, start: int, end: int) -> float:
        """Seconds the bytes of :meth:`load_bytes` take at the bandwidth."""
        return self.load_bytes(start, end) / self.bytes_per_s

    def latency_seconds(self, start: int, end: int) -> float:
        """Per-object seconds: one entry per KV segment plus the checkpoint, each with a manifest."""
        return 2 * ((end - start) // self.alignment + 1) * self.latency_s

    def load_seconds(self, start: int, end: int) -> float:
        """Seconds to load ``[start, end)`` and the checkpoint at ``end``."""
        return self.transfer_seconds(start, end) + self.latency_seconds(start, end)


def load_start(kv_hit: int, store_hit: int, granularity: int) -> int:
    """Where a load from the store begins (tokens): the local KV run rounded down to
    ``granularity`` (whole pages or entries), at most ``store_hit``."""
    return min(kv_hit // granularity * granularity, store_hit)


class StoreView(InstanceView):
    """Entries of the shared store, from every instance's stored events; a hit only at
    ``alignment`` boundaries.

    Args:
        unit: ``prefix_match_unit`` in tokens.
        alignment: tokens per store entry (a multiple of ``unit``).

    Raises:
        ValueError: ``alignment`` not a positive multiple of ``unit``.
    """

    def __init__(self, unit: int, alignment: int) -> None:
        if alignment <= 0 or alignment % unit:
            raise ValueError(f"store alignment {alignment} is not a positive multiple of the unit {unit}")
        super().__init__(unit)
        self.alignment = alignment

    def apply(self, event: CacheEvent) -> None:
        """Add what was stored; removals, clears and epochs do not reach the store."""
        if event.kind is EventKind.BLOCKS_STORED:
            self.kv.update(event.keys)
        elif event.kind is EventKind.CHECKPOINTS_STORED:
            self.checkpoints.update(k for k in event.keys if k in self.kv)

    def match(self, hashes: list[bytes], limit: int) -> JointHit:
        """The joint hit over whole store entries (boundaries at multiples of ``alignment``)."""
        g, a, ck = self.unit, self.alignment, self.checkpoints
        run = self.kv_run(hashes, limit)
        bounds = [EntryPresence(e, True, hashes[e // g - 1] in ck) for e in range(a, run + 1, a)]
        return joint_hit(bounds, limit)
