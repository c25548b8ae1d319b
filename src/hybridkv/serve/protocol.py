"""OpenAI-style request bodies: validation into :class:`Generation`, errors as :class:`APIError`.

Every check names the offending field and value; an invalid request never reaches the engine,
so nothing cached changes.
"""

from __future__ import annotations

import json
import re
import math
from dataclasses import dataclass

MAX_STOP = 4
MAX_ID_LEN = 256
#: Largest request body read (bytes): a prompt of 65,536 ids written as JSON is under 1 MiB, a
#: batch of 64 of them under 64 MiB; a larger body is refused (413) before it is parsed, so a
#: huge one cannot exhaust the server's memory (a 20 MB text prompt took 245 MB of peak RSS).
MAX_BODY_BYTES = 64 * 2**20


class APIError(Exception):
    """An error answer: HTTP ``status`` and the OpenAI error body fields.

    Args:
        status: HTTP status (4xx for the caller's mistakes, 503 when overloaded).
        message: what was wrong, naming the value.
        param: the request field at fault, or ``None``.
        code: a short machine-readable code, or ``None``.
        kind: the error ``type`` (``invalid_request_error``, ``not_found_error``, ...).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class Generation:
    """Validated generation settings of one request (lengths in tokens).

    Attributes:
        max_tokens: tokens to generate at most per prompt.
        temperature: 0 is greedy; above it, softmax sampling at that temperature.
        top_p: nucleus mass in (0, 1].
        seed: sampling seed, or ``None`` (then a fresh one per prompt).
        stop: stop strings (at most 4); the text ends before the first one met.
        stream: answer with server-sent events.
        tenant, cache_salt: cache identity of the request.
        hints: checkpoint boundaries (multiples of ``prefix_match_unit``).
        return_token_ids: add each choice's generated ``token_ids`` to the answer.
        include_usage: streaming: send a final chunk with ``usage``.
        ignore_eos: keep generating after the tokenizer's end-of-sequence token.
        adapter, adapter_version: the adapter name and version the request names (``""``: none);
            they enter the cache namespace only (this server applies no adapter weights).
    """

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    tenant: str
    cache_salt: str
    hints: tuple[int, ...]
    return_token_ids: bool
    include_usage: bool
    ignore_eos: bool = False
    adapter: str = ""
    adapter_version: str = ""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- the request-body schema ---------------------------------------------------------------------
# Every field a generation request may carry is listed here, in one of three kinds; any other
# field is refused (400, ``param`` naming it), so a setting this server cannot honour is never
# silently dropped. A JSON ``null`` means "not given" for every listed field.

_CHECKED_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "seed", "stop", "n", "echo", "logprobs", "return_token_ids", "ignore_eos", "cache_hints", "tenant",
    "cache_salt", "adapter", "adapter_version"})
CHECKED_FIELDS = {"completions": _CHECKED_COMMON | {"prompt"}, "chat": _CHECKED_COMMON | {"messages"}}
"""Fields each route (``completions``, ``chat``) honours; their values are range-checked by
:func:`parse_generation`, :func:`parse_prompts` and the chat template."""

IGNORED_FIELDS: dict[str, tuple[type, ...]] = {
    "user": (str,), "metadata": (dict,), "store": (bool,), "service_tier": (str,),
    "safety_identifier": (str,), "prompt_cache_key": (str,), "parallel_tool_calls": (bool,)}
"""Fields accepted (when of the JSON type listed) and ignored on both routes: OpenAI's end-user and
bookkeeping fields, which do not change what is generated."""

_NEUTRAL_COMMON: dict[str, tuple[object, ...]] = {
    "frequency_penalty": (0.0,), "presence_penalty": (0.0,), "logit_bias": ({},),
    "top_k": (-1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,), "min_tokens": (0,), "stop_token_ids": ([],),
    # SGLang's router re-serializes each request and always sends these, at these values unless
    # the client set them (sgl-router protocols: CompletionRequest, ChatCompletionRequest)
    "no_stop_trim": (False,), "skip_special_tokens": (True,), "return_hidden_states": (False,)}
NEUTRAL_FIELDS: dict[str, dict[str, tuple[object, ...]]] = {
    "completions": {**_NEUTRAL_COMMON, "best_of": (1,), "suffix": ("",)},
    "chat": {**_NEUTRAL_COMMON, "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",),
             "functions": ([],), "function_call": ("none",), "response_format": ({"type": "text"},),
             "modalities": (["text"],), "continue_final_message": (False,),
             "separate_reasoning": (True, False), "stream_reasoning": (True, False)}}
"""OpenAI, vLLM and SGLang fields this server does not implement, per route: accepted only at a
value that leaves the answer unchanged (listed; an integer value accepts only integers, a float
value any number; ``separate_reasoning`` and ``stream_reasoning`` change nothing without a
reasoning parser, so both booleans), refused otherwise. Text is always decoded without special
tokens and ends before a stop string, hence ``skip_special_tokens: true`` and
``no_stop_trim: false``."""


_TYPE_NAMES = {str: "a string", dict: "a JSON object", bool: "a boolean"}


def _neutral(x, v) -> bool:
    """Whether request value ``x`` is the neutral value ``v`` (1 is not 1.0 for an integer field,
    ``false`` is never ``0``)."""
    if isinstance(x, bool) or isinstance(v, bool):
        return x is v
    if isinstance(v, float):
        return isinstance(x, (int, float)) and x == v
    if isinstance(v, int):
        return _is_int(x) and x == v
    return x == v


def check_fields(body: dict, route: str) -> None:
    """Check the field names of a generation request ``body`` for ``route`` (``"completions"`` or
    ``"chat"``) against :data:`CHECKED_FIELDS`, :data:`IGNORED_FIELDS` and
    :data:`NEUTRAL_FIELDS` (their values are checked later, by :func:`parse_generation`).

    Raises:
        APIError: 400 naming the field (``param``): ``model`` missing or not a string, a field
            this server does not know, an ignored field of the wrong JSON type, a field it does
            not implement set to a value that would change generation, or ``max_tokens`` and
            ``max_completion_tokens`` both given and different.
    """
    model = body.get("model")
    if model is None:
        raise APIError(400, "missing required field model", "model", "missing_required_field")
    if not isinstance(model, str):
        raise APIError(400, f"model={_shown(model)} ({type(model).__name__}) must be a string", "model")
    checked, neutral = CHECKED_FIELDS[route], NEUTRAL_FIELDS[route]
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    for name, value in body.items():
        if name in checked:
            continue
        if name in IGNORED_FIELDS:
            kind = IGNORED_FIELDS[name]
            if value is not None and not isinstance(value, kind):
                raise APIError(400, f"{name}={_shown(value)} must be {_TYPE_NAMES[kind[0]]}", name)
            continue
        if name in neutral:
            if value is None or any(_neutral(value, v) for v in neutral[name]):
                continue
            allowed = " or ".join(json.dumps(v) for v in neutral[name])
            raise APIError(400, f"{name}={_shown(value)} is not supported by this server (only {name}={allowed}, "
                                "or leaving it out)", name, "unsupported_field")
        raise APIError(400, f"unknown field {_shown(name)} in a {path} request", name, "unknown_field")
    a, b = body.get("max_tokens"), body.get("max_completion_tokens")
    if a is not None and b is not None and a != b:
        raise APIError(400, f"max_tokens={_shown(a)} and max_completion_tokens={_shown(b)} disagree; give one",
                       "max_completion_tokens")


def _shown(value: object) -> str:
    """``repr(value)``, shortened to 60 characters (a huge value is not echoed whole)."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    x = body.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) \
            or x < lo or x > hi or (lo_open and x == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise APIError(400, f"{name}={x!r} must be a number in {bound}", name)
    return float(x)


