import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.replay.oracle import oracle_from_trace, oracle_reused_tokens, oracle_scan
from hybridkv.replay.trace import TraceRequest, load_trace, request_token_ids

VOCAB = 1 << 30


def naive_oracle(token_lists, block_size):
    """Dict of every earlier prompt's whole-block prefixes, as token tuples."""
    seen: dict[tuple[int, ...], bool] = {}
    out = []
    for tokens in token_lists:
        cap = max(0, len(tokens) - 1) // block_size
        k = 0
        while k < cap and tuple(tokens[: (k + 1) * block_size]) in seen:
            k += 1
        out.append(k * block_size)
        for j in range(1, len(tokens) // block_size + 1):
            seen[tuple(tokens[: j * block_size])] = True
    return out


def pairwise_oracle(token_lists, block_size):
    """Longest common prefix with any earlier prompt, by direct comparison."""
    arrays = [np.asarray(t) for t in token_lists]
    out = []
    for i, cur in enumerate(arrays):
        best = 0
        for prev in arrays[:i]:
            n = min(len(cur), len(prev))
            diff = np.flatnonzero(cur[:n] != prev[:n])
            best = max(best, int(diff[0]) if diff.size else n)
        cap = max(0, len(cur) - 1) // block_size * block_size
        out.append(min(best // block_size * block_size, cap))
    return out


@pytest.fixture(scope="module")
def trace():
    return load_trace().requests


def test_small_cases():
    a = [1, 2, 3, 4, 5, 6]
    # identical 6-token prompt at block 2: T-1 cap -> 4 tokens, not 6
    assert oracle_scan([a, a], 2).per_request == (0, 4)
    # shares one block with a, then diverges
    assert oracle_scan([a, [1, 2, 9, 9, 9]], 2).per_request == (0, 2)
    # a partial trailing block is never reused; a prefix shorter than a block neither
    assert oracle_scan([[1, 2, 3], [1, 2, 3, 4]], 2).per_request == (0, 2)
    assert oracle_scan([[1], [1, 5]], 2).per_request == (0, 0)
    # content at a different position is not a prefix hit
    assert oracle_scan([[7, 7, 1, 2], [1, 2, 3, 4]], 2).per_request == (0, 0)
    assert oracle_reused_tokens([a, a, a], 3) == 3 + 3
    assert oracle_scan([], 4).reused_tokens == 0
    with pytest.raises(ValueError):
        oracle_scan([a], 0)


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=20), min_size=1, max_size=12),
    block_size=st.integers(1, 5),
)
def test_scan_matches_naive(prompts, block_size):
    result = oracle_scan(prompts, block_size)
    assert list(result.per_request) == naive_oracle(prompts, block_size)
    assert list(result.per_request) == pairwise_oracle(prompts, block_size)
    assert result.prompt_tokens == sum(map(len, prompts))


@settings(max_examples=60, deadline=None)
@given(
    paths=st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 512)),
        min_size=1,
        max_size=10,
    ),
    block_tokens=st.integers(1, 24),
    block_size=st.integers(1, 40),
)
def test_id_level_matches_token_level(paths, block_tokens, block_size):
    requests = []
    for i, (path, last) in enumerate(paths):
        ids = tuple(1 + (hash(tuple(path[: j + 1])) & 0xFFFFF) for j in range(len(path)))
        requests.append(TraceRequest(i, i + 1, 0, 512 * (len(ids) - 1) + last, 1, ids))
    tokens = [request_token_ids(r, block_tokens, VOCAB) for r in requests]
    by_ids = oracle_from_trace(requests, block_tokens, block_size)
    by_tokens = oracle_scan(tokens, block_size)
    assert by_ids == by_tokens


def test_first_2000_at_512(trace):
    head = trace[:2000]
    by_ids = oracle_from_trace(head, 512, 512)
    # id level, checked against prefix tuples of ids (ids are prefix-chained)
    seen: set[tuple[int, ...]] = set()
    expected = []
    for r in head:
        cap = (r.input_length - 1) // 512
        whole = r.input_length // 512
        k = 0
        while k < cap and r.hash_ids[: k + 1] in seen:
            k += 1
        expected.append(k * 512)
        seen.update(r.hash_ids[: j + 1] for j in range(whole))
    assert list(by_ids.per_request) == expected
    # token level on a slice, with real 512-token blocks
    n = 120
    tokens = [request_token_ids(r, 512, 163_840) for r in head[:n]]
    assert list(by_ids.per_request[:n]) == pairwise_oracle(tokens, 512)
    assert oracle_scan(tokens, 512).per_request == by_ids.per_request[:n]
    assert sum(by_ids.per_request[:n]) > 0


@pytest.fixture(scope="module")
def head_tokens_16(trace):
    return [request_token_ids(r, 16, 163_840) for r in trace[:2000]]


@pytest.mark.parametrize("block_size", [16, 64, 8, 12, 24])
def test_id_level_matches_tokens_on_trace(trace, head_tokens_16, block_size):
    expected = oracle_scan(head_tokens_16, block_size)
    assert oracle_from_trace(trace[:2000], 16, block_size) == expected


def test_whole_trace_about_37_percent(trace):
    result = oracle_from_trace(trace, 512, 512)
    rate = result.token_hit_rate
    print(
        f"whole-trace oracle @512: {result.reused_tokens:,} / {result.prompt_tokens:,}"
        f" tokens = {100 * rate:.2f}%"
    )
    assert result.prompt_tokens == 144_793_823
    assert 0.36 < rate < 0.38
    scaled = oracle_from_trace(trace, 16, 16)
    assert abs(scaled.token_hit_rate - rate) < 0.005


def test_block_run_trie_answers_as_the_cache_block_trie_on_the_trace(trace):
    """The per-trace-block trie (one node a trace block) against the cache-block trie fed one key
    a cache block, at the simulator's 64-token unit in 512-token trace blocks."""
    from hybridkv.replay.oracle import _BlockRunTrie, _PrefixTrie
    from hybridkv.replay.trace import scaled_input_length

    runs, units = _BlockRunTrie(), _PrefixTrie()
    for r in trace[:3000]:
        length = scaled_input_length(r, 512)
        n, cap = length // 64, (length - 1) // 64
        keys = [r.hash_ids[j // 8] for j in range(n)]
        assert runs.match_then_insert(r.hash_ids, n, 8, cap) == units.match_then_insert(keys, cap)
