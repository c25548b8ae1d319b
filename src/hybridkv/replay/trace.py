"""Load the Mooncake conversation trace and synthesise token ids for it.

The trace (docs/design/design.md section 10) gives, per request, an arrival time, prompt and
output lengths, and one prefix-chained hash id per 512-token prompt block. It
carries no token ids, so each hash id gets its own deterministic token block:
equal ids at equal positions give equal token blocks, which keeps the trace's
sharing structure exactly.

Scaling: ``block_tokens`` is the synthetic block length. With 512 every prompt
has exactly ``input_length`` tokens; smaller values shorten every block (the last,
partial block in proportion) for CPU runs while keeping which prefixes are shared.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the published trace (the last block may be partial)."""

BUNDLED_TRACE = "conversation_trace.jsonl"

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

MAX_INPUT_TOKENS = 1 << 20
"""Longest prompt a trace line may give (``input_length``, tokens): 1,048,576, the 1M-token
context of Kimi Linear, the longest of the models hybridkv replays (the bundled trace's longest
prompt is 126,195). The run holds every prompt's token ids (8 bytes a token) and sizes its KV pool
and checkpoint slots to them, so a longer one would fail in a multi-GiB allocation instead."""

#: Largest value each integer field may hold: the prompt in tokens (:data:`MAX_INPUT_TOKENS`),
#: the output in tokens (the run caps what it generates), the arrival time in ms (it becomes a
#: float of seconds), hash ids (written as 64-bit unsigned in cache keys). Beyond: reason
#: ``out_of_range``.
_MAX = {"timestamp": 2**63 - 1, "input_length": MAX_INPUT_TOKENS, "output_length": 2**31 - 1,
        "hash_ids": 2**64 - 1}
_WHY = {"input_length": " (tokens: the longest context of the models replayed, Kimi Linear's 1M)"}


class TraceError(ValueError):
    """A trace file is missing, unreadable, or has a malformed line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace.

    index: 0-based position among the valid requests loaded.
    line_no: 1-based line of the file it came from.
    timestamp_ms: arrival time in ms from the start of the trace.
    input_length, output_length: prompt and output lengths in tokens (at 512
        tokens per block, i.e. unscaled).
    hash_ids: one id per 512-token prompt block, ``ceil(input_length / 512)`` of them.
    """

    index: int
    line_no: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True)
class TraceLoad:
    """Result of :func:`load_trace`.

    skipped counts malformed lines dropped under ``skip_bad=True`` (empty lines are
    not counted); skipped_reasons splits that count by reason code.
    """

    requests: list[TraceRequest]
    skipped: int
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    path: Path | None = None


class _BadLine(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


_INT_ONLY = {int}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: int) -> str:
    """``value`` in decimal, or its digit count when longer than 40 digits (not echoed whole)."""
    text = str(value)
    return text if len(text) <= 40 else f"a {len(text)}-digit integer"