def _identifier(body: dict, name: str, header: str | None, default: str) -> str:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."     # a huge value is not echoed whole
        raise APIError(400, f"{name}={shown} ({type(value).__name__}) must be a string of at most "
                            f"{MAX_ID_LEN} characters", name)
    if value is not None and len(value) > MAX_ID_LEN:
        raise APIError(400, f"{name} has {len(value)} characters; at most {MAX_ID_LEN} are allowed", name)
    if header is not None and len(header) > MAX_ID_LEN:
        raise APIError(400, f"the X-Tenant header has {len(header)} characters; at most {MAX_ID_LEN} are "
                            "allowed", name)
    if header is not None and value is not None and header != value:
        raise APIError(400, f"{name} field and the X-Tenant header disagree", name)
    return value if value is not None else header if header is not None else default


async def read_body(request) -> bytes:
    """The body of ``request`` (a Starlette ``Request``), at most :data:`MAX_BODY_BYTES` bytes.

    A longer body is read to its end and dropped (so the client gets the answer, not a reset
    connection) without being kept.

    Raises:
        APIError: 413 naming the limit for a longer body.
    """
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            parts.append(chunk)
        elif parts:
            parts.clear()
    if size > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {size} bytes; at most {MAX_BODY_BYTES} are read", None,
                       "request_too_large")
    return b"".join(parts)


