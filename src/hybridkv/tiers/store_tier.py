"""One cache tier over an object store: remote lookup, verified loads, committed saves (DESIGN §5).

A :class:`StoreTier` speaks cache ABI v5 (:mod:`hybridkv.tiers.layout`) to an
:class:`~hybridkv.store.base.ObjectStore`. Only boundaries aligned to
``alignment`` (``store_alignment``) become entries. Every failure is a counted
miss with a reason (absent, evicted, checksum, incomplete, unreachable); no
store exception escapes except bugs. While the store is unreachable, calls
fail fast for ``retry_seconds`` before the store is tried again.

Expiry. Every load from a store that cannot list its keys (``ObjectStore.lists_keys``
false: Mooncake) reads, in the same batched ``get_into``, the expiry horizons
that apply to its entries (:func:`~hybridkv.tiers.layout.reader_horizon_keys`: a purge
by age of a store that cannot list its keys raises them, :func:`hybridkv.tiers.purge.purge_store`);
with ``max_age_s`` the tier also keeps a standing horizon of its own (now minus
that age). An entry whose manifest was created before the horizon is an
``expired`` miss and is removed, manifest first, like a broken one. With
``horizon_refresh_s`` > 0 a tier reads an owner's horizons at most that often and
uses the last reading in between (a purge by age then reaches it within that time).

Lost horizons fail closed. A horizon is written hard-pinned (``ObjectStore.put_pinned``:
Mooncake's eviction never removes it), and a tier remembers the latest horizon it has seen
of each scope (one float per scope that ever held one). If a later reading of a scope is
lower or absent (the object was removed or lost anyway), the tier keeps applying the
remembered value, so an entry purged by age is never served again by a reader that saw its
horizon, counts it in :attr:`StoreTier.horizons_restored` and writes the horizon back
(:func:`~hybridkv.tiers.purge.raise_horizon`) for readers that never saw it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hybridkv.cache.groups import KIMI_LINEAR, Family
from hybridkv.cache.groups import nbytes
from hybridkv.store.base import DAMAGED, ObjectStore, StoreUnavailable
from hybridkv.tiers.base import PURGE_UNREACHABLE, Entry, Tier, TierPurge
from hybridkv.tiers.layout import (
    HORIZON_MAX_BYTES,
    MANIFEST_MAX_BYTES,
    EntryError,
    decode_manifest,
    entry_components,
    entry_key,
    entry_manifest,
    latest_horizon,
    manifest_created,
    reader_horizon_keys,
    reader_horizon_scopes,
    verify_component,
)
from hybridkv.tiers.purge import purge_store_detail, raise_horizon

log = logging.getLogger("hybridkv.store")

_ALIGN = 64          # byte alignment of every slot in a load arena


class StoreTier(Tier):
    """Entries of one namespace in one object store (cache ABI v5).

    Thread-safe: every store call and every statistics update runs under one
    lock, so a background prefetch and the engine's own calls can share a tier.
    Component puts run on one worker thread (see :meth:`save_entries`).

    Args:
        store: the backend.
        namespace, unit, alignment, shapes, name, write_through: see :class:`Tier`.
        retry_seconds: fail-fast window after the store was unreachable.
        max_age_s: entries created longer ago than this (seconds, by the manifest's ``created``)
            are ``expired`` misses and are removed when read; ``None``: no standing age limit.
        horizon_refresh_s: seconds a reading of an owner's expiry horizons is reused (0: read in
            every load batch, so a purge by age reaches every later load; a purge by age through
            this tier's own :meth:`purge` drops its readings, so it reaches this tier's next load).

    Raises:
        ValueError: ``max_age_s`` is not a positive finite number, ``horizon_refresh_s`` is
            negative (or the :class:`Tier` errors).
    """

    def __init__(self, store: ObjectStore, namespace: bytes, unit: int, alignment: int, shapes: dict[str, dict],
                 retry_seconds: float = 2.0, name: str = "store", write_through: bool = True,
                 write_back: bool | None = None, max_age_s: float | None = None,
                 horizon_refresh_s: float = 0.0, family: Family = KIMI_LINEAR) -> None:
        super().__init__(namespace, unit, alignment, shapes, name, write_through, write_back, family=family)
        if max_age_s is not None and not (0 < max_age_s < float("inf")):
            raise ValueError(f"max_age_s={max_age_s!r} must be a positive finite number of seconds")
        if not (0 <= horizon_refresh_s < float("inf")):
            raise ValueError(f"horizon_refresh_s={horizon_refresh_s!r} must be a finite number of seconds >= 0")
        self.max_age_s = max_age_s
        self.horizon_refresh_s = horizon_refresh_s
        self._horizons: dict[bytes, tuple[float, float | None]] = {}   # owner -> (monotonic read time, horizon)
        # (model | None, owner | None) -> latest horizon seen (Unix s): never forgotten, so a lost one fails closed
        self._seen_horizons: dict[tuple[bytes | None, bytes | None], float] = {}
        self.horizons_restored = 0   # scope readings found lower than seen before (lost objects), written back
        self.store = store
        self.retry_seconds = retry_seconds
        self._down_until = 0.0
        self._warned = False
        self._submit_lock = threading.Lock()
        self._closed = False
        self._worker: ThreadPoolExecutor | None = None   # component puts and prefetches, one at a time
        self._staging: np.ndarray | None = None          # reusable load arena (staging=True loads)

    def _call(self, fn, *args):
        """Run a store call under the tier lock; ``None`` (and an ``unreachable`` miss) if the store is down."""
        with self._lock:
            if time.monotonic() < self._down_until:
                self.count_miss("unreachable")
                return None
            try:
                return fn(*args)
            except StoreUnavailable as exc:
                self._down_until = time.monotonic() + self.retry_seconds
                self.count_miss("unreachable")
                if not self._warned:
                    log.warning("%s tier unreachable, continuing without it: %s", self.name, exc)
                    self._warned = True
                return None

    def exists(self, wanted: list[tuple[bytes, str]], owner: bytes | None = None) -> list[bool] | None:
        """Whether each ``(chained hash, group)`` entry's manifest (of ``owner``) exists, in one store
        call (none for an empty query). Expiry is not checked here (a load checks it)."""
        if not wanted:
            return []
        return self._call(self.store.exists, [entry_key(self.namespace, h, grp, "manifest", owner=owner)
                                              for h, grp in wanted])

    def submit(self, fn, *args):
        """Run ``fn(*args)`` on this tier's worker thread; a ``concurrent.futures.Future``.

        Never waits for the store: a call in flight on the worker holds the
        tier lock, not the submit lock."""
        with self._submit_lock:
            if self._closed:
                raise RuntimeError(f"{self.name} tier used after close()")
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"hybridkv-{self.name}")
            return self._worker.submit(fn, *args)

    def close(self) -> None:
        """Wait for the worker thread and release the staging arena. Idempotent."""
        with self._submit_lock:
            worker, self._worker, self._closed = self._worker, None, True
        if worker is not None:
            worker.shutdown(wait=True)
        with self._lock:
            if self._staging is not None:
                self.store.unregister_memory(self._staging)
                self._staging = None

    def _arena(self, nbytes: int, staging: bool) -> np.ndarray | None:
        """Memory for one load: fresh, or the staging arena (``None``: the store is unreachable)."""
        if not staging:
            return np.empty(max(nbytes, 1), dtype=np.uint8)
        if self._staging is None or self._staging.nbytes < nbytes:
            if self._staging is not None:
                old, self._staging = self._staging, None
                self._call(lambda: self.store.unregister_memory(old) or True)
            arena = np.zeros(max(nbytes, 1 << 20), dtype=np.uint8)    # zeroed: pages faulted in once
            if self._call(lambda: self.store.register_memory(arena) or True) is None:
                return None
            self._staging = arena                   # kept only once registered
        return self._staging

    def load_many(self, hashes: list[bytes], wanted: list[tuple[int, str]], staging: bool = False,
                  owner: bytes | None = None) -> list[dict | None]:
        """Verified components of several entries in one batched ``get_into``.

        Every manifest and every component this model expects lands in one
        arena: a manifest slot of ``MANIFEST_MAX_BYTES`` and an exact-size slot
        per component (sizes from ``shapes``). Then each manifest is
        decoded and checked, and each component is checked against the
        manifest's size and checksum. The returned tensors view the arena (no
        copy). Reading the manifest in the same batch as its components is
        safe: components are committed before the manifest, and whatever was
        read is checked against the manifest's checksums. The expiry horizons of
        ``owner``'s entries are read in the same batch (see the module docstring).

        Args:
            wanted: ``(boundary, group)`` pairs.
            staging: read into this tier's reusable arena (allocated, faulted
                in and registered with the store once) instead of fresh
                memory. The tensors returned are then valid only until the
                next ``staging=True`` load: install or copy them first.

        Returns:
            Per pair, component name -> tensor, or ``None`` (a counted miss).
        """
        if not wanted:
            return []
        keys, offsets, sizes = [], [], []
        pos = 0
        for b, grp in wanted:
            slots = [("manifest", MANIFEST_MAX_BYTES)] + [
                (n, nbytes(dt, shape)) for n, (dt, shape) in self.shapes[grp].items()]
            for name, size in slots:
                keys.append(self._key(hashes, b, grp, name, owner))
                offsets.append(pos)
                sizes.append(size)
                pos += -(-size // _ALIGN) * _ALIGN
        n_entry_keys = len(keys)
        own = self.namespace if owner is None else owner
        if getattr(self.store, "lists_keys", False):   # horizons are written only where keys cannot be listed
            fresh, cached = True, (0.0, None)
        else:
            cached = self._horizons.get(own)
            fresh = cached is not None and time.monotonic() - cached[0] < self.horizon_refresh_s
        for key in () if fresh else reader_horizon_keys(self.namespace, own):
            keys.append(key)
            offsets.append(pos)
            sizes.append(HORIZON_MAX_BYTES)
            pos += -(-HORIZON_MAX_BYTES // _ALIGN) * _ALIGN
        with self._lock:
            if time.monotonic() < self._down_until:      # fail fast before touching the arena
                self.count_miss("unreachable")
                return [None] * len(wanted)
            arena = self._arena(pos, staging)
            if arena is None:
                return [None] * len(wanted)
            # a component of no bytes (e.g. a state's compressor tail at a boundary where none is
            # open) is listed in its manifest but never stored: some backends refuse empty objects
            asked = [i for i, n in enumerate(sizes) if n > 0]
            views = [memoryview(arena[offsets[i]:offsets[i] + sizes[i]]) for i in asked]
            got = self._call(self.store.get_into, [keys[i] for i in asked], views)
            if got is None:
                return [None] * len(wanted)
            nread = [0] * len(keys)
            for i, n in zip(asked, got):
                nread[i] = n
            if fresh:
                stored = cached[1]
            else:
                stored = self._stored_horizon(own, arena, offsets[n_entry_keys:], nread[n_entry_keys:])
                if self.horizon_refresh_s > 0:
                    if len(self._horizons) >= 4096:
                        self._horizons.clear()
                    self._horizons[own] = (time.monotonic(), stored)
            horizon = self._horizon(stored)
            out, i = [], 0
            for b, grp in wanted:
                n_slots = 1 + len(self.shapes[grp])
                out.append(self._verify(hashes, b, grp, arena, offsets[i:i + n_slots], nread[i:i + n_slots],
                                        owner, horizon))
                i += n_slots
        return out

    def _stored_horizon(self, owner: bytes, arena, offsets, nread) -> float | None:
        """The latest expiry horizon (Unix seconds) among the 8 slots read for ``owner``'s entries
        (:func:`~hybridkv.tiers.layout.reader_horizon_keys` order); ``None``: none (slots that hold no
        horizon, or one implausibly far ahead of this clock, are ignored:
        :func:`~hybridkv.tiers.layout.decode_horizon`). A scope read lower than this tier saw it
        before (its objects lost) counts the remembered value and is written back (see the module
        docstring). Call under the tier lock."""
        now = time.time()
        blobs = [arena[o:o + n].tobytes() if n > 0 else None for o, n in zip(offsets, nread)]
        latest = None
        per = len(blobs) // 4
        for i, scope in enumerate(reader_horizon_scopes(self.namespace, owner)):
            got = latest_horizon(blobs[i * per:(i + 1) * per], now)
            seen = self._seen_horizons.get(scope)
            if seen is not None and (got is None or got < seen):
                got = seen                          # lost: fail closed, and restore it for other readers
                self.horizons_restored += 1
                log.warning("%s tier: an expiry horizon read lower than seen before (lost); applying and "
                            "writing back the one seen", self.name)
                try:
                    self._call(raise_horizon, self.store, scope[0], scope[1], seen)
                except (RuntimeError, ValueError) as exc:   # still applied here; the next reading retries
                    log.warning("%s tier: an expiry horizon could not be written back: %s", self.name, exc)
            elif got is not None:
                self._seen_horizons[scope] = got
            if got is not None:
                latest = got if latest is None else max(latest, got)
        return latest

    def _horizon(self, stored: float | None) -> float | None:
        """The horizon a load applies: the later of ``stored`` and now minus ``max_age_s``."""
        found = [t for t in (stored, None if self.max_age_s is None else time.time() - self.max_age_s)
                 if t is not None]
        return max(found) if found else None

    def _verify(self, hashes, b, grp, arena, offsets, nread, owner=None, horizon=None) -> dict | None:
        """Decode one entry read by :meth:`load_many` (``None`` and a counted miss on failure)."""
        names = self.shapes[grp]
        mo, mn = offsets[0], nread[0]
        if mn == DAMAGED:                           # a manifest the store found cut short or unreadable
            self.count_miss("incomplete")
            self.invalidate(hashes, b, grp, owner)
            return None
        if mn < 0:                                  # absent, or larger than any manifest a reader accepts
            present = self._call(self.store.exists, [self._key(hashes, b, grp, owner=owner)])
            if present is not None:                 # (None: counted unreachable already)
                self.count_miss("incomplete" if present[0] else "absent")
                if present[0]:                      # an oversized manifest nobody can read: drop it
                    self.invalidate(hashes, b, grp, owner)
            return None
        blob = arena[mo:mo + mn].tobytes()
        try:
            comps = decode_manifest(blob, grp, b, names, {n: self._key(hashes, b, grp, n, owner) for n in names})
            if horizon is not None:
                created = manifest_created(blob)
                if created is not None and created < horizon:
                    raise EntryError("expired", "entry created before the expiry horizon")
            order = {n: j for j, n in enumerate(names)}
            parts = {}
            for c in comps:
                j = 1 + order[c.name]
                n = nread[j]
                if n == DAMAGED:                    # cut short (or unreadable) in the store: a size mismatch
                    raise EntryError("checksum", f"component {c.name} is damaged in the store")
                if n < 0:                           # absent, or larger than the manifest says
                    present = self._call(self.store.exists, [c.key])
                    if present is None:
                        return None
                    if present[0]:
                        raise EntryError("checksum", f"component {c.name} is larger than its manifest says")
                    verify_component(c, None)
                parts[c.name] = verify_component(c, arena, offsets[j], n)
        except EntryError as exc:
            # Broken (a lost or corrupt component) or unusable (a manifest that does not decode, or not
            # for this entry): drop it, manifest first, so the next writer commits the entry again.
            # Manifests are written last and only whole, so a bad one under our key is never a
            # write still in progress.
            self.count_miss(exc.reason)
            self.invalidate(hashes, b, grp, owner)
            return None
        self.stats.bytes_loaded += len(blob) + sum(c.nbytes for c in comps)
        return parts

    def save_entries(self, entries: list[Entry], owner: bytes | None = None,
                     speculative: Collection[bytes] = ()) -> list[bool]:
        """Commit several entries with two batched puts: every component, then the manifests
        of the entries whose components all landed.

        The components' put runs on a worker thread while this thread computes
        their checksums and the manifests (the store call releases the GIL, so
        the two overlap); the manifests go out only after it returned.

        Args:
            entries: ``(chain_hash, parent_hash, group, boundary, tensors)`` tuples.
            owner: request namespace digest they were cached under (``None``: this tier's
                namespace): the keys' owner segment; the manifests record it and their
                creation time (Unix seconds) for purges.

        Returns:
            Per entry, whether it is now visible.
        """
        if not entries:
            return []
        with self._lock:
            if time.monotonic() < self._down_until:
                self.count_miss("unreachable")
                return [False] * len(entries)
        put = self.store.put if owner is None else functools.partial(self.store.put_owned, owner=owner)
        owner = self.namespace if owner is None else owner
        parts = [entry_components(self.namespace, h, group, tensors, owner=owner)
                 for h, _, group, _, tensors in entries]
        # components of no bytes are listed in the manifest only (some backends refuse empty objects)
        parts_stored = [[c for c in cs if c[2].nbytes] for cs in parts]
        pending = self.submit(self._call, put, [(key, data) for cs in parts_stored for _, key, data, _ in cs])
        now = time.time()
        manifests = [entry_manifest(self.namespace, h, parent, group, boundary, self.alignment, cs,
                                    owner=owner, created=now)
                     for (h, parent, group, boundary, _), cs in zip(entries, parts)]
        ok = pending.result()
        if ok is None:
            return [False] * len(entries)
        done, i = [], 0
        for cs in parts_stored:
            done.append(all(ok[i:i + len(cs)]))
            i += len(cs)
        ok = self._call(put, [m for m, d in zip(manifests, done) if d]) if any(done) else []
        if ok is None:
            return [False] * len(entries)
        visible, j = [], 0
        with self._lock:
            for cs, m, d in zip(parts, manifests, done):
                v = d and ok[j]
                j += d
                visible.append(v)
                if v:
                    self.stats.bytes_saved += sum(data.nbytes for _, _, data, _ in cs) + len(m[1])
        self._observe("saved", [(e[0], e[2]) for e, v in zip(entries, visible) if v])
        return visible

    def invalidate_chain(self, chain_hash: bytes, group: str, owner: bytes | None = None) -> None:
        """Remove an entry of ``owner``: the manifest first, then its components."""
        self._call(self.store.remove, [entry_key(self.namespace, chain_hash, group, "manifest", owner=owner)])
        names = self.shapes[group]
        self._call(self.store.remove, [entry_key(self.namespace, chain_hash, group, n, owner=owner) for n in names])
        self._observe("removed", [(chain_hash, group)])

    def purge(self, selector, chains: list[tuple[bytes, int, bytes | None]] = ()) -> TierPurge:
        """Remove every entry of this store that ``selector`` selects, entries other engines wrote
        included (:func:`hybridkv.tiers.purge.purge_store`: by key prefix, or by listing manifests;
        a purge by age of a store that cannot list raises an expiry horizon instead, returned as
        ``hidden_before``, and removes at once those of the entries ``chains`` name whose
        manifests are older than the cutoff).

        Returns:
            What was removed and hidden (:data:`~hybridkv.tiers.base.PURGE_UNREACHABLE` when the
            store is unreachable).
        """
        self.purges += 1                            # before any removal: prefetches started earlier are dropped
        got = self._call(purge_store_detail, self.store, selector)
        if got is None:
            return PURGE_UNREACHABLE
        if got.hidden_before is not None:
            with self._lock:
                self._horizons.clear()              # this tier's next loads read the horizon it just raised
                for scope in _scopes(selector):     # and never apply less, even if the object is lost
                    if self._seen_horizons.get(scope, float("-inf")) < got.hidden_before:
                        self._seen_horizons[scope] = got.hidden_before
        n, nbytes_removed = got.removed, got.nbytes
        if got.hidden_before is not None and chains:
            more, more_bytes = self._expire_chains(chains, got.hidden_before)
            n += more
            nbytes_removed = None if nbytes_removed is None else nbytes_removed + more_bytes
        if n or got.hidden_before is not None:
            self._observe("purged", [])
        return TierPurge(n, nbytes_removed, got.hidden_before, got.horizons)

    def _expire_chains(self, chains: list[tuple[bytes, int, bytes | None]],
                       created_before: float) -> tuple[int, int]:
        """Remove now the entries ``chains`` name whose manifests were created before ``created_before``
        (the rest of an age purge by horizon happens as readers meet them). Returns entries removed
        and their payload bytes."""
        removed = removed_bytes = 0
        by_owner: dict[bytes | None, list[tuple[bytes, str]]] = {}
        for h, b, owner in chains:
            if b % self.alignment == 0:
                by_owner.setdefault(owner, []).extend((h, grp) for grp in self.shapes)
        for owner, wanted in by_owner.items():
            blobs = self._call(self.store.get, [entry_key(self.namespace, h, grp, "manifest", owner=owner)
                                                for h, grp in wanted])
            if blobs is None:
                break
            for (h, grp), blob in zip(wanted, blobs):
                created = manifest_created(blob) if blob is not None else None
                if created is not None and created < created_before:
                    self.invalidate_chain(h, grp, owner)
                    removed += 1
                    removed_bytes += self.entry_nbytes(grp)
        return removed, removed_bytes


def _scopes(selector) -> list[tuple[bytes | None, bytes | None]]:
    """The horizon scopes ``(model | None, owner | None)`` a purge by age of ``selector`` raises."""
    models = sorted(selector.models) if selector.models is not None else [None]
    owners = sorted(selector.owners) if selector.owners is not None else [None]
    return [(m, o) for m in models for o in owners]
