"""Invalidation of cached entries by tenant, by salt, or all, across every tier.

The work is :func:`hybridkv.tiers.purge.purge` (the one implementation a CLI and a server
share): device entries are detached (never torn under a running request), the host tier and
the store drop every selected entry, manifest first, including entries an earlier server
process wrote to a persistent store. What this module adds is the server's side: the
:class:`NamespaceLedger` that maps a tenant and a salt to the request namespace digests they
produced (the owners the purge selects by). ``all`` selects every entry of this server's model
namespace. The ledger keeps digests and names only, never token ids. ``abi_version`` (an older
cache ABI, 1 to 4) removes that ABI's store objects, which no reader of the current ABI reaches:
for v3 and v4 those of this server's model (``hkv3/<model>/``, ``hkv4/<model>/``), for v1 and v2 every one (their keys
carry no model); the device and host tiers hold only current entries and lose nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.cache.purge import PurgeSelector
from hybridkv.engine.build import EngineHandle
from hybridkv.serve.protocol import APIError
from hybridkv.tiers.purge import purge as purge_tiers


@dataclass(slots=True)
class PurgeCounts:
    """What one invalidation removed.

    Attributes:
        namespaces: request namespace digests matched (0 for ``all``: it selects by model).
        device_nodes: device index nodes removed (one per ``prefix_match_unit`` tokens of KV).
        tier_entries: tier name -> entries removed (``host``, ``store``; ``-1``: unreachable).
        tier_bytes: tier name -> payload bytes removed (``None``: not known: a store purged by key
            prefix removes without reading, or unreachable).
        earlier_adapters_unreached: ``True`` when this server's store outlives its process and the
            scope is a tenant's that names no ``adapter_version``: the store may still hold that
            tenant's entries an earlier server process wrote under an adapter (naming no adapter)
            or an adapter version (naming one) this process has not served, which no digest this
            process knows selects; name ``adapter`` and ``adapter_version`` to reach them.
    """

    namespaces: int = 0
    device_nodes: int = 0
    tier_entries: dict[str, int] = field(default_factory=dict)
    tier_bytes: dict[str, int | None] = field(default_factory=dict)
    earlier_adapters_unreached: bool = False


class NamespaceLedger:
    """Request namespace digest -> the ``(tenant, salt, adapter, adapter_version)`` it was made
    from (``""``: none; a 2-tuple ``(tenant, salt)`` is read as one of no adapter).

    Owned by the engine thread (not thread-safe).
    """

    def __init__(self) -> None:
        self.owners: dict[bytes, tuple[str, ...]] = {}

    def record(self, namespace: bytes, owner: tuple[str, ...]) -> None:
        """Remember that requests ran under ``namespace`` for ``owner``."""
        self.owners[namespace] = owner

    def matching(self, tenant: str | None, salt: str | None, adapter: str | None = None,
                 adapter_version: str | None = None) -> set[bytes]:
        """Namespaces whose tenant, salt, adapter and adapter version equal the given ones
        (``None`` matches any)."""
        want = (tenant, salt, adapter, adapter_version)
        return {ns for ns, owner in self.owners.items()
                if all(w is None or w == have for w, have in zip(want, (*owner, "", "")[:4]))}


def purge(handle: EngineHandle, ledger: NamespaceLedger, tenant: str | None, salt: str | None,
          everything: bool, abi_version: int | None = None, known: frozenset[bytes] = frozenset(),
          adapter: str | None = None, adapter_version: str | None = None) -> PurgeCounts:
    """Remove the entries of the matching request namespaces (or, with ``everything``, of this
    server's model) from the device, the host tier and the store; with ``abi_version`` instead,
    the store objects of that older cache ABI (see the module docstring). Runs on the engine
    thread; safe while requests run.

    ``known``: namespaces of the scope computed from its names (the tenant's with the given salt,
    ``""`` when none, and the given adapter and version, none when not given), selected too: a
    restarted server's ledger has not seen them, yet an earlier process stored their entries in a
    persistent store. A tenant's other salts and adapters are reached only through the ledger
    (this process's own): a digest cannot be searched for by salt or adapter, which is why a
    ``cache_salt`` or ``adapter`` without a tenant is refused before it gets here
    (:func:`~hybridkv.serve.auth.invalidate_scope`), and why a scope may name an ``adapter``
    (and ``adapter_version``): the ledger's namespaces of that adapter (any version when none is
    named) and the named one are selected.

    A store that outlives the process (any but ``memory://``) may hold entries of adapter
    namespaces an earlier process wrote; a tenant's scope naming no ``adapter_version`` cannot
    reach those, which the answer says (``PurgeCounts.earlier_adapters_unreached``). Naming an
    ``adapter`` of which this process has served no version (under the scope's salt, if any)
    with such a store is refused: only the version ``""`` could be selected, and a 200 would
    hide that the versions stored before this process started were left.

    Raises:
        ValueError: ``abi_version`` is not an older cache ABI version (:class:`PurgeSelector`).
        APIError: 400 (param ``adapter_version``, code ``adapter_version_needed``) for an
            ``adapter`` without ``adapter_version`` of which this process has served no version,
            with a store that outlives the process.
    """
    lasting = handle.store_tier is not None and getattr(handle.store_tier.store, "scheme", "") != "memory"
    if abi_version is None and not everything and tenant is not None and lasting and adapter is not None \
            and adapter_version is None and not ledger.matching(tenant, salt, adapter, None):
        raise APIError(400, f"adapter={adapter!r}: this server process has served no version of it, so the "
                            "versions an earlier process stored cannot be found by name alone; give "
                            "adapter_version (one purge per version)", "adapter_version", "adapter_version_needed")
    if abi_version is not None:
        selector = PurgeSelector(abi_version=abi_version,
                                 models=frozenset({handle.namespace}) if abi_version >= 3 else None)
        counts = PurgeCounts()
        if handle.store_tier is not None:
            handle.store_tier.submit(lambda: None).result()     # queued store writes land first
        done = purge_tiers(handle.engine.cache, [t for t in (handle.host_tier, handle.store_tier) if t is not None],
                           selector)
        counts.device_nodes, counts.tier_entries = done.device_nodes, dict(done.tier_entries)
        counts.tier_bytes = dict(done.tier_bytes)
        return counts                          # current entries are untouched: the ledger stays
    namespaces = set() if everything else ledger.matching(tenant, salt, adapter, adapter_version) | set(known)
    counts = PurgeCounts(namespaces=len(namespaces),
                         earlier_adapters_unreached=lasting and tenant is not None and not everything
                         and adapter_version is None)
    if not everything and not namespaces:          # nothing selected: every configured tier removed 0
        names = [t.name for t in (handle.host_tier, handle.store_tier) if t is not None]
        counts.tier_entries, counts.tier_bytes = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
        return counts
    if handle.engine.connector is not None:
        handle.engine.connector.drain(timeout_s=30.0)      # prefetches in flight end first
    if handle.store_tier is not None:
        handle.store_tier.submit(lambda: None).result()     # and queued store writes land
    selector = (PurgeSelector(models=frozenset({handle.namespace})) if everything
                else PurgeSelector(owners=frozenset(namespaces)))
    done = purge_tiers(handle.engine.cache, [t for t in (handle.host_tier, handle.store_tier) if t is not None],
                       selector)
    counts.device_nodes, counts.tier_entries = done.device_nodes, dict(done.tier_entries)
    counts.tier_bytes = dict(done.tier_bytes)
    for ns in set(ledger.owners) if everything else namespaces:       # nothing of them is cached now
        ledger.owners.pop(ns, None)
    return counts
