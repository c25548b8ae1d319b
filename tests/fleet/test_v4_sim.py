"""Simulating DeepSeek-V4: the cost model's shapes from the config, the simulated engine's
restore recompute against the real engine's, and simulated V4 replays (untimed and timed)."""

from __future__ import annotations

import json
import math

import pytest

from hybridkv.cli import main
from hybridkv.fleet.costmodel import (H200_BF16_DENSE_FLOPS, H200_HBM_BYTES_PER_S, V4Shapes, cost_model,
                                      h200_deepseek_v4_flash, v4_flash_config)
from hybridkv.model.v4.config import V4Config
from hybridkv.replay.runner import ReplayOptions, run_replay

REL = 1e-9
"""Relative tolerance of float comparisons of derived figures (same formula, float rounding)."""


def _trace(path, rows):
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 512 * len(h), "output_length": 2,
                                        "hash_ids": h}) + "\n" for i, h in enumerate(rows)))
    return str(path)


# shared prefixes of 1..4 units of 64 tokens, so hits land at 64, 128, 192 and 256
ROWS = [[0, 1, 2, 3, 4], [0, 1, 2, 3, 5], [0, 1, 6], [0, 1, 2, 7], [8, 9], [0, 1, 2, 3, 4, 10], [8, 11]]


@pytest.mark.parametrize("name", ["v4-tiny", "v4-small"])
def test_parameter_counts_match_the_model(name):
    """V4Shapes counts every tensor of the model built from the config (and the routed experts)."""
    from hybridkv.model.v4.model import V4Model
    cfg = V4Config.preset(name)
    model = V4Model(cfg)
    shapes = V4Shapes.of(cfg)
    assert shapes.total_params == sum(p.numel() for p in model.parameters())
    assert shapes.routed_params == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def test_flash_shapes_and_cost_model_from_the_config():
    """V4-Flash: published sizes (284B total, about 13B activated), the seed's SWA/compressed
    ratio, and the cost model's coefficients from those FLOPs and bytes at 40% / 70% of peak."""
    cfg = v4_flash_config()
    assert (cfg.num_hidden_layers, cfg.hidden_size, len(cfg.csa_layers), len(cfg.hca_layers)) == (43, 4096, 21, 20)
    assert cfg.layer_types[:3] == ("sliding", "sliding", "csa") and cfg.csa_layers[-1] == 42
    s = V4Shapes.of(cfg)
    assert 283e9 < s.total_params < 286e9 and 13e9 < s.activated_params < 14e9
    # per token: CSA (512 + 128) * 2 B / 4 on 21 layers, HCA 512 * 2 B / 128 on 20
    assert s.compressed_bytes_per_token == 21 * 640 * 2 / 4 + 20 * 512 * 2 / 128 == 6880
    assert s.swa_bytes_per_token == 43 * 512 * 2
    assert math.isclose(s.swa_bytes_per_token / s.compressed_bytes_per_token, 6.4, rel_tol=REL)   # the seed: ~8x
    assert s.window_state_bytes == 43 * 127 * 512 * 2
    assert s.boundary_state_bytes(128) == s.window_state_bytes + 21 * 2 * 4 * (512 + 128) * 2
    m = h200_deepseek_v4_flash()
    flops, bw = H200_BF16_DENSE_FLOPS * 0.4, H200_HBM_BYTES_PER_S * 0.7
    per_token = 2 * s.activated_params + 43 * 128 * 64 * 2048 + 21 * 512 * 64 * 2048
    assert math.isclose(m.linear_s_per_token, per_token / flops, rel_tol=REL)
    assert math.isclose(m.attention_s_per_pair, (21 * 64 * 256 / 4 + 20 * 64 * 2048 / 128) / flops, rel_tol=REL)
    assert math.isclose(m.dense_weights_s + m.expert_weights_s, 2 * s.total_params / bw, rel_tol=REL)
    assert (m.experts, m.experts_per_token) == (256, 6)
    assert cost_model("h200-deepseek-v4-flash") == m


def _opts(trace, simulate, strategy, **kw):
    return ReplayOptions(trace=trace, limit=None, model="v4-tiny", block_tokens=64, simulate=simulate,
                         max_output_tokens=None if simulate else 1, swa_recovery=strategy, progress=False,
                         host_bytes=0, **kw)


