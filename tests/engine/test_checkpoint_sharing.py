"""A published checkpoint's slot keeps the tensors the forward captured, and under ``split`` the
chunk's end state is also the producer's working state for its next chunk: nothing may write
either in place. Requests resume from such checkpoints while their producers keep prefilling
(small chunks) and decoding; every slot's tensors must stay what they were when written, and
every request must reproduce a full prefill."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hkv_helpers import assert_exact, make_engine, tokens
from hybridkv.cache.pools import CheckpointPool
from hybridkv.engine.request import Request, Status

LOGIT_TOL = 1e-4
"""Largest |Δlogit| allowed between a cached run and a full prefill (fp32, tiny model)."""


@pytest.mark.parametrize("mechanism,budget", [("split", 64), ("split", 8192), ("extract", 128)])
def test_published_checkpoints_are_never_written_while_requests_resume_from_them(
        tiny_model, monkeypatch, mechanism, budget):
    written: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    write = CheckpointPool.put

    def remember(pool, slot, held):
        write(pool, slot, held)
        if held is not None:                # the slot's own tensors and a copy of their values then
            written.append((held, {c: t.clone() for c, t in held.items()}))

    monkeypatch.setattr(CheckpointPool, "put", remember)
    eng = make_engine(tiny_model, policy="branch+tail=64+interval=128", mechanism=mechanism, block_size=64,
                      budget=budget, pages=256, slots=6)
    vocab = tiny_model.config.vocab_size
    base = tokens(1, 256, vocab)
    first = [np.concatenate([base[:64 * (1 + i % 4)], tokens(100 + i, 30 + 17 * i, vocab)]) for i in range(6)]
    waves = [(first, 12), ([np.concatenate([p, tokens(200 + i, 70, vocab)]) for i, p in enumerate(first)], 4)]
    done, shared = [], 0                    # steps where a working state is a slot's tensors
    for w, (prompts, max_out) in enumerate(waves):
        reqs = [eng.add_request(Request(f"w{w}r{i}", p, max_out, record_logits=True)) for i, p in enumerate(prompts)]
        while any(r.status not in (Status.FINISHED, Status.REJECTED) for r in reqs):
            eng.step()
            for held, values in written:
                for comp, t in held.items():
                    assert torch.equal(t, values[comp]), f"checkpoint component {comp!r} changed after its write"
            held_ptrs = {t.data_ptr() for held, _ in written for t in held.values()}
            shared += any(r.alloc is not None and r.alloc.state is not None
                          and r.alloc.state.recurrent.data_ptr() in held_ptrs for r in eng.running)
        done += reqs
    assert len(written) >= 12 and sum(r.reused for r in done) >= 6 * 64      # slots reused, requests resumed
    if mechanism == "split":                # a chunk's end state went into a slot and went on computing
        assert shared
    for r in done:
        assert r.status == Status.FINISHED, r.reject_reason
        assert_exact(tiny_model, r, LOGIT_TOL)
    eng.cache.check_invariants()
