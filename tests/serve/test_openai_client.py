"""The official ``openai`` client against a live server: completions and chat, streaming and not,
concurrency, and exact reuse of a shared prefix."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serve_helpers import prompt_ids, wait_idle


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_of_a_text_prompt_reports_usage(server):
    out = client(server).completions.create(model="tiny", prompt="The cache keeps prefixes.", max_tokens=6,
                                            temperature=0)
    (choice,) = out.choices
    assert choice.finish_reason in ("length", "stop") and choice.index == 0
    assert out.usage.prompt_tokens == len(b"The cache keeps prefixes.")
    assert 1 <= out.usage.completion_tokens <= 6
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert out.model == "tiny" and out.object == "text_completion"


def test_streamed_completion_ends_with_a_finish_reason_and_usage(server):
    chunks = list(client(server).completions.create(model="tiny", prompt=prompt_ids(1, 100), max_tokens=5,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("length", "stop")
    usage = chunks[-1].usage
    assert usage.prompt_tokens == 100 and 1 <= usage.completion_tokens <= 5
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(token_chunks) == usage.completion_tokens                     # one chunk per generated token


def test_chat_completion_streamed_and_not(server):
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert out.choices[0].message.role == "assistant" and isinstance(out.choices[0].message.content, str)
    assert out.object == "chat.completion" and out.usage.prompt_tokens > 20
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == out.choices[0].message.content
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


def test_a_batch_of_prompts_answers_one_choice_each(server):
    prompts = [prompt_ids(2, 70), prompt_ids(3, 90)]
    out = client(server).completions.create(model="tiny", prompt=prompts, max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 160


def test_sixteen_concurrent_clients_all_finish(server):
    def one(i):
        return client(server).completions.create(model="tiny", prompt=prompt_ids(100 + i, 80 + i), max_tokens=3,
                                                 temperature=0, extra_body={"return_token_ids": True})
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(16)))
    assert [o.usage.prompt_tokens for o in outs] == [80 + i for i in range(16)]
    assert all(1 <= len(o.choices[0].token_ids) <= 3 for o in outs)
    state = wait_idle(server)
    assert state["page_refs"] == 0 and state["slot_refs"] == 0 and state["pages_accounted"]


def test_a_shared_long_prefix_is_reused_with_the_same_greedy_tokens(server, server_off):
    base = prompt_ids(7, 700)
    second = base + prompt_ids(8, 40)
    body = {"return_token_ids": True, "cache_hints": [640]}
    c, ref = client(server), client(server_off)
    c.completions.create(model="tiny", prompt=base, max_tokens=2, temperature=0, extra_body=body)
    hit = c.completions.create(model="tiny", prompt=second, max_tokens=8, temperature=0, extra_body=body)
    cold = ref.completions.create(model="tiny", prompt=second, max_tokens=8, temperature=0, extra_body=body)
    assert hit.usage.prompt_tokens_details.cached_tokens >= 640
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.choices[0].token_ids == cold.choices[0].token_ids


@pytest.mark.parametrize("temperature", [0.8])
def test_sampling_with_a_seed_repeats_and_differs_from_another_seed(server, temperature):
    c = client(server)
    ids = prompt_ids(9, 64)

    def run(seed):
        return c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=temperature, top_p=0.9,
                                    seed=seed, extra_body={"return_token_ids": True}).choices[0].token_ids
    a, b = run(5), run(5)
    assert a == b
    assert any(run(s) != a for s in (6, 7, 8))


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(server):
    c = client(server)
    ids = prompt_ids(11, 64)
    free = c.completions.create(model="tiny", prompt=ids, max_tokens=60, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) >= 6, "the greedy continuation needs some text to cut"
    stop = free[3:5]
    cut = free[: free.find(stop)]
    out = c.completions.create(model="tiny", prompt=ids, max_tokens=60, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model="tiny", prompt=ids, max_tokens=60, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_adapters_never_share_cached_entries(server):
    c, ids = client(server), prompt_ids(80, 300)

    def cached(prompt, **adapter) -> int:
        out = c.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                   extra_body=adapter or None)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(ids, adapter="a") == 0
    assert cached(ids + [9], adapter="a") == 256                            # same adapter: cached
    assert cached(ids + [9], adapter="b") == 0                              # another adapter: not
    assert cached(ids + [9], adapter="a", adapter_version="2") == 0         # another version: not
    assert cached(ids + [9]) == 0                                           # no adapter: not
    assert cached(ids + [10], adapter="b") == 256
    with pytest.raises(openai.BadRequestError, match="adapter_version"):
        cached(ids, adapter_version="2")
    with pytest.raises(openai.BadRequestError, match="adapter"):
        cached(ids, adapter=["x"])
