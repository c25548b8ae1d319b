"""Greedy decoding on top of the paged forward (prefill once, then one token per step)."""

from __future__ import annotations

import torch

from hybridkv.model.state import ForwardRequest


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int,
                    block_size: int = 64) -> torch.Tensor:
    """Greedy continuation of every prompt, batched in one paged forward per step.

    Args:
        model: a :class:`~hybridkv.model.model.HybridModel`.
        input_ids: ``int64 [T]`` or ``[B, T]`` prompts (``T >= 1``).
        max_new_tokens: tokens to generate per prompt (no early stop on EOS).
        block_size: page size of the private KV pool used for the run.

    Returns:
        ``int64 [B, T + max_new_tokens]`` (``[T + max_new_tokens]`` for 1-D input):
        prompts followed by the generated ids.

    Raises:
        ValueError: ``max_new_tokens < 0`` or invalid prompt ids (from the forward).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    squeeze = input_ids.dim() == 1
    ids = input_ids.reshape(1, -1) if squeeze else input_ids
    B, T = ids.shape
    total = T + max_new_tokens
    pages_per_seq = -(-total // block_size)
    pool = model.new_kv_pool(B * pages_per_seq, block_size)
    tables = [torch.arange(b * pages_per_seq, (b + 1) * pages_per_seq) for b in range(B)]
    out = [list(map(int, ids[b])) for b in range(B)]
    reqs = [ForwardRequest(ids[b].cpu(), 0, tables[b]) for b in range(B)]
    for step in range(max_new_tokens):
        results = model.forward_paged(reqs, pool)
        nxt = [int(r.logits[-1].argmax()) for r in results]
        for b in range(B):
            out[b].append(nxt[b])
        reqs = [ForwardRequest(torch.tensor([nxt[b]]), reqs[b].end, tables[b], results[b].end_state)
                for b in range(B)]
    result = torch.tensor(out, dtype=torch.long)
    return result[0] if squeeze else result
