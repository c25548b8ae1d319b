"""DeepSeek-V4 config: presets, transformers round trip, legacy keys, named validation errors."""

from __future__ import annotations

import json

import pytest

from hybridkv.model.v4.config import V4_PRESETS, V4Config


@pytest.mark.parametrize("name", V4_PRESETS)
def test_presets_have_the_real_schedule_shape(name):
    cfg = V4Config.preset(name)
    kinds = cfg.layer_types
    assert kinds[:2] == ("sliding", "sliding")                     # sliding bootstrap
    assert set(kinds[2:]) == {"csa", "hca"}
    assert all(a != b for a, b in zip(kinds[2:], kinds[3:]))      # CSA and HCA interleaved
    assert cfg.csa_rate == 4 and cfg.mlp_layer_types[0] == "hash_moe" and cfg.mlp_layer_types[-1] == "moe"


@pytest.mark.parametrize("name", V4_PRESETS)
def test_round_trip_through_transformers(name):
    from transformers import DeepseekV4Config

    cfg = V4Config.preset(name)
    assert V4Config.from_hf(DeepseekV4Config(**cfg.to_hf_dict())) == cfg
    assert V4Config.from_hf(cfg.to_hf_dict()) == cfg


def test_legacy_keys(tmp_path):
    d = V4Config.preset("v4-tiny").to_hf_dict()
    del d["layer_types"], d["compress_rates"], d["mlp_layer_types"], d["partial_rotary_factor"]
    d.update(compress_ratios=[0, 0, 4, 128, 4, 128], compress_rate_hca=128, num_hash_layers=2,
             qk_rope_head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = V4Config.from_hf(tmp_path)
    assert cfg.layer_types == V4Config.preset("v4-tiny").layer_types
    assert cfg.hca_rate == 128 and cfg.qk_rope_head_dim == 16
    assert cfg.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe", "moe", "moe")


@pytest.mark.parametrize("key, value, match", [
    ("index_topk", 0, "index_topk=0: must be >= 1"),
    ("sliding_window", "16", 'sliding_window="16": must be an integer, not a string'),
    ("hidden_size", True, "hidden_size=true: must be an integer, not true/false"),
    ("head_dim", 32.0, "head_dim=32.0: must be an integer, not a number with a fraction"),
    ("num_hidden_layers", 2**31, f"num_hidden_layers={2**31}: must be <= {2**31 - 1}"),
    ("hc_eps", float("inf"), "hc_eps=Infinity: must be a finite number > 0"),
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("model_type", "kimi_linear", "model_type='kimi_linear'"),
    ("layer_types", ["full_attention"] * 6, "layer_types="),
    ("o_groups", 3, "o_groups=3: must divide"),
    ("scoring_func", "relu", "scoring_func='relu'"),
    ("eos_token_id", 5000, "eos_token_id=5000: outside the vocab"),
])
def test_bad_values_are_named(key, value, match):
    d = V4Config.preset("v4-tiny").to_hf_dict()
    d[key] = value
    with pytest.raises(ValueError, match=match):
        V4Config.from_hf(d)


def test_the_constructor_checks_through_the_shared_schema():
    """A V4Config built in Python is held to the same Field checks as config.json (attribute named),
    and so is a legacy integer key."""
    from dataclasses import replace

    d = V4Config.preset("v4-tiny").to_hf_dict()
    del d["mlp_layer_types"]
    with pytest.raises(ValueError, match='num_hash_layers="2": must be an integer, not a string'):
        V4Config.from_hf({**d, "num_hash_layers": "2"})     # a legacy key, read only without mlp_layer_types
    cfg = V4Config.preset("v4-tiny")
    with pytest.raises(ValueError, match="index_topk=8.5: must be an integer"):
        replace(cfg, index_topk=8.5)
    with pytest.raises(ValueError, match="swiglu_limit=0: must be a finite number > 0"):
        replace(cfg, swiglu_limit=0)


def test_unknown_preset_and_bad_file(tmp_path):
    with pytest.raises(ValueError, match="unknown DeepSeek-V4 preset 'v4-huge'"):
        V4Config.preset("v4-huge")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        V4Config.from_hf(tmp_path)


@pytest.mark.parametrize(("key", "value"), [("rms_norm_eps", "x"), ("routed_scaling_factor", True),
                                            ("swiglu_limit", "10"), ("hc_eps", [1e-6])])
def test_a_float_field_of_the_wrong_json_type_is_refused_naming_it(key, value):
    """``float()`` used to convert ``true`` to 1.0 (accepted) and fail on ``"x"`` without the field."""
    d = V4Config.preset("v4-tiny").to_hf_dict()
    d[key] = value
    with pytest.raises(ValueError, match=f"{key}=.*must be a number"):
        V4Config.from_hf(d)
