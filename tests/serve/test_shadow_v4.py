"""Shadow verification of a DeepSeek-V4 server (``hybridkv serve --model v4-tiny --shadow-verify``)
under each ``--swa-recovery`` strategy: the recomputation's chunks against one whole forward, a
clean server that checks its hits and finds nothing, and a store writer that publishes wrong
entries with valid checksums: the check finds it, quarantines every cache group in every tier and
the next request is exact."""

from __future__ import annotations

import logging
import os
import signal

import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import EXIT_BOUND_S, perturb_writes, running_cli, wait_shadow_checks

from hybridkv.engine.build import load_model
from hybridkv.engine.request import Request
from hybridkv.serve.launch import RunningServer, ServeOptions, build_handle
from hybridkv.serve.shadow import SHADOW_CHUNK_TOKENS, V4_TOLERANCE, ShadowCheck, ShadowVerifier, recompute_v4_chunk

RECOVERIES = ["window", "periodic=128", "recompute"]
"""The ``--swa-recovery`` strategies (``periodic``: a state every 128 tokens)."""

PREFIX_TOKENS = 192
"""Tokens the prompts of a test share (three 64-token pages)."""

MAX_TOKENS = 4
"""Greedy tokens generated per completion."""

WAIT_S = 60.0
"""Longest wait for a shadow check to finish (seconds; it runs in the idle engine's slots)."""

VOCAB = 1024
"""v4-tiny's vocabulary (token ids are drawn from ``[3, VOCAB)``)."""


def _prompts(seed: int) -> list[list[int]]:
    """Two prompts sharing :data:`PREFIX_TOKENS` tokens, with 30 and 50 tokens of their own."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, VOCAB, PREFIX_TOKENS).tolist()
    return [prefix + rng.integers(3, VOCAB, k).tolist() for k in (30, 50)]


def _shadow_metrics(url: str) -> dict[str, float]:
    """Every ``hybridkv_shadow*`` sample of ``/metrics`` (labels folded into the name; histogram
    buckets left out), parsed by prometheus_client's text parser."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith("hybridkv_shadow") and "le" not in s.labels:
                out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def _wait_checks(url: str, n: int) -> dict[str, float]:
    """Poll :func:`_shadow_metrics` until ``n`` checks finished (at most :data:`WAIT_S`)."""
    return wait_shadow_checks(lambda: _shadow_metrics(url), n, WAIT_S)


