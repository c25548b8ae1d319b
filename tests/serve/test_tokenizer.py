"""The byte tokenizer shipped for presets, a model directory's own tokenizer, and the tokenizer
identity in the cache namespace."""

from __future__ import annotations

import openai
import pytest

from hybridkv.serve.launch import RunningServer, ServeOptions
from hybridkv.serve.tokenizer import (
    BOS,
    BYTE_VOCAB,
    IM_END,
    IM_START,
    ByteTokenizer,
    incremental_text,
    load_codec,
)


def test_byte_tokenizer_round_trips_utf8_and_renders_the_chat_template():
    tok = ByteTokenizer()
    text = "naïve 日本 <|im_start|>"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and all(8 <= i < BYTE_VOCAB for i in ids)
    assert tok.decode(ids) == text                             # specials are never made from text
    chat = tok.chat([{"role": "user", "content": "hi"}])
    assert chat == [BOS, IM_START, *tok.encode("user\nhi"), IM_END, *tok.encode("\n"), IM_START,
                    *tok.encode("assistant\n")]
    with pytest.raises(ValueError, match="messages\\[0\\].role is 'bot'"):
        tok.chat([{"role": "bot", "content": "x"}])


def test_incremental_text_holds_back_a_split_utf8_character():
    tok = ByteTokenizer()
    ids = tok.encode("a日")                                      # 1 + 3 bytes
    assert incremental_text(tok, ids[:2], 0) == ("a", 1)       # the first byte of 日 alone: held back
    assert incremental_text(tok, ids, 1) == ("日", 2)


def test_a_preset_vocabulary_too_small_for_bytes_is_refused():
    with pytest.raises(ValueError, match="vocab_size=200"):
        load_codec("tiny", 200)


def _save_tokenizer(path, template: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "user": 5, "assistant": 6, ":": 7}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    tok.chat_template = template
    tok.save_pretrained(path)


TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")


def test_a_model_directory_serves_with_its_own_tokenizer_and_template(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path, TEMPLATE)
    codec = load_codec(str(tmp_path), 1024)
    assert codec.encode("hello world") == [3, 4] and codec.eos_token_id == 2
    assert codec.chat([{"role": "user", "content": "hello"}]) == [5, 7, 3, 6, 7]
    assert codec.identity != ByteTokenizer().identity
    with RunningServer(ServeOptions(model=str(tmp_path), port=0, threads=1)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        out = c.chat.completions.create(model=str(tmp_path), messages=[{"role": "user", "content": "hello"}],
                                        max_tokens=2, temperature=0)
        assert out.usage.prompt_tokens == 5
        assert c.completions.create(model=str(tmp_path), prompt="hello world hello", max_tokens=1,
                                    temperature=0).usage.prompt_tokens == 3


def test_the_chat_template_enters_the_namespace(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _save_tokenizer(a, TEMPLATE)
    _save_tokenizer(b, TEMPLATE + " ")
    ca, cb = load_codec(str(a), 1024), load_codec(str(b), 1024)
    assert ca.identity[1] != cb.identity[1]
