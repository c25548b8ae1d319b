"""Cache ABI v5 keys and manifests: a manifest names only its own entry's objects, and one that does not
decode is an ``incomplete`` miss."""

from __future__ import annotations

import json

import pytest
import torch

from hybridkv.tiers.layout import (
    EntryError,
    decode_horizon,
    decode_manifest,
    encode_entry,
    encode_horizon,
    entry_key,
    reader_horizon_keys,
)


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


def test_keys_carry_model_then_owner_and_owner_defaults_to_the_model():
    ns, owner, h = b"n" * 32, b"o" * 32, b"a" * 32
    key = entry_key(ns, h, "full", "latents", owner=owner)
    assert key == f"hkv5/{ns.hex()}/{owner.hex()}/{h.hex()}/full/r0/latents"
    assert entry_key(ns, h, "full", "latents") == f"hkv5/{ns.hex()}/{ns.hex()}/{h.hex()}/full/r0/latents"
    comps, (mkey, manifest) = encode_entry(ns, h, None, "full", 64, 64, {"latents": torch.zeros(1, 2, 3)},
                                           owner=owner)
    assert mkey.startswith(f"hkv5/{ns.hex()}/{owner.hex()}/") and all(owner.hex() in k for k, _ in comps)
    assert json.loads(manifest)["owner"] == owner.hex()


def test_a_manifest_of_another_abi_is_an_incomplete_miss_not_bytes():
    """A v3 manifest that reached a v4 reader (v3 keys lack the owner segment, so normally it cannot)."""
    ns, h = b"n" * 32, b"a" * 32
    _, (_, manifest) = encode_entry(ns, h, None, "full", 64, 64, {"latents": torch.zeros(1, 2, 3)})
    m = json.loads(manifest)
    m["abi"], m["layout"] = 3, "hkv3-full-latents-f32+kda-rec-f32-conv-qkv"
    with pytest.raises(EntryError, match="not ours") as exc:
        decode_manifest(json.dumps(m).encode(), "full", 64, {"latents": ("float32", (1, 2, 3))},
                        {"latents": entry_key(ns, h, "full", "latents")})
    assert exc.value.reason == "incomplete"


def test_horizon_objects_round_up_to_the_millisecond_and_reject_junk():
    assert encode_horizon(1000.0001) == b"1000.001" and decode_horizon(b"1000.001") == 1000.001
    for junk in (b"nan", b"inf", b"x", b"\xff"):
        assert decode_horizon(junk) is None
    keys = reader_horizon_keys(b"m" * 32, b"o" * 32)
    assert len(keys) == 8 and len(set(keys)) == 8 and all(k.startswith("hkv4-horizon/") for k in keys)


def test_the_abi_version_is_defined_once_and_names_the_key_prefix():
    from hybridkv.cache import abi, purge
    from hybridkv.tiers import layout

    assert purge.ABI_VERSION is abi.ABI_VERSION and layout.ABI_VERSION is abi.ABI_VERSION
    assert abi.KEY_PREFIX == f"hkv{abi.ABI_VERSION}"
    assert layout.entry_key(b"n" * 32, b"c" * 32, "full", "manifest").startswith(f"hkv{abi.ABI_VERSION}/")
