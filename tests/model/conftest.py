"""Shared fixtures: a random tiny transformers reference checkpoint and tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv.model.model import HybridModel

TINY_HF = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 32,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "num_experts": 8,
    "num_experts_per_token": 2, "num_shared_experts": 1, "num_expert_group": 2, "topk_group": 1,
    "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2,
                        "head_dim": 32, "short_conv_kernel_size": 4},
    "first_k_dense_replace": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def make_reference(seed: int = 0):
    """A transformers KimiLinearForCausalLM with O(1)-scale random weights (fp32, eval)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    ref = KimiLinearForCausalLM(KimiLinearConfig(**TINY_HF)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                continue  # transformers' own init (inverse softplus of small dt)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in ref.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn(b.shape, generator=gen))
    return ref


@pytest.fixture(scope="session")
def reference():
    return make_reference()


@pytest.fixture(scope="session")
def reference_dir(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_ref")
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny():
    return HybridModel.from_preset("tiny", seed=0)


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    """Tiny shapes run fastest (and predictably on a shared 2-core box) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
