"""benchmarks/frontier_loss.py: the loss attribution on hand-made traces whose losses are known."""

import importlib.util
import json
from pathlib import Path

import pytest
from rich.console import Console

_spec = importlib.util.spec_from_file_location(
    "frontier_loss", Path(__file__).resolve().parents[2] / "benchmarks" / "frontier_loss.py")
fl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fl)

BLOCK = 512
FILL = [[90_001], [90_002], [90_003]]


def _trace(path: Path, prompts: list[list[int]]) -> str:
    """One request per prompt (hash ids of 512-token blocks), 10 s apart. An untimed replay admits
    up to ``max_num_seqs`` (4) requests at once, so ``FILL`` (three one-block prompts that reuse and
    checkpoint nothing) before a prompt makes it arrive after the ones before have finished."""
    with open(path, "w") as f:
        for k, ids in enumerate(prompts):
            f.write(json.dumps({"timestamp": 10_000 * k, "input_length": BLOCK * len(ids), "output_length": 1,
                                "hash_ids": ids}) + "\n")
    return str(path)


def _run(trace: str, device: float, host: float) -> dict:
    console = Console(stderr=True, quiet=True)
    base, rec = fl.every_block(trace, None, BLOCK, console)
    return fl.attribute(trace, None, BLOCK, base, rec, device, host, "default", console, slot_bytes=1 << 20)


def test_first_branch_inside_a_prefix_is_placement(tmp_path: Path) -> None:
    # A computes 6 blocks; B branches after 3 of them (no checkpoint there yet: the default policy
    # places `branch` only when a request branches); C branches there too and finds B's checkpoint.
    trace = _trace(tmp_path / "t.jsonl", [[1, 2, 3, 4, 5, 6], *FILL, [1, 2, 3, 9], *FILL, [1, 2, 3, 10]])
    row = _run(trace, 1.0, 0.0)
    assert row["every_block_reused"] == 2 * 3 * BLOCK
    assert row["classes"] == {"placement: inside a longer prefix, first reuse": 3 * BLOCK}
    assert row["gain_tokens"] == 0
    assert row["row"]["reused_tokens"] == 3 * BLOCK


def test_tail_evicted_before_the_next_turn_is_retention(tmp_path: Path) -> None:
    # 20 one-turn conversations, then the first comes back: with 8 checkpoint slots its tail is gone.
    convs = [[100 * k + 1, 100 * k + 2, 100 * k + 3] for k in range(20)]
    trace = _trace(tmp_path / "t.jsonl", convs + FILL + [convs[0] + [7]])
    row = _run(trace, 0.01, 0.0)
    assert row["row"]["slots"] == 8
    lost = row["every_block_reused"] - row["row"]["reused_tokens"]
    assert lost > 0
    assert sum(row["classes"].values()) == lost
    assert set(row["classes"]) == {"retention: device evicted (tail, 0 uses)"}
    # with a host tier large enough, the demoted tail comes back: nothing is lost
    row = _run(trace, 0.01, 1.0)
    assert row["classes"] == {}
    assert row["row"]["reused_tokens"] == row["every_block_reused"]


def test_bad_cells_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        fl.main(["--cells", "0.05"])
    assert e.value.code == 2
    assert "--cells '0.05'" in capsys.readouterr().err


def test_one_request_trace_reports_zero_reuse(tmp_path: Path) -> None:
    # the every-block run reuses nothing: the shares are 0 of 0, not a ZeroDivisionError
    trace = _trace(tmp_path / "t.jsonl", [[1, 2]])
    row = _run(trace, 0.5, 0.0)
    assert row["every_block_reused"] == 0
    assert row["share"] == 0.0 and row["loss_tokens"] == 0 and row["class_shares"] == {}
    assert "reuses 0 tokens" in fl.summary([row])


def _bad(tmp_path: Path) -> dict[str, str]:
    good = _trace(tmp_path / "good.jsonl", [[1, 2], [1, 3]])
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    return {"good": good, "empty": str(tmp_path / "empty.jsonl"), "bad": str(tmp_path / "bad.jsonl")}


@pytest.mark.parametrize(("args", "message"), [
    (["--limit", "0"], "--limit 0: must be at least 1"),
    (["--limit", "-5"], "--limit -5: must be at least 1"),
    (["--block", "0"], "--block 0: must be a positive"),
    (["--block", "100"], "--block 100: policy interval=100 must be a multiple of prefix_match_unit"),
    (["--trace", "{tmp}/nonexistent.jsonl"], "--trace {tmp}/nonexistent.jsonl: cannot open trace file"),
    (["--trace", "{empty}"], "--trace {empty}: no valid requests"),
    (["--trace", "{good}", "{bad}"], "--trace {bad}:1: not valid JSON"),
    (["--json", "{tmp}/no/dir/x.json"], "--json {tmp}/no/dir/x.json: cannot write there"),
    (["--md", "/proc/x.md"], "--md /proc/x.md: cannot write there"),
    (["--md", "{tmp}"], "--md {tmp}: is a directory"),
])
def test_bad_options_are_one_line_before_the_run(tmp_path: Path, capsys, args, message) -> None:
    names = {"tmp": str(tmp_path), **_bad(tmp_path)}
    argv = ["--trace", names["good"], "--cells", "0.5:0", *[a.format(**names) for a in args]]
    with pytest.raises(SystemExit) as e:
        fl.main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: " + message.format(**names)) and captured.err.count("\n") == 1
    assert captured.out == ""       # nothing ran: no summary printed
    assert not (tmp_path / "x.json").exists()
