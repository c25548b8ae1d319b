"""Decoding and stop-string search per generated token: whole-output re-decode (what the server
did before TextStream / StopScan) against the incremental path, byte tokenizer, one stop string
that never occurs (the search runs on every token). Prints seconds per output length.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_stream_decode.py --tokens 1000 4000

Results: docs/results/serving.md ("Streaming: incremental decoding").
"""

from __future__ import annotations

import argparse
import time

from hybridkv.serve.run import StopScan
from hybridkv.serve.tokenizer import ByteTokenizer, TextStream


def whole(tok: ByteTokenizer, ids: list[int], stops: tuple[str, ...]) -> float:
    """Seconds for the old path: per token, the engine thread's check and the loop's delta each
    decode the whole output and search it."""
    t = time.perf_counter()
    for k in range(1, len(ids) + 1):
        for _ in range(2):
            text = tok.decode(ids[:k])
            [text.find(s) for s in stops]
    return time.perf_counter() - t


def incremental(tok: ByteTokenizer, ids: list[int], stops: tuple[str, ...]) -> float:
    """Seconds for the new path: two TextStream + StopScan pairs (engine thread and event loop)."""
    t = time.perf_counter()
    pairs = [(TextStream(tok), StopScan(stops)) for _ in range(2)]
    for i in ids:
        for stream, scan in pairs:
            scan.feed(stream.push(i))
    return time.perf_counter() - t


def main() -> None:
    """Print both timings for each ``--tokens`` length."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000])
    args = ap.parse_args()
    tok, stops = ByteTokenizer(), ("\x00never",)
    for n in args.tokens:
        ids = tok.encode("naïve 日本 text " * (n // 10 + 1))[:n]
        print(f"{n} tokens: whole re-decode {whole(tok, ids, stops):.3f} s, "
              f"incremental {incremental(tok, ids, stops):.3f} s", flush=True)


if __name__ == "__main__":
    main()
