"""The TTFT lower bound of benchmarks/bench_routers.py (idle instance, oracle reuse)."""

import importlib.util
from pathlib import Path

import pytest

from hybridkv.fleet.costmodel import StepCostModel
from hybridkv.replay.oracle import oracle_from_trace
from hybridkv.replay.trace import TraceRequest

_spec = importlib.util.spec_from_file_location(
    "bench_routers", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_routers.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TOL_S = 1e-9
"""Absolute tolerance in seconds: the hand values below are exact decimals, so only float rounding."""

# 2 ms per step, 0.1 ms per token, 10 ns per attention pair, no memory term.
COST = StepCostModel(name="hand", overhead_s=0.002, linear_s_per_token=1e-4, attention_s_per_pair=1e-8)


def _req(i: int, length: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index=i, line_no=i + 1, timestamp_ms=i, input_length=length, output_length=1,
                        hash_ids=ids)


def test_bound_on_tiny_trace_matches_hand_computed() -> None:
    # A: 1000 tokens, nothing earlier; B: 700 tokens sharing A's first 512-token block.
    reqs = [_req(0, 1000, (1, 2)), _req(1, 700, (1, 3))]
    oracle = oracle_from_trace(reqs, 512, 64)
    assert oracle.per_request == (0, 512)
    got = bench.idle_oracle_ttft(list(oracle.prompt_lengths), list(oracle.per_request), COST, chunk_tokens=600)
    # A in chunks [0, 600) and [600, 1000):
    #   0.002 + 600e-4 + 1e-8 * 600*601/2           = 0.063803
    #   0.002 + 400e-4 + 1e-8 * (400*600 + 400*401/2) = 0.045202
    # B computes [512, 700) in one chunk: 0.002 + 188e-4 + 1e-8 * (188*512 + 188*189/2) = 0.02194022
    assert got == pytest.approx([0.063803 + 0.045202, 0.02194022], abs=TOL_S)


def test_bound_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        bench.idle_oracle_ttft([10], [10], COST, chunk_tokens=8)      # reuse must leave the last token
    with pytest.raises(ValueError):
        bench.idle_oracle_ttft([10, 5], [0], COST, chunk_tokens=8)
    with pytest.raises(ValueError):
        bench.idle_oracle_ttft([10], [0], COST, chunk_tokens=0)


def test_min_share() -> None:
    assert bench._min_share([{"busy_seconds": 1.0}, {"busy_seconds": 3.0}]) == pytest.approx(0.5)
    assert bench._min_share(None) is None
