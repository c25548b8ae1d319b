"""DeepSeek-V4 through the engine: the csa/hca prefix groups paged per block, the swa boundary
state in checkpoint slots, and the three SWA recovery strategies (window, periodic=P, recompute).
Each reuses a shared prefix and reproduces a full prefill at every computed position."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from hybridkv.api import LLM
from hybridkv.cache.config import CacheConfig, CheckpointPolicy, ConfigError
from hybridkv.cache.groups import RecomputeCone, SavedAtHit, SavedEvery
from hybridkv.cache.swa import SwaRecovery
from hybridkv.cli import main
from hybridkv.engine.build import build_engine, is_v4, load_model, model_config
from hybridkv.engine.request import Request
from hybridkv.engine.v4backend import max_cone_tokens
from hybridkv.model.v4.cone import recompute_cone_tokens
from hybridkv.model.v4.config import V4Config
from hybridkv.model.v4.model import V4Model

LOGIT_TOL = 1e-4
"""Largest |Δlogit| allowed between a cached run and a full prefill (fp32; the issue's bound)."""


@pytest.fixture(scope="module")
def tiny():
    return load_model("v4-tiny", 0)


@pytest.fixture(scope="module")
def hca128():
    """v4-tiny's shapes with an HCA rate of 128: a 64-aligned hit can end inside an HCA window."""
    cfg = dataclasses.replace(V4Config.preset("v4-tiny"), hca_rate=128)
    return V4Model(cfg).init_random(1).eval()


def _prompts(vocab: int, shared: int, tails=(40, 70, 100), seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, shared)
    return [np.concatenate([base, rng.integers(0, vocab, k)]) for k in tails]


def _run(model, prompts, recovery: str | None, block_size: int = 64, policy: str = "branch+tail",
         max_out: int = 3, **cache):
    cache = {"num_kv_pages": 64, "num_checkpoint_slots": 16, **cache}
    cfg = CacheConfig(block_size=block_size, prefix_match_unit=64, policy=CheckpointPolicy.parse(policy), **cache)
    handle = build_engine(model, cfg, model_name="v4-test", swa_recovery=recovery)
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(f"r{i}", p, max_out, record_logits=True)
        handle.engine.add_request(r)
        handle.engine.run_until_done()
        reqs.append(r)
    handle.engine.cache.check_invariants()
    return handle, reqs


def _check_exact(model, reqs) -> None:
    """Every recorded position within LOGIT_TOL of a full prefill; the same greedy tokens."""
    for r in reqs:
        ids = np.concatenate([r.prompt, np.asarray(r.output[:-1], dtype=np.int64)])
        full = model(torch.from_numpy(ids)[None])[0]
        assert min(r.logits) == r.reused                      # positions [reused, end) were computed
        assert len(r.logits) == len(ids) - r.reused
        for pos, row in r.logits.items():
            assert float((row - full[pos]).abs().max()) <= LOGIT_TOL, (r.request_id, pos)
        assert full[r.prompt_len - 1:].argmax(-1).tolist() == r.output


def test_window_reuses_the_saved_state(tiny):
    prompts = _prompts(tiny.config.vocab_size, 330)       # r0 saves tails at 320; r1, r2 share 320 tokens
    handle, reqs = _run(tiny, prompts, "window")
    assert isinstance(handle.backend.family.restore["swa"], SavedAtHit)
    assert [r.reused for r in reqs] == [0, 320, 320]
    assert all(r.match.restart == r.match.hit for r in reqs)
    assert handle.engine.stats.restore_recompute_tokens == 0
    _check_exact(tiny, reqs)


def test_periodic_resumes_from_the_nearest_saved_state(tiny):
    prompts = _prompts(tiny.config.vocab_size, 330)
    handle, reqs = _run(tiny, prompts, "periodic=128")
    assert handle.backend.family.restore["swa"] == SavedEvery(128)
    # states only at multiples of 128 (the policy is replaced): a hit at 320 restarts at 256
    assert handle.engine.stats.checkpoints_created.get("interval", 0) > 0
    assert [(r.match.hit, r.match.restart) for r in reqs] == [(0, 0), (320, 256), (320, 256)]
    assert handle.engine.stats.restore_recompute_tokens == 2 * 64
    _check_exact(tiny, reqs)


def test_recompute_saves_nothing_and_rebuilds_the_cone(tiny):
    prompts = _prompts(tiny.config.vocab_size, 330)
    handle, reqs = _run(tiny, prompts, "recompute")
    cone = max_cone_tokens(tiny.config, 64)
    assert handle.backend.family.restore["swa"] == RecomputeCone(cone)
    assert cone >= recompute_cone_tokens(tiny.config, 320)
    assert handle.engine.cache.checkpoints.num_free == handle.engine.cache.checkpoints.num_slots
    assert [(r.match.hit, r.match.restart) for r in reqs] == [(0, 0), (320, 320 - cone), (320, 320 - cone)]
    assert handle.engine.stats.restore_recompute_tokens == 2 * cone
    _check_exact(tiny, reqs)


@pytest.mark.parametrize("recovery", ["window", "periodic=128", "recompute"])
def test_hit_inside_an_hca_window(hca128, recovery):
    """A hit at 192 = 128 + 64 lies inside the second HCA window: its tail (64 rows) is part of
    the saved state (window), rebuilt from 128 (periodic) or from the raw tokens (recompute)."""
    prompts = _prompts(hca128.config.vocab_size, 200, tails=(20, 50), seed=3)
    handle, reqs = _run(hca128, prompts, recovery, block_size=128, policy="branch+tail")
    assert reqs[1].match.hit == 192
    assert 192 % hca128.config.hca_rate == 64
    expect = {"window": 192, "periodic=128": 128, "recompute": max(0, 192 - max_cone_tokens(hca128.config, 64))}
    assert reqs[1].match.restart == expect[recovery]
    _check_exact(hca128, reqs)


def test_split_steps_and_evictions_stay_exact(tiny):
    """Steps split at each saved boundary, and pools so small that entries are evicted between
    requests: hits still restore exactly (evicted pages take their subtree and states along)."""
    prompts = _prompts(tiny.config.vocab_size, 330, tails=(40, 70, 100, 130), seed=7)
    prompts.insert(2, np.random.default_rng(8).integers(0, tiny.config.vocab_size, 400))  # pushes entries out
    handle, reqs = _run(tiny, prompts, "periodic=128", mechanism="split", num_kv_pages=14, num_checkpoint_slots=3,
                        max_num_batched_tokens=100)
    assert handle.engine.cache.evicted_pages > 0
    assert any(r.reused for r in reqs)
    _check_exact(tiny, reqs)


def test_commands_without_v4_support_refuse_it(tmp_path, capsys):
    assert main(["calibrate", "--model", "v4-tiny", "--out", str(tmp_path / "c.json")]) == 2
    assert "calibrate does not run DeepSeek-V4 models yet" in capsys.readouterr().err.replace("\n", " ")


def test_block_size_must_hold_whole_entries(hca128):
    cfg = CacheConfig(block_size=64, prefix_match_unit=64, num_kv_pages=8, num_checkpoint_slots=4)
    with pytest.raises(ConfigError, match=r"block_size=64 must be a multiple of the 'hca' group's granularity 128"):
        build_engine(hca128, cfg, model_name="v4-test")


def test_swa_recovery_validation(tiny):
    cfg = CacheConfig(block_size=64, prefix_match_unit=64, num_kv_pages=8, num_checkpoint_slots=4)
    with pytest.raises(ConfigError, match=r"swa_recovery='sliding'"):
        build_engine(tiny, cfg, model_name="v4-tiny", swa_recovery="sliding")
    with pytest.raises(ConfigError, match=r"periodic=100: P must be a multiple of prefix_match_unit=64"):
        build_engine(tiny, cfg, model_name="v4-tiny", swa_recovery="periodic=100")
    with pytest.raises(ConfigError, match=r"P='x' is not an integer"):
        SwaRecovery.parse("periodic=x")
    with build_engine(tiny, cfg, model_name="v4-tiny", host_bytes=1 << 20) as built:    # tiers carry V4 groups
        assert (built.host_tier.page_group, built.host_tier.state_group) == ("csa-hca", "swa")
    kimi = load_model("tiny", 0)
    with pytest.raises(ValueError, match=r"swa_recovery='window' applies to DeepSeek-V4 models"):
        build_engine(kimi, cfg, model_name="tiny", swa_recovery="window")


def test_models_route_by_preset_and_directory(tmp_path, tiny):
    assert is_v4("v4-tiny") and is_v4("v4-small") and not is_v4("tiny")
    assert isinstance(model_config("v4-small"), V4Config)
    tiny.save_pretrained(tmp_path / "m")
    assert is_v4(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert isinstance(loaded, V4Model) and loaded.weight_digest() == tiny.weight_digest()


def test_llm_api_reuses_with_each_strategy():
    rng = np.random.default_rng(5)
    base = rng.integers(0, 1024, 200).tolist()
    for recovery in ("window", "periodic=64", "recompute"):
        with LLM("v4-tiny", swa_recovery=recovery) as llm:
            llm.generate([base + [1, 2]], max_tokens=2)
            out = llm.generate([base + [3, 4, 5]], max_tokens=2)
            assert out[0].reused_tokens == 192, recovery
    with pytest.raises(ValueError, match="applies to DeepSeek-V4 models"):
        LLM("tiny", swa_recovery="recompute")


def test_cli_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--model", "v4-tiny", "--swa-recovery", "periodic=0", "--limit", "1"])
    assert exc.value.code == 2
    assert "P=0 must be positive" in capsys.readouterr().err
    assert main(["replay", "--model", "tiny", "--swa-recovery", "window", "--limit", "1", "--no-progress"]) == 2
    assert "--swa-recovery window: applies to DeepSeek-V4 models" in capsys.readouterr().err.replace("\n", " ")
    assert main(["replay", "--model", "v4-tiny", "--swa-recovery", "periodic=96", "--limit", "1",
                 "--no-progress"]) == 2
    assert "--swa-recovery periodic=96: P=96 tokens must be a multiple of --prefix-match-unit 64" in \
        " ".join(capsys.readouterr().err.split())          # the options as typed, not the config fields
    assert main(["replay", "--model", "v4-tiny", "--limit", "2", "--no-progress", "--timed"]) == 2
    assert "--timed with --model v4-tiny: a real DeepSeek-V4 fleet is not timed" in \
        capsys.readouterr().err.replace("\n", " ")
    assert main(["replay", "--model", "v4-small", "--limit", "2", "--no-progress"]) == 2
    assert "block_size=64 must be a multiple of the 'hca' group's granularity 128" in \
        capsys.readouterr().err.replace("\n", " ")


@pytest.mark.parametrize("recovery", ["recompute", "periodic=64"])
def test_cli_replay_verifies_reuse(tmp_path, recovery):
    """A small V4 replay with --verify: reuse, exact logits, the strategy in the report; the
    default pools keep every state a ``periodic`` policy saves (one per unit here)."""
    out = tmp_path / "r.json"
    assert main(["replay", "--model", "v4-tiny", "--swa-recovery", recovery, "--limit", "6", "--verify", "3",
                 "--no-progress", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["reused_tokens"] > 0
    assert rep["verify"]["requests"] == 3 and rep["verify"]["greedy_mismatches"] == 0
    assert rep["verify"]["max_abs_logit_diff"] <= LOGIT_TOL
    assert rep["config"]["swa_recovery"] == recovery
    if recovery == "recompute":
        assert rep["config"]["restore_recompute_tokens"] > 0 and rep["config"]["num_checkpoint_slots"] == 16
    else:
        assert rep["config"]["policy"] == "interval=64" and rep["config"]["evicted_checkpoints"] == 0
        assert 0 < rep["checkpoints_created"]["interval"] <= rep["config"]["num_checkpoint_slots"]


@pytest.mark.parametrize("argv, opts", [
    (["--model", "v4-tiny", "--timed"], dict(model="v4-tiny", timed=True)),
    (["--model", "deepseek-v4-flash"], dict(model="deepseek-v4-flash")),
    (["--model", "tiny", "--swa-recovery", "recompute"], dict(model="tiny", swa_recovery="recompute")),
])
def test_replay_refuses_v4_misuse_with_one_rule_for_cli_and_api(capsys, argv, opts):
    """``hybridkv replay`` and ``run_replay`` refuse through the same check, with the same line."""
    from hybridkv.replay.runner import ReplayOptions, run_replay
    with pytest.raises(ValueError) as api:
        run_replay(ReplayOptions(limit=1, progress=False, **opts))
    assert main(["replay", *argv, "--limit", "1", "--no-progress"]) == 2
    assert f"error: {api.value}" in " ".join(capsys.readouterr().err.split())
