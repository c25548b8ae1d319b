"""Kimi-Linear-architecture compute core: KDA layers with exact checkpoints, MLA layers
over a paged latent KV pool, MoE feed-forward (DESIGN §9)."""

from hybridkv.model.config import HybridConfig
from hybridkv.model.generate import greedy_generate
from hybridkv.model.kv_pool import PagedKVPool
from hybridkv.model.model import HybridModel
from hybridkv.model.state import ForwardRequest, ForwardResult, KDACheckpoint

__all__ = ["HybridConfig", "HybridModel", "PagedKVPool", "ForwardRequest", "ForwardResult",
           "KDACheckpoint", "greedy_generate"]
