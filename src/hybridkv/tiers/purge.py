"""Active invalidation across every tier: the one purge a CLI and any server call (DESIGN §5, §8).

:func:`purge` removes what a :class:`~hybridkv.cache.purge.PurgeSelector` selects
from the device (:func:`~hybridkv.cache.purge.purge_device`: detached, never torn
under a running request), then from each lower tier (:meth:`Tier.purge`).
:func:`purge_store` is the store part on its own, for a store no engine has open
(``hybridkv cache purge --store URL``).

Store (cache ABI v5: ``hkv5/<model ns>/<owner>/<chain>/...``, docs/reference/cache-abi.md). A purge by
model version, by owner (tenant, salt) or by both removes key prefixes
(:meth:`~hybridkv.store.base.ObjectStore.remove_prefix`, with a ``*`` model segment for
owners alone): first every manifest under the prefix (the entries end for every reader at
once), then every other key there (components, and orphans a crashed writer left). Every
backend does this, Mooncake (which cannot list keys) with one ``remove_by_regex`` per step.
A purge that involves age (``created_before``) must read manifests: a backend that lists
its keys (disk, memory) is purged of the selected entries, manifests first; on one that
cannot (Mooncake), the purge raises an *expiry horizon* for the selected scope (model,
owner, or all) instead: every reader reads the horizons in its load batch and treats an
entry created before one as an ``expired`` miss that it removes, manifest first
(:class:`~hybridkv.tiers.store_tier.StoreTier`). The bytes of entries nobody reads again
stay until the backend evicts them; :attr:`PurgeCounts.hidden` names such tiers.

A reader that already holds a manifest and reads a component removed meanwhile gets a
counted ``evicted`` miss, never wrong bytes (components are checksummed against the
manifest); a reader that installed an entry before keeps its copy.

Counts only, never keys, hashes or namespaces, are returned or logged.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field

from hybridkv.cache.abi import KEY_PREFIX
from hybridkv.cache.purge import PurgeSelector, purge_device
from hybridkv.store.base import ObjectStore
from hybridkv.tiers.layout import (
    HORIZON_MAX_AHEAD_S,
    HORIZON_SLOTS,
    decode_horizon,
    encode_horizon,
    horizon_key,
    latest_horizon,
    legacy_prefix,
    owner_prefix,
)

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
        tier_bytes: tier name -> payload bytes removed (``None``: not known, e.g. a store purged by
            key prefix, or unreachable).
        unlisted: names of tiers that could not apply the selector at all (only device-named
            entries removed); none of this package's backends since cache ABI v4.
        hidden: names of tiers purged by an expiry horizon (a purge by age of a store that
            cannot list keys): the selected entries are misses for every reader from now on and
            are removed when read; ``tier_entries`` counts only those removed now.
    """

    device_nodes: int = 0
    device_checkpoints: int = 0
    held_pages: int = 0
    tier_entries: dict[str, int] = field(default_factory=dict)
    tier_bytes: dict[str, int | None] = field(default_factory=dict)
    unlisted: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StorePurge:
    """What :func:`purge_store_detail` did: ``removed`` entries (manifests removed), their payload
    bytes ``nbytes`` (components, from the manifests read; ``None``: removed by key prefix without
    reading), and ``hidden_before`` (Unix seconds) when it raised an expiry horizon instead of
    listing (``None``: it did not), in ``horizons`` scopes."""

    removed: int
    nbytes: int | None = 0
    hidden_before: float | None = None
    horizons: int = 0


