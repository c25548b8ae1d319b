"""The request sampler runs on the engine thread: no validated setting may make it raise."""

from __future__ import annotations

import pytest
import torch

from hybridkv.serve.protocol import APIError, make_sampler, parse_generation


def _sampler(**fields):
    gen = parse_generation({"max_tokens": 1, **fields}, None, 16, 16)
    return make_sampler(gen, seed=7)


@pytest.mark.parametrize("fields", [
    {"temperature": 1e-300},                   # logits / t overflow to inf: inf - inf was NaN
    {"temperature": 1e-46},                    # below float32's smallest subnormal
    {"temperature": 1.0, "top_p": 1e-300},     # top_p under float32 precision kept no token
    {"temperature": 1e-300, "top_p": 1e-300},
])
def test_extreme_but_valid_settings_sample_the_most_likely_token(fields):
    logits = torch.tensor([0.5, 3.0, -2.0, 2.9999], dtype=torch.float32)
    assert _sampler(**fields)(logits) == 1


def test_ordinary_sampling_still_draws_from_several_tokens():
    logits = torch.zeros(8, dtype=torch.float32)
    sample = _sampler(temperature=1.0)
    assert len({sample(logits) for _ in range(64)}) > 1


@pytest.mark.parametrize(("field", "value", "named"), [
    ("adapter", 5, "adapter=5 (int)"), ("adapter_version", ["v1"], "adapter_version=['v1'] (list)"),
    ("tenant", {"a": 1}, "tenant={'a': 1} (dict)"), ("adapter", "x" * 100_000, "100000 characters"),
])
def test_a_bad_identifier_is_named_without_echoing_a_huge_value(field, value, named):
    with pytest.raises(APIError) as exc:
        parse_generation({"max_tokens": 1, "adapter": "a", field: value}, None, 16, 16)
    msg = str(exc.value)
    assert named in msg and len(msg) < 300            # the offending value named, a huge one not echoed


def test_the_x_tenant_header_has_the_tenant_fields_length_limit():
    assert parse_generation({"max_tokens": 1}, "t" * 256, 16, 16).tenant == "t" * 256
    with pytest.raises(APIError, match="X-Tenant header has 257 characters"):
        parse_generation({"max_tokens": 1}, "t" * 257, 16, 16)
