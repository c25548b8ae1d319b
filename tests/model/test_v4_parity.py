"""DeepSeek-V4: parity with transformers' DeepseekV4ForCausalLM, and checkpoint loading/saving.

The reference config is one no preset uses (5 layers with a sliding layer first, CSA/HCA
interleaved, YaRN on the compressed branches, HCA rate 8, sliding window 8). transformers'
CSA selection breaks ties between equal indexer scores (all-zero ReLU sums) differently for
different sequence lengths; 16 indexer heads make an all-zero score (2^-16 per pair) rare
enough that the compared positions have no tie at the top-k cut.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridkv.model.v4.config import V4Config
from hybridkv.model.v4.model import V4Model

#: Max |Δlogit| against transformers (fp32, eager attention).
TRANSFORMERS_TOL = 1e-4

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
REF_HF = {
    "vocab_size": 160, "hidden_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 5,
    "num_attention_heads": 2, "head_dim": 16, "q_lora_rank": 16, "partial_rotary_factor": 0.5,
    "num_experts_per_tok": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "layer_types": [S, C, H, C, H], "compress_rates": {C: 4, H: 8}, "hc_mult": 3, "hc_sinkhorn_iters": 5,
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"], "sliding_window": 8, "o_groups": 2,
    "o_lora_rank": 8, "index_n_heads": 16, "index_head_dim": 8, "index_topk": 3,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}
T = 44


def make_reference(seed: int = 0, **overrides):
    """A transformers DeepseekV4ForCausalLM with O(1)-scale random weights (fp32, eval)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    ref = DeepseekV4ForCausalLM(DeepseekV4Config(**{**REF_HF, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in ref.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.rand(b.shape[0], 4, generator=gen).argsort(-1)[:, :b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=gen))
    return ref


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref = make_reference()
    d = tmp_path_factory.mktemp("v4ref")
    ref.save_pretrained(d, max_shard_size="40KB")          # sharded: exercises the index
    return ref, V4Model.from_pretrained(d)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, REF_HF["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def test_config_matches_transformers(pair):
    ref, ours = pair
    assert ours.config == V4Config.from_hf(ref.config)
    assert ours.config.layer_types == ("sliding", "csa", "hca", "csa", "hca")
    assert ours.config.rope_compress.kind == "yarn" and ours.config.rope_compress.attention_factor == 1.0


def test_last_position_of_every_prefix(pair):
    ref, ours = pair
    ids = _ids(T)
    logits, _ = ours.prefill(ids)
    assert logits.std() > 0.1                                 # not a degenerate model
    worst = 0.0
    with torch.no_grad():
        for c in range(1, T + 1):
            want = ref(ids[:c].reshape(1, -1)).logits[0, -1]
            worst = max(worst, float((logits[c - 1] - want).abs().max()))
    assert worst <= TRANSFORMERS_TOL, worst


def test_every_position_when_topk_covers_all_entries(tmp_path):
    ref = make_reference(seed=3, index_topk=64)              # >= T / 4 entries: no selection
    ref.save_pretrained(tmp_path)
    ours = V4Model.from_pretrained(tmp_path)
    ids = _ids(T, seed=4)
    with torch.no_grad():
        want = ref(ids.reshape(1, -1)).logits[0]
    got, _ = ours.prefill(ids)
    assert float((got - want).abs().max()) <= TRANSFORMERS_TOL


def test_save_pretrained_is_read_by_transformers(pair, tmp_path):
    from transformers import DeepseekV4ForCausalLM

    _, ours = pair
    ours.save_pretrained(tmp_path, max_shard_bytes=30_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    back = V4Model.from_pretrained(tmp_path)
    assert back.weight_digest() == ours.weight_digest()
    theirs = DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(T, seed=5)
    with torch.no_grad():
        want = theirs(ids.reshape(1, -1)).logits[0, -1]
    got, _ = ours.prefill(ids)
    assert float((got[-1] - want).abs().max()) <= TRANSFORMERS_TOL


def test_missing_tensor_is_named(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, ours = pair
    ours.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.attn.indexer.wq_b.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="layers.1.self_attn.compressor.indexer.q_b_proj.weight"):
        V4Model.from_pretrained(tmp_path)
