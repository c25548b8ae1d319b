"""Helpers of the serve tests: prompts and the engine's occupancy read on its own thread."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

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


SRC = Path(__file__).resolve().parents[2] / "src"
CLI_ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
"""Environment of a ``hybridkv`` subprocess: this checkout's sources, one thread."""
EXIT_BOUND_S = 60
"""A hang guard: seconds a started command may take to print its URL or to exit (seconds)."""


@contextlib.contextmanager
def running_cli(cmd: list[str]) -> Iterator[tuple[subprocess.Popen, str]]:
    """``hybridkv CMD --port 0`` as a subprocess (stderr piped): yields it and the URL its startup
    line prints (``... on http://127.0.0.1:PORT ... (Ctrl-C stops it)``); killed at the end if it
    still runs. Fails the test if it exits before printing the URL."""
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", *cmd, "--port", "0"], env=CLI_ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:                       # the startup line names the port picked
            if " on http://127.0.0.1:" in line and "Ctrl-C stops it" in line:
                url = line.split(" on ")[1].split()[0]
                break
        if url is None:
            proc.wait(timeout=EXIT_BOUND_S)
            pytest.fail(f"{cmd[0]} exited {proc.returncode} before printing its URL")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def router_stats(router) -> dict:
    """``GET /router/stats`` of a running router (a ``BackgroundUvicorn``), as JSON."""
    import httpx
    return httpx.get(f"{router.url}/router/stats", timeout=10).json()


def wait_router(pred, router, polls: int = 400) -> dict:
    """Poll the router's stats until ``pred(stats)`` (at most ``polls`` polls, 25 ms apart);
    fails the test with the last stats otherwise."""
    s: dict = {}
    for _ in range(polls):
        s = router_stats(router)
        if pred(s):
            return s
        time.sleep(0.025)
    pytest.fail(f"router never reached the expected state: {s}")


def wait_running(s: RunningServer, polls: int = 400) -> None:
    """Poll until the server's engine runs a request (at most ``polls`` polls, 25 ms apart)."""
    for _ in range(polls):
        if engine_idle(s)["running"]:
            return
        time.sleep(0.025)


def perturb_writes(tier, group: str):
    """Make ``tier`` a writer whose ``group`` entries (KDA checkpoints, ``swa`` states or
    ``csa-hca`` pages) are wrong before they are published: each floating-point component
    multiplied by -3, then checksummed and written as usual (the manifest's checksums match the
    wrong bytes). Returns the honest ``save_entries``."""
    honest = tier.save_entries

    def save(entries, owner=None, speculative=()):
        wrong = [(h, parent, grp, b, {k: t * -3.0 if grp == group and t.is_floating_point() else t
                                      for k, t in tensors.items()})
                 for h, parent, grp, b, tensors in entries]
        return honest(wrong, owner=owner, speculative=speculative)

    tier.save_entries = save
    return honest


def wait_shadow_checks(read, n: int, wait_s: float) -> dict[str, float]:
    """Poll ``read()`` (shadow metric samples by name) every 50 ms until
    ``hybridkv_shadow_checks_total`` reaches ``n`` or ``wait_s`` seconds pass; the last samples."""
    deadline = time.monotonic() + wait_s
    while True:
        m = read()
        if m.get("hybridkv_shadow_checks_total", 0) >= n or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def router_args(workers: list[str], **kw):
    """The ``hybridkv router`` arguments of a test's in-process router over ``workers`` (URLs):
    the ``hybrid`` policy on the tiny model, 1 s polls, no keys; ``kw`` overrides any of them."""
    import argparse

    base = dict(worker=list(workers), policy="hybrid", model="tiny", cost_model=None, poll_interval=1.0,
                health_every=1, follow_wait=0.0, store_gbps=1.1, store_latency_us=194.0, api_key=None,
                api_keys_file=None, admin_key=None, worker_key=None)
    return argparse.Namespace(**{**base, **kw})
