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
