"""Active invalidation of device entries (DESIGN §8): what to purge, and the device part of a purge.

A :class:`PurgeSelector` names entries by who cached them and when; every tier
applies the same selector (the whole purge across tiers is
:func:`hybridkv.tiers.purge.purge`). Entries are selected by

* ``owners``: request namespace digests (``Request.namespace``: a tenant's, a
  salt's ``CacheIdentity(...).digest()``; the engine's own namespace for requests
  that gave none);
* ``models``: model namespaces (``CacheIdentity(model_repo, weight_digest).digest()``,
  the namespace an engine and its tiers are built with): every entry of an old
  weight digest after an upgrade;
* ``created_before``: seconds on the clock the entry was stamped with (the
  coordinator's clock on the device, wall time in lower tiers): a TTL purge;
* ``abi_version``: an older cache ABI (1 to 4): every store object under its key prefix
  (``hkv3/``, or ``hkv3/<model>/`` with ``models``; docs/reference/cache-abi.md). No reader of the
  current ABI reaches those objects, so nothing else removes them; the device and the host
  tier hold only current entries, so such a purge selects nothing there. It combines only
  with ``models`` (v3 and v4 keys carry the model namespace; owners and ages are not read).

Criteria combine with AND; at least one must be given.

Device semantics. A selected node is removed with its whole subtree (deeper
units cannot be reached without it). Nothing a running request reads is torn:
a removed node's page stays allocated while a request's block table holds it
and is freed on release; a checkpoint slot being copied is freed when the copy
ends (the pools' refcounts). The request keeps computing on its own pages and
working state, so its output is unchanged. Nothing is written back to lower
tiers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.cache.abi import ABI_VERSION
from hybridkv.cache.index import BlockNode



@dataclass(frozen=True, slots=True)
class PurgeSelector:
    """Which entries a purge removes (criteria AND-ed; see the module docstring).

    Attributes:
        owners: request namespace digests, or ``None`` (any owner).
        models: model namespace digests, or ``None`` (any model).
        created_before: seconds; entries stamped earlier match; ``None``: any age.
        abi_version: an older cache ABI version whose store objects to remove (see the module
            docstring); ``None``: entries of the current ABI.

    Raises:
        ValueError: no criterion given, a digest that is not bytes or is empty, a ``created_before`` that
            is not a finite number (NaN compares false with every stamp, so it would select
            every entry), an ``abi_version`` that is not an integer older than the current ABI,
            or one given with owners or an age (or with models for an ABI before v3, whose keys
            carry no model).
    """

    owners: frozenset[bytes] | None = None
    models: frozenset[bytes] | None = None
    created_before: float | None = None
    abi_version: int | None = None

    def __post_init__(self) -> None:
        if self.owners is None and self.models is None and self.created_before is None and self.abi_version is None:
            raise ValueError("a purge needs owners, models, created_before or abi_version; none was given")
        if self.abi_version is not None:
            v = self.abi_version
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < ABI_VERSION:
                raise ValueError(f"purge abi_version={v!r} must be an older cache ABI version: an integer from 1 "
                                 f"to {ABI_VERSION - 1} (v{ABI_VERSION}, the current one, is purged by owners, "
                                 "models or age)")
            if self.owners is not None or self.created_before is not None:
                raise ValueError(f"purge abi_version={v!r} combines only with models: an older ABI's objects are "
                                 "removed by key prefix (v1 to v3 keys carry no owner), and their age is not read")
            if self.models is not None and v < 3:
                raise ValueError(f"purge abi_version={v!r} cannot be narrowed by models: keys of cache ABI v{v} "
                                 "carry no model namespace (v3 and v4 keys do)")
        cb = self.created_before
        if cb is not None and (isinstance(cb, bool) or not isinstance(cb, (int, float)) or not math.isfinite(cb)):
            raise ValueError(f"purge created_before={cb!r} must be a finite number of seconds")
        for name in ("owners", "models"):
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, (bytes, str)) or not all(isinstance(x, bytes) and x for x in v):
                    raise ValueError(f"purge {name}={v!r} must be a set of namespace digests (non-empty bytes)")
                object.__setattr__(self, name, frozenset(v))

    def matches(self, model: bytes | None, owner: bytes | None, created: float | None) -> bool:
        """Whether an entry of ``model`` cached by ``owner`` at ``created`` (seconds) is selected.
        An unknown owner or time (``None``) never matches a criterion on it. An ``abi_version``
        purge matches no current entry (device and host tiers hold only those)."""
        if self.abi_version is not None:
            return False
        if self.models is not None and model not in self.models:
            return False
        if self.owners is not None and owner not in self.owners:
            return False
        return not (self.created_before is not None and (created is None or created >= self.created_before))


@dataclass(slots=True)
class DevicePurge:
    """What :func:`purge_device` removed.

    Attributes:
        nodes: index nodes removed (one per ``prefix_match_unit`` tokens of KV).
        checkpoints: checkpoints detached with them.
        held_pages: removed pages that running requests still hold (freed on release).
        chains: ``(chained hash, boundary, owner)`` of each removed node (boundary in tokens,
            owner its request namespace or ``None``): lower tiers that cannot enumerate their
            entries remove these.
    """

    nodes: int = 0
    checkpoints: int = 0
    held_pages: int = 0
    chains: list[tuple[bytes, int, bytes | None]] | None = None


def purge_device(cache, selector: PurgeSelector) -> DevicePurge:
    """Remove the selected entries of ``cache`` (a :class:`HybridCacheCoordinator`) and their subtrees.

    Safe while requests run (see the module docstring). Returns the counts.
    """
    out = DevicePurge(chains=[])
    model = cache.namespace
    stack = list(cache.index.root.children.values())
    doomed: list[BlockNode] = []
    while stack:
        n = stack.pop()
        if selector.matches(model, n.owner, n.created):
            doomed.append(n)                   # its subtree goes with it
        else:
            stack.extend(n.children.values())
    held: set[int] = set()
    for top in doomed:
        sub = [top]
        i = 0
        while i < len(sub):
            sub.extend(sub[i].children.values())
            i += 1
        out.checkpoints += sum(n.checkpoint is not None for n in sub)
        out.chains.extend((n.key, n.end, n.owner) for n in sub)
        held.update(n.page for n in sub if cache.pages.refcount[n.page] > 0)
        out.nodes += cache.purge_subtree(top)
    out.held_pages = len(held)
    return out
