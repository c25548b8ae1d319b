"""``hybridkv bench-serve``: replay a trace against a running server with the trace's timestamps
and report TTFT percentiles, cached tokens and errors.

Each trace request becomes one streaming ``/v1/completions`` call with synthetic token ids
(:func:`~hybridkv.replay.trace.request_token_array`, the same ids ``hybridkv replay`` uses) or,
with ``prompt_format="text"``, the same structure as text (ids drawn from a 95-id vocabulary,
each written as the printable ASCII character ``chr(32 + id)``: one token per character under the
presets' byte tokenizer, so prompt lengths and shared prefixes are those of the ids; for routers
that only accept text prompts), greedy, ``max_tokens`` the scaled output length capped by ``--max-tokens``. Request ``i`` is
sent at ``timestamp_i * time_scale`` seconds after the start. The URL must be loopback.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx
import numpy as np

from hybridkv.replay.trace import load_trace, request_token_array, scaled_output_length

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PROBE_TIMEOUT_S = 5.0
"""Default seconds to connect to the server and to wait for its ``/v1/models`` answer before the
replay starts (a server that accepts and never answers is reported after this, not after
``max_seconds``)."""
TEXT_VOCAB = 95
"""Printable ASCII characters (32-126) a ``text`` prompt is written with."""


@dataclass(slots=True)
class BenchOptions:
    """What to replay and how (seconds, tokens).

    Attributes:
        url: the server, ``http://127.0.0.1:PORT`` (loopback only).
        trace: trace path, ``None`` for the bundled one.
        limit: first N requests.
        time_scale: factor on the trace's timestamps (2 = half the rate).
        max_seconds: stop sending and cancel what runs after this long.
        block_tokens: synthetic tokens per trace hash id.
        max_tokens: cap on generated tokens per request.
        seed: seed of the synthetic token ids.
        prompt_format: ``ids`` (token-id prompts) or ``text`` (printable ASCII, see above).
        probe_timeout: seconds to connect to the server and to read its ``/v1/models`` answer
            (the probe before the replay; see :func:`probe_model`).
        api_key: sent as ``Authorization: Bearer`` with every request (a server or router
            started with keys); ``None``: none. Never shown by ``repr``.
    """

    url: str
    trace: str | None = None
    limit: int = 200
    time_scale: float = 1.0
    max_seconds: float = 600.0
    block_tokens: int = 64
    max_tokens: int = 4
    seed: int = 0
    prompt_format: str = "ids"
    probe_timeout: float = PROBE_TIMEOUT_S
    api_key: str | None = field(default=None, repr=False)


class ProbeError(Exception):
    """The server's ``/v1/models`` could not be read; the message names the URL tried, what was
    tried and why it failed."""


@dataclass(slots=True)
class BenchReport:
    """What a replay measured (seconds in ``*_s``, tokens).

    Attributes:
        sent, completed: requests sent and answered in full.
        errors: HTTP status (or ``"transport"``, ``"unfinished"``) -> count.
        ttft_s, e2e_s: per completed request.
        prompt_tokens, cached_tokens: summed over completed requests.
        wall_s: the replay's duration.
    """

    sent: int = 0
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0

    def percentiles(self) -> dict[str, float | None]:
        """TTFT p50 / p90 / p99 and e2e p50 / p99 in milliseconds (``None`` without data)."""
        out: dict[str, float | None] = {}
        for name, xs, qs in (("ttft", self.ttft_s, (50, 90, 99)), ("e2e", self.e2e_s, (50, 99))):
            for q in qs:
                out[f"{name}_p{q}_ms"] = float(np.percentile(xs, q)) * 1000 if xs else None
        return out

    def summary(self) -> dict:
        """The report as one JSON-ready dict (without the per-request lists)."""
        d = {k: v for k, v in asdict(self).items() if k not in ("ttft_s", "e2e_s")}
        d["cached_fraction"] = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {**d, **self.percentiles()}


def check_loopback(url: str) -> str:
    """``url`` without a trailing slash.

    Raises:
        ValueError: not an ``http`` URL on a loopback host, or a port outside 0-65535 (naming it).
    """
    parsed = urlparse(url)
    if parsed.scheme != "http" or parsed.hostname not in LOOPBACK:
        raise ValueError(f"--url {url!r}: bench-serve only talks to http://127.0.0.1 / localhost / [::1]")
    try:
        _ = parsed.port                     # raises on a port out of range
    except ValueError as exc:
        raise ValueError(f"--url {url!r}: {exc}") from None
    return url.rstrip("/")


async def probe_model(client: httpx.AsyncClient, url: str, timeout: float) -> dict:
    """The first model card of ``GET {url}/v1/models`` (``{"id", ...}``; a ``hybridkv serve``
    card also has ``vocab_size``), read with ``timeout`` seconds for connecting and for each read.

    Raises:
        ProbeError: no connection, no answer within ``timeout`` seconds, a status other than 200,
            or an answer that is not an OpenAI model list (each named, with the URL).
    """
    target = f"{url}/v1/models"
    try:
        resp = await client.get("/v1/models", timeout=httpx.Timeout(timeout))
    except httpx.ConnectTimeout:
        raise ProbeError(f"timed out after {timeout:g} s connecting to {target} (--probe-timeout sets the "
                         "wait)") from None
    except httpx.TimeoutException:
        raise ProbeError(f"timed out after {timeout:g} s waiting for {target}: the server accepted the "
                         "connection but sent no answer (--probe-timeout sets the wait)") from None
    except httpx.ConnectError as exc:
        raise ProbeError(f"cannot connect to {target}: {exc or 'connection failed'} (is a server "
                         "listening there?)") from None
    except httpx.HTTPError as exc:
        raise ProbeError(f"GET {target} failed: {exc or type(exc).__name__}") from None
    if resp.status_code != 200:
        raise ProbeError(f"GET {target} answered HTTP {resp.status_code}: {resp.text[:200]!r}")
    try:
        card = resp.json()["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        card = None
    if not isinstance(card, dict) or not isinstance(card.get("id"), str):
        raise ProbeError(f"GET {target} answered 200 but not an OpenAI model list: {resp.text[:200]!r}")
    return card


def _add_error(report: BenchReport, key: str) -> None:
    report.errors[key] = report.errors.get(key, 0) + 1


async def _one(client: httpx.AsyncClient, body: dict, report: BenchReport) -> None:
    start = time.monotonic()
    first = None
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            _add_error(report, str(resp.status_code))
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                _add_error(report, "stream_error")
                return
            if chunk.get("choices") and first is None:
                first = time.monotonic()
            usage = chunk.get("usage") or usage
    if first is None or usage is None:
        _add_error(report, "incomplete")
        return
    report.completed += 1
    report.ttft_s.append(first - start)
    report.e2e_s.append(time.monotonic() - start)
    report.prompt_tokens += usage["prompt_tokens"]
    report.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]


async def _send_at(client, delay: float, body: dict, report: BenchReport) -> None:
    await asyncio.sleep(delay)
    report.sent += 1
    try:
        await _one(client, body, report)
    except httpx.HTTPError:
        _add_error(report, "transport")


async def run_bench(opts: BenchOptions) -> BenchReport:
    """Replay ``opts.limit`` trace requests against ``opts.url`` and measure them.

    Raises:
        ValueError: a non-loopback URL; :class:`~hybridkv.replay.trace.TraceError`: a bad trace.
        ProbeError: the server's ``/v1/models`` cannot be read within ``opts.probe_timeout``
            seconds (see :func:`probe_model`).
    """
    url = check_loopback(opts.url)
    if opts.prompt_format not in ("ids", "text"):
        raise ValueError(f"prompt_format={opts.prompt_format!r} must be 'ids' or 'text'")
    text = opts.prompt_format == "text"
    trace = load_trace(opts.trace, limit=opts.limit).requests
    report = BenchReport()
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(opts.max_seconds), headers=headers) as client:
        card = await probe_model(client, url, opts.probe_timeout)
        model, vocab = card["id"], TEXT_VOCAB if text else card.get("vocab_size")
        if not (isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0):
            raise ProbeError(f"{url}/v1/models gives no vocab_size for model {model!r}, which token-id prompts "
                             "need; use --prompt-format text")
        start = time.monotonic()
        tasks = []
        for req in trace:
            ids = request_token_array(req, opts.block_tokens, vocab, opts.seed).tolist()
            body = {"model": model, "prompt": "".join(chr(32 + i) for i in ids) if text else ids, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "max_tokens": min(opts.max_tokens, scaled_output_length(req, opts.block_tokens))}
            tasks.append(asyncio.create_task(_send_at(client, req.timestamp_ms / 1000 * opts.time_scale, body,
                                                      report)))
        _done, pending = await asyncio.wait(tasks, timeout=opts.max_seconds)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            report.errors["unfinished"] = len(pending)
        report.wall_s = time.monotonic() - start
    return report


def render(report: BenchReport) -> str:
    """A few lines of text: counts, cached tokens, TTFT and latency percentiles (ms)."""
    s = report.summary()

    def ms(key: str) -> str:
        return "-" if s[key] is None else f"{s[key]:.0f}"

    errors = ", ".join(f"{k}: {v}" for k, v in sorted(report.errors.items())) or "none"
    return "\n".join([
        f"requests   sent {report.sent}, completed {report.completed}, errors {errors}",
        (f"tokens     prompt {report.prompt_tokens}, cached {report.cached_tokens} "
        f"({s['cached_fraction']:.1%})"),
        f"TTFT ms    p50 {ms('ttft_p50_ms')}, p90 {ms('ttft_p90_ms')}, p99 {ms('ttft_p99_ms')}",
        f"e2e ms     p50 {ms('e2e_p50_ms')}, p99 {ms('e2e_p99_ms')}",
        f"wall       {report.wall_s:.1f} s"])
