"""Regressions found by an adversarial review (each one crashed, leaked or gave wrong output)."""

from __future__ import annotations

import numpy as np
import pytest
from hkv_helpers import assert_exact, make_engine, run_one, tokens

from hybridkv.engine.request import Request, Status
from hybridkv.tiers.layout import EntryError, decode_manifest, encode_entry, entry_key


def test_acquire_holds_the_whole_hit_path_before_evicting(tiny_model):
    v = tiny_model.config.vocab_size
    X, Y = tokens(1, 64, v), tokens(2, 64, v)
    e = make_engine(tiny_model, block_size=128, unit=64, pages=3, slots=8, max_num_seqs=1)
    run_one(e, np.concatenate([X, tokens(3, 30, v)]), max_output_tokens=1)     # unit [0,64) on page P
    run_one(e, np.concatenate([X, Y, tokens(4, 20, v)]), max_output_tokens=1)  # COW: [64,128) on its own page
    r = e.add_request(Request("e", np.concatenate([X, Y, tokens(5, 200, v)]), 1, record_logits=True))
    e.run_until_done()                                  # needs P's page too: must not evict its own hit
    assert r.status in (Status.FINISHED, Status.REJECTED)
    if r.status == Status.FINISHED:
        assert_exact(tiny_model, r)
    e.cache.check_invariants()
    assert all(rc == 0 for rc in e.cache.pages.refcount)


def test_out_of_vocab_request_is_refused_and_leaks_nothing(tiny_model):
    v = tiny_model.config.vocab_size
    e = make_engine(tiny_model, pages=8)
    with pytest.raises(ValueError, match=f"token id {v + 7} outside"):
        e.add_request(Request("bad", np.array([1, 2, v + 7]), 2))
    with pytest.raises(ValueError, match="token id -1 outside"):
        e.add_request(Request("neg", np.array([-1, 2]), 2))
    with pytest.raises(ValueError, match="must be integers"):
        e.add_request(Request("float", np.array([1.5, 2.0]), 2))
    good = run_one(e, tokens(9, 100, v))
    with pytest.raises(ValueError, match="already submitted"):
        e.add_request(good)
    assert not e.has_work and all(rc == 0 for rc in e.cache.pages.refcount)


def test_manifest_cannot_point_at_another_entrys_objects():
    import torch
    ns, h1, h2 = b"n" * 32, b"a" * 32, b"b" * 32
    t = {"latents": torch.zeros(1, 2, 3)}
    _, (_, manifest) = encode_entry(ns, h1, None, "full", 64, 64, t)
    expected = {"latents": ("float32", (1, 2, 3))}
    decode_manifest(manifest, "full", 64, expected, {"latents": entry_key(ns, h1, "full", "latents")})
    with pytest.raises(EntryError, match="points outside its entry") as exc:
        decode_manifest(manifest, "full", 64, expected, {"latents": entry_key(ns, h2, "full", "latents")})
    assert exc.value.reason == "incomplete"
    deep = b"[" * 100000 + b"]" * 100000
    with pytest.raises(EntryError) as exc:
        decode_manifest(deep, "full", 64, expected, {"latents": "k"})
    assert exc.value.reason == "incomplete"
