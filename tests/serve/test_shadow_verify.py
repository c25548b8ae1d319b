"""Shadow verification (``hybridkv serve --shadow-verify``): a served hit recomputed without the
cache, a wrong entry found and quarantined in every tier, ties and full queues counted apart."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import perturb_writes, prompt_ids, wait_shadow_checks

from hybridkv.cache.groups import KDA
from hybridkv.cli import main
from hybridkv.engine.request import Request
from hybridkv.serve.launch import RunningServer, ServeOptions, build_handle
from hybridkv.serve.metrics import ServeMetrics
from hybridkv.serve.shadow import ShadowVerifier
from hybridkv.serve.worker import EngineWorker, Job

WAIT_S = 60.0
"""Longest wait for a shadow check to finish (seconds; it runs in the idle engine's slots)."""


def _metrics(url: str) -> dict[str, float]:
    """Every sample of ``/metrics`` whose name starts with ``hybridkv_shadow``, parsed by
    prometheus_client's text parser (labels folded into the name)."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith("hybridkv_shadow"):
                key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "le")
                if "le" not in s.labels:
                    out[key] = s.value
    return out


def _complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_checks(url: str, n: int) -> dict[str, float]:
    """Poll :func:`_metrics` until ``n`` checks finished (at most :data:`WAIT_S`)."""
    return wait_shadow_checks(lambda: _metrics(url), n, WAIT_S)


def _checkpoint_manifests(s: RunningServer) -> int:
    """Checkpoint (KDA) entries the server's store holds, listed on the engine thread."""
    def count(h):
        return sum(k.endswith("/manifest") and f"/{KDA}/" in k for k in h.store_tier.store.list_keys("hkv"))
    return s.server.worker.call(count).result(timeout=30)


def test_a_perturbed_checkpoint_with_a_valid_checksum_is_found_and_quarantined(tmp_path, server_off):
    prompt = prompt_ids(31, 300)
    with RunningServer(ServeOptions(port=0, threads=1, store=f"disk://{tmp_path}", shadow_verify=1.0)) as s:
        tier = s.server.handle.store_tier
        honest = perturb_writes(tier, KDA)
        first = _complete(s.url, prompt)                                   # computes; the store gets wrong checkpoints
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        s.server.worker.call(lambda h: h.store_tier.submit(lambda: None).result()).result(timeout=30)
        tier.save_entries = honest                                         # later writers are honest
        assert _checkpoint_manifests(s) > 0
        assert httpx.post(s.url + "/flush_cache", timeout=30).status_code == 200     # device empty, store kept
        events = httpx.get(s.url + "/v1/cache/events", params={"after": -1}, timeout=30).json()

        served = _complete(s.url, prompt)                                  # restored from the wrong checkpoint
        assert served["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        exact = _complete(server_off.url, prompt)["choices"][0]["text"]
        assert served["choices"][0]["text"] != exact                       # the client got a wrong answer
        m = _wait_checks(s.url, 1)
        assert m["hybridkv_shadow_checks_total"] == 1 and m["hybridkv_shadow_mismatches_total"] == 1, m
        assert m["hybridkv_shadow_dropped_total"] == 0 and m["hybridkv_shadow_check_seconds_count"] == 1

        # quarantined in every tier: nothing of the prefix is left to reuse, on the device or in the store
        assert _checkpoint_manifests(s) == 0
        later = httpx.get(s.url + "/v1/cache/events", params={"epoch": events["epoch"], "after": events["next"] - 1},
                          timeout=30).json()
        removed = {(e["medium"], e["kind"]) for e in later["events"]}
        assert ("device", "blocks_removed") in removed and ("store", "checkpoints_removed") in removed, removed

        again = _complete(s.url, prompt)                                   # exact: as a cache-off server answers
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["choices"][0]["text"] == exact
        m = _wait_checks(s.url, 1)
        assert m["hybridkv_shadow_mismatches_total"] == 1


def test_exact_hits_pass_and_a_full_queue_drops_the_check():
    handle = build_handle(ServeOptions(port=0, threads=1))
    try:
        engine = handle.engine
        prompt = np.asarray(prompt_ids(32, 200), dtype=np.int64)
        miss = engine.add_request(Request("miss", prompt.copy(), 3, record_logits=True))
        engine.run_until_done()
        hit = engine.add_request(Request("hit", prompt.copy(), 3, record_logits=True))
        engine.run_until_done()
        assert miss.reused == 0 and hit.reused > 0
        metrics = ServeMetrics()
        v = ShadowVerifier(handle, 1.0, metrics, queue_size=1, chunk_tokens=64)
        assert not v.offer(miss, greedy=True)                               # a miss is never queued
        assert v.offer(hit, greedy=True) and not v.offer(hit, greedy=True)
        assert v.dropped == 1
        row = handle.backend.vocab_size * 4                               # bytes of one float32 logit row
        small = ShadowVerifier(handle, 1.0, queue_bytes=len(hit.logits) * row - 1)       # just short of the hit's
        assert not small.offer(hit, greedy=True) and small.dropped == 1 and not small.pending
        steps = 0
        while v.pending:
            outcome = v.step()
            steps += 1
        assert steps == -(-(hit.prompt_len + 2) // 64)                    # one chunk per idle slot
        assert outcome.problem is None and v.checks == 1 and v.mismatches == 0
    finally:
        handle.close()


def test_the_rate_is_checked_and_zero_samples_nothing():
    handle = build_handle(ServeOptions(port=0, threads=1))
    try:
        assert not any(ShadowVerifier(handle, 0.0).sample() for _ in range(100))
        assert all(ShadowVerifier(handle, 1.0).sample() for _ in range(100))
        for bad in (-0.1, 1.5):
            try:
                ShadowVerifier(handle, bad)
            except ValueError as exc:
                assert "--shadow-verify" in str(exc) and str(bad) in str(exc)
            else:
                raise AssertionError(f"rate {bad} accepted")
    finally:
        handle.close()


def test_the_cli_refuses_a_rate_outside_zero_to_one(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--shadow-verify", "1.5"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--shadow-verify" in err and "'1.5'" in err and "Traceback" not in err


def test_an_argmax_tie_is_counted_and_nothing_is_quarantined():
    """The prompt of soak seed 86626, round 1287, request #21: the full prefill's two largest logits
    at its last position are equal (tests/replay/test_argmax_tie.py). A hit that served the other
    of the two is a tie: counted under ``kind="argmax"``, no mismatch, the entries stay."""
    from hybridkv.replay.soak_rounds import build_prompt
    handle = build_handle(ServeOptions(port=0, threads=1))
    try:
        engine = handle.engine
        prompt, _ = build_prompt([["r", 1361757979, 384], ["r", 1471509622, 34], ["r", 155059214, 28]], {},
                                 handle.backend.vocab_size)
        engine.add_request(Request("warm", prompt[:390].copy(), 1))
        engine.run_until_done()
        hit = engine.add_request(Request("hit", prompt.copy(), 1, record_logits=True))
        engine.run_until_done()
        assert hit.reused > 0
        top2 = torch.topk(hit.logits[prompt.shape[0] - 1], 2).indices.tolist()
        hit.output = [top2[1] if hit.output[0] == top2[0] else top2[0]]     # the other of the two served
        metrics = ServeMetrics()
        v = ShadowVerifier(handle, 1.0, metrics)
        assert v.offer(hit, greedy=True)
        while v.pending:
            outcome = v.step()
        assert outcome.argmax_tie == prompt.shape[0] - 1 and outcome.problem is None
        assert (v.checks, v.ties, v.mismatches) == (1, 1, 0)
        assert metrics.registry.get_sample_value("hybridkv_shadow_ties_total", {"kind": "argmax"}) == 1
        again = engine.add_request(Request("again", prompt.copy(), 1))
        engine.run_until_done()
        assert again.reused == hit.reused                                   # nothing was quarantined
    finally:
        handle.close()


def test_a_check_yields_to_a_request_that_arrives_during_it():
    """A check runs one chunk per idle slot: a request submitted while a long check runs is
    admitted after at most the chunk under way (plus the one that may start before the submission
    reaches the engine thread), long before the check ends."""
    handle = build_handle(ServeOptions(port=0, threads=1))
    v = ShadowVerifier(handle, 1.0, chunk_tokens=8)
    worker = EngineWorker(handle, shadow=v)
    worker.start()
    try:
        prompt = np.asarray(prompt_ids(33, 600), dtype=np.int64)
        seen: dict[str, threading.Event] = {}
        at_first_token: dict[str, tuple[int, bool]] = {}

        def job(name: str, ids: np.ndarray) -> Job:
            seen[name] = threading.Event()

            def emit(event: tuple) -> None:
                if event[0] == "token" and name not in at_first_token:
                    at_first_token[name] = (v.chunks, v.pending)
                if event[0] in ("done", "error"):
                    seen[name].set()
            return Job(ids, 2, handle.namespace, ("", ""), emit)

        for name in ("cold", "hit"):                           # the second reuses the first's prefix
            assert worker.submit(job(name, prompt.copy()))
            assert seen[name].wait(WAIT_S)
        before = v.chunks
        assert worker.submit(job("during", np.asarray(prompt_ids(34, 100), dtype=np.int64)))
        assert seen["during"].wait(WAIT_S)
        chunks, pending = at_first_token["during"]
        assert pending, "the check ended before the request that arrived during it was served"
        assert chunks - before <= 2
        deadline = time.monotonic() + WAIT_S
        while v.checks < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert v.checks == 1 and v.mismatches == 0 and v.chunks == -(-(600 + 1) // 8)
    finally:
        worker.stop()
        handle.close()
