"""Cost models: the H200 derivation's orders of magnitude, the roofline, files and their errors."""

from __future__ import annotations

import json

import pytest

from hybridkv.fleet.costmodel import (
    CostModelError,
    StepCostModel,
    cost_model,
    h200_kimi_linear_48b,
)


def test_h200_prefill_and_decode_rates_follow_from_the_stated_numbers():
    m = h200_kimi_linear_48b()
    # 6.08 GFLOP per token at 40% of 989 TFLOPS: ~15 us a token, ~65k tokens/s
    assert 14e-6 < m.linear_s_per_token < 17e-6
    # a lone decoder reads the dense weights and 8 of 256 experts' worth: ~(1.55e9 + 1.45e9) * 2 B at 3.36 TB/s
    one = m.step_seconds([], decoders=1, decode_context=1000) - m.overhead_s
    assert 1.5e-3 < one < 2.2e-3
    # a big batch touches every expert: 96 GB of weights at 3.36 TB/s bounds it from below
    assert m.step_seconds([], decoders=256, decode_context=256_000) > 96e9 / 3.36e12


def test_a_step_is_the_slower_of_compute_and_memory():
    m = StepCostModel(name="t", overhead_s=1.0, linear_s_per_token=2.0, attention_s_per_pair=0.0,
                      dense_weights_s=5.0)
    assert m.step_seconds([(0, 1)]) == 1.0 + 5.0          # memory-bound
    assert m.step_seconds([(0, 4)]) == 1.0 + 8.0          # compute-bound
    assert m.step_seconds([]) == 0.0
    assert m.prefill_seconds(10, 14) == 8.0


def test_a_cost_model_round_trips_through_its_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(h200_kimi_linear_48b().to_json())
    assert cost_model(str(path)) == h200_kimi_linear_48b()


@pytest.mark.parametrize("content, named", [
    ("{not json", "c.json"),
    (json.dumps({"name": "x", "overhead_s": 0, "linear_s_per_token": 1, "attention_s_per_pair": 0, "gpus": 2}),
     "'gpus'"),
    (json.dumps({"name": "x", "overhead_s": -1, "linear_s_per_token": 1, "attention_s_per_pair": 0}),
     "overhead_s=-1"),
])
def test_a_bad_cost_model_file_is_named(tmp_path, content, named):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(CostModelError, match=named):
        cost_model(str(path))
