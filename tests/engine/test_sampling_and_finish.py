"""A request's own sampler picks its tokens from the logits; ``Engine.finish`` ends a decoding
request early and releases what it holds."""

from __future__ import annotations

import pytest
import torch
from hkv_helpers import make_engine, tokens

from hybridkv.engine.request import Request, Status


def test_a_sampler_sees_the_last_logits_and_its_choice_is_the_token(tiny_model):
    v = tiny_model.config.vocab_size
    e = make_engine(tiny_model)
    seen = []

    def lowest(logits: torch.Tensor) -> int:
        seen.append(tuple(logits.shape))
        return int(logits.argmin())

    sampled = e.add_request(Request("s", tokens(1, 100, v), 3, sampler=lowest, record_logits=True))
    e.run_until_done()
    assert seen == [(v,)] * 3
    assert sampled.output == [int(sampled.logits[99 + i].argmin()) for i in range(3)]


def test_finish_ends_a_decoding_request_and_releases_its_references(tiny_model):
    e = make_engine(tiny_model)
    r = e.add_request(Request("f", tokens(2, 130, tiny_model.config.vocab_size), 50))
    with pytest.raises(ValueError, match="status is waiting"):
        e.finish(r)
    while r.status != Status.DECODE:
        e.step()
    e.finish(r)
    assert r.status == Status.FINISHED and not e.has_work and e.stats.cancelled == 0
    cache = e.cache
    cache.check_invariants()
    assert sum(cache.pages.refcount) == 0 and sum(cache.checkpoints.refcount) == 0
    assert e.cache.lookup(tokens(2, 130, tiny_model.config.vocab_size)).hit == 128     # what it computed stays
