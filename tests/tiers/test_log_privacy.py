"""Logs never hold prompt content (correctness contract, item 8): no token ids, no store keys, no
chain hashes or namespace digests from which a prompt could be confirmed.

Two engines share a store that injects every fault kind, so the tiers log their warnings (misses,
unreachable store, failed puts, dropped manifests); every record at DEBUG level and above, from
every logger, is checked against what the run handled.
"""

from __future__ import annotations

import logging
import re

import numpy as np
from hkv_helpers import run_one, tokens
from tier_helpers import instance

from hybridkv.store.faults import FAULT_KINDS, FaultyStore
from hybridkv.store.memory import MemoryStore


class _KeyRecorder(MemoryStore):
    """A memory store that remembers every key it was asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def exists(self, keys):
        self.seen.update(keys)
        return super().exists(keys)

    def put(self, items):
        items = list(items)
        self.seen.update(k for k, _ in items)
        return super().put(items)

    def get(self, keys):
        self.seen.update(keys)
        return super().get(keys)


def test_no_log_record_holds_token_ids_keys_or_hashes(tiny_model, caplog):
    v = tiny_model.config.vocab_size
    inner = _KeyRecorder()
    store = FaultyStore(inner, dict.fromkeys(FAULT_KINDS, 0.3) | {"slow": 0.0}, seed=4, close_inner=False)
    P = tokens(130, 1024, v)
    prompts = [np.concatenate([P, tokens(131 + i, 150, v)]) for i in range(4)]
    secrets: set[str] = set()
    with caplog.at_level(logging.DEBUG):
        for prompt in prompts:
            engine, _ = instance(tiny_model, store, policy="tail=1024")
            run_one(engine, prompt)
            secrets |= {h.hex() for h in engine.cache.hash_prompt(prompt)} | {engine.cache.namespace.hex()}
    assert sum(store.injected.values()) > 0 and inner.seen
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert caplog.records, "the faults should have been logged"
    for key in inner.seen:                                        # every hex run of 16+ digits in a key
        secrets |= set(re.findall(r"[0-9a-f]{16,}", key))
    leaked = sorted(s for s in secrets if s in text)
    assert not leaked, leaked[:3]
    for prompt in prompts:                                        # no 4 consecutive prompt ids, in any form
        for i in range(0, len(prompt) - 4, 97):
            window = [int(t) for t in prompt[i:i + 4]]
            assert ", ".join(map(str, window)) not in text and " ".join(map(str, window)) not in text