@pytest.mark.parametrize("strategy", ["window", "periodic=128", "recompute"])
def test_simulated_restore_recompute_matches_the_engine(tmp_path, strategy):
    """Same trace slice and options: the simulated V4 engine reuses, recomputes and saves
    exactly what the engine with the v4-tiny model does, restore by restore."""
    trace = _trace(tmp_path / "t.jsonl", ROWS)
    real = run_replay(_opts(trace, False, strategy))
    sim = run_replay(_opts(trace, True, strategy))
    for key in ("reused_tokens", "computed_prompt_tokens", "branch_recompute_tokens", "checkpoints_created"):
        assert getattr(sim, key) == getattr(real, key), key
    assert sim.config["restore_recompute_tokens"] == real.config["restore_recompute_tokens"]
    rs, rr = sim.config["swa_restore"], real.config["swa_restore"]
    assert (rs["hits"], rs["restores"], rs["recompute_tokens_per_hit"]) == \
        (rr["hits"], rr["restores"], rr["recompute_tokens_per_hit"])
    assert real.reused_tokens > 0
    if strategy != "window":
        assert real.config["restore_recompute_tokens"] > 0
        assert rs["recovery_seconds"]["max"] > 0 and "recovery_seconds" not in rr
    else:
        assert rs["recovery_seconds"]["max"] == 0


def test_simulated_flash_replays_untimed_and_timed(tmp_path, capsys):
    """deepseek-v4-flash runs simulated, untimed and on a timed fleet, and is refused without
    --simulate with one line naming the preset."""
    trace = _trace(tmp_path / "t.jsonl", ROWS * 3)
    out = tmp_path / "r.json"
    assert main(["replay", "--simulate", "--model", "deepseek-v4-flash", "--trace", trace, "--swa-recovery",
                 "recompute", "--json", str(out), "--no-progress"]) == 0
    rep = json.loads(out.read_text())
    sr = rep["config"]["swa_restore"]
    assert rep["reused_tokens"] > 0 and sr["restores"] > 0 and sr["recovery_seconds"]["p99"] > 0
    assert sr["device_bytes_per_cached_token"] == {"compressed": 6880, "swa_states": 0.0, "total": 6880.0}
    assert main(["replay", "--simulate", "--model", "deepseek-v4-flash", "--trace", trace, "--timed",
                 "--instances", "2", "--swa-recovery", "periodic=512", "--json", str(out), "--no-progress"]) == 0
    rep = json.loads(out.read_text())
    assert rep["ttft_seconds"]["p99"] > 0 and rep["cost_model"].startswith("deepseek-v4-flash")
    capsys.readouterr()
    assert main(["replay", "--model", "deepseek-v4-flash", "--trace", trace, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "deepseek-v4-flash" in err and "--simulate" in err and "Traceback" not in err


def test_recovery_seconds_price_the_cone_triangle():
    """recompute prices the cone's layer-rows (114,681 for V4-Flash at h = 8192), periodic the
    whole ``[c, h)`` through every layer; a hit shorter than the cone recomputes from 0."""
    from hybridkv.engine.v4backend import SimulatedV4Backend
    from hybridkv.fleet.costmodel import v4_restore_pricer
    cfg = v4_flash_config()
    m = h200_deepseek_v4_flash()
    cone = SimulatedV4Backend(cfg, 512, 64, "recompute", restore_cost=v4_restore_pricer(cfg, "recompute"))
    per = SimulatedV4Backend(cfg, 512, 64, "periodic=2048", restore_cost=v4_restore_pricer(cfg, "periodic=2048"))
    assert SimulatedV4Backend(cfg, 512, 64, "recompute").recovery_seconds(0, 4096) == 0.0   # counted, not priced
    h, n = 8192, 5461
    tri = cone.recovery_seconds(h - n, h)
    full = per.recovery_seconds(h - n, h)
    assert math.isclose(full, m.prefill_seconds(h - n, h), rel_tol=1e-6)
    assert math.isclose(tri, m.linear_s_per_token * 114_681 / 43
                        + m.attention_s_per_pair * (5334 * (h - 5334) + 5334 * 5335 // 2) * 114_681 / (43 * 5334),
                        rel_tol=1e-6)
    assert 0.45 < tri / full < 0.55
    assert math.isclose(cone.recovery_seconds(0, 4096), per.recovery_seconds(0, 4096), rel_tol=REL)


def test_flash_preset_builds_no_model():
    """The simulate-only preset is refused by load_model with one message naming it."""
    from hybridkv.engine.build import load_model
    with pytest.raises(ValueError, match="deepseek-v4-flash.*simulate-only"):
        load_model("deepseek-v4-flash")
