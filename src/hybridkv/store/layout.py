"""Cache ABI v1: object keys, component encoding and manifests (DESIGN §5; docs/cache_abi.md).

An *entry* is one group's state at one aligned boundary ``L`` of one prefix:

* ``kv`` entry: MLA latents of tokens ``[L - A, L)`` for every MLA layer, one
  component ``latents``: ``float32[num_mla_layers, A, kv_latent_dim]``.
* ``kda`` entry: checkpoint ``C(P_L)``: components ``recurrent``
  (``float32[L_kda, H, K, V]``) and ``conv.q``, ``conv.k``, ``conv.v``
  (each ``[L_kda, H*K, kernel-1]``, the q | k | v thirds of the conv window).

Keys: ``hkv1/<namespace hex>/<chained hash hex of [0, L)>/<group>/r<rank>/<component>``;
the manifest is the component ``manifest``. The manifest (JSON, UTF-8) lists every
component with key, byte size, dtype, shape and SHA-256, plus the layout version,
the token length ``L``, the segment length ``A`` and the parent hash (of
``[0, L - A)``). Components are written first, the manifest last; an entry
exists only if its manifest and every component exist and verify.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch

ABI_VERSION = 1
LAYOUT_VERSION = "hkv1-kv-latents-f32+kda-rec-f32-conv-qkv"
GROUPS = ("kv", "kda")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EntryError(ValueError):
    """A store object does not decode into a valid entry; ``reason`` is a miss reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def entry_key(namespace: bytes, chain_hash: bytes, group: str, component: str, rank: int = 0) -> str:
    """Key of one object of the entry at the boundary whose chained hash is ``chain_hash``."""
    return f"hkv1/{namespace.hex()}/{chain_hash.hex()}/{group}/r{rank}/{component}"


@dataclass(frozen=True, slots=True)
class Component:
    """One component of an entry as listed in its manifest."""

    name: str
    key: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    sha256: str


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a contiguous CPU copy of ``t``."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def bytes_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`tensor_bytes` (a new, writable tensor)."""
    tdt = _DTYPES[dtype]
    if tdt == torch.bfloat16:
        arr = np.frombuffer(data, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
    arr = np.frombuffer(data, dtype=np.dtype(str(tdt).removeprefix("torch."))).copy()
    return torch.from_numpy(arr).reshape(shape)


def encode_entry(namespace: bytes, chain_hash: bytes, parent_hash: bytes | None, group: str,
                 boundary: int, segment: int, tensors: dict[str, torch.Tensor],
                 rank: int = 0) -> tuple[list[tuple[str, bytes]], tuple[str, bytes]]:
    """Objects of one entry: the component objects, and the manifest object to write last.

    Args:
        namespace: namespace digest.
        chain_hash: chained hash of ``[0, boundary)``.
        parent_hash: chained hash of ``[0, boundary - segment)`` (``None`` at the start).
        group: ``"kv"`` or ``"kda"``.
        boundary: ``L`` in tokens.
        segment: ``A`` in tokens (the tokens a ``kv`` entry covers).
        tensors: component name -> tensor.

    Returns:
        ``(components, manifest)`` as ``(key, bytes)`` pairs.
    """
    comps, listing = [], []
    for name, t in tensors.items():
        data = tensor_bytes(t)
        key = entry_key(namespace, chain_hash, group, name, rank)
        comps.append((key, data))
        listing.append({"name": name, "key": key, "nbytes": len(data),
                        "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"abi": ABI_VERSION, "layout": LAYOUT_VERSION, "group": group, "token_length": boundary,
                "segment": segment, "parent": parent_hash.hex() if parent_hash else "", "rank": rank,
                "components": listing}
    mkey = entry_key(namespace, chain_hash, group, "manifest", rank)
    return comps, (mkey, json.dumps(manifest, sort_keys=True).encode())


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


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
            group / length, components that do not match ``expected``, a
            byte size that does not fit the shape, or a foreign key).
    """
    try:
        m = json.loads(data)
        if m["abi"] != ABI_VERSION or m["layout"] != LAYOUT_VERSION:
            raise EntryError("incomplete", f"manifest ABI {m['abi']} / layout {m['layout']!r} not ours")
        if m["group"] != group or m["token_length"] != boundary:
            raise EntryError("incomplete", f"manifest is for {m['group']}@{m['token_length']}, "
                                           f"expected {group}@{boundary}")
        comps = [Component(c["name"], c["key"], int(c["nbytes"]), c["dtype"], tuple(c["shape"]), c["sha256"])
                 for c in m["components"]]
    except EntryError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise EntryError("incomplete", f"manifest does not parse: {type(exc).__name__}") from None
    got = {c.name: (c.dtype, c.shape) for c in comps}
    if got != expected:
        raise EntryError("incomplete", f"manifest components {sorted(got)} differ from the expected {sorted(expected)}")
    for c in comps:
        if c.key != keys[c.name]:
            raise EntryError("incomplete", f"manifest component {c.name} points outside its entry")
        numel = 1
        for d in c.shape:
            numel *= d
        if c.nbytes != numel * _ITEMSIZE[c.dtype]:
            raise EntryError("incomplete", f"manifest component {c.name}: {c.nbytes} bytes do not fit {c.shape}")
    return comps


def verify_component(comp: Component, data: bytes | None) -> torch.Tensor:
    """Check size and SHA-256 of one component's bytes and decode it.

    Raises:
        EntryError: ``evicted`` (object gone although its manifest exists) or
            ``checksum`` (size or digest mismatch).
    """
    if data is None:
        raise EntryError("evicted", f"component {comp.name} is missing")
    if len(data) != comp.nbytes or hashlib.sha256(data).hexdigest() != comp.sha256:
        raise EntryError("checksum", f"component {comp.name} fails its checksum")
    return bytes_tensor(data, comp.dtype, comp.shape)
