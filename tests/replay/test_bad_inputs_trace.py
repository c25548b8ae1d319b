"""A trace line whose prompt no replayed model could hold is refused at load time, naming file, line,
field and the bound (before: it passed validation and failed in a 16-107 GiB allocation)."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.replay.trace import MAX_INPUT_TOKENS, TraceError, load_trace

BLOCK = 512


def _line(ts: int, input_length: int, first_id: int = 0) -> str:
    ids = list(range(first_id, first_id + -(-input_length // BLOCK)))
    return json.dumps({"timestamp": ts, "input_length": input_length, "output_length": 4, "hash_ids": ids})


@pytest.fixture
def trace(tmp_path):
    """Three lines; line 2 asks for 2^31 - 1 prompt tokens (with the 4,194,304 hash ids that takes)."""
    path = tmp_path / "huge.jsonl"
    path.write_text("\n".join([_line(0, 1024), _line(1, 2**31 - 1, first_id=100), _line(2, 1024)]) + "\n")
    return path


def test_a_prompt_longer_than_the_bound_is_refused_naming_file_line_field_and_bound(trace):
    with pytest.raises(TraceError) as info:
        load_trace(trace)
    text = str(info.value)
    assert f"{trace}:2:" in text and "'input_length'" in text and "2147483647" in text
    assert f"at most {MAX_INPUT_TOKENS}" in text


def test_the_bound_itself_is_accepted(tmp_path):
    path = tmp_path / "edge.jsonl"
    path.write_text(_line(0, MAX_INPUT_TOKENS) + "\n" + _line(1, MAX_INPUT_TOKENS + 1) + "\n")
    load = load_trace(path, skip_bad=True)
    assert [r.input_length for r in load.requests] == [MAX_INPUT_TOKENS]
    assert load.skipped_reasons == {"out_of_range": 1}


def test_replay_exits_2_with_one_line_and_skip_bad_skips_it(trace, tmp_path, capsys):
    assert main(["replay", "--no-progress", "--simulate", "--trace", str(trace)]) == 2
    err = capsys.readouterr()
    text = " ".join((err.out + err.err).split())
    assert "Traceback" not in text and "'input_length' is 2147483647" in text and "1048576" in text
    out = tmp_path / "report.json"
    assert main(["replay", "--no-progress", "--simulate", "--skip-bad", "--trace", str(trace),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 2 and report["skipped_lines"] == 1
