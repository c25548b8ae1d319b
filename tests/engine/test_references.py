"""S12 (references) and the randomized no-cache equivalence property."""

from __future__ import annotations

import numpy as np
from hkv_helpers import assert_exact, make_engine, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.engine.request import Request, Status


def _assert_all_released(engine):
    cache = engine.cache
    cache.check_invariants()
    assert all(rc == 0 for rc in cache.pages.refcount), "page refcounts"
    assert all(rc == 0 for rc in cache.checkpoints.refcount), "checkpoint refcounts"
    assert cache.pages.num_free + cache.pages.num_evictable == cache.pages.num_pages
    cache.clear()
    cache.check_invariants()
    assert cache.pages.num_free == cache.pages.num_pages
    assert cache.checkpoints.num_free == cache.checkpoints.num_slots
    assert cache.index.num_nodes == 0


def test_s12_references_return_to_start(tiny_model):
    v = tiny_model.config.vocab_size
    rng = np.random.default_rng(12)
    prefixes = [tokens(100 + i, int(rng.integers(128, 384)), v) for i in range(5)]
    e = make_engine(tiny_model, policy="branch+tail+interval=128", block_size=128, unit=64,
                    budget=256, pages=8, slots=6, max_num_seqs=4)
    stages = ["prefill", "after_lookup", "decode", "failed_admission"]
    reqs, plan = [], {}
    for i in range(200):
        p = prefixes[int(rng.integers(len(prefixes)))]
        cut = int(rng.integers(1, len(p) + 1))
        prompt = np.concatenate([p[:cut], tokens(1000 + i, int(rng.integers(1, 120)), v)])
        r = e.add_request(Request(f"q{i}", prompt, int(rng.integers(2, 6))))
        reqs.append(r)
        if rng.random() < 0.3:
            plan[r.request_id] = stages[len(plan) % len(stages)]
    cancelled = dict.fromkeys(stages, 0)

    def reached(r, stage):
        if stage == "after_lookup":
            return r.status == Status.PREFILL and r.computed == r.reused
        if stage == "prefill":
            return r.status == Status.PREFILL and r.computed > r.reused
        if stage == "decode":
            return r.status == Status.DECODE
        return r.status == Status.WAITING and r.admission_failures > 0

    while e.has_work:
        e.admit()
        for r in list(e.running) + list(e.waiting):
            stage = plan.get(r.request_id)
            if stage and reached(r, stage):
                cancelled[stage] += 1
                e.cancel(r)
        e.step()
        e.cache.check_invariants()
    n_cancel = sum(cancelled.values())
    assert 40 <= n_cancel <= 80, cancelled                    # about 30% of 200
    assert all(n > 0 for n in cancelled.values()), cancelled
    assert e.stats.reused_tokens > 0 and e.cache.evicted_pages > 0
    assert all(r.done for r in reqs)
    _assert_all_released(e)


request_spec = st.tuples(st.integers(0, 2), st.integers(1, 300), st.integers(1, 80), st.integers(1, 3),
                         st.sampled_from([None, "waiting", "prefill", "decode"]))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(request_spec, min_size=2, max_size=6), mechanism=st.sampled_from(["extract", "split"]),
       seed=st.integers(0, 1000))
def test_random_sequences_equal_no_cache(tiny_model, specs, mechanism, seed):
    v = tiny_model.config.vocab_size
    prefixes = [tokens(seed * 7 + i, 320, v) for i in range(3)]
    e = make_engine(tiny_model, policy="branch+tail+interval=128", mechanism=mechanism, block_size=128,
                    unit=64, budget=192, pages=10, slots=3, max_num_seqs=3)
    reqs = []
    for i, (which, cut, extra, out, cancel_at) in enumerate(specs):
        prompt = np.concatenate([prefixes[which][:cut], tokens(seed * 13 + i, extra, v)])
        r = e.add_request(Request(f"h{i}", prompt, out, record_logits=True))
        reqs.append((r, cancel_at))
    while e.has_work:
        for r, cancel_at in reqs:
            if cancel_at is not None and not r.done and r.status.value == cancel_at:
                e.cancel(r)
        e.step()
        e.cache.check_invariants()
    for r, _ in reqs:
        if r.status == Status.FINISHED:
            assert_exact(tiny_model, r)
    _assert_all_released(e)
