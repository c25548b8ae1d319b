"""Step records of timed runs, and the cost model fitted to whole engine steps (issue 9, item 5)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cli import main
from hybridkv.engine.build import build_engine, load_model
from hybridkv.engine.request import Request
from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.fleet.instance import FleetInstance, FleetRequest
from hybridkv.fleet.routers import RoundRobin
from hybridkv.fleet.simulator import Fleet
from hybridkv.fleet.steplog import (
    StepLogError,
    StepRecord,
    compare_steps,
    fit_steps,
    read_step_log,
    summarize_steps,
    write_step_log,
)
from hybridkv.model.config import HybridConfig

FIT_RTOL = 1e-6
"""Relative tolerance on coefficients recovered from noise-free steps (least squares round-off)."""
CLOCK_ATOL = 1e-5
"""Seconds: records are rounded to microseconds."""

KNOWN = StepCostModel(name="known", overhead_s=0.01, linear_s_per_token=3e-4, attention_s_per_pair=3e-8,
                      seq_s=0.003)


def synthetic_steps(model: StepCostModel, n: int = 30, seed: int = 0) -> list[StepRecord]:
    """Steps of varied shape whose seconds are exactly ``model``'s price."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        chunks = [[int(rng.integers(0, 4) * 256), int(rng.integers(1, 1500))] for _ in range(rng.integers(0, 3))]
        decoders = int(rng.integers(0 if chunks else 1, 4))
        rec = StepRecord(0, float(i), 0.0, chunks, decoders, decoders * int(rng.integers(100, 3000)))
        rec.seconds = rec.price(model)
        out.append(rec)
    return out


def test_a_fit_to_whole_steps_recovers_the_model_that_made_them():
    fitted = fit_steps(synthetic_steps(KNOWN), "fit")
    for f in ("overhead_s", "linear_s_per_token", "attention_s_per_pair", "seq_s"):
        assert getattr(fitted, f) == pytest.approx(getattr(KNOWN, f), rel=FIT_RTOL), f
    c = compare_steps(synthetic_steps(KNOWN, seed=1), fitted)
    assert c["ratio"] == pytest.approx(1.0, rel=FIT_RTOL) and c["median_step_ratio"] == pytest.approx(1.0)


def test_a_fit_needs_steps_with_tokens():
    with pytest.raises(ValueError, match="1 steps with tokens"):
        fit_steps([StepRecord(0, 0.0, 0.5, [[0, 64]]), StepRecord(0, 1.0, 0.5)], "fit")


def test_the_step_log_round_trips_and_a_bad_one_is_named(tmp_path):
    steps = synthetic_steps(KNOWN, n=5)
    path = tmp_path / "steps.json"
    write_step_log(path, steps, {"mode": "model"})
    back, meta = read_step_log(path)
    assert back == steps and meta == {"mode": "model"}
    path.write_text('{"steps": [{"instance": 0, "start": 0, "seconds": 1, "colour": "red"}]}')
    with pytest.raises(StepLogError, match="step 0.*colour"):
        read_step_log(path)
    path.write_text('{"steps": [{"instance": 0, "start": 0, "seconds": -1}]}')
    with pytest.raises(StepLogError, match="seconds=-1"):
        read_step_log(path)


def test_calibrate_from_steps_writes_the_fitted_model_and_refuses_a_simulated_log(tmp_path, capsys):
    log, out = tmp_path / "steps.json", tmp_path / "cost.json"
    write_step_log(log, synthetic_steps(KNOWN), {"mode": "model", "model": "small", "instances": 2})
    assert main(["calibrate", "--from-steps", str(log), "--out", str(out)]) == 0
    got = StepCostModel.load(out)
    assert got.linear_s_per_token == pytest.approx(KNOWN.linear_s_per_token, rel=FIT_RTOL)
    assert "whole engine steps" in got.source
    write_step_log(log, synthetic_steps(KNOWN), {"mode": "simulate"})
    assert main(["calibrate", "--from-steps", str(log), "--out", str(out)]) == 2
    assert "mode 'simulate'" in capsys.readouterr().err


