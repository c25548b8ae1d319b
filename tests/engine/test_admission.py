"""Admission: a request's hit path is held while pages are freed for it, and requests with token ids
the model cannot embed are refused before they hold anything."""

from __future__ import annotations

import numpy as np
import pytest
from hkv_helpers import assert_exact, make_engine, run_one, tokens

from hybridkv.engine.request import Request, Status


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


def test_a_request_that_fits_falls_back_to_less_reuse_instead_of_being_refused(tiny_model):
    """Block 128, a 2-page pool: X(64)+30 leaves X's unit cached on a page with a tail checkpoint;
    X+190 (254 tokens, 2 pages) cannot copy that partial page and take 2 fresh ones, so it runs
    without the hit (before: REJECTED "needs 2 pages; the pool has 2")."""
    v = tiny_model.config.vocab_size
    X = tokens(40, 64, v)
    e = make_engine(tiny_model, policy="tail", block_size=128, unit=64, pages=2, slots=4, max_num_seqs=1)
    run_one(e, np.concatenate([X, tokens(41, 30, v)]), max_output_tokens=1)
    r = run_one(e, np.concatenate([X, tokens(42, 190, v)]), max_output_tokens=1)
    assert r.prompt_len == 254 and r.reused == 0 and e.stats.rejected == 0
    assert_exact(tiny_model, r)
    e.cache.check_invariants()


def test_a_refusal_states_a_true_reason(tiny_model):
    v = tiny_model.config.vocab_size
    e = make_engine(tiny_model, policy="tail", block_size=128, unit=64, pages=2, slots=4, max_num_seqs=1)
    r = e.add_request(Request("big", tokens(43, 300, v), 1))
    e.run_until_done()
    assert r.status == Status.REJECTED
    assert r.reject_reason == "needs 3 pages (300 tokens of KV) even without reuse; the pool has 2"


@pytest.mark.parametrize("length, want", [(128, [0, 64, 64]), (256, [0, 192, 192])])
def test_identical_resend_of_an_aligned_prompt_reuses_the_deepest_usable_boundary(tiny_model, length, want):
    """Block 64, policy tail, the same prompt three times (before: 0/0/0 for 64 and 128, 0/0/192
    for 256 with branch, and tail alone never hit): the tail sits at T - 1 aligned down."""
    v = tiny_model.config.vocab_size
    e = make_engine(tiny_model, policy="tail", block_size=64, unit=64, pages=16, slots=8)
    P = tokens(44, length, v)
    got = []
    for _ in range(3):
        r = run_one(e, P, max_output_tokens=2)
        got.append(r.reused)
        assert_exact(tiny_model, r)
    assert got == want

