"""Other dtypes and devices: bf16 smoke test on CPU, CUDA model parity (gpu marker)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.model.generate import greedy_generate
from hybridkv.model.model import HybridModel
from hybridkv.model.state import ForwardRequest


def test_bf16_model_runs_and_tracks_fp32():
    fp32 = HybridModel.from_preset("tiny", seed=0)
    bf16 = HybridModel.from_preset("tiny", seed=0, dtype=torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].self_attn.A_log.dtype == torch.float32
    ids = torch.randint(3, 1024, (1, 150), generator=torch.Generator().manual_seed(0))
    a, b = fp32(ids), bf16(ids)
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    # bf16 rounding flips a few expert choices, so compare typical, not worst, error
    assert (a - b).abs().mean().item() < 0.1 * a.abs().mean().item()  # measured ~0.05
    cp = bf16.forward_paged([ForwardRequest(ids[0], 0, torch.tensor([0, 1, 2]))],
                            bf16.new_kv_pool(3, 64))[0].end_state
    assert cp.recurrent.dtype == torch.float32 and cp.conv.dtype == torch.bfloat16
    assert greedy_generate(bf16, ids[0, :10], 3).shape == (13,)


@pytest.mark.gpu
def test_cuda_model_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cpu = HybridModel.from_preset("tiny", seed=0)
    gpu = HybridModel.from_preset("tiny", seed=0, device="cuda")
    ids = torch.randint(3, 1024, (1, 300), generator=torch.Generator().manual_seed(0))
    assert (cpu(ids) - gpu(ids.cuda()).cpu()).abs().max().item() <= 1e-3
    pool = gpu.new_kv_pool(8, 64)
    res = gpu.forward_paged([ForwardRequest(ids[0], 0, torch.arange(8), capture=[64, 100])], pool)[0]
    ref = cpu.forward_paged([ForwardRequest(ids[0], 0, torch.arange(8), capture=[64, 100])],
                            cpu.new_kv_pool(8, 64))[0]
    for b in (64, 100):
        assert (res.checkpoints[b].recurrent.cpu() - ref.checkpoints[b].recurrent).abs().max() <= 1e-3
