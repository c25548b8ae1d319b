"""When the engine thread fails, every caller hears of it: nothing waits on an inbox nobody reads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hybridkv.serve.launch import RunningServer, ServeOptions
from hybridkv.serve.worker import Job

WAIT_S = 30          # hang guard for events that must come at once


class _Events:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.ended = threading.Event()

    def emit(self, event: tuple) -> None:
        self.events.append(event)
        if event[0] in ("done", "error"):
            self.ended.set()


def _job(events: _Events) -> Job:
    return Job(np.arange(8, 72, dtype=np.int64), 4, b"\0" * 32, ("t", ""), events.emit)


def test_jobs_and_calls_queued_while_the_engine_fails_get_an_error():
    with RunningServer(ServeOptions(port=0, threads=1)) as s:
        worker, engine = s.server.worker, s.server.handle.engine
        in_step, release = threading.Event(), threading.Event()

        def failing_step():
            in_step.set()
            release.wait(WAIT_S)
            raise RuntimeError("injected step failure")

        engine.step = failing_step
        first, queued, late = _Events(), _Events(), _Events()
        assert worker.submit(_job(first))
        assert in_step.wait(WAIT_S)
        assert worker.submit(_job(queued))             # lands in the inbox during the failing step
        pending_call = worker.call(lambda h: 1)
        release.set()
        for ev in (first, queued):
            assert ev.ended.wait(WAIT_S) and ev.events[-1][0] == "error"
            assert "injected step failure" in ev.events[-1][1]
        with pytest.raises(RuntimeError, match="injected step failure"):
            pending_call.result(WAIT_S)
        assert worker.submit(_job(late))               # after the failure: refused at once
        assert late.ended.wait(WAIT_S) and late.events[-1][0] == "error"
        with pytest.raises(RuntimeError, match="injected step failure"):
            worker.invalidate(None, None, True).result(WAIT_S)
