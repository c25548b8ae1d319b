"""Cache ABI v5: object keys, component encoding and manifests (DESIGN §5; docs/reference/cache-abi.md).

An *entry* is what one lifetime of a model's cache groups holds at one aligned boundary ``L``
of one prefix (:func:`hybridkv.cache.groups.tier_entry_shapes`, driven by the group specs):

* the *page entry*: every prefix group's entries of the segment ``[L - A, L)`` under one
  manifest (Kimi Linear: ``full``, component ``latents``
  ``float32[num_mla_layers, A, kv_latent_dim]``; DeepSeek-V4: ``csa-hca``, components
  ``csa.kv``, ``csa.index``, ``hca.kv``);
* the *state entry*: the boundary group's state at ``L`` (Kimi Linear: ``kda``, checkpoint
  ``C(P_L)``: ``recurrent`` ``float32[L_kda, H, K, V]`` and ``conv.q``, ``conv.k``, ``conv.v``
  each ``[L_kda, H*K, kernel-1]``; DeepSeek-V4: ``swa``, windows, compressor tails and
  overlaps).

Keys: ``hkv5/<namespace hex>/<owner hex>/<chained hash hex of [0, L)>/<group>/r<rank>/<component>``
(``namespace``: the engine's model namespace; ``owner``: the request namespace the entry
was cached under, so a purge by tenant or salt is a key-prefix removal on any backend);
the manifest is the component ``manifest``. The manifest (JSON, UTF-8) lists every
component with key, byte size, dtype, shape and XXH3-128 checksum, plus the layout
version, the token length ``L``, the segment length ``A`` and the parent hash (of
``[0, L - A)``). Components are written first, the manifest last; an entry
exists only if its manifest and every component exist and verify.

Group names and entry shapes come from :mod:`hybridkv.cache.groups` (one vocabulary
from the config to the keys). Older ABIs are not read: v1 (``hkv1/`` keys, SHA-256
checksums), v2 (``hkv2/`` keys, the ``full`` group named ``kv``), v3 (``hkv3/`` keys
without the owner segment) and v4 (``hkv4/`` keys, one entry per Kimi Linear group) objects
are simply absent to a v5 reader. The checksum detects
corrupt and truncated objects; keys already come from the SHA-256 chain, so a fast non-cryptographic hash suffices
(XXH3-128 via the ``xxhash`` package, ~10 GB/s against ~1 GB/s for SHA-256 on the
development machine, docs/results/store.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import xxhash

from hybridkv._torch import torch
from hybridkv.cache.abi import ABI_VERSION, KEY_PREFIX
from hybridkv.cache.groups import DTYPE_BYTES, nbytes
from hybridkv.model.state import KDACheckpoint

LAYOUT_VERSION = "hkv5-page-entry+state-entry"
CHECKSUM = "xxh3_128"

#: Largest manifest a reader accepts (bytes); ours are about 1 KiB. A load reads the
#: manifest into a slot of this size in the same batched get as the components.
MANIFEST_MAX_BYTES = 16 << 10

DTYPES = ("float64", "float32", "bfloat16", "float16")
"""Component dtype names (:data:`hybridkv.cache.groups.DTYPE_BYTES` gives sizes; :func:`torch_dtype`
the torch dtype of each)."""


def torch_dtype(name: str):
    """The torch dtype of component dtype ``name`` (one of :data:`DTYPES`).

    Raises:
        KeyError: another name.
    """
    if name not in DTYPES:
        raise KeyError(name)
    return getattr(torch, name)


class EntryError(ValueError):
    """A store object does not decode into a valid entry; ``reason`` is a miss reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def entry_key(namespace: bytes, chain_hash: bytes, group: str, component: str, rank: int = 0,
              owner: bytes | None = None) -> str:
    """Key of one object of the entry at the boundary whose chained hash is ``chain_hash``.

    ``namespace`` is the engine's model namespace, ``owner`` the request namespace the entry is
    cached under (``None``: ``namespace`` itself, what a request that named none is cached
    under)."""
    own = namespace if owner is None else owner
    return f"{KEY_PREFIX}/{namespace.hex()}/{own.hex()}/{chain_hash.hex()}/{group}/r{rank}/{component}"