def tenant_header(headers) -> str | None:
    """The request's one ``X-Tenant`` header value, or ``None`` without one (``headers``: a
    Starlette ``Headers``).

    Raises:
        APIError: 400 (param ``tenant``) for two or more ``X-Tenant`` headers: they name no single
            tenant (a gateway appending its own after the client's would otherwise lose to it).
    """
    values = headers.getlist("x-tenant")
    if len(values) > 1:
        raise APIError(400, f"the request has {len(values)} X-Tenant headers; give one", "tenant")
    if values:
        check_tenant(values[0], "the X-Tenant header")
    return values[0] if values else None


def check_tenant(value: object, where: str) -> None:
    """Refuse an empty tenant name: ``""`` would be a tenant of its own (its own namespace),
    distinct from ``default``, which a client leaving the tenant out gets.

    Args:
        value: the tenant given (``None``: not given, accepted).
        where: what gave it (``the tenant field``, ``the X-Tenant header``), named in the error.

    Raises:
        APIError: 400 (param ``tenant``, code ``empty_tenant``) for ``""``.
    """
    if value == "":
        raise APIError(400, f"{where} is empty (''); name a tenant of 1 to {MAX_ID_LEN} characters, or leave it out "
                            "for the tenant 'default'", "tenant", "empty_tenant")


def parse_generation(body: dict, tenant_header: str | None, default_max_tokens: int, unit: int) -> Generation:
    """Settings shared by completions and chat from ``body``.

    Raises:
        APIError: 400 naming the field: ``max_tokens`` not an integer >= 1, ``temperature`` outside
            [0, 2], ``top_p`` outside (0, 1], a ``seed`` not a 64-bit signed integer, ``stop`` not a
            string or list of at most 4 strings, ``stream`` or ``stream_options.include_usage`` not a
            boolean, ``n`` other than the integer 1, ``echo`` true, ``logprobs`` asked for, a bad
            ``tenant`` (an empty one included) / ``cache_salt`` / ``cache_hints``, an ``adapter``
            or ``adapter_version`` that is not a string of at most 256 characters, an
            ``adapter_version`` without ``adapter``.
    """
    max_tokens = next((body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None),
                      default_max_tokens)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise APIError(400, f"max_tokens={max_tokens!r} must be an integer >= 1", "max_tokens")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -2**63 <= seed < 2**63):
        raise APIError(400, f"seed={seed!r} must be a 64-bit signed integer", "seed")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    for name in ("stream", "echo", "return_token_ids", "ignore_eos"):
        if body.get(name) is not None and not isinstance(body.get(name), bool):
            raise APIError(400, f"{name}={body.get(name)!r} must be a boolean", name)
    if body.get("echo"):
        raise APIError(400, "echo=true is not supported", "echo")
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise APIError(400, f"n={n!r}: only n=1 (an integer) is supported", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise APIError(400, "logprobs are not supported", "logprobs")
    hints = body.get("cache_hints") or []
    if not isinstance(hints, list) or not all(_is_int(h) and h > 0 and h % unit == 0 for h in hints):
        raise APIError(400, f"cache_hints must be a list of positive multiples of {unit} (tokens)", "cache_hints")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    if options.get("include_usage") is not None and not isinstance(options.get("include_usage"), bool):
        raise APIError(400, f"stream_options.include_usage={options.get('include_usage')!r} must be a boolean",
                       "stream_options")
    check_tenant(body.get("tenant"), "the tenant field")
    adapter = _identifier(body, "adapter", None, "")
    adapter_version = _identifier(body, "adapter_version", None, "")
    if adapter_version and not adapter:
        raise APIError(400, f"adapter_version={adapter_version!r} needs an adapter name", "adapter_version")
    return Generation(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                      top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), seed=seed, stop=tuple(stop),
                      stream=bool(body.get("stream")), tenant=_identifier(body, "tenant", tenant_header, "default"),
                      cache_salt=_identifier(body, "cache_salt", None, ""), hints=tuple(hints),
                      return_token_ids=bool(body.get("return_token_ids")),
                      include_usage=bool(options.get("include_usage")), ignore_eos=bool(body.get("ignore_eos")),
                      adapter=adapter, adapter_version=adapter_version)


