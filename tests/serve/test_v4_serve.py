"""``hybridkv serve --model v4-tiny``: the official ``openai`` client against a live DeepSeek-V4
server under each SWA recovery strategy; a shared prefix is reused (from the device, from a disk
store after a restart, from the host tier after an eviction) and the generated tokens are a full
prefill's (a cache-off server's) greedy tokens; events and ``/server_info`` name V4's groups."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import wait_idle

from hybridkv.cli import main
from hybridkv.engine.build import load_model
from hybridkv.serve.launch import RunningServer, ServeOptions, build_handle

PREFIX_TOKENS = 192
"""Tokens the two prompts share (three 64-token pages)."""

MAX_TOKENS = 4
"""Greedy tokens generated per completion."""


@pytest.fixture(scope="module")
def v4():
    """The reference: v4-tiny with the server's seed, run cache-free."""
    return load_model("v4-tiny", 0)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``model`` after ``prompt``, each from a full prefill (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor(ids, dtype=torch.int64)[None])[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("recovery", ["window", "periodic=128", "recompute"])
def test_a_shared_prefix_is_reused_exactly(v4, recovery):
    rng = np.random.default_rng(5)
    vocab = v4.config.vocab_size
    prefix = rng.integers(3, vocab, PREFIX_TOKENS).tolist()
    prompts = [prefix + rng.integers(3, vocab, k).tolist() for k in (30, 50)]
    with RunningServer(ServeOptions(model="v4-tiny", port=0, threads=1, kv_pages=64, checkpoint_slots=8,
                                    swa_recovery=recovery)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        outs = [c.completions.create(model="v4-tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"return_token_ids": True, "ignore_eos": True}) for p in prompts]
        assert outs[0].usage.prompt_tokens_details.cached_tokens == 0
        assert outs[1].usage.prompt_tokens_details.cached_tokens >= 128    # a 64-aligned boundary of the prefix
        assert outs[1].usage.prompt_tokens_details.cached_tokens <= PREFIX_TOKENS
        for p, out in zip(prompts, outs):
            got = out.choices[0].token_ids
            assert len(got) == out.usage.completion_tokens == MAX_TOKENS
            assert got == _greedy(v4, p, MAX_TOKENS)
        state = wait_idle(s)
        assert state["page_refs"] == 0 and state["slot_refs"] == 0 and state["pages_accounted"]
        text = httpx.get(s.url + "/metrics", timeout=30).text
        samples = {smp.name: smp.value for f in text_string_to_metric_families(text) for smp in f.samples
                   if not smp.labels or set(smp.labels) == {"le"} and smp.labels["le"] == "+Inf"}
        assert samples["hybridkv_reused_prompt_tokens_count"] == 2
        assert samples["hybridkv_reused_prompt_tokens_sum"] == outs[1].usage.prompt_tokens_details.cached_tokens


def _ask(s: RunningServer, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy token ids and cached prompt tokens of one completion, through the ``openai`` client."""
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = c.completions.create(model="v4-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                               extra_body={"return_token_ids": True, "ignore_eos": True})
    return out.choices[0].token_ids, out.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("recovery", ["window", "periodic=64", "recompute"])
def test_store_and_host_tier_carry_v4_groups(tmp_path, recovery):
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 1000, PREFIX_TOKENS).tolist()
    first, second = prefix + rng.integers(3, 1000, 30).tolist(), prefix + rng.integers(3, 1000, 50).tolist()
    other = rng.integers(3, 1000, 400).tolist()
    with RunningServer(ServeOptions(model="v4-tiny", port=0, threads=1, policy="none")) as off:
        want = _ask(off, second)
    assert want[1] == 0
    store = f"disk://{tmp_path}/store"
    opts = ServeOptions(model="v4-tiny", port=0, threads=1, kv_pages=64, checkpoint_slots=8, swa_recovery=recovery,
                        store=store)
    with RunningServer(opts) as s:
        assert _ask(s, first)[1] == 0
        wait_idle(s)
        info = httpx.get(s.url + "/v1/cache/info", timeout=30).json()
        groups = httpx.get(s.url + "/server_info", timeout=30).json()["cache_groups"]
        model_info = httpx.get(s.url + "/model_info", timeout=30).json()
        events = httpx.get(s.url + "/v1/cache/events", timeout=30).json()["events"]
    assert [(g["name"], g["kind"], g["unit"]) for g in groups] == [("csa", "paged", 4), ("hca", "paged", 16),
                                                                  ("swa", "state", 64)]
    assert info["groups"] == groups and all(g["entry_bytes"] > 0 for g in groups)
    assert (model_info["model_type"], model_info["architectures"]) == ("deepseek_v4", ["DeepseekV4ForCausalLM"])
    assert [g["name"] for g in info["store"]["groups"]] == ["csa", "hca", "swa"]
    seen = {(e["kind"], e["medium"], e["group"]) for e in events}
    for medium in ("device", "store"):        # a page event per paged group; a saved state under swa
        assert {("blocks_stored", medium, "csa"), ("blocks_stored", medium, "hca")} <= seen
        assert (("checkpoints_stored", medium, "swa") in seen) == (recovery != "recompute")
    with RunningServer(opts) as s:           # a restart: the device is empty, the store is not
        got = _ask(s, second)
        loaded = s.server.handle.store_tier.stats.hit_tokens
    assert got[1] == loaded == PREFIX_TOKENS and got[0] == want[0]
    # the host tier: the first prompt's pages are evicted to it by an unrelated long prompt
    with RunningServer(ServeOptions(model="v4-tiny", port=0, threads=1, kv_pages=8, checkpoint_slots=8,
                                    swa_recovery=recovery, host_mib=16, max_model_len=512)) as s:
        assert _ask(s, first)[1] == 0 and _ask(s, other)[1] == 0
        got = _ask(s, second)
        from_host = s.server.handle.host_tier.stats.hit_tokens
    assert got[0] == want[0] and got[1] >= 128 and from_host >= 128


def test_serve_refuses_what_v4_does_not_run(capsys):
    with pytest.raises(ValueError, match=r"--model deepseek-v4-flash is a simulate-only preset"):
        build_handle(ServeOptions(model="deepseek-v4-flash", port=0, threads=1))
    assert main(["serve", "--model", "tiny", "--port", "0", "--swa-recovery", "recompute"]) == 2
    err = capsys.readouterr().err
    assert "error: --swa-recovery recompute: applies to DeepSeek-V4 models" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["serve", "--model", "v4-tiny", "--port", "0", "--swa-recovery", "periodic=0"])
    assert "--swa-recovery" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [["serve", "--model", "v4-tiny", "--port", "0"],
                                 ["replay", "--simulate", "--model", "deepseek-v4-flash", "--limit", "2"]])
def test_a_period_off_the_unit_names_the_options_and_values(cmd, capsys):
    """``--swa-recovery periodic=2`` is refused at start with the options as typed, not the config fields."""
    assert main([*cmd, "--swa-recovery", "periodic=2", "--prefix-match-unit", "64"]) == 2
    err = " ".join(capsys.readouterr().err.split())          # the replay's console wraps long lines
    assert err.startswith("error: --swa-recovery periodic=2: P=2 tokens must be a multiple of "
                          "--prefix-match-unit 64") and "e.g. --swa-recovery periodic=64" in err, err
    assert "swa_recovery" not in err and "prefix_match_unit=" not in err and "Traceback" not in err


def test_the_event_feed_names_each_group_of_the_family():
    """Kimi Linear (the default): ``full`` / ``kda``; DeepSeek-V4: a page event once per paged group
    (``csa``, ``hca``, same keys), the state under ``swa``; ``all_cleared`` names none."""
    from hybridkv.cache.groups import BOUNDARY, PREFIX, SAVED_AT_HIT, GroupSpec
    from hybridkv.cache.swa import v4_family
    from hybridkv.serve.cache_events import EventFeed

    unit, state = bytes(32), bytes([1]) * 32
    kimi = EventFeed()
    kimi.stored([unit], [state], [])
    assert [(e["kind"], e["group"]) for e in kimi.page(None, -1)["events"]] == [
        ("blocks_stored", "full"), ("checkpoints_stored", "kda")]
    fam = v4_family(GroupSpec("csa", PREFIX, 4), GroupSpec("hca", PREFIX, 16), GroupSpec("swa", BOUNDARY, 64),
                    SAVED_AT_HIT)
    v4 = EventFeed(family=fam)
    v4.stored([unit], [state], [])
    v4.reset()
    events = v4.page(None, -1)["events"]
    assert [(e["kind"], e.get("group")) for e in events] == [("all_cleared", None)]
    v4.stored([unit], [state], [])
    events = v4.page(None, -1)["events"]
    assert [(e["kind"], e.get("group"), e["keys"]) for e in events] == [
        ("all_cleared", None, []), ("blocks_stored", "csa", [unit.hex()]), ("blocks_stored", "hca", [unit.hex()]),
        ("checkpoints_stored", "swa", [state.hex()])]
