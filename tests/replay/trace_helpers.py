"""Small traces for the replay tests."""
import json


def whole_block_trace(tmp_path, prompts: list[list[int]]) -> str:
    """A Mooncake-format trace at ``tmp_path/trace.jsonl``: one request per hash-id list (a request
    ``i`` arrives at second ``i``), every block whole (512 tokens of ``input_length`` each), one
    output token. Returns the path."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(prompts)))
    return str(path)