def parse_prompts(prompt, encode) -> list[list[int]]:
    """``prompt`` as a list of id lists: a string, a list of ids, or a batch of either.

    Raises:
        APIError: 400 (param ``prompt``) for anything else, an empty prompt or an empty batch.
    """
    single = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(x) for x in prompt))
    if single:
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(x, (int, float, bool)) for x in prompt):
        j = next(j for j, x in enumerate(prompt) if not _is_int(x))
        raise APIError(400, f"prompt: element {j} is {prompt[j]!r}, not an integer token id", "prompt")
    else:
        raise APIError(400, "prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
    out = []
    for i, p in enumerate(batch):
        if isinstance(p, list) and not all(_is_int(x) for x in p):
            j = next(j for j, x in enumerate(p) if not _is_int(x))
            raise APIError(400, f"prompt {i}: element {j} is {p[j]!r}, not an integer token id", "prompt")
        ids = encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, f"prompt {i} is empty (0 tokens)", "prompt")
        out.append(ids)
    return out


def check_ids(ids: list[int], i: int, vocab_size: int, max_model_len: int, max_tokens: int) -> None:
    """Raise a 400 :class:`APIError` if prompt ``i`` has an id outside ``[0, vocab_size)`` or
    ``len(ids) + max_tokens`` exceeds ``max_model_len`` (tokens)."""
    bad = next((x for x in ids if not 0 <= x < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"prompt {i}: token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    if len(ids) + max_tokens > max_model_len:
        raise APIError(400, f"prompt {i} has {len(ids)} tokens; with max_tokens={max_tokens} that exceeds "
                            f"the model's limit of {max_model_len} tokens", "prompt", "context_length_exceeded")


def make_sampler(gen: Generation, seed: int):
    """A sampler for :class:`~hybridkv.engine.request.Request` (``float32[vocab]`` logits -> id), or
    ``None`` for greedy (``temperature == 0``).

    The sampler runs on the engine thread, so it must not raise for any validated setting: the
    logits are shifted so their maximum is 0 before dividing by ``temperature`` (no ``inf - inf``
    for a temperature as small as 1e-300) and computed in float64, and nucleus filtering always
    keeps the most likely token (a ``top_p`` below float precision leaves one token, not none).
    """
    if gen.temperature == 0:
        return None
    import torch                                   # here: the CLI parser imports this module's checks

    rng = torch.Generator().manual_seed(seed)
    temperature, top_p = gen.temperature, gen.top_p

    def sample(logits: torch.Tensor) -> int:
        x = logits.to(torch.float64)
        probs = torch.softmax((x - x.max()) / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < top_p          # the smallest set reaching top_p
            keep[0] = True                                         # never an empty set
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=rng))

    return sample


#: A ``\\u`` escape of a UTF-16 surrogate: the only way a lone surrogate enters a decoded body.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_object(raw: bytes) -> dict:
    """The request body as a JSON object; a 400 :class:`APIError` for bad JSON (nesting too deep
    for the decoder included), a string holding a lone surrogate escape (valid JSON, but no
    Unicode text: no tokenizer or namespace digest can encode it), or another type."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):          # pairs decode to one character; a lone one stays
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode("ascii")
            raise APIError(400, f"the request body has a string with a lone surrogate {bad}, "
                                "which is not Unicode text") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body
