"""Text <-> token ids for the server: a model directory's own tokenizer (``transformers``), or the
byte-level tokenizer shipped for the presets so text prompts work offline.

Byte tokenizer (``hybridkv-byte-v1``): ids 0-7 are specials, byte ``b`` is id ``8 + b``, so the
vocabulary is 264 ids and fits every preset (``tiny`` has 1,024)::

    0 <pad>   1 <s> (bos)   2 </s> (eos)   3 <|im_start|>   4 <|im_end|>   5-7 reserved

Its chat template (``hybridkv-chat-v1``) renders ``messages`` as::

    <s> <|im_start|>ROLE\\nCONTENT<|im_end|>\\n ... <|im_start|>assistant\\n

(``<s>``, ``<|im_start|>``, ``<|im_end|>`` are the single special ids, the rest UTF-8 bytes).
Specials never come from text: a prompt containing the characters ``<|im_start|>`` encodes them
as bytes. Both names enter the cache namespace (:attr:`Codec.identity`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

BYTE_OFFSET = 8
PAD, BOS, EOS, IM_START, IM_END = 0, 1, 2, 3, 4
BYTE_VOCAB = BYTE_OFFSET + 256
_ROLES = ("system", "user", "assistant", "tool", "developer")


class Codec(Protocol):
    """What the server needs of a tokenizer (lengths in tokens)."""

    identity: tuple[str, str]
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no specials added)."""

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (specials skipped)."""

    def chat(self, messages: list[dict]) -> list[int]:
        """Prompt ids of ``messages`` ending with the assistant's turn opened."""


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with string values.

    Raises:
        ValueError: not a non-empty list, an unknown role or a non-string content (naming the index).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ValueError(f"messages[{i}].role is {role!r}; expected one of {', '.join(_ROLES)}")
        content = m.get("content", "")
        if isinstance(content, list):             # OpenAI content parts: text only
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text":
                    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                    raise ValueError(f"messages[{i}].content[{j}] is a {kind!r} part; only text parts are supported")
                if not isinstance(p.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}].text must be a string, "
                                     f"got {type(p.get('text')).__name__}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")  # noqa: TRY004
        out.append({"role": m["role"], "content": content})
    return out


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """The shipped byte-level tokenizer (see the module docstring for ids and template)."""

    identity: tuple[str, str] = ("hybridkv-byte-v1", "hybridkv-chat-v1")
    eos_token_id: int | None = EOS

    def encode(self, text: str) -> list[int]:
        """One id per UTF-8 byte of ``text``."""
        return [BYTE_OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """UTF-8 text of the byte ids (specials and ids above the byte range skipped; invalid
        sequences become U+FFFD)."""
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_VOCAB)
        return data.decode("utf-8", errors="replace")

    def chat(self, messages: list[dict]) -> list[int]:
        """The ``hybridkv-chat-v1`` rendering of ``messages`` (validated by :func:`check_messages`)."""
        ids = [BOS]
        for m in check_messages(messages):
            ids += [IM_START, *self.encode(f"{m['role']}\n{m['content']}"), IM_END, *self.encode("\n")]
        return ids + [IM_START, *self.encode("assistant\n")]


class HFTokenizer:
    """A model directory's tokenizer through ``transformers.AutoTokenizer``.

    Args:
        path: the model directory (with ``tokenizer.json`` / ``tokenizer_config.json``).

    Raises:
        OSError / ValueError: ``transformers`` cannot load the tokenizer in ``path``.
    """

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(str(path))
        files = sorted(p for p in path.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))
        h = hashlib.sha256()
        for p in files:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        template = self._tok.chat_template or ""
        self.identity = (f"hf-{h.hexdigest()[:16]}", hashlib.sha256(template.encode()).hexdigest()[:16])
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without added specials."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, specials skipped."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict]) -> list[int]:
        """The tokenizer's own chat template over ``messages``, generation prompt added.

        Raises:
            ValueError: the tokenizer has no chat template, or bad ``messages``.
        """
        if not self._tok.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        ids = self._tok.apply_chat_template(check_messages(messages), add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)


def load_codec(model: str, vocab_size: int) -> Codec:
    """The tokenizer for ``model``: a directory's own tokenizer when it has one, else the byte
    tokenizer.

    Raises:
        ValueError: the byte tokenizer's 264 ids do not fit ``vocab_size`` (naming both).
    """
    path = Path(model)
    if path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return HFTokenizer(path)
    if vocab_size < BYTE_VOCAB:
        raise ValueError(f"model {model!r} has vocab_size={vocab_size}; the byte tokenizer needs {BYTE_VOCAB}")
    return ByteTokenizer()


HOLD_MAX_IDS = 8
"""Ids a :class:`TextStream` holds back at most while their text ends in an incomplete character
(U+FFFD); past it the replacement character is released as text (a UTF-8 character is at most 4
bytes, so only invalid output is released this way)."""


class TextStream:
    """The text of a growing id sequence, decoded incrementally.

    Each :meth:`push` decodes a short window: one id of context (the last settled one) plus the
    ids not settled yet, so a sequence of ``n`` ids costs O(n) decoding in all, not O(n^2) as
    decoding the whole sequence per id would. The context id keeps tokenizers that render an id
    differently at the start of a text (a leading space) consistent: only the window's text past
    what the context itself decodes to is new. A trailing incomplete UTF-8 character (U+FFFD) is
    held back until later ids complete it (at most :data:`HOLD_MAX_IDS` ids).

    Args:
        codec: the tokenizer.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._window: list[int] = []      # the context id (after the first) and the unsettled ids
        self._emitted = 0                 # characters of decode(_window) already returned

    def push(self, token_id: int) -> str:
        """Append ``token_id``; the text it completes (possibly ``""``)."""
        self._window.append(token_id)
        text = self.codec.decode(self._window)
        settled = not text.endswith("\ufffd") or len(self._window) > HOLD_MAX_IDS
        stable = text if settled else text.rstrip("\ufffd")
        new = stable[self._emitted:]
        if settled:
            self._window = self._window[-1:]
            self._emitted = len(self.codec.decode(self._window))
        else:
            self._emitted = max(self._emitted, len(stable))
        return new
