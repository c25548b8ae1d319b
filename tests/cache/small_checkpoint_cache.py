"""A small coordinator for the checkpoint-pool order tests: 64-token blocks and units, 400 KV
pages, 4 checkpoint slots of 1,000 bytes, one namespace."""
from __future__ import annotations

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.coordinator import HybridCacheCoordinator
from hybridkv.cache.pools import CheckpointPool

NS = b"n" * 32
UNIT = BLOCK = 64
SLOTS = 4


def small_cache(policy: str = "tail+interval=64", **fields) -> HybridCacheCoordinator:
    """A coordinator with :data:`SLOTS` checkpoint slots, ``policy`` and the other
    :class:`CacheConfig` ``fields`` given (e.g. ``checkpoint_eviction="utility"``)."""
    cfg = CacheConfig(block_size=BLOCK, prefix_match_unit=UNIT, num_kv_pages=400, num_checkpoint_slots=SLOTS,
                      policy=CheckpointPolicy.parse(policy), **fields)
    return HybridCacheCoordinator(cfg, NS, CheckpointPool(SLOTS, slot_bytes=1000), page_bytes=4096)


def serve_once(cache: HybridCacheCoordinator, prompt, labels: dict):
    """Look ``prompt`` (token ids) up, acquire, publish a checkpoint (no payload) at each boundary
    of ``labels`` (boundary in tokens -> placing label), release, check the invariants.
    Returns ``(hit tokens, allocation)``."""
    match = cache.lookup(prompt)
    alloc = cache.acquire(match, len(prompt) + 8)
    cache.publish(alloc, match.hashes, len(prompt), {b: (None, lab) for b, lab in labels.items()})
    cache.release(alloc)
    cache.check_invariants()
    return match.hit, alloc
