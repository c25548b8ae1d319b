"""Simulated replays key their caches by trace unit payloads (no tokens synthesised): the
keys must fall exactly where hashing the synthetic tokens puts them, and whole runs must
give the same figures either way."""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.index import PrefixIndex
from hybridkv.cache.namespace import (
    CacheIdentity,
    PeriodicMemo,
    chain_payloads,
    chain_periodic,
    chained_block_hashes,
)
from hybridkv.cache.pools import CheckpointPool, PagePool
from hybridkv.engine.build import build_engine, model_config
from hybridkv.engine.request import Request
from hybridkv.replay.instance import InstanceSpec, run_instance
from hybridkv.replay.timed import TimedSetup, run_timed
from hybridkv.replay.trace import (
    TraceRequest,
    TraceUnits,
    load_trace,
    placeholder_prompts,
    request_token_array,
    scaled_input_length,
)

NS = CacheIdentity(tenant="sim-keys").digest()
VOCAB = 1000

# prefix-chained ids, partial last blocks, one id reused at another position (7 after 5 and first)
IDS = [(1, 2, 3), (1, 2, 4), (1, 2), (5,), (1, 2, 3, 6), (7, 2, 3), (5, 7), (7,)]
LENGTHS = [1500, 1100, 1024, 300, 2000, 1400, 700, 512]


def trace_requests() -> list[TraceRequest]:
    return [TraceRequest(i, i + 1, 10 * i, n, 4, ids) for i, (ids, n) in enumerate(zip(IDS, LENGTHS))]


@pytest.mark.parametrize("block_tokens, unit", [(512, 64), (64, 64), (96, 64), (32, 64), (100, 16)])
def test_payload_keys_are_equal_exactly_where_token_hashes_are(block_tokens, unit):
    units = TraceUnits(block_tokens, unit, VOCAB, seed=3)
    reqs = trace_requests()
    keys = [chain_payloads(NS, units.payloads(r)) for r in reqs]
    toks = [chained_block_hashes(NS, request_token_array(r, block_tokens, VOCAB, seed=3), unit) for r in reqs]
    for r, k, t in zip(reqs, keys, toks):
        assert len(k) == len(t) == scaled_input_length(r, block_tokens) // unit
    for (ka, ta), (kb, tb) in itertools.product(zip(keys, toks), repeat=2):
        for i in range(min(len(ka), len(kb))):
            assert (ka[i] == kb[i]) == (ta[i] == tb[i])
    assert len({k for ks in keys for k in ks}.intersection(t for ts in toks for t in ts)) == 0


