import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.replay.trace import (
    TraceError,
    TraceRequest,
    block_token_ids,
    load_trace,
    request_token_ids,
    scaled_input_length,
    scaled_output_length,
)

GOOD = {"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [0, 1]}


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def with_fields(**changes) -> str:
    obj = dict(GOOD)
    for key, value in changes.items():
        if value is _DROP:
            del obj[key]
        else:
            obj[key] = value
    return json.dumps(obj)


_DROP = object()

BAD_LINES = [
    ("not json", "{not json", "invalid_json", "JSON"),
    ("array", "[1, 2]", "not_object", "object"),
    ("missing timestamp", with_fields(timestamp=_DROP), "missing_field", "'timestamp'"),
    ("missing hash_ids", with_fields(hash_ids=_DROP), "missing_field", "'hash_ids'"),
    ("string length", with_fields(input_length="600"), "wrong_type", "'input_length'"),
    ("float timestamp", with_fields(timestamp=1.5), "wrong_type", "'timestamp'"),
    ("bool output", with_fields(output_length=True), "wrong_type", "'output_length'"),
    ("negative input", with_fields(input_length=-3), "negative_value", "'input_length'"),
    ("negative output", with_fields(output_length=-1), "negative_value", "'output_length'"),
    ("negative timestamp", with_fields(timestamp=-10), "negative_value", "'timestamp'"),
    ("zero input", with_fields(input_length=0, hash_ids=[]), "negative_value", "'input_length'"),
    ("hash_ids not list", with_fields(hash_ids=7), "wrong_type", "'hash_ids'"),
    ("hash id string", with_fields(hash_ids=[0, "x"]), "wrong_type", "'hash_ids'[1]"),
    ("negative hash id", with_fields(hash_ids=[0, -4]), "negative_hash_id", "-4"),
    ("too few ids", with_fields(hash_ids=[0]), "hash_ids_length", "'hash_ids'"),
    ("too many ids", with_fields(hash_ids=[0, 1, 2]), "hash_ids_length", "600"),
    # Beyond the integer range the replay computes with (a crash in the run, not a line error, before).
    ("hash id over 64 bits", with_fields(hash_ids=[0, 2**64]), "out_of_range", "'hash_ids'[1]"),
    ("huge output", with_fields(output_length=10**23), "out_of_range", "'output_length'"),
    ("huge timestamp", with_fields(timestamp=10**400), "out_of_range", "'timestamp'"),
]


@pytest.fixture(scope="module")
def bundled():
    return load_trace()


def test_bundled_trace_loads_whole(bundled):
    start = time.perf_counter()
    load = load_trace()
    elapsed = time.perf_counter() - start
    print(f"whole trace load: {elapsed:.3f} s for {len(load.requests)} requests")
    assert len(load.requests) == 12031
    assert load.skipped == 0 and load.skipped_reasons == {}
    assert load.path is not None and load.path.name == "conversation_trace.jsonl"
    first = load.requests[0]
    assert first == TraceRequest(0, 1, 0, 6758, 500, tuple(range(14)))
    assert [r.index for r in load.requests[:5]] == [0, 1, 2, 3, 4]
    assert all(r.hash_ids[0] == 0 for r in load.requests)
    assert sum(r.input_length for r in load.requests) == 144_793_823


def test_limit(bundled):
    load = load_trace(limit=3)
    assert load.requests == bundled.requests[:3]
    with pytest.raises(ValueError):
        load_trace(limit=0)


@pytest.mark.parametrize(("bad", "reason", "needle"), [b[1:] for b in BAD_LINES], ids=[b[0] for b in BAD_LINES])
def test_bad_line_names_file_line_and_field(tmp_path, bad, reason, needle):
    path = write_lines(tmp_path, [json.dumps(GOOD), "", bad, json.dumps(GOOD)])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert f"{path}:3:" in message
    assert needle in message


def test_skip_bad_counts_by_reason(tmp_path):
    lines = [json.dumps(GOOD)] + [b[1] for b in BAD_LINES] + ["", "   ", json.dumps(GOOD)]
    load = load_trace(write_lines(tmp_path, lines), skip_bad=True)
    assert len(load.requests) == 2
    assert load.skipped == len(BAD_LINES)
    expected: dict[str, int] = {}
    for _, _, reason, _ in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert load.skipped_reasons == expected
    assert [r.index for r in load.requests] == [0, 1]
    assert [r.line_no for r in load.requests] == [1, len(lines)]


def test_empty_lines_are_silent(tmp_path):
    load = load_trace(write_lines(tmp_path, ["", json.dumps(GOOD), "", ""]))
    assert len(load.requests) == 1 and load.skipped == 0
    assert load.requests[0].line_no == 2


def test_no_valid_requests(tmp_path):
    with pytest.raises(TraceError, match="no valid requests"):
        load_trace(write_lines(tmp_path, ["", ""]))
    with pytest.raises(TraceError, match="no valid requests") as info:
        load_trace(write_lines(tmp_path, ["{bad", "[]"]), skip_bad=True)
    assert str(tmp_path) in str(info.value)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope" / "trace.jsonl"
    with pytest.raises(TraceError) as info:
        load_trace(missing)
    assert str(missing) in str(info.value)


def test_trace_block_tokens_changes_length_check(tmp_path):
    path = write_lines(tmp_path, [json.dumps({**GOOD, "hash_ids": [0, 1, 2]})])
    assert len(load_trace(path, trace_block_tokens=256).requests) == 1
    with pytest.raises(TraceError):
        load_trace(path)


# --- token synthesis ---------------------------------------------------------------

_SNIPPET = (
    "from hybridkv.replay.trace import block_token_ids;"
    "print([block_token_ids(h, 16, 151_000, seed=s) for h in (0, 7, 123_456) for s in (0, 3)])"
)


def test_block_tokens_same_across_processes():
    outputs = []
    for hashseed in ("1", "987"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        result = subprocess.run(
            [sys.executable, "-c", _SNIPPET], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
    here = [block_token_ids(h, 16, 151_000, seed=s) for h in (0, 7, 123_456) for s in (0, 3)]
    assert outputs[0].strip() == str(here)


def test_block_tokens_range_and_distinctness():
    blocks = [block_token_ids(h, 64, 1000) for h in range(50)]
    assert all(len(b) == 64 and all(0 <= t < 1000 for t in b) for b in blocks)
    assert len({tuple(b) for b in blocks}) == 50
    assert block_token_ids(3, 64, 1000, seed=1) != block_token_ids(3, 64, 1000)
    # the returned list is a fresh copy: cached blocks stay unchanged
    b = block_token_ids(3, 64, 1000)
    b[0] = -1
    assert block_token_ids(3, 64, 1000)[0] != -1
    with pytest.raises(ValueError):
        block_token_ids(1, 0, 10)
    with pytest.raises(ValueError):
        block_token_ids(1, 4, 0)


def test_full_scale_reproduces_input_length(bundled):
    for req in bundled.requests[:100]:
        tokens = request_token_ids(req, 512, 163_840)
        assert len(tokens) == req.input_length == scaled_input_length(req, 512)
        assert tokens[:512] == block_token_ids(req.hash_ids[0], 512, 163_840)
    assert scaled_output_length(bundled.requests[0], 512) == 500


def test_scaled_lengths():
    req = TraceRequest(0, 1, 0, 512 * 2 + 100, 700, (4, 5, 6))
    # last real block 100 tokens -> round(100 * 16 / 512) = round(3.125) = 3
    assert scaled_input_length(req, 16) == 16 * 2 + 3
    assert len(request_token_ids(req, 16, 1000)) == 35
    tiny = TraceRequest(0, 1, 0, 512 * 2 + 1, 0, (4, 5, 6))
    assert scaled_input_length(tiny, 16) == 33  # at least one token in the last block
    assert scaled_output_length(tiny, 16) == 1
    assert scaled_output_length(req, 16) == 22  # round(21.875)
    tokens = request_token_ids(req, 16, 1000)
    assert tokens[32:] == block_token_ids(6, 16, 1000)[:3]


id_paths = st.lists(st.integers(0, 6), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(a=id_paths, b=id_paths, last_a=st.integers(1, 512), last_b=st.integers(1, 512), bt=st.integers(1, 64))
def test_scaling_keeps_shared_prefixes(a, b, last_a, last_b, bt):
    # prefix-chained ids: the id at position i encodes the path so far
    ids_a = tuple(hash(tuple(a[: i + 1])) & 0xFFFFFF for i in range(len(a)))
    ids_b = tuple(hash(tuple(b[: i + 1])) & 0xFFFFFF for i in range(len(b)))
    ra = TraceRequest(0, 1, 0, 512 * (len(a) - 1) + last_a, 1, ids_a)
    rb = TraceRequest(1, 2, 0, 512 * (len(b) - 1) + last_b, 1, ids_b)
    ta, tb = request_token_ids(ra, bt, 1 << 30), request_token_ids(rb, bt, 1 << 30)
    assert len(ta) == scaled_input_length(ra, bt)
    shared = 0
    while shared < min(len(a), len(b)) and ids_a[shared] == ids_b[shared]:
        shared += 1
    # whole shared blocks are equal token for token
    common = min(shared * bt, len(ta), len(tb))
    assert ta[:common] == tb[:common]
    if shared < min(len(a), len(b)) - 1:
        # first diverging full block differs (vocab 2**30: a clash is ~impossible)
        assert ta[shared * bt : (shared + 1) * bt] != tb[shared * bt : (shared + 1) * bt]
