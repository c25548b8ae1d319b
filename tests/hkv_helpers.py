"""Engine builders and exactness checks shared by the engine tests."""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.cache.config import CacheConfig, CheckpointPolicy
from hybridkv.cache.namespace import CacheIdentity
from hybridkv.engine.backend import TorchBackend
from hybridkv.engine.engine import Engine
from hybridkv.engine.request import Request, Status


def make_engine(model, *, policy="branch+tail", mechanism="extract", block_size=1024, unit=64,
                budget=8192, pages=64, slots=16, max_num_seqs=4, identity=None) -> Engine:
    """An engine over ``model`` with the given cache settings."""
    cfg = CacheConfig(block_size=block_size, prefix_match_unit=unit, max_num_batched_tokens=budget,
                      num_kv_pages=pages, num_checkpoint_slots=slots,
                      policy=CheckpointPolicy.parse(policy), mechanism=mechanism, max_num_seqs=max_num_seqs)
    backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    ident = identity or CacheIdentity(model_repo="tiny", weight_digest=model.weight_digest())
    return Engine(cfg, backend, ident.digest())


def run_one(engine: Engine, prompt, max_output_tokens: int = 3, hints=()) -> Request:
    """Submit one request with logits recording and run the engine dry."""
    r = engine.add_request(Request(f"r{engine.stats.requests}", np.asarray(prompt), max_output_tokens,
                                   hints=tuple(hints), record_logits=True))
    engine.run_until_done()
    assert r.status == Status.FINISHED, r.reject_reason
    return r


@torch.no_grad()
def assert_exact(model, req: Request, tol: float = 1e-4) -> float:
    """Logits at every position the cached run computed equal a no-cache prefill; same greedy tokens."""
    ids = np.concatenate([req.prompt, np.asarray(req.output[:-1], dtype=np.int64)])
    full = model(torch.from_numpy(ids)[None])[0]
    assert sorted(req.logits) == list(range(req.reused, len(ids))), "computed positions"
    diff = max(float((row - full[pos]).abs().max()) for pos, row in req.logits.items())
    assert diff <= tol, f"max abs logit diff {diff}"
    assert full[req.prompt_len - 1:].argmax(-1).tolist() == req.output
    return diff


def tokens(seed: int, n: int, vocab: int) -> np.ndarray:
    """``n`` deterministic random token ids."""
    return np.random.default_rng(seed).integers(0, vocab, n, dtype=np.int64)


def tamper_resumed_rows(monkeypatch, backend_cls, delta: float = 0.01) -> None:
    """Patch ``backend_cls.run`` so the first logits row of every multi-token chunk resumed at a
    64-aligned position is off by ``delta`` (a stand-in for a reuse or restore bug; greedy tokens
    stay right)."""
    run = backend_cls.run

    def wrong(self, items):
        outs = run(self, items)
        for it, out in zip(items, outs):
            if it.start > 0 and it.start % 64 == 0 and out.logits is not None and out.logits.shape[0] > 1:
                out.logits[0] += delta
        return outs

    monkeypatch.setattr(backend_cls, "run", wrong)