@pytest.mark.parametrize("block_tokens, unit", [(512, 64), (64, 64), (96, 64), (32, 64), (100, 16), (128, 32)])
def test_periodic_hashes_are_the_payload_chain(block_tokens, unit):
    units = TraceUnits(block_tokens, unit, VOCAB, seed=3)
    engine = build_engine(model_config("tiny"), _config(64), model_name="tiny").engine
    for r in trace_requests():
        want = engine.cache.chain_units(units.payloads(r))
        assert units.hashes(r, engine.cache) == want
        periodic = units.periodic(r)
        assert (periodic is None) == (block_tokens % unit != 0)
        if periodic is not None:
            heads, tails, n = periodic
            assert [heads[i % len(heads)] + tails[i // len(heads)] for i in range(n)] == units.payloads(r)
            assert chain_periodic(NS, heads, tails, n) == chain_payloads(NS, units.payloads(r))


@pytest.mark.parametrize("block_tokens, unit", [(512, 64), (64, 64), (96, 64), (128, 32)])
def test_memoised_hashes_equal_the_payload_chain(block_tokens, unit):
    """hashes_all (whole blocks through a memo, the trace's requests twice so every block repeats)
    gives chain_units' hashes for every request; a memo refuses other heads or namespaces."""
    units = TraceUnits(block_tokens, unit, VOCAB, seed=3)
    engine = build_engine(model_config("tiny"), _config(64), model_name="tiny").engine
    reqs = trace_requests() * 2
    got = units.hashes_all(reqs, engine.cache)
    assert got == [engine.cache.chain_units(units.payloads(r)) for r in reqs]
    if block_tokens % unit:                            # not periodic: hashes_all is hashes, no memo
        return
    memo = PeriodicMemo(NS, units.periodic(reqs[0])[0])
    for r in reqs:
        heads, tails, n = units.periodic(r)
        assert chain_periodic(NS, heads, tails, n, memo) == chain_payloads(NS, units.payloads(r))
    distinct = {(ks[i * len(heads) - 1] if i else b"hybridkv.root", r.hash_ids[i])
                for r, ks in zip(reqs, (chain_periodic(NS, *units.periodic(r)) for r in reqs))
                for i in range(len(ks) // len(heads))}
    assert len(memo.blocks) == len(distinct)
    with pytest.raises(ValueError, match="memo"):
        chain_periodic(NS + b"x", heads, tails, n, memo)
    with pytest.raises(ValueError, match="memo"):
        chain_periodic(NS, heads[:-1] + [b"other"], tails, n, memo)


def test_periodic_chains_name_bad_payloads_as_the_payload_chain_does():
    heads, tails = [b"abc", b"abcdefgh"], [b"x", b"12345678"]     # payload 1 (9 bytes) is fine, 3 (16) is not
    assert chain_periodic(NS, heads, tails, 2) == chain_payloads(NS, [b"abcx", b"abcdefghx"])
    assert chain_periodic(NS, heads, tails, 0) == []
    for n in (3, 4):
        with pytest.raises(ValueError, match="unit payload 3 is 16 bytes") if n == 4 else contextlib.nullcontext():
            chain_periodic(NS, heads, tails, n)
        payloads = [heads[i % 2] + tails[i // 2] for i in range(n)]
        with pytest.raises(ValueError, match="unit payload 3 is 16 bytes") if n == 4 else contextlib.nullcontext():
            chain_payloads(NS, payloads)
    with pytest.raises(ValueError, match="unit payload 0 is 8 bytes"):
        chain_periodic(NS, [b"abcdefg"], [b"z", b"y"], 1)
    with pytest.raises(ValueError, match="5 payloads from 2 heads and 2 tails"):
        chain_periodic(NS, heads, tails, 5)


def test_bad_units_and_payloads_are_named():
    with pytest.raises(ValueError, match="unit must be >= 1, got 0"):
        TraceUnits(512, 0, VOCAB)
    with pytest.raises(ValueError, match="hash id 18446744073709551616"):
        TraceUnits(512, 64, VOCAB).payloads(TraceRequest(0, 1, 0, 10, 1, (1 << 64,)))
    engine = build_engine(model_config("tiny"), _config(64), model_name="tiny").engine
    with pytest.raises(ValueError, match="unit payload 1 is 16 bytes"):
        engine.cache.chain_units([b"abc", b"0123456789abcdef"])
    with pytest.raises(ValueError, match="placeholder|length must be >= 1, got 0"):
        placeholder_prompts([3, 0])


def _config(block: int, pages: int = 4096, slots: int = 512) -> CacheConfig:
    return CacheConfig(block_size=block, prefix_match_unit=64, num_kv_pages=pages, num_checkpoint_slots=slots,
                       policy=CheckpointPolicy.parse("branch+tail=512+interval=2048+supersede"), max_num_seqs=4,
                       max_num_batched_tokens=8192)


def test_given_hashes_give_the_same_lookup_and_a_wrong_count_is_refused():
    built = build_engine(model_config("tiny"), _config(64), model_name="tiny")
    engine, cache = built.engine, built.engine.cache
    prompt = request_token_array(trace_requests()[4], 512, VOCAB)
    engine.add_request(Request("a", prompt))
    engine.run_until_done()
    again = np.concatenate([prompt[:640], prompt[:100]])
    hashes = cache.hash_prompt(again)
    assert cache.lookup(again, hashes=hashes, touch=False) == cache.lookup(again, touch=False)
    with pytest.raises(ValueError, match="10 unit hashes given for a prompt of 740 tokens"):
        cache.lookup(again, hashes=hashes[:10])
    with pytest.raises(ValueError, match="request b: 3 unit hashes given for a prompt of 740 tokens"):
        engine.add_request(Request("b", again, hashes=hashes[:3]))


def test_extend_builds_the_tree_get_or_insert_builds():
    keys = [chained_block_hashes(NS, np.arange(8 * n, dtype=np.int64) % 5 + n, 8) for n in (1, 2, 1)]
    trees = []
    for batch in (False, True):
        pool = PagePool(64)
        index = PrefixIndex(8, pool, CheckpointPool(2))
        for ks in keys:
            pages = [pool.pop_free() for _ in ks]
            if batch:
                nodes = index.extend(index.root, ks, pages, owner=b"o", now=1.0)
            else:
                parent, nodes = index.root, []
                for k, p in zip(ks, pages):
                    parent, _ = index.get_or_insert(parent, k, p, owner=b"o", now=1.0)
                    nodes.append(parent)
            assert [n.key for n in nodes] == ks
            for p in pages:
                pool.unref(p)
        index.check_invariants()
        pool.check_invariants()
        trees.append(_nodes(index))
    assert trees[0] == trees[1]


def _nodes(index: PrefixIndex) -> list[tuple]:
    out, stack = [], [index.root]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        out.append((n.end, n.key, n.page, n.owner, n.created))
    return sorted(out)


def _timed(units, reqs, prompts):
    cfg = _config(512, pages=200, slots=60)
    setup = TimedSetup(model="tiny", seed=0, simulate=True, instances=3, router="hybrid", time_scale=1.0,
                       cost_model=None)
    run = run_timed(setup, cfg, reqs, prompts, [min(r.output_length, 50) for r in reqs], set(), None, units)
    return run.timing, [(res.stats, res.reused, res.evicted_pages, res.evicted_checkpoints, res.tiers)
                        for res in run.results]


def test_a_simulated_run_keyed_by_payloads_equals_one_hashing_tokens():
    """Timed (3 instances, hybrid router, shared store, eviction) and untimed, 60 trace requests."""
    reqs = load_trace(limit=60).requests
    vocab = model_config("tiny").vocab_size
    tokens = [request_token_array(r, 512, vocab) for r in reqs]
    units = TraceUnits(512, 64, vocab)
    placeholders = placeholder_prompts([len(p) for p in tokens])
    timed = _timed(units, reqs, placeholders)
    assert timed == _timed(None, reqs, tokens)
    assert sum(ev for _, _, ev, _, _ in timed[1]) > 0
    results = []
    for u, prompts in ((units, placeholders), (None, tokens)):
        spec = InstanceSpec(instance_id=0, model="tiny", seed=0, config=_config(512, pages=400, slots=100),
                            prompts=prompts, indices=list(range(len(reqs))), output_lengths=[1] * len(reqs),
                            simulate=True, trace=reqs if u else [], units=u)
        res = run_instance(spec)
        results.append((res.stats, res.reused, res.evicted_pages, res.evicted_checkpoints))
    assert results[0] == results[1]
    assert results[0][2] > 0            # the small pool evicted: eviction order is covered too
