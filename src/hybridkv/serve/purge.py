"""Invalidation of cached entries by tenant, by salt, or all, across every tier.

Entries are keyed by namespace-bound chained hashes, so no tier can tell a tenant's entries from
another's by looking at them. The :class:`NamespaceLedger` remembers, per namespace digest, the
``(tenant, salt)`` it was made from and the prompt hash chains admitted under it; a purge walks
those chains: the device index drops the namespace's prefix trees
(:meth:`~hybridkv.cache.coordinator.HybridCacheCoordinator.remove_prefix`), the host tier and the
store drop every entry on the chains (the store removes each manifest before its components).

What a ledger cannot see is not purged from the lower tiers: entries a previous server process
wrote to a persistent store, and chains dropped from a full ledger (``max_chains``, oldest first).
``all`` also clears the whole device index. The ledger keeps digests only, never token ids.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from hybridkv.engine.build import EngineHandle


@dataclass(slots=True)
class PurgeCounts:
    """What one invalidation removed.

    Attributes:
        namespaces: namespace digests matched.
        device_nodes: device index nodes removed (one per ``prefix_match_unit`` tokens of KV).
        tier_entries: tier name -> entries removed (``host``, ``store``).
    """

    namespaces: int = 0
    device_nodes: int = 0
    tier_entries: dict[str, int] = field(default_factory=dict)


class NamespaceLedger:
    """Namespace digest -> ``(tenant, salt)`` and the hash chains admitted under it.

    Owned by the engine thread (not thread-safe).

    Args:
        max_chains: chains remembered in all (oldest dropped first); each is one prompt's
            list of 32-byte unit hashes.
    """

    def __init__(self, max_chains: int = 100_000) -> None:
        self.max_chains = max_chains
        self.owners: dict[bytes, tuple[str, str]] = {}
        self._chains: OrderedDict[tuple[bytes, bytes], list[bytes]] = OrderedDict()   # (ns, last hash) -> chain

    def record(self, namespace: bytes, owner: tuple[str, str], hashes: list[bytes]) -> None:
        """Remember that a prompt with unit hashes ``hashes`` ran under ``namespace`` of ``owner``."""
        self.owners[namespace] = owner
        if not hashes:
            return
        key = (namespace, hashes[-1])
        self._chains[key] = hashes
        self._chains.move_to_end(key)
        while len(self._chains) > self.max_chains:
            self._chains.popitem(last=False)

    def matching(self, tenant: str | None, salt: str | None) -> set[bytes]:
        """Namespaces whose tenant and salt equal the given ones (``None`` matches any)."""
        return {ns for ns, (t, s) in self.owners.items()
                if (tenant is None or t == tenant) and (salt is None or s == salt)}

    def take(self, namespaces: set[bytes]) -> list[list[bytes]]:
        """Remove and return the chains of ``namespaces``."""
        keys = [k for k in self._chains if k[0] in namespaces]
        return [self._chains.pop(k) for k in keys]


def purge(handle: EngineHandle, ledger: NamespaceLedger, tenant: str | None, salt: str | None,
          everything: bool) -> PurgeCounts:
    """Remove the entries of the matching namespaces (or all with ``everything``) from every tier.

    Must run on the engine thread while no request runs (the device purge refuses otherwise).

    Raises:
        RuntimeError: a request still holds cache references.
    """
    namespaces = set(ledger.owners) if everything else ledger.matching(tenant, salt)
    chains = ledger.take(namespaces)
    counts = PurgeCounts(namespaces=len(namespaces))
    cache = handle.engine.cache
    if everything:
        counts.device_nodes = cache.index.num_nodes
        cache.clear()
    else:
        for first in {c[0] for c in chains}:
            counts.device_nodes += cache.remove_prefix(first)
    if handle.engine.connector is not None:
        handle.engine.connector.drain(timeout_s=30.0)      # prefetches in flight end first
    if handle.store_tier is not None:
        handle.store_tier.submit(lambda: None).result()     # and queued store writes land
    for tier in (handle.host_tier, handle.store_tier):
        if tier is not None:
            counts.tier_entries[tier.name] = _purge_tier(tier, chains)
    for ns in namespaces:
        ledger.owners.pop(ns, None)
    return counts


def _purge_tier(tier, chains: list[list[bytes]]) -> int:
    """Remove every entry of ``tier`` on ``chains``; returns entries that were present."""
    seen: set[tuple[bytes, str]] = set()
    removed = 0
    for hashes in chains:
        wanted = [(b, group) for b in range(tier.alignment, len(hashes) * tier.unit + 1, tier.alignment)
                  for group in tier.shapes if (tier.chain_hash(hashes, b), group) not in seen]
        if not wanted:
            continue
        keys = [(tier.chain_hash(hashes, b), group) for b, group in wanted]
        seen.update(keys)
        present = tier.exists(keys) or [False] * len(keys)
        for (b, group), here in zip(wanted, present):
            if here:
                tier.invalidate(hashes, b, group)
                removed += 1
    return removed
