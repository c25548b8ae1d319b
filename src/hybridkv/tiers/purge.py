"""Active invalidation across every tier: the one purge a CLI and any server call (DESIGN §5, §8).

:func:`purge` removes what a :class:`~hybridkv.cache.purge.PurgeSelector` selects
from the device (:func:`~hybridkv.cache.purge.purge_device`: detached, never torn
under a running request), then from each lower tier (:meth:`Tier.purge`).
:func:`purge_store` is the store part on its own, for a store no engine has open
(``hybridkv cache purge --store URL``).

Store. Entries are found by listing the manifests under the cache ABI's key
prefix (:meth:`~hybridkv.store.base.ObjectStore.list_keys`); the model namespace
is in each key, the owner and creation time in the manifest (docs/cache_abi.md).
Every selected manifest is removed first (the entry stops existing for every
reader at once), then its components. A reader that already holds a manifest
and reads a component removed meanwhile gets a counted ``evicted`` miss, never
wrong bytes (components are checksummed against the manifest). A purge of model
versions alone removes whole key prefixes instead, which Mooncake (it cannot list
keys) supports too; for any other selector such a backend is purged of the entries
the device could name (``chains``) only, and :attr:`PurgeCounts.unlisted` says so.

Counts only, never keys, hashes or namespaces, are returned or logged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from hybridkv.cache.purge import PurgeSelector, purge_device
from hybridkv.store.base import ObjectStore
from hybridkv.tiers.layout import KEY_PREFIX

log = logging.getLogger("hybridkv.store")

_BATCH = 256          # manifests read per store call


@dataclass(slots=True)
class PurgeCounts:
    """What one :func:`purge` removed.

    Attributes:
        device_nodes: device index nodes removed (one per ``prefix_match_unit`` tokens).
        device_checkpoints: device checkpoints removed with them.
        held_pages: removed device pages that running requests still hold (freed on release).
        tier_entries: tier name -> entries removed (``-1``: the tier was unreachable).
        unlisted: names of tiers whose backend cannot list keys (only device-named entries removed).
    """

    device_nodes: int = 0
    device_checkpoints: int = 0
    held_pages: int = 0
    tier_entries: dict[str, int] = field(default_factory=dict)
    unlisted: list[str] = field(default_factory=list)


def purge(cache, tiers, selector: PurgeSelector) -> PurgeCounts:
    """Remove the selected entries from the device (``cache``, a coordinator, or ``None``) and
    from each tier of ``tiers``. Safe while requests run; call it from the engine thread.

    Returns:
        The counts.
    """
    out = PurgeCounts()
    chains: list[tuple[bytes, int]] = []
    if cache is not None:
        dev = purge_device(cache, selector)
        out.device_nodes, out.device_checkpoints, out.held_pages = dev.nodes, dev.checkpoints, dev.held_pages
        chains = dev.chains
    for tier in tiers:
        try:
            out.tier_entries[tier.name] = tier.purge(selector, chains)
        except NotImplementedError:              # a store that cannot list its keys
            out.unlisted.append(tier.name)
            out.tier_entries[tier.name] = tier.purge_chains(chains)
    log.info("purge: %d device nodes, tiers %s", out.device_nodes, out.tier_entries)
    return out


def purge_store(store: ObjectStore, selector: PurgeSelector) -> int:
    """Remove every cache entry of ``store`` that ``selector`` selects: manifests first, then the
    components each listed (only keys inside its own entry). Manifests that do not parse are
    left alone (not ours to judge; a reader drops them). Returns entries removed.

    A selector of model versions alone (no owner, no age: an upgrade's purge) needs no manifest
    read, since the model namespace is each key's second part: every manifest under the model's
    key prefix is removed, then every other key there (components, and orphans a crashed writer
    left), through :meth:`~hybridkv.store.base.ObjectStore.remove_prefix`, which a store that
    cannot list its keys (Mooncake) answers too.

    Raises:
        NotImplementedError: the backend cannot list its keys (and the selector needs them).
        StoreUnavailable: the store cannot be reached.
    """
    if selector.models is not None and selector.owners is None and selector.created_before is None:
        removed = 0
        for model in sorted(selector.models):
            prefix = f"{KEY_PREFIX}/{model.hex()}/"
            removed += store.remove_prefix(prefix, "/manifest")    # the entries end for every reader
            store.remove_prefix(prefix)                             # then their bytes
        return removed
    prefix = f"{KEY_PREFIX}/"
    if selector.models is not None and len(selector.models) == 1:
        prefix += next(iter(selector.models)).hex() + "/"
    manifests = [k for k in store.list_keys(prefix) if k.endswith("/manifest")]
    doomed: list[str] = []
    components: list[str] = []
    for i in range(0, len(manifests), _BATCH):
        keys = manifests[i:i + _BATCH]
        for key, blob in zip(keys, store.get(keys)):
            picked = _selected(key, blob, selector)
            if picked is not None:
                doomed.append(key)
                components.extend(picked)
    for i in range(0, len(doomed), _BATCH):
        store.remove(doomed[i:i + _BATCH])
    for i in range(0, len(components), _BATCH):
        store.remove(components[i:i + _BATCH])
    return len(doomed)


def _selected(key: str, blob: bytes | None, selector: PurgeSelector) -> list[str] | None:
    """The component keys of the entry whose manifest is ``blob`` if ``selector`` selects it."""
    if blob is None:
        return None
    parts = key.split("/")
    try:
        model = bytes.fromhex(parts[1])
        m = json.loads(blob)
        owner = bytes.fromhex(m["owner"]) if "owner" in m else None
        created = float(m["created"]) if "created" in m else None
        comps = [c["key"] for c in m["components"]]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError):
        return None
    if not selector.matches(model, owner, created):
        return None
    own = key[: -len("manifest")]
    return [c for c in comps if isinstance(c, str) and c.startswith(own)]