def _parse_line(raw: bytes, trace_block_tokens: int) -> tuple[int, int, int, tuple[int, ...]]:
    try:
        obj = json.loads(raw.decode("utf-8-sig"))    # UTF-8 (a BOM allowed); bytes alone would be sniffed as UTF-16/32
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, deep nesting
        raise _BadLine("invalid_json", f"not valid JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise _BadLine("not_object", f"expected a JSON object, got {type(obj).__name__}")
    for name in _FIELDS:
        if name not in obj:
            raise _BadLine("missing_field", f"missing field {name!r}")
    for name in ("timestamp", "input_length", "output_length"):
        value = obj[name]
        if not _is_int(value):
            raise _BadLine("wrong_type", f"field {name!r} must be an integer, got {value!r}")
        if value < 0:
            raise _BadLine("negative_value", f"field {name!r} is negative: {value!r}")
        if value > _MAX[name]:
            raise _BadLine("out_of_range", f"field {name!r} is {_shown(value)}; at most {_MAX[name]} is allowed"
                                           f"{_WHY.get(name, '')}")
    if obj["input_length"] == 0:
        raise _BadLine("negative_value", "field 'input_length' must be positive, got 0")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise _BadLine("wrong_type", f"field 'hash_ids' must be a list, got {hash_ids!r:.60}")
    # JSON gives ints as exactly int: all ints, none negative and none over 64 bits is checked in C;
    # otherwise the loop below finds the first bad id for the message
    ok = not hash_ids or (set(map(type, hash_ids)) == _INT_ONLY and min(hash_ids) >= 0
                          and max(hash_ids) <= _MAX["hash_ids"])
    for pos, hid in enumerate(() if ok else hash_ids):
        if not _is_int(hid):
            raise _BadLine("wrong_type", f"field 'hash_ids'[{pos}] must be an integer, got {hid!r}")
        if hid < 0:
            raise _BadLine("negative_hash_id", f"field 'hash_ids'[{pos}] is negative: {hid}")
        if hid > _MAX["hash_ids"]:
            raise _BadLine("out_of_range", f"field 'hash_ids'[{pos}] is {_shown(hid)}; hash ids must fit 64 bits "
                                           f"(at most {_MAX['hash_ids']})")
    expected = -(-obj["input_length"] // trace_block_tokens)
    if len(hash_ids) != expected:
        raise _BadLine(
            "hash_ids_length",
            f"field 'hash_ids' has {len(hash_ids)} ids but input_length "
            f"{obj['input_length']} needs ceil({obj['input_length']}/{trace_block_tokens}) = {expected}",
        )
    return obj["timestamp"], obj["input_length"], obj["output_length"], tuple(hash_ids)


def _bundled_path() -> Path:
    ref = resources.files("hybridkv") / "data" / BUNDLED_TRACE
    # The package is installed from a directory (editable or wheel), never a zip.
    return Path(str(ref))


def load_trace(
    path: str | Path | None = None,
    *,
    limit: int | None = None,
    skip_bad: bool = False,
    trace_block_tokens: int = TRACE_BLOCK_TOKENS,
) -> TraceLoad:
    """Read a trace file (``None`` = the bundled Mooncake conversation trace).

    limit: stop after this many valid requests (``None`` = all).
    skip_bad: count and skip malformed lines instead of raising.
    trace_block_tokens: tokens per hash id in the file, for the length check.

    Raises TraceError (naming file, 1-based line and field) on a malformed line
    unless ``skip_bad``; on a missing/unreadable file; and when no valid request
    was read. Empty lines are skipped silently.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    if trace_block_tokens < 1:
        raise ValueError(f"trace_block_tokens must be >= 1, got {trace_block_tokens}")
    file_path = _bundled_path() if path is None else Path(path)
    requests: list[TraceRequest] = []
    reasons: Counter[str] = Counter()
    try:
        handle = open(file_path, "rb")  # noqa: SIM115 - closed by the `with` below; opened apart for its error
    except OSError as exc:
        raise TraceError(f"{file_path}: cannot open trace file: {exc.strerror or exc}") from None
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                ts, inp, out, ids = _parse_line(raw, trace_block_tokens)
            except _BadLine as bad:
                if not skip_bad:
                    raise TraceError(f"{file_path}:{line_no}: {bad.detail}") from None
                reasons[bad.reason] += 1
                continue
            requests.append(TraceRequest(len(requests), line_no, ts, inp, out, ids))
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        detail = f" ({sum(reasons.values())} malformed lines skipped)" if reasons else ""
        raise TraceError(f"{file_path}: no valid requests in trace{detail}")
    return TraceLoad(requests, sum(reasons.values()), dict(reasons), file_path)


# --- token synthesis -------------------------------------------------------------


@lru_cache(maxsize=16384)
def _block_array(hash_id: int, block_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    # blake2b(seed, hash_id) seeds PCG64; random_raw is the generator's raw 64-bit
    # stream, fixed by the algorithm, so ids are stable across processes and numpy
    # versions (PYTHONHASHSEED plays no part).
    digest = hashlib.blake2b(
        f"hybridkv-trace:{seed}:{hash_id}".encode(), digest_size=16
    ).digest()
    bitgen = np.random.PCG64(int.from_bytes(digest, "little"))
    raw = bitgen.random_raw(block_tokens)
    tokens = (raw % np.uint64(vocab_size)).astype(np.int64)
    tokens.flags.writeable = False
    return tokens


def _check_synth_args(block_tokens: int, vocab_size: int) -> None:
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")


def block_token_ids(hash_id: int, block_tokens: int, vocab_size: int, *, seed: int = 0) -> list[int]:
    """The ``block_tokens`` token ids, each in ``[0, vocab_size)``, that stand for ``hash_id``.

    Deterministic in (hash_id, block_tokens, vocab_size, seed) across processes.
    """
    _check_synth_args(block_tokens, vocab_size)
    return _block_array(hash_id, block_tokens, vocab_size, seed).tolist()


def _last_block_tokens(req: TraceRequest, block_tokens: int, trace_block_tokens: int) -> int:
    real = req.input_length - trace_block_tokens * (len(req.hash_ids) - 1)
    # round half up, in integers: max(1, round(real * block_tokens / trace_block_tokens))
    return max(1, (2 * real * block_tokens + trace_block_tokens) // (2 * trace_block_tokens))


def scaled_input_length(
    req: TraceRequest, block_tokens: int, *, trace_block_tokens: int = TRACE_BLOCK_TOKENS
) -> int:
    """Prompt length in tokens after scaling (``len(request_token_ids(...))``)."""
    _check_synth_args(block_tokens, 1)
    last = _last_block_tokens(req, block_tokens, trace_block_tokens)
    return block_tokens * (len(req.hash_ids) - 1) + last


def scaled_output_length(
    req: TraceRequest, block_tokens: int, *, trace_block_tokens: int = TRACE_BLOCK_TOKENS
) -> int:
    """Output length scaled like the prompt: ``max(1, round(output_length * block_tokens / 512))``."""
    _check_synth_args(block_tokens, 1)
    num = 2 * req.output_length * block_tokens + trace_block_tokens
    return max(1, num // (2 * trace_block_tokens))


def request_token_ids(
    req: TraceRequest,
    block_tokens: int,
    vocab_size: int,
    seed: int = 0,
    *,
    trace_block_tokens: int = TRACE_BLOCK_TOKENS,
) -> list[int]:
    """Synthetic prompt of ``req``: its hash ids' blocks, concatenated.

    Every block is ``block_tokens`` long except the last, which holds the first
    ``max(1, round(last_real * block_tokens / 512))`` tokens of its id's block,
    where ``last_real = input_length - 512 * (len(hash_ids) - 1)``. With
    ``block_tokens == 512`` the length is exactly ``input_length``.
    """
    return request_token_array(req, block_tokens, vocab_size, seed,
                               trace_block_tokens=trace_block_tokens).tolist()


def request_token_array(
    req: TraceRequest,
    block_tokens: int,
    vocab_size: int,
    seed: int = 0,
    *,
    trace_block_tokens: int = TRACE_BLOCK_TOKENS,
) -> np.ndarray:
    """:func:`request_token_ids` as a new ``int64[T]`` array (no Python list; fast for whole traces)."""
    _check_synth_args(block_tokens, vocab_size)
    last = _last_block_tokens(req, block_tokens, trace_block_tokens)
    parts = [_block_array(h, block_tokens, vocab_size, seed) for h in req.hash_ids]
    parts[-1] = parts[-1][:last]
    return np.concatenate(parts)


# --- unit payloads: the synthetic prompt's units without its tokens ---------------


@dataclass(frozen=True, slots=True)
class TraceUnits:
    """Describes each ``unit``-token unit of a synthetic prompt by the ids that make its tokens.

    A unit's token ids are a function of the hash ids of the trace blocks it overlaps,
    its offset in the first of them, and the synthesis parameters (``block_tokens``,
    ``vocab_size``, ``seed``): the scaled blocks are ``block_tokens`` long except a
    partial last one, which holds the first tokens of its id's block, so a whole unit
    never depends on where the prompt ends. :meth:`payloads` encodes exactly that, so
    two units have equal payload chains iff :func:`request_token_array` gives them
    equal token prefixes (barring two different ids whose PCG64 streams agree on a whole
    unit, the same caveat as :func:`hybridkv.replay.oracle.oracle_from_trace`). Chained
    by :meth:`~hybridkv.cache.coordinator.HybridCacheCoordinator.chain_units`, they key
    a simulated cache exactly as hashing the synthetic tokens would, without making them.

    Attributes:
        block_tokens: synthetic tokens per hash id (>= 1).
        unit: ``prefix_match_unit`` in tokens (>= 1).
        vocab_size: vocabulary of the synthetic ids (>= 1).
        seed: token seed (as :func:`request_token_array`).
        trace_block_tokens: tokens per hash id in the trace file.

    Raises:
        ValueError: a size below 1 (naming it).
    """

    block_tokens: int
    unit: int
    vocab_size: int
    seed: int = 0
    trace_block_tokens: int = TRACE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        _check_synth_args(self.block_tokens, self.vocab_size)
        if self.unit < 1:
            raise ValueError(f"unit must be >= 1, got {self.unit}")

    def payloads(self, req: TraceRequest) -> list[bytes]:
        """One payload per whole unit of ``req``'s scaled prompt
        (``scaled_input_length // unit`` of them), ``33 + 8 m`` bytes each (``m`` ids):
        ``b"T"``, ``seed``, ``block_tokens``, ``vocab_size``, the unit's offset in its first
        block and the ids it overlaps, as 8-byte little-endian integers.

        Raises:
            ValueError: a hash id of 2**64 or more (naming it and the request).
        """
        periodic = self.periodic(req)
        if periodic is not None:                       # every unit inside one block
            offsets, ids, n = periodic
            per = len(offsets)
            return [offsets[i % per] + ids[i // per] for i in range(n)]
        bt, g = self.block_tokens, self.unit
        n = scaled_input_length(req, bt, trace_block_tokens=self.trace_block_tokens) // g
        head, ids = self._head(), self._ids(req)
        out = []
        for i in range(n):
            s = i * g
            first, last = s // bt, (s + g - 1) // bt
            out.append(head + (s - first * bt).to_bytes(8, "little") + b"".join(ids[first:last + 1]))
        return out

    def periodic(self, req: TraceRequest) -> tuple[list[bytes], list[bytes], int] | None:
        """:meth:`payloads` of ``req`` as ``(heads, tails, n)``, payload ``i`` being
        ``heads[i % len(heads)] + tails[i // len(heads)]`` (a unit's offset in its block, then the
        block's id), when every unit lies inside one block (``block_tokens`` a multiple of
        ``unit``); ``None`` otherwise.

        Raises:
            ValueError: as :meth:`payloads`.
        """
        bt, g = self.block_tokens, self.unit
        if bt % g:
            return None
        n = scaled_input_length(req, bt, trace_block_tokens=self.trace_block_tokens) // g
        head, ids = self._head(), self._ids(req)
        return [head + (k * g).to_bytes(8, "little") for k in range(bt // g)], ids, n

    def hashes(self, req: TraceRequest, cache) -> list[bytes]:
        """``cache.chain_units(self.payloads(req))``
        (:meth:`~hybridkv.cache.coordinator.HybridCacheCoordinator.chain_units`), computed
        without making the payloads when they are :meth:`periodic`."""
        periodic = self.periodic(req)
        if periodic is None:
            return cache.chain_units(self.payloads(req))
        return cache.chain_periodic_units(*periodic)

    def hashes_all(self, reqs: list[TraceRequest], cache) -> list[list[bytes]]:
        """:meth:`hashes` of each of ``reqs``, in order (the same hashes), with whole blocks
        chained once: a block after the same chained hash (a conversation's history, re-sent by
        each turn) is taken from a :class:`~hybridkv.cache.namespace.PeriodicMemo` local to this
        call, which holds at most the distinct whole blocks of ``reqs`` and is dropped on return.

        Raises:
            ValueError: as :meth:`hashes`.
        """
        if self.block_tokens % self.unit:
            return [self.hashes(r, cache) for r in reqs]
        out = []
        memo = None
        for r in reqs:
            heads, tails, n = self.periodic(r)
            if memo is None:
                memo = cache.periodic_memo(heads)
            out.append(cache.chain_periodic_units(heads, tails, n, memo=memo))
        return out

    def _head(self) -> bytes:
        return b"T" + b"".join(v.to_bytes(8, "little", signed=True)
                               for v in (self.seed, self.block_tokens, self.vocab_size))

    @staticmethod
    def _ids(req: TraceRequest) -> list[bytes]:
        try:
            return [h.to_bytes(8, "little") for h in req.hash_ids]
        except OverflowError:
            bad = next(h for h in req.hash_ids if h >= 1 << 64)
            raise ValueError(f"trace request {req.index}: hash id {bad} does not fit 64 bits") from None


def placeholder_prompts(lengths: list[int]) -> list[np.ndarray]:
    """Read-only ``int64`` zero prompts of ``lengths`` tokens (views of one buffer): the
    prompts of a simulated replay whose requests carry unit hashes from :class:`TraceUnits`
    (lengths matter there, token ids do not).

    Raises:
        ValueError: a length below 1 (naming it).
    """
    if not lengths:
        return []
    bad = min(lengths)
    if bad < 1:
        raise ValueError(f"prompt length must be >= 1, got {bad}")
    buf = np.zeros(max(lengths), dtype=np.int64)
    buf.flags.writeable = False
    return [buf[:n] for n in lengths]
