"""Fixture: the tiny real model (session-wide)."""

import pytest
import torch

from hybridkv.model.model import HybridModel


@pytest.fixture(scope="session")
def tiny_model():
    """The ``tiny`` preset, seed 0, fp32 on CPU."""
    torch.manual_seed(0)
    return HybridModel.from_preset("tiny", seed=0).eval()
