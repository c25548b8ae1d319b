"""Parity with transformers.KimiLinearForCausalLM on the same weights (fp32, CPU)."""

from __future__ import annotations

import torch

from hybridkv.model.generate import greedy_generate
from hybridkv.model.model import HybridModel
from hybridkv.model.state import ForwardRequest

TOL = 1e-4


def test_prefill_logits_match_transformers(reference, reference_dir):
    model = HybridModel.from_pretrained(reference_dir)
    ids = torch.randint(3, 512, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits.float()
    got = model(ids)
    assert got.shape == want.shape == (1, 300, 512)
    assert want.abs().max() > 1.0  # the weights make non-trivial logits
    assert (got - want).abs().max().item() <= TOL


def test_greedy_decode_matches_transformers(reference, reference_dir):
    model = HybridModel.from_pretrained(reference_dir)
    ids = torch.randint(3, 512, (1, 70), generator=torch.Generator().manual_seed(2))
    steps = 20
    # transformers: prefill, then one token per step with its cache
    ref_tokens, ref_logits = [], []
    with torch.no_grad():
        out = reference(ids, use_cache=True)
        cache = out.cache
        for _ in range(steps):
            lg = out.logits[0, -1].float()
            ref_logits.append(lg)
            nxt = int(lg.argmax())
            ref_tokens.append(nxt)
            out = reference(torch.tensor([[nxt]]), cache=cache, use_cache=True)
            cache = out.cache
    # ours, step by step, comparing logits at each step
    pool = model.new_kv_pool(2, 64)
    table = torch.tensor([0, 1])
    req = ForwardRequest(ids[0], 0, table)
    for step in range(steps):
        res = model.forward_paged([req], pool)[0]
        assert (res.logits[0] - ref_logits[step]).abs().max().item() <= TOL, step
        nxt = int(res.logits[0].argmax())
        assert nxt == ref_tokens[step], step
        req = ForwardRequest(torch.tensor([nxt]), req.end, table, res.end_state)
    # and the packaged helper agrees
    gen = greedy_generate(model, ids, steps)
    assert gen[0, 70:].tolist() == ref_tokens
