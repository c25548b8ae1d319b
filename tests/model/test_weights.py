"""Checkpoint I/O: published names, sharding, aliases, and errors that name the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.model.model import HybridModel
from hybridkv.model.weights import INDEX, SINGLE


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / SINGLE))
    edit(tensors)
    save_file(tensors, str(dst / SINGLE))
    return dst


def test_published_names_round_trip(reference_dir, tmp_path):
    model = HybridModel.from_pretrained(reference_dir)
    names = set(load_file(str(reference_dir / SINGLE)))
    assert set(model.state_dict()) == names
    assert "model.layers.0.self_attn.q_conv1d.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    model.save_pretrained(tmp_path / "out")
    again = HybridModel.from_pretrained(tmp_path / "out")
    assert again.weight_digest() == model.weight_digest()
    assert set(load_file(str(tmp_path / "out" / SINGLE))) == names


def test_transformers_loads_our_checkpoint(tmp_path):
    from transformers import KimiLinearForCausalLM

    ours = HybridModel.from_preset("tiny", seed=3)
    ours.save_pretrained(tmp_path)
    ref = KimiLinearForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 1024, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
    assert (ours(ids) - want).abs().max().item() <= 1e-4


def test_sharded_checkpoint_and_mlp_alias(reference_dir, tmp_path):
    model = HybridModel.from_pretrained(reference_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "sharded" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert HybridModel.from_pretrained(tmp_path / "sharded").weight_digest() == model.weight_digest()

    def rename_dense(t):
        for name in [n for n in t if "layers.0.block_sparse_moe." in n]:
            t[name.replace("block_sparse_moe.", "mlp.")] = t.pop(name)

    alias = _rewrite(reference_dir, tmp_path / "alias", rename_dense)
    assert HybridModel.from_pretrained(alias).weight_digest() == model.weight_digest()


@pytest.mark.parametrize("kind", ["missing", "extra", "misshaped"])
def test_bad_checkpoint_names_the_tensor(reference_dir, tmp_path, kind):
    name = "model.layers.2.self_attn.kv_b_proj.weight"

    def edit(t):
        if kind == "missing":
            del t[name]
        elif kind == "extra":
            t["model.layers.2.self_attn.bogus.weight"] = torch.zeros(3)
        else:
            t[name] = torch.zeros(5, 5)

    bad = _rewrite(reference_dir, tmp_path / kind, edit)
    want = "bogus" if kind == "extra" else "kv_b_proj"
    with pytest.raises(ValueError, match=want):
        HybridModel.from_pretrained(bad)


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_an_unreadable_safetensors_file_is_named(reference_dir, tmp_path, damage):
    """Before: a truncated model.safetensors raised safetensors' own error with a traceback."""
    bad = tmp_path / damage
    shutil.copytree(reference_dir, bad)
    path = bad / SINGLE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 64 + data[64:])
    with pytest.raises(ValueError, match=f"{path}: not a readable safetensors file"):
        HybridModel.from_pretrained(bad)


def test_weight_digest_is_deterministic_and_sensitive():
    a = HybridModel.from_preset("tiny", seed=0)
    b = HybridModel.from_preset("tiny", seed=0)
    c = HybridModel.from_preset("tiny", seed=1)
    assert a.weight_digest() == b.weight_digest() != c.weight_digest()
    assert len(a.weight_digest()) == 64
    with torch.no_grad():
        b.lm_head.weight[0, 0] += 1
    assert b.weight_digest() == a.weight_digest()  # cached
    assert b.weight_digest(refresh=True) != a.weight_digest()
