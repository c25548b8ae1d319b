"""Engines sharing one object store, for the tier scenarios."""

from __future__ import annotations

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import TorchBackend
from hybridkv.engine.engine import Engine
from hybridkv.store.memory import MemoryStore
from hybridkv.tiers.connector import host_tier_for, tier_for


def instance(model, store, *, policy="branch+tail", block_size=1024, unit=64, alignment=1024, pages=32, slots=8,
             max_num_seqs=8, max_num_batched_tokens=8192):
    """A fresh engine (empty device cache) whose only lower tier is ``store``."""
    cfg = CacheConfig(block_size=block_size, prefix_match_unit=unit, max_num_batched_tokens=max_num_batched_tokens,
                      num_kv_pages=pages, num_checkpoint_slots=slots, policy=CheckpointPolicy.parse(policy),
                      store_alignment=alignment, max_num_seqs=max_num_seqs)
    backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    ns = CacheIdentity(model_repo="tiny", weight_digest=model.weight_digest()).digest()
    tier = tier_for(store, backend, ns, unit, cfg.store_boundary)
    return Engine(cfg, backend, ns, tiers=[tier]), tier


def host_instance(model, *, block_size, pages, policy, kind="tensors", write_through=False, store=None):
    """A fresh engine whose only lower tier is a host tier of 64 MiB: a :class:`HostTier`
    (``kind="tensors"``) or a write-back ``StoreTier`` over ``store`` (default a MemoryStore)."""
    cfg = CacheConfig(block_size=block_size, prefix_match_unit=64, num_kv_pages=pages, num_checkpoint_slots=4,
                      policy=CheckpointPolicy.parse(policy))
    backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    ns = CacheIdentity(model_repo="tiny").digest()
    if kind == "tensors":
        host = host_tier_for(64 << 20, backend, ns, 64, block_size, write_through=write_through)
    else:
        store = MemoryStore(capacity_bytes=64 << 20) if store is None else store
        host = tier_for(store, backend, ns, 64, block_size, name="host", write_through=False)
    return Engine(cfg, backend, ns, tiers=[host]), host


class PrefixedStore:
    """Delegates to a shared store under a key prefix of its own (test isolation on one Mooncake master)."""

    def __init__(self, inner, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix
        self.scheme = inner.scheme
        self.lists_keys = getattr(inner, "lists_keys", False)

    def exists(self, keys):
        return self.inner.exists([self.prefix + k for k in keys])

    def put(self, items):
        return self.inner.put([(self.prefix + k, v) for k, v in items])

    def put_owned(self, items, owner):
        return self.inner.put_owned([(self.prefix + k, v) for k, v in items], owner)

    def put_pinned(self, items):
        return self.inner.put_pinned([(self.prefix + k, v) for k, v in items])

    def get(self, keys):
        return self.inner.get([self.prefix + k for k in keys])

    def get_into(self, keys, buffers):
        return self.inner.get_into([self.prefix + k for k in keys], buffers)

    def remove(self, keys):
        return self.inner.remove([self.prefix + k for k in keys])

    def list_keys(self, prefix):
        n = len(self.prefix)
        return [k[n:] for k in self.inner.list_keys(self.prefix + prefix)]

    def remove_prefix(self, prefix, suffix=""):
        return self.inner.remove_prefix(self.prefix + prefix, suffix)

    def register_memory(self, buffer):
        return self.inner.register_memory(buffer)

    def unregister_memory(self, buffer):
        return self.inner.unregister_memory(buffer)

    def close(self):
        pass


def held(tier, hashes, boundaries, group) -> list[bool] | None:
    """Whether ``tier`` holds the ``group`` entry at each boundary of a prompt (one existence query)."""
    return tier.exists([(tier.chain_hash(hashes, b), group) for b in boundaries])


class UnlistedStore(PrefixedStore):
    """A store that cannot list its keys, as Mooncake (purges by age go through expiry horizons)."""

    def __init__(self, inner, prefix: str = "") -> None:
        super().__init__(inner, prefix)
        self.lists_keys = False

    def list_keys(self, prefix):
        raise NotImplementedError("UnlistedStore cannot list its keys")
