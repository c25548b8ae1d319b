"""One cache tier over an object store: remote lookup, verified loads, committed saves (DESIGN §5).

A :class:`StoreTier` speaks cache ABI v2 (:mod:`hybridkv.store.layout`) to an
:class:`~hybridkv.store.base.ObjectStore`. Only boundaries aligned to
``alignment`` (``store_alignment``) become entries. Every failure is a counted
miss with a reason (absent, evicted, checksum, incomplete, unreachable); no
store exception escapes except bugs. While the store is unreachable, calls
fail fast for ``retry_seconds`` before the store is tried again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.model.state import KDACheckpoint
from hybridkv.store.base import ObjectStore, StoreUnavailable
from hybridkv.store.layout import (
    ITEMSIZE,
    MANIFEST_MAX_BYTES,
    EntryError,
    decode_manifest,
    entry_components,
    entry_key,
    entry_manifest,
    verify_component,
)

log = logging.getLogger("hybridkv.store")

MISS_REASONS = ("absent", "evicted", "checksum", "incomplete", "unreachable")
_ALIGN = 64          # byte alignment of every slot in a load arena


def _nbytes(dtype: str, shape: tuple) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


@dataclass(slots=True)
class TierStats:
    """Counters of one tier (tokens and bytes)."""

    hit_tokens: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    misses: Counter = field(default_factory=lambda: Counter({r: 0 for r in MISS_REASONS}))

    def as_dict(self) -> dict:
        """``{hit_tokens, bytes_loaded, bytes_saved}`` for the JSON report."""
        return {"hit_tokens": self.hit_tokens, "bytes_loaded": self.bytes_loaded, "bytes_saved": self.bytes_saved}


@dataclass(frozen=True, slots=True)
class RemoteMatch:
    """Per-group result of a remote lookup (tokens).

    Attributes:
        kv_length: contiguous remote KV from 0 (aligned).
        checkpoint_boundaries: aligned boundaries ``<= kv_length`` with a checkpoint manifest.
        best_joint: deepest of those (0 = none).
        missing_branching_boundary: ``kv_length`` when it exceeds ``best_joint``, else ``None``.
    """

    kv_length: int
    checkpoint_boundaries: tuple[int, ...]
    best_joint: int
    missing_branching_boundary: int | None


@dataclass(frozen=True, slots=True)
class EntryShapes:
    """What this model's entries look like: component -> (dtype, shape)."""

    kv: dict
    kda: dict

    @classmethod
    def for_model(cls, num_mla_layers: int, segment: int, latent_dim: int, recurrent_shape: tuple,
                  conv_shape: tuple, conv_dtype: str = "float32") -> EntryShapes:
        """Shapes for a model; ``conv_shape`` is the whole window ``(L_kda, 3*H*K, k-1)``."""
        third = (conv_shape[0], conv_shape[1] // 3, conv_shape[2])
        return cls(kv={"latents": ("float32", (num_mla_layers, segment, latent_dim))},
                   kda={"recurrent": ("float32", tuple(recurrent_shape)), "conv.q": (conv_dtype, third),
                        "conv.k": (conv_dtype, third), "conv.v": (conv_dtype, third)})

    @classmethod
    def for_config(cls, config, segment: int, conv_dtype: str = "float32") -> EntryShapes:
        """Shapes for a :class:`~hybridkv.model.config.HybridConfig` (no weights needed);
        ``conv_dtype`` is the model's compute dtype."""
        rec = config.recurrent_state_shape
        conv = config.conv_state_shape
        return cls.for_model(config.num_mla_layers, segment, config.kv_latent_dim, tuple(rec), tuple(conv),
                             conv_dtype)


def checkpoint_components(ckpt: KDACheckpoint) -> dict[str, torch.Tensor]:
    """The ``kda`` entry components of a checkpoint: recurrent and the q | k | v conv thirds."""
    q, k, v = ckpt.conv.chunk(3, dim=1)
    return {"recurrent": ckpt.recurrent, "conv.q": q, "conv.k": k, "conv.v": v}


def checkpoint_from_components(parts: dict[str, torch.Tensor], boundary: int) -> KDACheckpoint:
    """Inverse of :func:`checkpoint_components`."""
    conv = torch.cat([parts["conv.q"], parts["conv.k"], parts["conv.v"]], dim=1)
    return KDACheckpoint(parts["recurrent"], conv, boundary)


class Tier:
    """What every lower tier shares: keys, alignment, per-group lookup and the entry helpers.

    Subclasses implement :meth:`_exists`, :meth:`load_many`, :meth:`save_entries`
    and :meth:`invalidate`.

    Args:
        namespace: namespace digest.
        unit: ``prefix_match_unit`` (tokens per chained hash).
        alignment: A (tokens) of this tier's entries; a multiple of ``unit``.
        shapes: this model's entry shapes.
        name: tier name in reports (``host`` or ``store``).
        write_through: entries are saved as soon as they are computed.
        write_back: entries are saved when the device evicts them; default
            ``not write_through``. A host tier may do both.

    Raises:
        ValueError: ``alignment`` is not a positive multiple of ``unit``, or
            the tier would never be written (neither write-through nor write-back).
    """

    def __init__(self, namespace: bytes, unit: int, alignment: int, shapes: EntryShapes,
                 name: str = "store", write_through: bool = True, write_back: bool | None = None) -> None:
        if alignment <= 0 or alignment % unit:
            raise ValueError(f"store_alignment={alignment} must be a positive multiple of prefix_match_unit={unit}")
        self.namespace = namespace
        self.unit = unit
        self.alignment = alignment
        self.shapes = shapes
        self.name = name
        self.write_through = write_through
        self.write_back = (not write_through) if write_back is None else write_back
        if not (self.write_through or self.write_back):
            raise ValueError(f"{name} tier: neither write-through nor write-back, so it would never be written")
        self.stats = TierStats()
        self._lock = threading.RLock()            # guards store calls and statistics

    def count_miss(self, reason: str) -> None:
        """Count one miss with ``reason`` (one of :data:`MISS_REASONS`)."""
        with self._lock:
            self.stats.misses[reason] += 1

    def add_hit_tokens(self, tokens: int) -> None:
        """Credit ``tokens`` of hit to this tier."""
        with self._lock:
            self.stats.hit_tokens += tokens

    def _exists(self, keys: list[str]) -> list[bool] | None:
        """Whether each manifest key is present (``None``: unreachable)."""
        raise NotImplementedError

    def load_many(self, hashes: list[bytes], wanted: list[tuple[int, str]]) -> list[dict | None]:
        """Per ``(boundary, group)``: component name -> tensor, or ``None`` (a counted miss)."""
        raise NotImplementedError

    def save_entries(self, entries: list[tuple]) -> list[bool]:
        """Commit ``(chain_hash, parent_hash, group, boundary, tensors)`` entries; per entry, visible now."""
        raise NotImplementedError

    def invalidate(self, hashes: list[bytes], boundary: int, group: str) -> None:
        """Remove one entry (its manifest first)."""
        raise NotImplementedError

    def _hash(self, hashes: list[bytes], boundary: int) -> bytes:
        return hashes[boundary // self.unit - 1]

    def _key(self, hashes, boundary, group, component="manifest"):
        return entry_key(self.namespace, self._hash(hashes, boundary), group, component)

    # -- lookup ------------------------------------------------------------
    def lookup(self, hashes: list[bytes], cap: int, local_kv: int = 0) -> RemoteMatch | None:
        """Per-group result for a prompt whose unit hashes are ``hashes``, reuse capped at ``cap``.

        ``local_kv`` tokens of KV are already on the device; KV contiguity is
        counted from there, so only the missing segments must be in this tier.
        ``None`` when the store is unreachable (counted as an ``unreachable`` miss).
        """
        a = self.alignment
        bounds = list(range(a, min(cap, len(hashes) * self.unit) + 1, a))
        if not bounds:
            return RemoteMatch(0, (), 0, None)
        kv_bounds = [b for b in bounds if b > local_kv // a * a]
        keys = [self._key(hashes, b, "kv") for b in kv_bounds] + [self._key(hashes, b, "kda") for b in bounds]
        found = self._exists(keys)
        if found is None:
            return None
        kv_len = local_kv // a * a
        for b, ok in zip(kv_bounds, found[: len(kv_bounds)]):
            if not ok:
                break
            kv_len = b
        found = found[len(kv_bounds):]
        ckpts = tuple(b for b, ok in zip(bounds, found) if ok and b <= kv_len)
        best = ckpts[-1] if ckpts else 0
        return RemoteMatch(kv_len, ckpts, best, kv_len if kv_len > best else None)

    # -- entry helpers -----------------------------------------------------
    def _load(self, hashes, boundary, group) -> dict[str, torch.Tensor] | None:
        return self.load_many(hashes, [(boundary, group)])[0]

    def load_kv(self, hashes: list[bytes], boundary: int) -> torch.Tensor | None:
        """Verified latents ``float32[L_mla, A, D]`` of tokens ``[boundary - A, boundary)``, or ``None``."""
        got = self._load(hashes, boundary, "kv")
        return None if got is None else got["latents"]

    def load_checkpoint(self, hashes: list[bytes], boundary: int) -> KDACheckpoint | None:
        """Verified ``C(P_boundary)``, or ``None`` (a counted miss)."""
        got = self._load(hashes, boundary, "kda")
        return None if got is None else checkpoint_from_components(got, boundary)

    def _save(self, hashes, boundary, group, tensors) -> bool:
        return self.save_entries([self.entry(hashes, boundary, group, tensors)])[0]

    def save_entry(self, chain_hash: bytes, parent_hash: bytes | None, group: str, boundary: int,
                   tensors: dict[str, torch.Tensor]) -> bool:
        """Commit one entry (nothing visible if it fails)."""
        return self.save_entries([(chain_hash, parent_hash, group, boundary, tensors)])[0]

    def entry(self, hashes: list[bytes], boundary: int, group: str, tensors: dict) -> tuple:
        """An entry tuple for :meth:`save_entries` at an aligned ``boundary`` of a prompt."""
        self._check_aligned(boundary)
        parent = self._hash(hashes, boundary - self.alignment) if boundary > self.alignment else None
        return (self._hash(hashes, boundary), parent, group, boundary, tensors)

    def has_many(self, hashes: list[bytes], wanted: list[tuple[int, str]]) -> list[bool] | None:
        """Whether each ``(boundary, group)`` entry's manifest exists, in one query (``None`` if unreachable)."""
        if not wanted:
            return []
        return self._exists([self._key(hashes, b, grp) for b, grp in wanted])

    def has(self, hashes: list[bytes], boundaries: list[int], group: str) -> list[bool] | None:
        """Whether each boundary's manifest exists (``None`` if unreachable)."""
        if not boundaries:
            return []
        return self._exists([self._key(hashes, b, group) for b in boundaries])

    def save_kv(self, hashes: list[bytes], boundary: int, latents: torch.Tensor) -> bool:
        """Commit the ``kv`` entry at ``boundary`` (latents of the last A tokens)."""
        self._check_aligned(boundary)
        return self._save(hashes, boundary, "kv", {"latents": latents})

    def save_checkpoint(self, hashes: list[bytes], boundary: int, ckpt: KDACheckpoint) -> bool:
        """Commit the ``kda`` entry ``C(P_boundary)``: recurrent and the three conv parts."""
        self._check_aligned(boundary)
        return self._save(hashes, boundary, "kda", checkpoint_components(ckpt))

    def _check_aligned(self, boundary: int) -> None:
        if boundary <= 0 or boundary % self.alignment:
            raise ValueError(f"boundary {boundary} is not a positive multiple of store_alignment={self.alignment}")


class StoreTier(Tier):
    """Entries of one namespace in one object store (cache ABI v2).

    Thread-safe: every store call and every statistics update runs under one
    lock, so a background prefetch and the engine's own calls can share a tier.
    Component puts run on one worker thread (see :meth:`save_entries`).

    Args:
        store: the backend.
        namespace, unit, alignment, shapes, name, write_through: see :class:`Tier`.
        retry_seconds: fail-fast window after the store was unreachable.
    """

    def __init__(self, store: ObjectStore, namespace: bytes, unit: int, alignment: int, shapes: EntryShapes,
                 retry_seconds: float = 2.0, name: str = "store", write_through: bool = True,
                 write_back: bool | None = None) -> None:
        super().__init__(namespace, unit, alignment, shapes, name, write_through, write_back)
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
                self.stats.misses["unreachable"] += 1
                return None
            try:
                return fn(*args)
            except StoreUnavailable as exc:
                self._down_until = time.monotonic() + self.retry_seconds
                self.stats.misses["unreachable"] += 1
                if not self._warned:
                    log.warning("%s tier unreachable, continuing without it: %s", self.name, exc)
                    self._warned = True
                return None

    def _exists(self, keys):
        return self._call(self.store.exists, keys)

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

    def load_many(self, hashes: list[bytes], wanted: list[tuple[int, str]], staging: bool = False
                  ) -> list[dict | None]:
        """Verified components of several entries in one batched ``get_into``.

        Every manifest and every component this model expects lands in one
        arena: a manifest slot of ``MANIFEST_MAX_BYTES`` and an exact-size slot
        per component (sizes from :class:`EntryShapes`). Then each manifest is
        decoded and checked, and each component is checked against the
        manifest's size and checksum. The returned tensors view the arena (no
        copy). Reading the manifest in the same batch as its components is
        safe: components are committed before the manifest, and whatever was
        read is checked against the manifest's checksums.

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
                (n, _nbytes(dt, shape)) for n, (dt, shape) in getattr(self.shapes, grp).items()]
            for name, size in slots:
                keys.append(self._key(hashes, b, grp, name))
                offsets.append(pos)
                sizes.append(size)
                pos += -(-size // _ALIGN) * _ALIGN
        with self._lock:
            if time.monotonic() < self._down_until:      # fail fast before touching the arena
                self.stats.misses["unreachable"] += 1
                return [None] * len(wanted)
            arena = self._arena(pos, staging)
            if arena is None:
                return [None] * len(wanted)
            views = [memoryview(arena[o:o + n]) for o, n in zip(offsets, sizes)]
            nread = self._call(self.store.get_into, keys, views)
            if nread is None:
                return [None] * len(wanted)
            out, i = [], 0
            for b, grp in wanted:
                n_slots = 1 + len(getattr(self.shapes, grp))
                out.append(self._verify(hashes, b, grp, arena, offsets[i:i + n_slots], nread[i:i + n_slots]))
                i += n_slots
        return out

    def _verify(self, hashes, b, grp, arena, offsets, nread) -> dict | None:
        """Decode one entry read by :meth:`load_many` (``None`` and a counted miss on failure)."""
        names = getattr(self.shapes, grp)
        mo, mn = offsets[0], nread[0]
        if mn < 0:                                  # absent, or larger than any manifest a reader accepts
            present = self._call(self.store.exists, [self._key(hashes, b, grp)])
            if present is not None:                 # (None: counted unreachable already)
                self.stats.misses["incomplete" if present[0] else "absent"] += 1
            return None
        blob = arena[mo:mo + mn].tobytes()
        try:
            comps = decode_manifest(blob, grp, b, names, {n: self._key(hashes, b, grp, n) for n in names})
            order = {n: j for j, n in enumerate(names)}
            parts = {}
            for c in comps:
                j = 1 + order[c.name]
                n = nread[j]
                if n < 0:                           # absent, or larger than the manifest says
                    present = self._call(self.store.exists, [c.key])
                    if present is None:
                        return None
                    if present[0]:
                        raise EntryError("checksum", f"component {c.name} is larger than its manifest says")
                    verify_component(c, None)
                parts[c.name] = verify_component(c, arena, offsets[j], n)
        except EntryError as exc:
            self.stats.misses[exc.reason] += 1
            return None
        self.stats.bytes_loaded += len(blob) + sum(c.nbytes for c in comps)
        return parts

    def save_entries(self, entries: list[tuple]) -> list[bool]:
        """Commit several entries with two batched puts: every component, then the manifests
        of the entries whose components all landed.

        The components' put runs on a worker thread while this thread computes
        their checksums and the manifests (the store call releases the GIL, so
        the two overlap); the manifests go out only after it returned.

        Args:
            entries: ``(chain_hash, parent_hash, group, boundary, tensors)`` tuples.

        Returns:
            Per entry, whether it is now visible.
        """
        if not entries:
            return []
        with self._lock:
            if time.monotonic() < self._down_until:
                self.stats.misses["unreachable"] += 1
                return [False] * len(entries)
        parts = [entry_components(self.namespace, h, group, tensors) for h, _, group, _, tensors in entries]
        pending = self.submit(self._call, self.store.put, [(key, data) for cs in parts for _, key, data, _ in cs])
        manifests = [entry_manifest(self.namespace, h, parent, group, boundary, self.alignment, cs)
                     for (h, parent, group, boundary, _), cs in zip(entries, parts)]
        ok = pending.result()
        if ok is None:
            return [False] * len(entries)
        done, i = [], 0
        for cs in parts:
            done.append(all(ok[i:i + len(cs)]))
            i += len(cs)
        ok = self._call(self.store.put, [m for m, d in zip(manifests, done) if d]) if any(done) else []
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
        return visible

    def invalidate(self, hashes: list[bytes], boundary: int, group: str) -> None:
        """Remove an entry: the manifest first, then its components."""
        mkey = self._key(hashes, boundary, group)
        self._call(self.store.remove, [mkey])
        names = getattr(self.shapes, group)
        self._call(self.store.remove, [self._key(hashes, boundary, group, n) for n in names])

