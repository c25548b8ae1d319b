"""Config parsing/validation, presets, sizes, and the paged KV pool."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from hybridkv.model.config import HybridConfig
from hybridkv.model.kv_pool import PagedKVPool
from hybridkv.model.model import HybridModel
from hybridkv.model.state import ForwardRequest


def test_published_48b_preset():
    c = HybridConfig.preset("kimi-linear-48b-a3b")
    assert c.num_hidden_layers == 27 and c.hidden_size == 2304 and c.vocab_size == 163840
    assert c.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert c.num_kda_layers == 20 and c.num_mla_layers == 7
    assert (c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size) == (32, 128, 4)
    assert c.kv_latent_dim == 576 and c.conv_dim == 3 * 32 * 128
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (256, 8, 1)
    assert c.mlp_layer_types[0] == "dense" and set(c.mlp_layer_types[1:]) == {"sparse"}
    assert c.routed_scaling_factor == 2.446
    # DESIGN §2: 2 MiB recurrent per layer (fp32) plus conv windows
    assert c.checkpoint_bytes == 20 * (32 * 128 * 128 + 3 * 32 * 128 * 3) * 4
    assert c.checkpoint_bytes == 44_892_160  # 42.8 MiB: 40 MiB recurrent + 2.8 MiB conv
    assert c.kv_bytes_per_token == 7 * 576 * 4


def test_presets_agree_with_transformers():
    from transformers import KimiLinearConfig

    for name in ("tiny", "small", "kimi-linear-48b-a3b"):
        c = HybridConfig.preset(name)
        hf = KimiLinearConfig(**c.to_hf_dict())
        assert HybridConfig.from_hf(hf) == c
        assert HybridConfig.from_hf(c.to_hf_dict()) == c
        assert hf.layer_types == ["linear_attention" if t == "kda" else "full_attention"
                                  for t in c.layer_types]


def test_from_path(tmp_path):
    c = HybridConfig.preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf_dict()))
    assert HybridConfig.from_hf(tmp_path) == c == HybridConfig.from_hf(tmp_path / "config.json")


@pytest.mark.parametrize("key,value", [("vocab_size", 0), ("num_experts_per_token", 99),
                                       ("pad_token_id", 5000), ("num_expert_group", 3),
                                       ("q_lora_rank", 64), ("hidden_act", "gelu")])
def test_bad_values_name_key_and_value(key, value):
    d = HybridConfig.preset("tiny").to_hf_dict()
    d[key] = value
    with pytest.raises(ValueError, match=re.escape(f"{key}={json.dumps(value)}")):
        HybridConfig.from_hf(d)


@pytest.mark.parametrize("text,message", [
    ('{"model_type": "llama", "num_hidden_layers": 2}', 'model_type="llama": not a Kimi Linear model'),
    ('{"model_type": "kimi_linear",', "not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
])
def test_a_bad_config_file_is_named_with_what_is_wrong(tmp_path, text, message):
    """Before: a llama config said "num_hidden_layers=None: missing" or "linear_attn_config={}", and
    invalid JSON gave the parser's message without the file's name."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        HybridConfig.from_hf(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: ")


def test_bad_layer_lists():
    d = HybridConfig.preset("tiny").to_hf_dict()
    d["linear_attn_config"] = dict(d["linear_attn_config"], full_attn_layers=[3, 4])
    with pytest.raises(ValueError, match=re.escape("kda_layers/full_attn_layers=[[1, 2, 4], [3, 4]]: layer 4 listed twice")):
        HybridConfig.from_hf(d)
    with pytest.raises(ValueError, match="unknown preset"):
        HybridConfig.preset("huge")


def test_tiny_is_fast_and_small_is_sized_for_cpu():
    torch.set_num_threads(1)
    m = HybridModel.from_preset("tiny")
    ids = torch.randint(0, 1024, (1, 1024))
    m(ids)
    t = time.perf_counter()
    m(ids)
    assert time.perf_counter() - t < 1.0
    s = HybridConfig.preset("small")
    assert s.num_mla_layers == 2 and s.hidden_size == 256 and s.num_experts == 16


