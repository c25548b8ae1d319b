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
    TextStream,
    check_messages,
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


def test_text_stream_holds_back_a_split_utf8_character():
    tok = ByteTokenizer()
    stream = TextStream(tok)
    got = [stream.push(i) for i in tok.encode("a日b")]          # 1 + 3 + 1 bytes
    assert got == ["a", "", "", "日", "b"]                       # the first bytes of 日 alone: held back


def test_text_stream_pieces_join_to_the_whole_decode():
    tok = ByteTokenizer()
    text = "naïve 日本語 text, ünïcödé 🙂 and ascii " * 40
    ids = tok.encode(text) + [2, 1000, 0]                         # specials and ids above the bytes decode to ""
    stream = TextStream(tok)
    assert "".join(stream.push(i) for i in ids) == tok.decode(ids) == text
    bad = TextStream(tok)                                         # invalid bytes are released, not held forever
    assert "".join(bad.push(i) for i in [8 + 0xFF] * 20 + tok.encode("x")) == "\ufffd" * 20 + "x"


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


def test_text_stream_decodes_a_bounded_window_per_id():
    class Counting(ByteTokenizer):
        longest = 0

        def decode(self, ids):
            Counting.longest = max(Counting.longest, len(ids))
            return super().decode(ids)

    tok = Counting()
    stream = TextStream(tok)
    ids = tok.encode("日本語 and more text " * 500)                # 11,000 ids
    assert "".join(stream.push(i) for i in ids) == ByteTokenizer().decode(ids)
    assert Counting.longest <= 4                                   # a context id and one 3-byte character


@pytest.mark.parametrize("content,named", [
    ([{"type": "text", "text": 5}], "messages[0].content[0].text must be a string, got int"),
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
     "messages[0].content[1] is a 'image_url' part"),
    (["plain"], "messages[0].content[0] is a 'str' part"),
])
def test_a_bad_content_part_is_refused_naming_its_position_and_fault(content, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_messages([{"role": "user", "content": content}])
    assert check_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b"}]}]) == [
        {"role": "user", "content": "ab"}]
