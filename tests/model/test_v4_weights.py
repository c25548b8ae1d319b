"""DeepSeek-V4 tensor names: one rename table, read both ways, round-trips every tensor of the presets."""

from __future__ import annotations

import pytest
import torch

from hybridkv.model.v4 import weights
from hybridkv.model.v4.config import V4Config
from hybridkv.model.v4.model import V4Model


def test_the_rename_table_is_one_to_one():
    pubs = [p for p, _ in weights._LAYER_NAMES]
    ours = [o for _, o in weights._LAYER_NAMES]
    assert len(set(pubs)) == len(pubs) and len(set(ours)) == len(ours)
    assert weights._TO_PUBLISHED == {o: p for p, o in weights._TO_OURS.items()}


@pytest.mark.parametrize("name", ["v4-tiny", "v4-small"])
def test_every_tensor_name_round_trips(name):
    """Ours -> published (``published_state``) -> ours (the reader's ``_ours``): every layer tensor
    comes back under its own name (experts are split one by one and stacked again by the reader)."""
    torch.manual_seed(0)
    state = V4Model(V4Config.preset(name)).state_dict()
    published = weights.published_state(state)
    assert not any(".self_attn." in k or ".mlp." in k for k in published)       # every module path renamed
    back = {weights._ours(k) for k in published}
    expert = weights._EXPERT
    stacked = {m.group(1) + ".gate_up_proj" for k in back if (m := expert.match(k))} | \
              {m.group(1) + ".down_proj" for k in back if (m := expert.match(k))}
    assert {k for k in back if not expert.match(k)} | stacked == set(state)


def test_a_published_name_maps_by_its_longest_path():
    assert weights._ours("model.layers.3.attn.indexer.compressor.norm.weight") == \
        "model.layers.3.self_attn.compressor.indexer.kv_norm.weight"
    assert weights._ours("layers.0.ffn.gate.bias") == "model.layers.0.mlp.gate.e_score_correction_bias"
    assert weights._ours("layers.0.hc_ffn_scale") == "model.layers.0.ffn_hc.scale"
    with pytest.raises(ValueError, match="unexpected tensor 'blocks.0.w'"):
        weights._ours("blocks.0.w")
