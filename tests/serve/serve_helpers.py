"""Helpers of the serve tests: prompts and the engine's occupancy read on its own thread."""

from __future__ import annotations

import time

import numpy as np

from hybridkv.serve.launch import RunningServer


def prompt_ids(seed: int, n: int, vocab: int = 1024) -> list[int]:
    """``n`` random token ids of the tiny vocabulary."""
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def engine_idle(s: RunningServer) -> dict:
    """The engine's occupancy, read on its thread: running / waiting requests, pages and slots
    referenced, whether every page is free or cached, and the invariants hold."""
    def read(h):
        cache = h.engine.cache
        cache.check_invariants()
        pages = cache.pages
        return {"running": len(h.engine.running), "waiting": len(h.engine.waiting),
                "page_refs": sum(pages.refcount), "slot_refs": sum(cache.checkpoints.refcount),
                "pages_accounted": pages.num_free + pages.num_evictable == pages.num_pages,
                "connector_requests": h.engine.connector.num_requests if h.engine.connector else 0}
    return s.server.worker.call(read).result(timeout=30)


def wait_idle(s: RunningServer, polls: int = 200) -> dict:
    """Poll :func:`engine_idle` until nothing runs or waits (at most ``polls`` polls, 50 ms apart)."""
    for _ in range(polls):
        state = engine_idle(s)
        if state["running"] == 0 and state["waiting"] == 0 and s.server.worker.queue_depth == 0:
            return state
        time.sleep(0.05)
    return state
