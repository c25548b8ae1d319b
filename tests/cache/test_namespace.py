"""Cache namespace digests (CacheIdentity) and chained block hashes: determinism, chaining, isolation."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache.namespace import CacheIdentity, chained_block_hashes

NS = CacheIdentity().digest()
NS_OTHER = CacheIdentity(tenant="other").digest()

token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=40)
units = st.integers(1, 5)


def reference_hashes(namespace: bytes, tokens, unit: int) -> list[bytes]:
    """The documented chain, written out independently: h_i = SHA256(h_{i-1} || ns || int64-LE tokens_i)."""
    out, prev = [], b"hybridkv.root"
    for i in range(len(tokens) // unit):
        chunk = struct.pack(f"<{unit}q", *tokens[i * unit:(i + 1) * unit])
        prev = hashlib.sha256(prev + namespace + chunk).digest()
        out.append(prev)
    return out


# -- chained_block_hashes ------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(token_lists, units)
def test_chained_hashes_follow_the_documented_formula(tokens, unit):
    assert chained_block_hashes(NS, tokens, unit) == reference_hashes(NS, tokens, unit)


@settings(max_examples=60, deadline=None)
@given(token_lists, units)
def test_same_tokens_give_the_same_hashes(tokens, unit):
    first = chained_block_hashes(NS, tokens, unit)
    assert chained_block_hashes(NS, list(tokens), unit) == first
    assert chained_block_hashes(NS, np.array(tokens, dtype=np.int64), unit) == first
    assert len(first) == len(tokens) // unit
    assert all(isinstance(h, bytes) and len(h) == 32 for h in first)


def test_hashes_do_not_depend_on_the_integer_container_type():
    tokens = [5, 17, 3, 99, 0, 1]
    want = chained_block_hashes(NS, tokens, 2)
    assert chained_block_hashes(NS, tuple(tokens), 2) == want
    assert chained_block_hashes(NS, np.array(tokens, dtype=np.int32), 2) == want
    assert chained_block_hashes(NS, np.array(tokens, dtype=">i8"), 2) == want   # big-endian input, same ids


@settings(max_examples=80, deadline=None)
@given(st.data(), st.lists(st.integers(0, 1000), min_size=1, max_size=40), units)
def test_a_changed_token_changes_every_hash_from_its_unit_on_and_none_before(data, tokens, unit):
    i = data.draw(st.integers(0, len(tokens) - 1), label="changed position")
    changed = list(tokens)
    changed[i] = tokens[i] + data.draw(st.integers(1, 1000), label="delta")
    a, b = chained_block_hashes(NS, tokens, unit), chained_block_hashes(NS, changed, unit)
    first = i // unit
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


def test_an_equal_unit_after_a_different_history_hashes_differently():
    a = chained_block_hashes(NS, [1, 2, 7, 8], 2)
    b = chained_block_hashes(NS, [3, 4, 7, 8], 2)
    assert a[1] != b[1]                          # the chain carries the whole prefix, not just the unit
    swapped = chained_block_hashes(NS, [7, 8, 1, 2], 2)
    assert set(swapped).isdisjoint(a)            # reordering units changes every hash


@settings(max_examples=60, deadline=None)
@given(token_lists, token_lists, units)
def test_different_namespaces_never_share_a_hash(tokens_a, tokens_b, unit):
    a = chained_block_hashes(NS, tokens_a, unit)
    b = chained_block_hashes(NS_OTHER, tokens_b, unit)
    assert set(a).isdisjoint(b)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=40), st.binary(max_size=40), st.lists(st.integers(0, 50), min_size=1, max_size=12), units)
def test_distinct_raw_namespaces_with_one_unit_size_never_share_a_hash(ns_a, ns_b, tokens, unit):
    if ns_a == ns_b:
        ns_b = ns_b + b"\x00"
    a = chained_block_hashes(ns_a, tokens, unit)
    b = chained_block_hashes(ns_b, tokens, unit)
    assert set(a).isdisjoint(b)


@settings(max_examples=60, deadline=None)
@given(token_lists, units, st.integers(0, 4))
def test_a_partial_trailing_unit_is_not_hashed(tokens, unit, extra):
    whole = tokens[: len(tokens) // unit * unit]
    want = chained_block_hashes(NS, whole, unit)
    padded = whole + list(range(min(extra, unit - 1)))
    assert chained_block_hashes(NS, padded, unit) == want
    assert chained_block_hashes(NS, tokens, unit) == want


@settings(max_examples=60, deadline=None)
@given(token_lists, units)
def test_hashes_of_a_prefix_are_a_prefix_of_the_hashes(tokens, unit):
    full = chained_block_hashes(NS, tokens, unit)
    for k in range(len(full) + 1):
        assert chained_block_hashes(NS, tokens[: k * unit], unit) == full[:k]


def test_max_units_caps_the_number_of_hashes():
    tokens = list(range(20))
    full = chained_block_hashes(NS, tokens, 4)
    assert len(full) == 5
    assert chained_block_hashes(NS, tokens, 4, max_units=2) == full[:2]
    assert chained_block_hashes(NS, tokens, 4, max_units=0) == []
    assert chained_block_hashes(NS, tokens, 4, max_units=99) == full


def test_fewer_tokens_than_one_unit_give_no_hashes():
    assert chained_block_hashes(NS, [], 4) == []
    assert chained_block_hashes(NS, [1, 2, 3], 4) == []


def test_text_instead_of_token_ids_is_rejected():
    with pytest.raises(ValueError):
        chained_block_hashes(NS, "hello world", 1)


def test_a_text_namespace_is_rejected():
    with pytest.raises(TypeError):
        chained_block_hashes("tenant-a", [1, 2, 3, 4], 2)


def test_token_ids_beyond_int64_are_rejected():
    with pytest.raises(OverflowError):
        chained_block_hashes(NS, [2**63], 1)


# -- CacheIdentity -------------------------------------------------------


def reference_digest(identity: CacheIdentity) -> bytes:
    """The documented encoding: domain tag, then per field ``len(tag) tag len(value) value`` (8-byte BE lengths)."""
    h = hashlib.sha256(b"hybridkv.namespace.v1")
    for f in dataclasses.fields(identity):
        for part in (f.name.encode(), getattr(identity, f.name).encode("utf-8")):
            h.update(len(part).to_bytes(8, "big") + part)
    return h.digest()


FIELD_NAMES = [f.name for f in dataclasses.fields(CacheIdentity)]


def test_digest_is_32_bytes_and_stable_across_calls_and_instances():
    a = CacheIdentity(model_repo="org/m", weight_digest="abc")
    d = a.digest()
    assert isinstance(d, bytes) and len(d) == 32
    assert a.digest() == d
    assert CacheIdentity(model_repo="org/m", weight_digest="abc").digest() == d


def test_digest_follows_the_documented_tagged_length_prefixed_encoding():
    for identity in (CacheIdentity(), CacheIdentity(model_repo="org/m", adapter_id="lora-1", tenant="t\u00e9")):
        assert identity.digest() == reference_digest(identity)


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_every_field_changes_the_digest(name):
    base = CacheIdentity()
    changed = dataclasses.replace(base, **{name: getattr(base, name) + "x"})
    emptied = dataclasses.replace(base, **{name: "" if getattr(base, name) else "y"})
    assert len({base.digest(), changed.digest(), emptied.digest()}) == 3


def test_digests_of_all_single_field_changes_are_distinct():
    base = CacheIdentity()
    digests = {dataclasses.replace(base, **{n: "v"}).digest() for n in FIELD_NAMES}
    digests.add(base.digest())
    assert len(digests) == len(FIELD_NAMES) + 1


def test_moving_characters_across_a_field_boundary_changes_the_digest():
    a = CacheIdentity(model_repo="ab", weight_digest="c")
    b = CacheIdentity(model_repo="a", weight_digest="bc")
    assert a.digest() != b.digest()


def test_swapping_values_between_fields_changes_the_digest():
    a = CacheIdentity(adapter_id="acme", tenant="default")
    b = CacheIdentity(adapter_id="default", tenant="acme")
    assert a.digest() != b.digest()


def test_unicode_values_are_distinguished():
    assert CacheIdentity(tenant="caf\u00e9").digest() != CacheIdentity(tenant="cafe").digest()


def test_identity_is_immutable():
    ident = CacheIdentity()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.tenant = "other"   # type: ignore[misc]


def test_a_non_string_field_is_rejected_by_digest():
    with pytest.raises(AttributeError, match="encode"):
        CacheIdentity(tp_size=2).digest()       # type: ignore[arg-type]


def test_bind_namespace_separates_bindings_and_is_stable():
    from hybridkv.cache.namespace import bind_namespace

    a = bind_namespace(NS, b"torch|digest-a")
    assert a == bind_namespace(NS, b"torch|digest-a") and len(a) == 32
    assert a != bind_namespace(NS, b"torch|digest-b") and a != bind_namespace(NS_OTHER, b"torch|digest-a")
    assert a != NS                                                       # never the caller's digest itself
