"""Synthesise and scale request traces in the format ``hybridkv replay`` reads.

Two commands, ``hybridkv trace synth`` and ``hybridkv trace scale`` (docs/how-to/synthesise-traces.md).
Both write JSON lines of the Mooncake trace format that :func:`hybridkv.replay.trace.load_trace`
reads: ``timestamp`` (arrival, ms from the start), ``input_length`` and ``output_length`` (tokens),
and ``hash_ids``, one per 512-token prompt block (:data:`~hybridkv.replay.trace.TRACE_BLOCK_TOKENS`),
prefix-chained: two requests carry the same id at the same position exactly when their prompts
agree up to the end of that block. Every block but a prompt's last is whole; the last holds
1 to 512 tokens and its id is the prompt's own (a later turn that re-sends the prompt gives that
block, now whole, a fresh id, as a prefix-chained hash would).

:func:`synth_requests` generates one of four workloads, seeded (the same arguments give the same
trace, line for line, on one Python version):

* ``tenants``: many tenants, each with a long system prompt of its own; a tenant is drawn by a
  Zipf law over tenants; a request is a new conversation (system prompt + a user message) or the
  next turn of one of the tenant's recent conversations (its history + the previous answer + a
  new message). Sharing: the system prompt across a tenant's users, the history within one.
* ``agentic``: agent sessions; each session runs one of a few agent types (a system prompt with
  its tool schemas, shared by every session of that type), states a task, then takes turns that
  append the previous step's output and a tool's output (mostly short, sometimes a long file or
  search result). Sessions interleave; each ends after a geometric number of turns.
* ``documents``: documents (long, Zipf popularity) shared across users: a short common system
  prompt, the document, a question; some users ask a follow-up on the same document.
* ``hotset``: a pool of long contexts of which a small hot set draws most requests; every
  ``shift_every`` requests part of the hot set is replaced, so what is hot shifts over time;
  the rest of the traffic is cold (a pool context outside the hot set, or a fresh prompt).

Arrivals are a Poisson process at ``rate`` requests per second.

:func:`scale_trace` repeats a trace ``copies`` times, each copy in a fresh namespace of hash
ids (no block shared across copies, every sharing within a copy kept), optionally with
arrivals compressed to a target rate and a common system-prompt prefix of ``shared_prefix_blocks``
blocks in front of every prompt of every copy. It streams: the output is merged from the copies
line by line, never held whole in memory.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

from hybridkv.replay.args import finite_positive_float
from hybridkv.replay.trace import MAX_INPUT_TOKENS, TRACE_BLOCK_TOKENS, TraceError, TraceRequest, load_trace

KINDS = ("tenants", "agentic", "documents", "hotset")
"""Workloads :func:`synth_requests` generates."""

DEFAULT_RATE = 4.0
"""Requests per second of ``trace synth`` when ``--rate`` is not given (the bundled trace averages 3.4)."""

MAX_REQUESTS = 100_000_000
"""Most requests one ``trace synth`` or ``trace scale`` writes (a bound against a typo)."""

MAX_CONTEXT_BLOCKS = 240
"""Longest prompt a synthesised request may have, in blocks (240 x 512 = 122,880 tokens, about the
bundled trace's longest, 126,195): a conversation or session that would grow past it starts over
from its shared prefix."""

B = TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class SynthParams:
    """Knobs of the four workloads (each names its kind; ranges are inclusive ``(low, high)``).

    Sizes are in 512-token blocks unless said otherwise; probabilities in [0, 1].

    Attributes:
        tenants: ``tenants``: number of tenants (64).
        system_blocks: ``tenants``: a tenant's system prompt length, drawn once per tenant ((8, 40):
            4 to 20 thousand tokens).
        tenant_zipf: ``tenants``: exponent of the Zipf law over tenants (1.0; 0 = uniform).
        message_blocks: ``tenants`` / ``documents``: a user message or question ((1, 4)).
        followup: ``tenants`` / ``documents``: probability that a request continues a recent
            conversation (0.4).
        recent: ``tenants`` / ``documents``: conversations per tenant or document that a follow-up
            may continue, the most recent kept (8).
        sessions: ``agentic``: sessions running at once (64).
        agent_types: ``agentic``: distinct agent system prompts (8).
        agent_blocks: ``agentic``: an agent type's system prompt with its tool schemas ((12, 32)).
        task_blocks: ``agentic``: the task that opens a session ((1, 3)).
        tool_blocks: ``agentic``: a tool's output, usual case ((1, 6)).
        long_tool: ``agentic``: probability of a long tool output (a file, a search result) (0.15).
        long_tool_blocks: ``agentic``: a long tool output ((8, 32)).
        mean_turns: ``agentic``: mean turns per session (geometric law) (10).
        documents: ``documents``: number of documents (500).
        document_blocks: ``documents``: a document's length ((8, 64)).
        document_zipf: ``documents``: exponent of the Zipf law over documents (1.1).
        preamble_blocks: ``documents``: the system prompt common to every request (2).
        pool: ``hotset``: long contexts in the pool (1000).
        context_blocks: ``hotset``: a context's length ((8, 48)).
        hot_set: ``hotset``: contexts hot at a time (16).
        hot_share: ``hotset``: share of requests that go to the hot set (0.7).
        shift_every: ``hotset``: requests between shifts of the hot set (500).
        shift_share: ``hotset``: share of the hot set replaced at each shift (0.25).
        fresh_share: ``hotset``: share of cold requests that are a fresh prompt rather than a pool
            context (0.5).
        question_blocks: ``hotset``: the question after a context ((1, 3)).
        output_tokens: every kind: output length in tokens, drawn log-uniformly ((16, 1024)).
    """

    tenants: int = 256
    system_blocks: tuple[int, int] = (8, 40)
    tenant_zipf: float = 1.0
    message_blocks: tuple[int, int] = (1, 4)
    followup: float = 0.4
    recent: int = 8
    sessions: int = 64
    agent_types: int = 8
    agent_blocks: tuple[int, int] = (12, 32)
    task_blocks: tuple[int, int] = (1, 3)
    tool_blocks: tuple[int, int] = (1, 6)
    long_tool: float = 0.15
    long_tool_blocks: tuple[int, int] = (8, 32)
    mean_turns: float = 10.0
    documents: int = 500
    document_blocks: tuple[int, int] = (8, 64)
    document_zipf: float = 1.1
    preamble_blocks: int = 2
    pool: int = 1000
    context_blocks: tuple[int, int] = (8, 48)
    hot_set: int = 16
    hot_share: float = 0.7
    shift_every: int = 500
    shift_share: float = 0.25
    fresh_share: float = 0.5
    question_blocks: tuple[int, int] = (1, 3)
    output_tokens: tuple[int, int] = (16, 1024)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                lo, hi = v
                if not (1 <= lo <= hi):
                    raise ValueError(f"{f.name} must be a range 1 <= low <= high, got {v}")
            elif f.name in ("followup", "long_tool", "hot_share", "shift_share", "fresh_share"):
                if not 0.0 <= v <= 1.0:
                    raise ValueError(f"{f.name} must be a probability in [0, 1], got {v}")
            elif f.name in ("tenant_zipf", "document_zipf"):
                if not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"{f.name} must be a finite exponent >= 0, got {v}")
            elif f.name == "mean_turns":
                if not (math.isfinite(v) and v >= 1):
                    raise ValueError(f"mean_turns must be >= 1, got {v}")
            elif f.name == "preamble_blocks":
                if v < 0:
                    raise ValueError(f"preamble_blocks must be >= 0, got {v}")
            elif v < 1:
                raise ValueError(f"{f.name} must be >= 1, got {v}")
        if self.hot_set > self.pool:
            raise ValueError(f"hot_set ({self.hot_set}) must not exceed pool ({self.pool})")


class _Gen:
    """State shared by the workloads: the seeded generator and the next fresh hash id."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_id = 0

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def span(self, r: tuple[int, int]) -> int:
        return self.rng.randint(r[0], r[1])

    def zipf_table(self, n: int, s: float) -> list[float]:
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        total = 0.0
        cum = []
        for w in weights:
            total += w
            cum.append(total)
        return cum

    def pick(self, cum: list[float]) -> int:
        from bisect import bisect_left
        return min(bisect_left(cum, self.rng.random() * cum[-1]), len(cum) - 1)

    def output(self, p: SynthParams) -> int:
        lo, hi = p.output_tokens
        return min(hi, max(lo, int(round(math.exp(self.rng.uniform(math.log(lo), math.log(hi)))))))

    def prompt(self, prefix: list[int], new_blocks: int) -> tuple[list[int], int]:
        """``prefix`` (whole blocks) + ``new_blocks`` fresh blocks, the last of 1..512 tokens:
        ``(hash_ids, input_length)``."""
        ids = prefix + self.fresh(new_blocks)
        return ids, (len(ids) - 1) * B + self.rng.randint(1, B)


