"""What every lower tier shares (DESIGN §4, §5): miss reasons, statistics, the per-group
remote match, entry shapes, checkpoint components, and the :class:`Tier` base class
(keys, alignment, per-group lookup, entry helpers) that :class:`~hybridkv.tiers.store_tier.StoreTier`
and :class:`~hybridkv.tiers.host.HostTier` build on.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from hybridkv.model.state import KDACheckpoint
from hybridkv.tiers.layout import component_nbytes, entry_key

MISS_REASONS = ("absent", "evicted", "checksum", "incomplete", "unreachable")


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

    def entry_nbytes(self, group: str) -> int:
        """Payload bytes of one ``group`` entry of this model (components only)."""
        return sum(component_nbytes(dtype, shape) for dtype, shape in getattr(self.shapes, group).values())

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
        """Key of ``component`` of the entry at ``boundary``; the manifest's is :meth:`_entry_key`."""
        h = self._hash(hashes, boundary)
        return self._entry_key(h, group) if component == "manifest" else entry_key(self.namespace, h, group, component)

    def _entry_key(self, chain_hash: bytes, group: str):
        """The key whose presence means the entry exists (its manifest)."""
        return entry_key(self.namespace, chain_hash, group, "manifest")

    def has_entries(self, wanted: list[tuple[bytes, str]]) -> list[bool] | None:
        """Whether each ``(chained hash, group)`` entry exists, in one query (``None`` if unreachable)."""
        if not wanted:
            return []
        return self._exists([self._entry_key(h, grp) for h, grp in wanted])

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
        return self.has_entries([(self._hash(hashes, b), grp) for b, grp in wanted])

    def has(self, hashes: list[bytes], boundaries: list[int], group: str) -> list[bool] | None:
        """Whether each boundary's manifest exists (``None`` if unreachable)."""
        return self.has_many(hashes, [(b, group) for b in boundaries])

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