def test_pool_layout_and_copy_page():
    c = HybridConfig.preset("tiny")
    pool = PagedKVPool(c, num_pages=4, block_size=8)
    assert pool.latents.shape == (1, 4, 8, c.kv_latent_dim)
    assert pool.page_size_bytes == 8 * c.kv_latent_dim * 4
    pool.latents[:, 1] = torch.randn(1, 8, c.kv_latent_dim)
    pool.copy_page(1, 2, num_tokens=5)
    assert torch.equal(pool.latents[:, 2, :5], pool.latents[:, 1, :5])
    assert not pool.latents[:, 2, 5:].any()
    with pytest.raises(ValueError, match="page 4"):
        pool.copy_page(1, 4)
    with pytest.raises(ValueError, match="num_tokens=9"):
        pool.copy_page(1, 2, 9)


def test_pool_holds_normed_latent_and_raw_rope(tiny):
    """The pool entry of a token is [kv_a_layernorm(kv_nope) | k_rot] of the MLA layer input."""
    pool = tiny.new_kv_pool(1, 8)
    ids = torch.tensor([5, 6, 7])
    tiny.forward_paged([ForwardRequest(ids, 0, torch.tensor([0]))], pool)
    c = tiny.config
    attn = tiny.model.layers[c.mla_layers[0]].self_attn
    stored = pool.latents[0, 0, :3]
    k_rot_part = stored[:, c.kv_lora_rank:]
    normed = stored[:, :c.kv_lora_rank]
    assert stored.shape[-1] == c.kv_latent_dim and not pool.latents[0, 0, 3:].any()
    w = attn.kv_a_layernorm.weight
    rms = (normed / w).pow(2).mean(-1)
    assert torch.allclose(rms, torch.ones(3), atol=1e-3)
    assert k_rot_part.abs().sum() > 0


def _req(ids, **kw):
    return ForwardRequest(torch.as_tensor(ids), kw.pop("start", 0), kw.pop("table", torch.tensor([0, 1])), **kw)


@pytest.mark.parametrize("make,msg", [
    (lambda m: _req([1, 1024]), "token id 1024"),
    (lambda m: _req([-1, 3]), "token id -1"),
    (lambda m: _req([], start=0), "empty"),
    (lambda m: _req([1, 2, 3], capture=[4]), "capture boundary 4"),
    (lambda m: _req([1, 2, 3], capture=[0]), "capture boundary 0"),
    (lambda m: _req([1, 2, 3], start=5, initial_state=None), "start=5"),
    (lambda m: _req([1, 2, 3], start=5, initial_state=m.zero_checkpoint()), "boundary=0"),
    (lambda m: _req(list(range(20)), table=torch.tensor([0])), "end=20"),
    (lambda m: _req([1, 2], table=torch.tensor([7])), "page 7"),
])
def test_forward_errors_name_the_value(tiny, make, msg):
    pool = tiny.new_kv_pool(2, 16)
    with pytest.raises(ValueError, match=msg):
        tiny.forward_paged([make(tiny)], pool)


def test_plain_forward_errors(tiny):
    with pytest.raises(ValueError, match="T >= 1"):
        tiny(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="token id 5000"):
        tiny(torch.tensor([[1, 5000]]))


def test_zero_checkpoint_shapes(tiny):
    cp = tiny.zero_checkpoint()
    c = tiny.config
    assert cp.boundary == 0 and cp.recurrent.dtype == torch.float32
    assert tuple(cp.recurrent.shape) == (3, 2, 32, 32) and tuple(cp.conv.shape) == (3, 192, 3)
    assert cp.nbytes == c.checkpoint_bytes
    # starting from the zero checkpoint equals starting from None
    pool = tiny.new_kv_pool(1, 16)
    a = tiny.forward_paged([_req([4, 5, 6], table=torch.tensor([0]), initial_state=cp)], pool)[0]
    b = tiny.forward_paged([_req([4, 5, 6], table=torch.tensor([0]))], pool)[0]
    assert torch.equal(a.logits, b.logits)