def _fits(prefix: list[int], more: int) -> bool:
    return len(prefix) + more <= MAX_CONTEXT_BLOCKS


def _conversations(g: _Gen, p: SynthParams, heads: list[list[int]], zipf: float
                   ) -> Iterator[tuple[list[int], int, int]]:
    """Conversations that start on one of ``heads`` (a tenant's system prompt, a shared document),
    picked with Zipf exponent ``zipf``: a new message of ``message_blocks`` on its head, or, with
    probability ``followup``, the next turn of one of the head's ``recent`` conversations (its
    history, the re-sent last block, the answer and the message)."""
    cum = g.zipf_table(len(heads), zipf)
    convs: list[deque] = [deque(maxlen=p.recent) for _ in heads]   # (history, last output)
    while True:
        t = g.pick(cum)
        msg = g.span(p.message_blocks)
        history = None
        if convs[t] and g.rng.random() < p.followup:
            k = g.rng.randrange(len(convs[t]))
            hist, out_prev = convs[t][k]
            more = 1 + -(-out_prev // B) + msg          # the re-sent last block, the answer, the message
            if _fits(hist, more):
                del convs[t][k]
                history = (hist, more)
        prefix, more = history if history else (heads[t], msg)
        ids, length = g.prompt(prefix, more)
        out = g.output(p)
        convs[t].append((ids[:-1], out))
        yield ids, length, out


def _tenants(g: _Gen, p: SynthParams) -> Iterator[tuple[list[int], int, int]]:
    systems = [g.fresh(g.span(p.system_blocks)) for _ in range(p.tenants)]
    yield from _conversations(g, p, systems, p.tenant_zipf)


def _agentic(g: _Gen, p: SynthParams) -> Iterator[tuple[list[int], int, int]]:
    agents = [g.fresh(g.span(p.agent_blocks)) for _ in range(p.agent_types)]
    end = 1.0 / p.mean_turns

    def start() -> list:
        return [agents[g.rng.randrange(p.agent_types)], g.span(p.task_blocks), 0]   # history, new blocks, last output

    active = [start() for _ in range(p.sessions)]
    while True:
        k = g.rng.randrange(p.sessions)
        s = active[k]
        ids, length = g.prompt(s[0], s[1])
        out = g.output(p)
        yield ids, length, out
        if g.rng.random() < end:
            active[k] = start()
            continue
        tool = g.span(p.long_tool_blocks if g.rng.random() < p.long_tool else p.tool_blocks)
        more = 1 + -(-out // B) + tool
        active[k] = [ids[:-1], more, out] if _fits(ids[:-1], more) else start()


def _documents(g: _Gen, p: SynthParams) -> Iterator[tuple[list[int], int, int]]:
    preamble = g.fresh(p.preamble_blocks)
    docs = [preamble + g.fresh(g.span(p.document_blocks)) for _ in range(p.documents)]
    yield from _conversations(g, p, docs, p.document_zipf)


def _hotset(g: _Gen, p: SynthParams) -> Iterator[tuple[list[int], int, int]]:
    pool = [g.fresh(g.span(p.context_blocks)) for _ in range(p.pool)]
    hot = g.rng.sample(range(p.pool), p.hot_set)
    replace = max(1, round(p.shift_share * p.hot_set)) if p.shift_share > 0 else 0
    n = 0
    while True:
        if n and n % p.shift_every == 0 and replace:
            hot_now = set(hot)
            cold = [i for i in range(p.pool) if i not in hot_now]
            gone = g.rng.sample(range(p.hot_set), min(replace, len(cold)))
            for slot, new in zip(gone, g.rng.sample(cold, len(gone))):
                hot[slot] = new
        n += 1
        q = g.span(p.question_blocks)
        if g.rng.random() < p.hot_share:
            prefix = pool[hot[g.rng.randrange(p.hot_set)]]
        elif g.rng.random() < p.fresh_share or p.hot_set == p.pool:
            prefix, q = [], g.span(p.context_blocks) + q
        else:
            hot_set = set(hot)
            while True:
                i = g.rng.randrange(p.pool)
                if i not in hot_set:
                    break
            prefix = pool[i]
        ids, length = g.prompt(prefix, q)
        yield ids, length, g.output(p)


_WORKLOADS = {"tenants": _tenants, "agentic": _agentic, "documents": _documents, "hotset": _hotset}


def synth_requests(kind: str, requests: int, seed: int = 0, rate: float = DEFAULT_RATE,
                   params: SynthParams | None = None) -> Iterator[dict]:
    """The ``requests`` trace lines of workload ``kind``, in arrival order, one dict each
    (``timestamp`` ms int, ``input_length`` tokens, ``output_length`` tokens, ``hash_ids`` list of
    ints, one per 512-token block), as the module docstring describes.

    kind: one of :data:`KINDS`. seed: any int (the same seed, the same trace).
    rate: mean arrivals per second (Poisson process; > 0, finite). params: the workload's knobs
    (:class:`SynthParams`; default its defaults).

    Raises:
        ValueError: an unknown kind, ``requests`` below 1 or above :data:`MAX_REQUESTS`, a rate that
            is not a finite positive number (each message names the value).
    """
    if kind not in _WORKLOADS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if not 1 <= requests <= MAX_REQUESTS:
        raise ValueError(f"requests must be 1 to {MAX_REQUESTS:,}, got {requests}")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite positive number of requests per second, got {rate}")
    g = _Gen(seed)
    arrivals = random.Random(f"hybridkv-synth-arrivals:{seed}")
    work = _WORKLOADS[kind](g, params or SynthParams())
    t = 0.0
    for i in range(requests):
        ids, length, out = next(work)
        if i:
            t += arrivals.expovariate(rate)
        yield {"timestamp": int(t * 1000), "input_length": length, "output_length": out, "hash_ids": ids}


def write_lines(lines, out: str | Path) -> int:
    """Write ``lines`` (trace dicts) to ``out`` as JSON lines, one at a time; return how many.

    The file is written to ``out`` + ``.part`` and renamed at the end, so an interrupted run
    leaves no half trace under the name asked for. Raises OSError from the file system."""
    out = Path(out)
    part = out.with_name(out.name + ".part")
    n = 0
    try:
        with open(part, "w", encoding="utf-8", buffering=1 << 18) as f:
            dumps = json.JSONEncoder(separators=(", ", ": ")).encode
            for line in lines:
                f.write(dumps(line))
                f.write("\n")
                n += 1
        os.replace(part, out)
    finally:
        if part.exists():
            part.unlink()
    return n


# --- scale -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalePlan:
    """How :func:`scale_trace` maps the source trace.

    Attributes:
        copies: copies of the source trace (>= 1).
        namespace: hash ids per copy: copy ``c`` maps id ``h`` to ``shared + c * namespace + h``
            (the source's largest id + 1).
        shared: ids ``0 .. shared - 1`` are the common prefix (``shared_prefix_blocks``).
        time_factor: source ms -> output ms (1.0 keeps the source's arrival times).
        stagger_ms: copy ``c`` arrives ``c * stagger_ms`` later than copy 0 (so copies do not arrive
            in lockstep; below one output interarrival time).
        requests: lines the output will have (``copies`` x the source's requests).
    """

    copies: int
    namespace: int
    shared: int
    time_factor: float
    stagger_ms: float
    requests: int


def plan_scale(source: list[TraceRequest], copies: int, rate: float | None = None,
               shared_prefix_blocks: int = 0) -> ScalePlan:
    """The :class:`ScalePlan` of ``copies`` copies of ``source`` (requests as loaded).

    rate: target mean arrivals per second of the output (``None``: keep the source's times, so
    the rate is ``copies`` times the source's). shared_prefix_blocks: 512-token blocks of a common
    system prompt put in front of every prompt of every copy (0: none).

    Raises:
        ValueError: ``copies`` below 1, too many lines, a bad rate, a negative prefix, hash ids
            that would not fit 64 bits, or a prompt that the prefix makes longer than
            :data:`~hybridkv.replay.trace.MAX_INPUT_TOKENS` (each message names the value).
    """
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    if shared_prefix_blocks < 0:
        raise ValueError(f"shared_prefix_blocks must be >= 0, got {shared_prefix_blocks}")
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite positive number of requests per second, got {rate}")
    n = copies * len(source)
    if n > MAX_REQUESTS:
        raise ValueError(f"copies {copies} x {len(source):,} requests = {n:,} lines; at most {MAX_REQUESTS:,}")
    namespace = 1 + max((max(r.hash_ids) for r in source if r.hash_ids), default=0)
    top = shared_prefix_blocks + copies * namespace - 1
    if top > 2**64 - 1:
        raise ValueError(f"copies {copies}: the copies' hash ids would reach {top}, beyond 64 bits "
                         f"(the source's ids go up to {namespace - 1})")
    longest = max(r.input_length for r in source) + shared_prefix_blocks * B
    if longest > MAX_INPUT_TOKENS:
        raise ValueError(f"shared_prefix_blocks {shared_prefix_blocks}: the longest prompt would be {longest:,} "
                         f"tokens; at most {MAX_INPUT_TOKENS:,}")
    t0 = min(r.timestamp_ms for r in source)
    span_ms = max(r.timestamp_ms for r in source) - t0
    if rate is None:
        factor = 1.0
        stagger = 0.0
    else:
        target_ms = n / rate * 1000.0            # the output's duration at the target rate
        factor = target_ms / span_ms if span_ms else 0.0
        stagger = 1000.0 / rate
    return ScalePlan(copies, namespace, shared_prefix_blocks, factor, stagger, n)


def scale_trace(source: list[TraceRequest], plan: ScalePlan) -> Iterator[dict]:
    """The scaled trace's lines (dicts as :func:`synth_requests`), merged in arrival order
    (ties: copy order, then source order), generated one at a time (memory: the source and one
    pending line per copy).

    Copy ``c``'s request at source time ``t`` (ms from the source's first arrival) arrives at
    ``round(t * time_factor + c * stagger_ms)``; its hash ids are ``shared + c * namespace + h``
    after the ``shared`` common-prefix ids ``0 .. shared - 1``; its input length grows by
    ``512 * shared``."""
    t0 = min(r.timestamp_ms for r in source)
    prefix = list(range(plan.shared))
    extra = plan.shared * B

    def copy(c: int) -> Iterator[tuple[int, int, int, dict]]:
        base = plan.shared + c * plan.namespace
        for r in source:
            ts = int(round((r.timestamp_ms - t0) * plan.time_factor + c * plan.stagger_ms))
            yield ts, c, r.index, {"timestamp": ts, "input_length": r.input_length + extra,
                                   "output_length": r.output_length,
                                   "hash_ids": prefix + [base + h for h in r.hash_ids]}

    for _, _, _, line in heapq.merge(*(copy(c) for c in range(plan.copies)), key=lambda x: x[:3]):
        yield line


# --- command line --------------------------------------------------------------------------------


def _int_arg(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer ({what})") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"{v} must be >= {low} ({what})")
    return v


def _requests_arg(text: str) -> int:
    v = _int_arg(text, 1, "requests")
    if v > MAX_REQUESTS:
        raise argparse.ArgumentTypeError(f"{v} is above {MAX_REQUESTS:,} (requests)")
    return v


_KIND_OPTIONS = {"tenants": "tenants", "sessions": "agentic", "documents": "documents", "hot_set": "hotset"}
"""Workload option (``SynthParams`` field) -> the only kind it applies to."""


def register_cli(subparsers) -> None:
    """Add ``trace synth`` and ``trace scale`` to the ``hybridkv`` command's subparsers
    (``args.trace_func(args)`` runs the one chosen)."""
    d = SynthParams()
    t = subparsers.add_parser("trace", help="synthesise or scale request traces (the format replay reads)",
                              description="Write request traces in the Mooncake format that `hybridkv replay "
                                          "--trace` reads: synthesise one of four workloads, or scale a trace up.")
    sub = t.add_subparsers(dest="trace_command", required=True)
    s = sub.add_parser("synth", help="generate a seeded synthetic trace of one of four workloads",
                       description="Generate a seeded trace: tenants (many tenants, each with a long system "
                                   "prompt, users' conversations under it), agentic (agent sessions whose turns "
                                   "append tool output), documents (long documents shared across users, with "
                                   "follow-up questions), hotset (a small hot set of long contexts that shifts "
                                   "over time, plus cold traffic). Arrivals are Poisson at --rate. The same "
                                   "options give the same file. Every workload knob: "
                                   "hybridkv.replay.synth.SynthParams.")
    s.add_argument("--kind", required=True, choices=KINDS, help="workload to generate")
    s.add_argument("--requests", required=True, type=_requests_arg, help="requests (lines) to write")
    s.add_argument("--seed", type=lambda x: _int_arg(x, 0, "seed"), default=0,
                   help="seed of the generator, an integer >= 0 (default 0)")
    s.add_argument("--rate", type=finite_positive_float, default=DEFAULT_RATE,
                   help=f"mean arrivals per second, a Poisson process (default {DEFAULT_RATE:g})")
    s.add_argument("--tenants", type=lambda x: _int_arg(x, 1, "tenants"), default=None,
                   help=f"--kind tenants: number of tenants, each with its own system prompt of "
                        f"{d.system_blocks[0]}-{d.system_blocks[1]} blocks of 512 tokens (default {d.tenants})")
    s.add_argument("--sessions", type=lambda x: _int_arg(x, 1, "sessions"), default=None,
                   help=f"--kind agentic: agent sessions running at once, over {d.agent_types} agent types "
                        f"(default {d.sessions})")
    s.add_argument("--documents", type=lambda x: _int_arg(x, 1, "documents"), default=None,
                   help=f"--kind documents: documents of {d.document_blocks[0]}-{d.document_blocks[1]} blocks, "
                        f"Zipf popularity (default {d.documents})")
    s.add_argument("--hot-set", type=lambda x: _int_arg(x, 1, "hot set"), default=None,
                   help=f"--kind hotset: contexts hot at a time, out of a pool of {d.pool}; a quarter of them "
                        f"replaced every {d.shift_every} requests (default {d.hot_set})")
    s.add_argument("--out", required=True, help="trace file to write (JSON lines)")
    s.set_defaults(trace_func=cmd_synth)
    c = sub.add_parser("scale", help="repeat a trace in fresh hash namespaces, arrivals compressed to a rate",
                       description="Repeat a trace --copies times, each copy with its own hash ids (no block "
                                   "shared across copies, all sharing within a copy kept), merged by arrival time "
                                   "and, with --rate, compressed to that mean rate; --shared-prefix-blocks puts a "
                                   "common system prompt in front of every prompt of every copy. Streams its "
                                   "output (millions of lines in bounded memory).")
    c.add_argument("--trace", default=None, help="source trace (default: the bundled one)")
    c.add_argument("--copies", required=True, type=lambda x: _int_arg(x, 1, "copies"), help="copies of the trace")
    c.add_argument("--rate", type=finite_positive_float, default=None,
                   help="mean arrivals per second of the output (default: keep the source's arrival times, "
                        "so --copies times its rate); copy c arrives c/RATE s after copy 0")
    c.add_argument("--shared-prefix-blocks", type=lambda x: _int_arg(x, 0, "shared prefix blocks"), default=0,
                   help="512-token blocks of a system prompt common to every copy, put in front of every "
                        "prompt (default 0: copies share nothing)")
    c.add_argument("--out", required=True, help="trace file to write (JSON lines)")
    c.set_defaults(trace_func=cmd_scale)


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _check_out(out: str, trace: str | None = None) -> str | None:
    from hybridkv.replay.args import unwritable
    problem = unwritable(out)
    if problem:
        return f"--out {out}: {problem}"
    if trace is not None and os.path.exists(trace) and os.path.realpath(trace) == os.path.realpath(out):
        return f"--out {out} is the same file as --trace {trace}: writing it would destroy the source"
    return None


def cmd_synth(args: argparse.Namespace) -> int:
    """``hybridkv trace synth``: 0 when written, 2 on bad options or an unwritable file."""
    given = {name: getattr(args, name) for name in _KIND_OPTIONS if getattr(args, name) is not None}
    for name, value in given.items():
        if _KIND_OPTIONS[name] != args.kind:
            flag = "--" + name.replace("_", "-")
            return _fail(f"{flag} {value} applies to --kind {_KIND_OPTIONS[name]}, not --kind {args.kind}")
    try:
        params = SynthParams(**given)
    except ValueError as exc:
        return _fail(str(exc))
    problem = _check_out(args.out)
    if problem:
        return _fail(problem)
    try:
        n = write_lines(synth_requests(args.kind, args.requests, args.seed, args.rate, params), args.out)
    except OSError as exc:
        return _fail(f"--out {args.out}: {exc.strerror or exc}")
    print(f"wrote {n:,} requests ({args.kind}, seed {args.seed}) to {args.out}")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    """``hybridkv trace scale``: 0 when written, 2 on bad options, a bad source or an unwritable file."""
    problem = _check_out(args.out, args.trace)
    if problem:
        return _fail(problem)
    try:
        source = load_trace(args.trace).requests
        plan = plan_scale(source, args.copies, args.rate, args.shared_prefix_blocks)
    except TraceError as exc:
        return _fail(str(exc))
    except ValueError as exc:
        return _fail(str(exc).replace("copies ", "--copies ", 1).replace("shared_prefix_blocks", "--shared-prefix-blocks"))
    try:
        n = write_lines(scale_trace(source, plan), args.out)
    except OSError as exc:
        return _fail(f"--out {args.out}: {exc.strerror or exc}")
    print(f"wrote {n:,} requests ({args.copies} copies) to {args.out}")
    return 0
