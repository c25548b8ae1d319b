"""The engine binds its namespace to the backend's weights and state layout: a caller that hands it
a CacheIdentity without the weight digest (or the same identity for other weights) cannot make two
models share entries, on the device or through a shared store."""

from __future__ import annotations

import numpy as np
import torch
from hkv_helpers import assert_exact, run_one, tokens

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import TorchBackend
from hybridkv.engine.engine import Engine
from hybridkv.model.model import HybridModel
from hybridkv.store.memory import MemoryStore
from hybridkv.tiers.connector import tier_for


def _engine(model, store):
    cfg = CacheConfig(block_size=256, num_kv_pages=32, num_checkpoint_slots=8, policy=CheckpointPolicy.parse("tail"))
    backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    ns = CacheIdentity(model_repo="tiny").digest()                    # no weight digest: the same for both
    return Engine(cfg, backend, ns, tiers=[tier_for(store, backend, ns, 64, 256)])


def test_models_with_other_weights_never_share_entries(tiny_model):
    torch.manual_seed(0)
    other = HybridModel.from_preset("tiny", seed=1).eval()
    assert other.weight_digest() != tiny_model.weight_digest()
    v = tiny_model.config.vocab_size
    store = MemoryStore()
    P = tokens(61, 512, v)
    a = _engine(tiny_model, store)
    run_one(a, np.concatenate([P, tokens(62, 40, v)]))
    b = _engine(other, store)                                          # fresh device cache, shared store
    rb = run_one(b, np.concatenate([P, tokens(63, 40, v)]))
    assert rb.reused == 0                                              # before: 512 reused, logits off by 4.19
    assert_exact(other, rb)
    c = _engine(tiny_model, store)                                     # same weights: the store still serves
    rc = run_one(c, np.concatenate([P, tokens(64, 40, v)]))
    assert rc.reused == 512
    assert_exact(tiny_model, rc)
