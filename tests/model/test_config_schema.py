"""The model config schema: every bad ``config.json`` value is refused by ``hybridkv replay --model DIR``
with exit 2 and one line naming the file, the key and the value as the file has it."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli import main
from hybridkv.model.config import HybridConfig
from hybridkv.model.config_schema import MAX_SIZE


def _model_dir(tmp_path, key: str, value) -> str:
    """A directory whose ``config.json`` is the tiny preset with ``key`` (dotted: nested) set to ``value``."""
    d = HybridConfig.preset("tiny").to_hf_dict()
    *outer, last = key.split(".")
    target = d
    for part in outer:
        target = target[part]
    target[last] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


def _replay_error(tmp_path, capsys, key: str, value, *extra: str) -> str:
    path = _model_dir(tmp_path, key, value)
    rc = main(["replay", "--simulate", "--no-progress", "--limit", "1", "--model", path, *extra])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2, err
    assert "Traceback" not in err and err.count("error:") == 1
    assert f"{tmp_path / 'config.json'}: invalid model config:" in err
    return err


@pytest.mark.parametrize("key,value,why", [
    # before: TypeError "int() argument must be ... not 'list'" (traceback, exit 1)
    ("hidden_size", [64], "hidden_size=[64]: must be an integer, not an array"),
    # before: truncated to 64, exit 0
    ("hidden_size", 64.5, "hidden_size=64.5: must be an integer, not a number with a fraction"),
    ("kv_lora_rank", 32.0, "kv_lora_rank=32.0: must be an integer"),
    # before: accepted as 64, exit 0
    ("hidden_size", "64", 'hidden_size="64": must be an integer, not a string'),
    # before: "invalid literal for int() with base 10: 'abc'" without the key
    ("hidden_size", "abc", 'hidden_size="abc": must be an integer, not a string'),
    # before: read as 1, then a tensor shape error
    ("hidden_size", True, "hidden_size=true: must be an integer, not true/false"),
    ("vocab_size", -5, "vocab_size=-5: must be >= 1"),
    ("intermediate_size", MAX_SIZE + 1, f"intermediate_size={MAX_SIZE + 1}: must be <= {MAX_SIZE}"),
    ("linear_attn_config.num_heads", 0, "linear_attn_config.num_heads=0: must be >= 1"),
    ("rms_norm_eps", "x", 'rms_norm_eps="x": must be a number, not a string'),
    ("rms_norm_eps", 0, "rms_norm_eps=0: must be a finite number > 0"),
    ("routed_scaling_factor", True, "routed_scaling_factor=true: must be a number, not true/false"),
    ("moe_renormalize", "false", 'moe_renormalize="false": must be true or false, not a string'),
    ("pad_token_id", True, "pad_token_id=true: must be an integer"),
    ("linear_attn_config", [1], "linear_attn_config=[1]: must be an object, not an array"),
    ("mlp_layer_types", "dense", 'mlp_layer_types="dense": must be an array'),
])
def test_a_size_of_the_wrong_type_or_range_is_named(tmp_path, capsys, key, value, why):
    assert why in _replay_error(tmp_path, capsys, key, value)


def test_zero_attention_heads_is_blamed_on_num_attention_heads(tmp_path, capsys):
    """Before: "num_key_value_heads=2: must equal num_attention_heads"."""
    err = _replay_error(tmp_path, capsys, "num_attention_heads", 0)
    assert "num_attention_heads=0: must be >= 1" in err and "num_key_value_heads" not in err


def test_unequal_key_value_heads_names_both(tmp_path, capsys):
    err = _replay_error(tmp_path, capsys, "num_key_value_heads", 1)
    assert "num_key_value_heads=1: must equal num_attention_heads=2" in err


@pytest.mark.parametrize("kda,why", [
    # before: "kda_layers=(0, 1, 4): layer 4 outside [0, 4)" (0-based; the file said 5)
    ([1, 2, 5], "[[1, 2, 5], [3]]: layer 5 outside 1..4 (num_hidden_layers=4)"),
    ([0, 1, 2], "[[0, 1, 2], [3]]: layer 0 outside 1..4"),
    ([1, 2, 3, 4], "[[1, 2, 3, 4], [3]]: layer 3 listed twice"),
    ([1, 2], "[[1, 2], [3]]: layer 4 in neither list"),
    ([1, True], "linear_attn_config.kda_layers=[1, true]: must be an array of 1-based layer numbers"),
])
def test_layer_errors_show_the_files_1_based_numbers(tmp_path, capsys, kda, why):
    err = _replay_error(tmp_path, capsys, "linear_attn_config.kda_layers", kda)
    assert why in err
    if "outside" in why or "twice" in why or "neither" in why:
        assert "linear_attn_config.kda_layers/full_attn_layers=" in err


def test_fewer_layers_than_listed_names_the_file_number(tmp_path, capsys):
    err = _replay_error(tmp_path, capsys, "num_hidden_layers", 3)
    assert "layer 4 outside 1..3 (num_hidden_layers=3)" in err


def test_a_bad_size_is_refused_before_weights_are_read(tmp_path, capsys):
    """A real (not simulated) replay: before, ``true`` reached the weight loader as a shape error."""
    path = _model_dir(tmp_path, "hidden_size", True)
    rc = main(["replay", "--no-progress", "--limit", "1", "--model", path])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "hidden_size=true: must be an integer" in err and "tensor" not in err


def test_direct_construction_checks_the_same_schema():
    c = HybridConfig.preset("tiny")
    fields = {f: getattr(c, f) for f in c.__slots__}
    with pytest.raises(ValueError, match="hidden_size=64.5: must be an integer"):
        HybridConfig(**dict(fields, hidden_size=64.5))
    with pytest.raises(ValueError, match=r"kda_layers/mla_layers=.*layer 4 outside 0..3"):
        HybridConfig(**dict(fields, kda_layers=(0, 1, 4)))
