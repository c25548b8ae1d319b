"""Cache ABI v3 manifests: a manifest names only its own entry's objects, and one that does not
decode is an ``incomplete`` miss."""

from __future__ import annotations

import pytest
import torch

from hybridkv.tiers.layout import EntryError, decode_manifest, encode_entry, entry_key


def test_manifest_cannot_point_at_another_entrys_objects():
    ns, h1, h2 = b"n" * 32, b"a" * 32, b"b" * 32
    t = {"latents": torch.zeros(1, 2, 3)}
    _, (_, manifest) = encode_entry(ns, h1, None, "full", 64, 64, t)
    expected = {"latents": ("float32", (1, 2, 3))}
    decode_manifest(manifest, "full", 64, expected, {"latents": entry_key(ns, h1, "full", "latents")})
    with pytest.raises(EntryError, match="points outside its entry") as exc:
        decode_manifest(manifest, "full", 64, expected, {"latents": entry_key(ns, h2, "full", "latents")})
    assert exc.value.reason == "incomplete"


def test_deeply_nested_manifest_is_an_incomplete_miss():
    deep = b"[" * 100000 + b"]" * 100000
    with pytest.raises(EntryError) as exc:
        decode_manifest(deep, "full", 64, {"latents": ("float32", (1, 2, 3))}, {"latents": "k"})
    assert exc.value.reason == "incomplete"