def legacy_prefix(abi_version: int, model: bytes | None = None) -> str:
    """Key prefix of every object of an older cache ABI (``hkv3/``; ``hkv3/<model>/`` for one
    model's v3 objects; v1 and v2 keys have no model segment). docs/reference/cache-abi.md "Versions"."""
    if not 1 <= abi_version < ABI_VERSION:
        raise ValueError(f"cache ABI v{abi_version} is not an older ABI (1 to {ABI_VERSION - 1})")
    if model is not None and abi_version < 3:
        raise ValueError(f"keys of cache ABI v{abi_version} carry no model namespace")
    return f"hkv{abi_version}/" if model is None else f"hkv{abi_version}/{model.hex()}/"


def owner_prefix(model: bytes | None, owner: bytes | None) -> str:
    """Key prefix of every entry of ``model`` cached by ``owner`` (``None``: any, written as the
    one-segment wildcard ``*`` of :meth:`~hybridkv.store.base.ObjectStore.remove_prefix`)."""
    m = "*" if model is None else model.hex()
    return f"{KEY_PREFIX}/{m}/" if owner is None else f"{KEY_PREFIX}/{m}/{owner.hex()}/"


#: Key prefix of expiry horizons: the purge by age of a store that cannot list its keys
#: (docs/concepts/commit-protocol.md "Expiry horizons"). Outside ``hkv5/`` so no purge by prefix removes one.
HORIZON_PREFIX = "hkv4-horizon"
HORIZON_SLOTS = ("a", "b")
#: Largest horizon object a reader accepts (bytes; ours are about 14: ``"1764558000.123"``).
HORIZON_MAX_BYTES = 64
#: Seconds a horizon may lie ahead of the clock of whoever reads or raises it (clock skew between
#: hosts). A purge by age never asks for a later one, and a stored one later than this is not a
#: horizon (a stamp in ms, garbage): it is ignored, since a horizon never goes back and nothing
#: removes one, so honouring it would expire every entry of its scope, later ones included, for good.
HORIZON_MAX_AHEAD_S = 300.0


def horizon_key(model: bytes | None, owner: bytes | None, slot: str) -> str:
    """Key of one slot of the expiry horizon of the entries of ``model`` cached by ``owner``
    (``None``: every model / every owner, written ``all``)."""
    m = "all" if model is None else model.hex()
    o = "all" if owner is None else owner.hex()
    return f"{HORIZON_PREFIX}/{m}/{o}/{slot}"


def reader_horizon_scopes(model: bytes, owner: bytes) -> list[tuple[bytes | None, bytes | None]]:
    """The horizon scopes ``(model | None, owner | None)`` that apply to an entry of ``model``
    cached by ``owner``: (all, all), (model, all), (all, owner) and (model, owner)."""
    return [(None, None), (model, None), (None, owner), (model, owner)]


def reader_horizon_keys(model: bytes, owner: bytes) -> list[str]:
    """The horizon slots that apply to an entry of ``model`` cached by ``owner``: both slots of
    each scope of :func:`reader_horizon_scopes`, in that order; 8 keys."""
    return [horizon_key(m, o, slot) for m, o in reader_horizon_scopes(model, owner) for slot in HORIZON_SLOTS]


def encode_horizon(created_before: float) -> bytes:
    """A horizon object: Unix seconds as ASCII decimal (ms resolution, rounded up so that
    every entry stamped before ``created_before`` stays before the stored value)."""
    return f"{math.ceil(float(created_before) * 1000) / 1000:.3f}".encode()