def purge(cache, tiers, selector: PurgeSelector) -> PurgeCounts:
    """Remove the selected entries from the device (``cache``, a coordinator, or ``None``) and
    from each tier of ``tiers``. Safe while requests run; call it from the engine thread.

    Returns:
        The counts.
    """
    out = PurgeCounts()
    chains: list[tuple[bytes, int, bytes | None]] = []
    if cache is not None:
        dev = purge_device(cache, selector)
        out.device_nodes, out.device_checkpoints, out.held_pages = dev.nodes, dev.checkpoints, dev.held_pages
        chains = dev.chains
    for tier in tiers:
        try:
            done = tier.purge(selector, chains)
        except NotImplementedError:              # a tier that cannot apply the selector
            out.unlisted.append(tier.name)
            done = tier.purge_chains(chains)
        out.tier_entries[tier.name] = done.entries
        out.tier_bytes[tier.name] = done.nbytes
        if done.hidden:
            out.hidden.append(tier.name)
    log.info("purge: %d device nodes, tiers %s, by horizon %s", out.device_nodes, out.tier_entries, out.hidden)
    return out


def purge_store(store: ObjectStore, selector: PurgeSelector) -> int:
    """:func:`purge_store_detail`'s entries removed."""
    return purge_store_detail(store, selector).removed


def purge_store_detail(store: ObjectStore, selector: PurgeSelector) -> StorePurge:
    """Remove every cache entry of ``store`` that ``selector`` selects, manifests first (see the
    module docstring).

    * An older cache ABI (``abi_version``): by key prefix, ``hkv<N>/`` (``hkv3/<model>/`` per
      model given), manifests first, on every backend; no running engine of the current ABI
      reads those objects.
    * No age criterion: by key prefix, one prefix per (model, owner) pair of the selector (``*``
      for a criterion not given), on every backend; orphaned components under it go too.
    * With an age criterion, on a backend that lists keys: the manifests under ``hkv5/`` (or
      ``hkv5/<model>/``) are read and the selected ones removed, then the components each
      lists (only keys inside its own entry). Manifests that do not parse are left alone.
    * With an age criterion, on a backend that cannot list (Mooncake): an expiry horizon is
      raised for each (model, owner) scope of the selector (:func:`raise_horizon`); nothing is
      removed now (``removed`` 0).

    Raises:
        StoreUnavailable: the store cannot be reached.
        ValueError: a horizon would lie in the future (:func:`raise_horizon`).
        RuntimeError: a horizon could not be raised (another purge kept replacing it).
    """
    models = sorted(selector.models) if selector.models is not None else [None]
    owners = sorted(selector.owners) if selector.owners is not None else [None]
    if selector.abi_version is not None or selector.created_before is None:
        removed = 0
        if selector.abi_version is not None:
            prefixes = [legacy_prefix(selector.abi_version, m) for m in models]
        else:
            prefixes = [owner_prefix(m, o) for m in models for o in owners]
        for prefix in prefixes:
            removed += store.remove_prefix(prefix, "/manifest")    # the entries end for every reader
        for prefix in prefixes:
            store.remove_prefix(prefix)                             # then their bytes
        return StorePurge(removed, None)
    prefix = f"{KEY_PREFIX}/"
    if selector.models is not None and len(selector.models) == 1:
        prefix += next(iter(selector.models)).hex() + "/"
        if selector.owners is not None and len(selector.owners) == 1:
            prefix += next(iter(selector.owners)).hex() + "/"
    try:
        listed = store.list_keys(prefix)
    except NotImplementedError:
        for m in models:
            for o in owners:
                raise_horizon(store, m, o, selector.created_before)
        return StorePurge(0, 0, selector.created_before, len(models) * len(owners))
    manifests = [k for k in listed if k.endswith("/manifest")]
    doomed: list[str] = []
    components: list[str] = []
    freed = 0
    for i in range(0, len(manifests), _BATCH):
        keys = manifests[i:i + _BATCH]
        for key, blob in zip(keys, store.get(keys)):
            picked = _selected(key, blob, selector)
            if picked is not None:
                doomed.append(key)
                components.extend(picked[0])
                freed += picked[1]
    for i in range(0, len(doomed), _BATCH):
        store.remove(doomed[i:i + _BATCH])
    for i in range(0, len(components), _BATCH):
        store.remove(components[i:i + _BATCH])
    return StorePurge(len(doomed), freed)


