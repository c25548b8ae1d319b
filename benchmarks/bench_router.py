"""``hybridkv router`` in front of running workers: does a request land where its prefix is cached?

Run by hand against a running router (not part of the test suite)::

    python benchmarks/bench_router.py --url http://127.0.0.1:8080 --documents 8 --asks 4

Sends ``documents * asks`` completions one after another, in a seeded random order: each
document is a long shared prefix (``--prefix-tokens`` random token ids of the tiny vocabulary)
followed by a fresh ``--suffix-tokens`` question. After each answer it waits until the router's
view of the worker that served it has taken in that worker's events (``GET /router/stats``),
so every later ask could be routed on them. Reports, from the answers' ``usage``: prompt and
cached tokens, asks that reused the document (``cached_tokens > 0``) out of those whose document
had been asked before, and the router's per-worker counters.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx
import numpy as np


def run(url: str, documents: int, asks: int, prefix_tokens: int, suffix_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(10, 1024, prefix_tokens).tolist() for _ in range(documents)]
    order = rng.permutation(np.repeat(np.arange(documents), asks)).tolist()
    seen: set[int] = set()
    out = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "repeat_asks": 0, "repeat_asks_reusing": 0}
    with httpx.Client(timeout=120) as client:
        for d in order:
            ids = docs[d] + rng.integers(10, 1024, suffix_tokens).tolist()
            r = client.post(f"{url}/v1/completions",
                            json={"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()
            usage = r.json()["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            out["requests"] += 1
            out["prompt_tokens"] += usage["prompt_tokens"]
            out["cached_tokens"] += cached
            if d in seen:
                out["repeat_asks"] += 1
                out["repeat_asks_reusing"] += cached > 0
            seen.add(d)
            applied = sum(w["events_applied"] for w in client.get(f"{url}/router/stats").json()["workers"])
            for _ in range(200):                   # events arrive by long poll (periodic polls as fallback)
                time.sleep(0.05)
                now = sum(w["events_applied"] for w in client.get(f"{url}/router/stats").json()["workers"])
                if now > applied:
                    break
        out["router"] = client.get(f"{url}/router/stats").json()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--asks", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=640)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(run(args.url, args.documents, args.asks, args.prefix_tokens, args.suffix_tokens, args.seed),
                     indent=2))


if __name__ == "__main__":
    main()