def decode_horizon(blob, now: float | None = None) -> float | None:
    """Seconds of a horizon object, ``None`` when it is not one (ignored, never an error): not a
    finite decimal number, or, given ``now`` (Unix seconds), later than ``now`` plus
    :data:`HORIZON_MAX_AHEAD_S`."""
    try:
        t = float(bytes(blob).decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not math.isfinite(t) or (now is not None and t > now + HORIZON_MAX_AHEAD_S):
        return None
    return t


def latest_horizon(blobs, now: float) -> float | None:
    """The latest horizon (Unix seconds) among the slot objects ``blobs`` (``None`` items: absent
    slots), each read by :func:`decode_horizon` against ``now``; ``None``: no slot holds one."""
    found = [t for t in (decode_horizon(b, now) for b in blobs if b is not None) if t is not None]
    return max(found) if found else None


def manifest_created(blob) -> float | None:
    """The ``created`` seconds of a manifest (``None``: not recorded or not a number)."""
    try:
        t = json.loads(bytes(blob)).get("created")
    except (ValueError, AttributeError, RecursionError, UnicodeDecodeError):
        return None
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


@dataclass(frozen=True, slots=True)
class Component:
    """One component of an entry as listed in its manifest (``nbytes`` in bytes,
    ``checksum`` the XXH3-128 hex digest of those bytes)."""

    name: str
    key: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    checksum: str


def tensor_view(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of ``t`` as a flat byte memoryview.

    No copy when ``t`` is already a contiguous CPU tensor (the view keeps it
    alive); otherwise of a contiguous CPU copy. Any dtype, bfloat16 included.
    """
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def checksum(data) -> str:
    """XXH3-128 hex digest of a bytes-like object (no copy)."""
    return xxhash.xxh3_128_hexdigest(data)


def view_tensor(buffer, offset: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``buffer[offset:]``: no copy when ``buffer`` is writable (it must
    stay alive then), a private copy when it is read-only (``bytes``)."""
    tdt = torch_dtype(dtype)
    if memoryview(buffer).readonly:
        buffer = bytearray(buffer)
    numel = nbytes(dtype, shape) // DTYPE_BYTES[dtype]
    if numel == 0:
        return torch.empty(shape, dtype=tdt)
    return torch.frombuffer(buffer, dtype=tdt, count=numel, offset=offset).reshape(shape)


def entry_components(namespace: bytes, chain_hash: bytes, group: str, tensors: dict[str, torch.Tensor],
                     rank: int = 0, owner: bytes | None = None) -> list[tuple[str, str, memoryview, torch.Tensor]]:
    """The component objects of one entry: ``(name, key, bytes, tensor)`` per component.

    The bytes are a memoryview over the tensor's own memory when it is a
    contiguous CPU tensor (zero copy): the caller must not modify the tensors
    until the put returns.
    """
    return [(name, entry_key(namespace, chain_hash, group, name, rank, owner), tensor_view(t), t)
            for name, t in tensors.items()]


def entry_manifest(namespace: bytes, chain_hash: bytes, parent_hash: bytes | None, group: str, boundary: int,
                   segment: int, components: list[tuple[str, str, memoryview, torch.Tensor]],
                   rank: int = 0, owner: bytes | None = None, created: float | None = None) -> tuple[str, bytes]:
    """The manifest object ``(key, UTF-8 JSON)`` of an entry, checksumming each component (XXH3-128).

    ``owner`` (the request namespace digest the entry was cached under, written as hex) and
    ``created`` (Unix seconds) are optional fields readers ignore; purges select by them
    (docs/reference/cache-abi.md)."""
    listing = [{"name": name, "key": key, "nbytes": data.nbytes, "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "checksum": checksum(data)} for name, key, data, t in components]
    manifest = {"abi": ABI_VERSION, "layout": LAYOUT_VERSION, "checksum": CHECKSUM, "group": group,
                "token_length": boundary, "segment": segment, "parent": parent_hash.hex() if parent_hash else "",
                "rank": rank, "components": listing}
    if owner is not None:
        manifest["owner"] = owner.hex()
    if created is not None:
        manifest["created"] = round(float(created), 3)
    return (entry_key(namespace, chain_hash, group, "manifest", rank, owner),
            json.dumps(manifest, sort_keys=True).encode())


def encode_entry(namespace: bytes, chain_hash: bytes, parent_hash: bytes | None, group: str,
                 boundary: int, segment: int, tensors: dict[str, torch.Tensor],
                 rank: int = 0, owner: bytes | None = None, created: float | None = None
                 ) -> tuple[list[tuple[str, memoryview]], tuple[str, bytes]]:
    """Objects of one entry: the component objects, and the manifest object to write last.

    Args:
        namespace: namespace digest.
        chain_hash: chained hash of ``[0, boundary)``.
        parent_hash: chained hash of ``[0, boundary - segment)`` (``None`` at the start).
        group: the entry kind (``"full"`` / ``"kda"``, ``"csa-hca"`` / ``"swa"``).
        boundary: ``L`` in tokens.
        segment: ``A`` in tokens (the tokens a ``full`` entry covers).
        tensors: component name -> tensor.
        owner: request namespace digest (key path and manifest; ``None``: ``namespace``).
        created: Unix seconds to record (``None``: not recorded).

    Returns:
        ``(components, manifest)`` as ``(key, buffer)`` pairs; component buffers
        as in :func:`entry_components`.
    """
    comps = entry_components(namespace, chain_hash, group, tensors, rank, owner)
    return ([(key, data) for _, key, data, _ in comps],
            entry_manifest(namespace, chain_hash, parent_hash, group, boundary, segment, comps, rank,
                           owner=owner, created=created))


def decode_manifest(data: bytes, group: str, boundary: int, expected: dict[str, tuple[str, tuple]],
                    keys: dict[str, str]) -> list[Component]:
    """Parse and check a manifest against what this reader expects.

    Args:
        expected: component name -> (dtype, shape) this model needs.
        keys: component name -> the key it must live under (this entry's
            namespace, chained hash, group and rank): a manifest cannot point
            at another entry's objects.

    Raises:
        EntryError: reason ``incomplete`` (unparseable, other ABI / layout /
            group / length, fields of the wrong type (sizes must be JSON
            integers), components that do not match ``expected`` or repeat, a
            byte size that does not fit the shape, or a foreign key).
    """
    try:
        m = json.loads(bytes(data))
        if m["abi"] != ABI_VERSION or m["layout"] != LAYOUT_VERSION or m["checksum"] != CHECKSUM:
            raise EntryError("incomplete", f"manifest ABI {m['abi']} / layout {m['layout']!r} not ours")
        if m["group"] != group or m["token_length"] != boundary:
            raise EntryError("incomplete", f"manifest is for {m['group']}@{m['token_length']}, "
                                           f"expected {group}@{boundary}")
        comps = [Component(c["name"], c["key"], c["nbytes"], c["dtype"], tuple(c["shape"]), c["checksum"])
                 for c in m["components"]]
        for c in comps:
            if not all(isinstance(x, str) for x in (c.name, c.key, c.dtype, c.checksum)) or not all(
                    type(x) is int and x >= 0 for x in (c.nbytes, *c.shape)):
                raise EntryError("incomplete", "manifest component fields have the wrong types")
        got = {c.name: (c.dtype, c.shape) for c in comps}
    except EntryError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, UnicodeDecodeError) as exc:
        raise EntryError("incomplete", f"manifest does not parse: {type(exc).__name__}") from None
    if len(got) != len(comps) or got != expected:
        raise EntryError("incomplete", f"manifest components {sorted(got)} differ from the expected {sorted(expected)}")
    for c in comps:
        if c.key != keys[c.name]:
            raise EntryError("incomplete", f"manifest component {c.name} points outside its entry")
        if c.nbytes != nbytes(c.dtype, c.shape):
            raise EntryError("incomplete", f"manifest component {c.name}: {c.nbytes} bytes do not fit {c.shape}")
    return comps


def verify_component(comp: Component, buffer, offset: int = 0, nread: int | None = None) -> torch.Tensor:
    """Check size and checksum of one component's bytes and return a tensor over them.

    Args:
        buffer: writable bytes-like object holding the component at ``offset``
            (``None``: the object was missing).
        nread: bytes the store delivered (``-1``: absent or larger than the
            slot); default the whole remaining buffer.

    Returns:
        A tensor viewing ``buffer`` (no copy), dtype and shape from the manifest.

    Raises:
        EntryError: ``evicted`` (object gone although its manifest exists) or
            ``checksum`` (size or digest mismatch).
    """
    if buffer is None:
        raise EntryError("evicted", f"component {comp.name} is missing")
    view = memoryview(buffer).cast("B")
    if nread is None:
        nread = view.nbytes - offset
    if nread != comp.nbytes or checksum(view[offset: offset + nread]) != comp.checksum:
        raise EntryError("checksum", f"component {comp.name} fails its checksum")
    return view_tensor(buffer, offset, comp.dtype, comp.shape)


def checkpoint_components(ckpt: KDACheckpoint) -> dict[str, torch.Tensor]:
    """The ``kda`` entry components of a checkpoint: ``recurrent`` and the q | k | v conv thirds
    (names and shapes: :meth:`hybridkv.cache.groups.KDASpec.entry_shape`)."""
    return ckpt.components()


def checkpoint_from_components(parts: dict[str, torch.Tensor], boundary: int) -> KDACheckpoint:
    """Inverse of :func:`checkpoint_components`: ``C(P_boundary)``."""
    return KDACheckpoint.from_components(parts, boundary)