def _ask(url: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy token ids and cached prompt tokens of one bounded completion (``openai`` client)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = c.completions.create(model="v4-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                               extra_body={"return_token_ids": True, "ignore_eos": True})
    return out.choices[0].token_ids, out.usage.prompt_tokens_details.cached_tokens


def test_v4_recompute_chunks_match_a_whole_forward():
    """The check's chunks (the V4 model's own chunked prefill from the empty state) against one
    whole forward of the same tokens, within :data:`V4_TOLERANCE`; and a verifier on a V4 engine
    recomputes a served hit in ``ceil(n / 64)`` chunks and passes it."""
    model = load_model("v4-tiny", 0)
    ids = np.random.default_rng(11).integers(3, VOCAB, 301).astype(np.int64)
    whole = model(torch.from_numpy(ids)[None])[0]
    c = ShadowCheck(ids, 300, 64, {}, [], None, [])
    parts = []
    while c.done < ids.shape[0]:
        end = min(c.done + SHADOW_CHUNK_TOKENS, ids.shape[0])
        logits, c.state = recompute_v4_chunk(model, c, end)
        assert logits.shape == (end - c.done, VOCAB) and c.state.boundary == end
        parts.append(logits)
        c.done = end
    assert len(parts) == 5
    assert float((torch.cat(parts) - whole).abs().max()) <= V4_TOLERANCE

    handle = build_handle(ServeOptions(model="v4-tiny", port=0, threads=1, kv_pages=64, checkpoint_slots=8))
    try:
        engine = handle.engine
        prompt = np.asarray(_prompts(12)[0], dtype=np.int64)
        engine.add_request(Request("miss", prompt.copy(), 3))
        engine.run_until_done()
        hit = engine.add_request(Request("hit", prompt.copy(), 3, record_logits=True))
        engine.run_until_done()
        assert hit.reused > 0
        v = ShadowVerifier(handle, 1.0)
        assert v.tol == V4_TOLERANCE and v.offer(hit, greedy=True)
        while v.pending:
            outcome = v.step()
        assert v.chunks == -(-(hit.prompt_len + 2) // SHADOW_CHUNK_TOKENS)
        assert outcome.problem is None and outcome.diff <= V4_TOLERANCE and (v.checks, v.mismatches) == (1, 0)
    finally:
        handle.close()


def _check_clean(url: str) -> None:
    """Two prompts sharing a prefix: the first a miss (not checked), the second a hit that is
    checked and passes."""
    first, second = _prompts(5)
    assert _ask(url, first)[1] == 0
    assert _ask(url, second)[1] >= 128                                  # a hit over the shared prefix
    m = _wait_checks(url, 1)
    assert m["hybridkv_shadow_checks_total"] == 1, m
    assert m["hybridkv_shadow_mismatches_total"] == 0 and m["hybridkv_shadow_dropped_total"] == 0, m
    assert m["hybridkv_shadow_check_seconds_count"] == 1


@pytest.mark.parametrize("recovery", ["window", "periodic=128"])
def test_a_clean_v4_server_checks_its_hits_and_finds_no_mismatch(recovery):
    with RunningServer(ServeOptions(model="v4-tiny", port=0, threads=1, kv_pages=64, checkpoint_slots=8,
                                    swa_recovery=recovery, shadow_verify=1.0)) as s:
        _check_clean(s.url)


def test_hybridkv_serve_v4_with_shadow_verify_checks_hits_under_recompute():
    """The command line: ``hybridkv serve --model v4-tiny --swa-recovery recompute --shadow-verify 1``
    starts (a V4 model is no longer refused), checks its hit, and stops on SIGINT sent to its PID."""
    cmd = ["serve", "--model", "v4-tiny", "--threads", "1", "--kv-pages", "64", "--checkpoint-slots", "8",
           "--swa-recovery", "recompute", "--shadow-verify", "1"]
    with running_cli(cmd) as (proc, url):
        _check_clean(url)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=EXIT_BOUND_S) == 0


@pytest.fixture(scope="module")
def v4_off():
    """v4-tiny with reuse off (policy ``none``): the reference for exactness."""
    with RunningServer(ServeOptions(model="v4-tiny", port=0, threads=1, policy="none")) as s:
        yield s


def _manifests(s: RunningServer, group: str) -> int:
    """``group`` entries the server's store holds (manifests), listed on the engine thread."""
    def count(h):
        return sum(k.endswith("/manifest") and f"/{group}/" in k for k in h.store_tier.store.list_keys("hkv"))
    return s.server.worker.call(count).result(timeout=30)


@pytest.mark.parametrize("recovery,group", [("window", "swa"), ("periodic=128", "swa"), ("recompute", "csa-hca")])
def test_a_wrong_v4_entry_with_a_valid_checksum_is_found_and_quarantined(tmp_path, v4_off, caplog, recovery, group):
    prompt = _prompts(31)[1]
    exact = _ask(v4_off.url, prompt)[0]
    opts = ServeOptions(model="v4-tiny", port=0, threads=1, kv_pages=64, checkpoint_slots=8, swa_recovery=recovery,
                        store=f"disk://{tmp_path}", shadow_verify=1.0)
    with RunningServer(opts) as s, caplog.at_level(logging.WARNING, logger="hybridkv.serve.shadow"):
        tier = s.server.handle.store_tier
        honest = perturb_writes(tier, group)
        assert _ask(s.url, prompt)[1] == 0                              # computes; the store gets wrong entries
        s.server.worker.call(lambda h: h.store_tier.submit(lambda: None).result()).result(timeout=30)
        tier.save_entries = honest                                      # later writers are honest
        assert _manifests(s, group) > 0 and _manifests(s, "csa-hca") > 0
        assert httpx.post(s.url + "/flush_cache", timeout=30).status_code == 200     # device empty, store kept
        events = httpx.get(s.url + "/v1/cache/events", params={"after": -1}, timeout=30).json()

        _, cached = _ask(s.url, prompt)                                 # restored from the wrong entries
        assert cached > 0
        m = _wait_checks(s.url, 1)
        assert m["hybridkv_shadow_checks_total"] == 1 and m["hybridkv_shadow_mismatches_total"] == 1, m
        assert m["hybridkv_shadow_dropped_total"] == 0 and m["hybridkv_shadow_check_seconds_count"] == 1
        lines = [r.getMessage() for r in caplog.records if "shadow check: mismatch" in r.getMessage()]
        assert len(lines) == 1 and "'store': " in lines[0], lines

        # quarantined in every group and tier: nothing of the prefix is left on the device or in the store
        assert _manifests(s, "swa") == 0 and _manifests(s, "csa-hca") == 0
        later = httpx.get(s.url + "/v1/cache/events", params={"epoch": events["epoch"], "after": events["next"] - 1},
                          timeout=30).json()
        removed = {(e["medium"], e["kind"], e.get("group")) for e in later["events"] if e["kind"].endswith("_removed")}
        want = {("device", "blocks_removed", "csa"), ("device", "blocks_removed", "hca"),
                ("store", "blocks_removed", "csa"), ("store", "blocks_removed", "hca")}
        if recovery != "recompute":
            want.add(("store", "checkpoints_removed", "swa"))
        assert want <= removed, removed

        again, cached = _ask(s.url, prompt)                             # exact: as a cache-off server answers
        assert cached == 0 and again == exact
        assert _wait_checks(s.url, 1)["hybridkv_shadow_mismatches_total"] == 1


@pytest.mark.parametrize("recovery,group", [("window", "swa"), ("recompute", "csa-hca")])
def test_a_wrong_v4_host_entry_is_quarantined_in_the_host_tier_and_the_store(tmp_path, v4_off, caplog, recovery,
                                                                              group):
    """The host tier writes wrong ``group`` entries when the device demotes a prefix to it (an
    unrelated long prompt evicts it); the hit restored from the host tier is found wrong, and the
    quarantine removes the prefix from the device, the host tier and the store (which holds honest
    copies: they go too)."""
    first, second = _prompts(41)
    other = np.random.default_rng(42).integers(3, VOCAB, 400).tolist()
    exact = _ask(v4_off.url, second)[0]
    opts = ServeOptions(model="v4-tiny", port=0, threads=1, kv_pages=8, checkpoint_slots=8, swa_recovery=recovery,
                        host_mib=16, max_model_len=512, store=f"disk://{tmp_path}", shadow_verify=1.0)
    with RunningServer(opts) as s, caplog.at_level(logging.WARNING, logger="hybridkv.serve.shadow"):
        perturb_writes(s.server.handle.host_tier, group)
        assert _ask(s.url, first)[1] == 0 and _ask(s.url, other)[1] == 0      # the first prefix goes to the host
        assert _manifests(s, "csa-hca") > 0
        _, cached = _ask(s.url, second)                                 # restored from the host tier
        assert cached >= 128 and s.server.handle.host_tier.stats.hit_tokens >= 128
        m = _wait_checks(s.url, 1)
        assert m["hybridkv_shadow_checks_total"] == 1 and m["hybridkv_shadow_mismatches_total"] == 1, m
        lines = [r.getMessage() for r in caplog.records if "shadow check: mismatch" in r.getMessage()]
        assert len(lines) == 1 and "'host': " in lines[0] and "'store': " in lines[0], lines
        assert "'host': 0" not in lines[0] and "'store': 0" not in lines[0], lines
        again, cached = _ask(s.url, second)                             # nothing of the prefix is reused
        assert cached == 0 and again == exact