def read_horizon(store: ObjectStore, model: bytes | None, owner: bytes | None) -> float | None:
    """The expiry horizon of one scope (the later of its two slots; ``None``: none). A slot that
    holds no horizon, or one implausibly far ahead of this clock, is ignored
    (:func:`~hybridkv.tiers.layout.decode_horizon`), as readers ignore it."""
    return latest_horizon(store.get([horizon_key(model, owner, s) for s in HORIZON_SLOTS]), time.time())


def raise_horizon(store: ObjectStore, model: bytes | None, owner: bytes | None, created_before: float,
                  attempts: int = 4) -> float:
    """Make the expiry horizon of the (``model``, ``owner``) scope at least ``created_before``
    (Unix seconds; ``None`` = every model / owner). Never lowers it.

    Objects are immutable (a put never overwrites), so a horizon lives in two slots and readers
    take the later one: the new value goes into an empty slot, or replaces the earlier of two
    (remove, then put), while the other slot keeps a value at least as late as the old horizon,
    so no reader ever sees the horizon go back. Slots are written with
    :meth:`~hybridkv.store.base.ObjectStore.put_pinned` (Mooncake: hard-pinned, never evicted). The result is read back; a concurrent purge
    that replaced it with an earlier value is answered by trying again.

    Returns:
        The horizon now (seconds).

    Raises:
        ValueError: ``created_before`` is not finite, or later than now plus
            :data:`~hybridkv.tiers.layout.HORIZON_MAX_AHEAD_S` (a stamp in ms?): such a horizon
            would expire every entry of the scope, later ones included, for good.
        StoreUnavailable: the store cannot be reached.
        RuntimeError: still below ``created_before`` after ``attempts`` tries (the store refused
            the put, or purges keep racing).
    """
    now = time.time()
    if not math.isfinite(created_before) or created_before > now + HORIZON_MAX_AHEAD_S:
        raise ValueError(f"expiry horizon created_before={created_before!r} s is not finite or is in the future "
                         f"(now {now:.3f} s): it would expire every later entry too")
    keys = [horizon_key(model, owner, s) for s in HORIZON_SLOTS]
    blob = encode_horizon(created_before)
    target = decode_horizon(blob)
    for _ in range(attempts):
        cur = [decode_horizon(b, now) if b is not None else None for b in store.get(keys)]
        present = [t for t in cur if t is not None]
        if present and max(present) >= target:
            return max(present)
        i = cur.index(None) if None in cur else min(range(len(cur)), key=lambda j: cur[j])
        store.remove([keys[i]])                   # absent or the earlier: the other slot still holds the horizon
        store.put_pinned([(keys[i], blob)])       # never evicted by the store itself (Mooncake: hard pin)
    now = read_horizon(store, model, owner)
    if now is None or now < target:
        raise RuntimeError(f"the expiry horizon could not be raised to {target:.3f} s in {attempts} tries")
    return now


def _selected(key: str, blob: bytes | None, selector: PurgeSelector) -> tuple[list[str], int] | None:
    """The component keys of the entry whose manifest is ``blob``, and their bytes as the manifest
    lists them, if ``selector`` selects it (model and owner from the key: ``hkv5/<model>/<owner>/...``)."""
    if blob is None:
        return None
    parts = key.split("/")
    try:
        model = bytes.fromhex(parts[-6])
        owner = bytes.fromhex(parts[-5])
        m = json.loads(blob)
        created = float(m["created"]) if "created" in m else None
        comps = [c["key"] for c in m["components"]]
        size = sum(int(c["nbytes"]) for c in m["components"])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError):
        return None
    if not selector.matches(model, owner, created):
        return None
    own = key[: -len("manifest")]
    return [c for c in comps if isinstance(c, str) and c.startswith(own)], size