def test_a_bad_step_clock_is_named():
    with pytest.raises(ValueError, match="step_clock='sundial'"):
        FleetInstance(0, lambda listener, step_cost: None, None, 4, step_clock="sundial")


def _run(simulate: bool, prompts: list[np.ndarray], outputs: list[int], clock: str = "cpu") -> list[FleetInstance]:
    cfg = CacheConfig(block_size=64, prefix_match_unit=64, num_kv_pages=512, num_checkpoint_slots=64,
                      policy=CheckpointPolicy.parse("branch+tail+interval=256"), max_num_seqs=3,
                      max_num_batched_tokens=8192)
    if simulate:
        tiny = HybridConfig.preset("tiny")
        cost = KNOWN

        def build(listener, step_cost):
            return build_engine(tiny, cfg, model_name="tiny", listener=listener, step_cost=step_cost)
    else:
        model, cost = load_model("tiny", 0), None

        def build(listener, step_cost):
            return build_engine(model, cfg, model_name="tiny", listener=listener)
    inst = FleetInstance(0, build, cost, cfg.max_num_seqs, step_clock=clock)
    inst.record_steps()
    frs = [FleetRequest(i, Request(f"r{i}", p, 1 if simulate else o), arrival=0.0, output_tokens=o)
           for i, (p, o) in enumerate(zip(prompts, outputs))]
    try:
        Fleet([inst], RoundRobin(), 64, KNOWN).run(frs)
    finally:
        inst.handle.close()
    return [inst]


@pytest.fixture
def one_thread():
    """One torch thread, as timed replays run (several threads spin on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_real_and_a_simulated_instance_run_the_same_steps(one_thread):
    """Same requests, all arriving at once: the simulated engine (decode modelled by the instance)
    and the real one (decoding in the engine) take the same steps, chunk for chunk and decoder
    for decoder; every real record's seconds is its step's CPU time, the clock's sum."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 500, 128)
    prompts = [np.concatenate([shared, rng.integers(0, 500, int(n))]) for n in (20, 70, 40, 150, 10)]
    outputs = [2, 6, 4, 3, 5]                  # unequal: a freed slot admits a prefill beside decoders
    real, sim = _run(False, prompts, outputs)[0], _run(True, prompts, outputs)[0]
    shape = [(r.chunks, r.decoders) for r in real.step_log]
    assert shape == [(r.chunks, r.decoders) for r in sim.step_log]
    assert summarize_steps(real.step_log)["mixed_steps"] > 0             # decoders priced with prefill
    for r in real.step_log:
        assert r.seconds == pytest.approx(r.cpu_seconds, abs=CLOCK_ATOL) and r.wall_seconds is not None
        assert r.backend_seconds is not None and r.backend_seconds <= r.seconds + CLOCK_ATOL
    assert sum(r.seconds for r in real.step_log) == pytest.approx(real.stats.busy_seconds, abs=CLOCK_ATOL * 50)
    for r in sim.step_log:                                            # a simulated step is its price
        assert r.seconds == pytest.approx(r.price(KNOWN), abs=CLOCK_ATOL)


def test_a_timed_replay_writes_its_step_log_on_the_cpu_clock(tmp_path):
    log, rep = tmp_path / "steps.json", tmp_path / "r.json"
    assert main(["replay", "--no-progress", "--timed", "--model", "tiny", "--limit", "4", "--instances", "2",
                 "--time-scale", "1000", "--router", "least-load", "--step-clock", "cpu", "--step-log", str(log),
                 "--json", str(rep)]) == 0
    steps, meta = read_step_log(log)
    assert meta["mode"] == "model" and meta["step_clock"] == "cpu" and meta["requests"] == 4
    report = json.loads(rep.read_text())
    for k, inst in enumerate(report["instances"]):
        mine = [r for r in steps if r.instance == k]
        assert sum(r.seconds for r in mine) == pytest.approx(inst["busy_seconds"], abs=CLOCK_ATOL * len(mine))
        assert all(r.seconds == pytest.approx(r.cpu_seconds, abs=CLOCK_ATOL) for r in mine)
    assert summarize_steps(steps)["prefill_tokens"] == report["computed_prompt_tokens"]
