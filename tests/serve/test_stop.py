"""Stop strings over a long output: the incremental search finds what a whole-text search finds,
and a long streamed generation ends before its stop string."""

from __future__ import annotations

import json
import random

import httpx
from serve_helpers import prompt_ids

from hybridkv.serve.run import StopScan


def test_stop_scan_matches_a_whole_text_search_over_any_split():
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice("abc日") for _ in range(rng.randint(0, 60)))
        stops = tuple({"".join(rng.choice("abc日") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))})
        scan, at, found = StopScan(stops), 0, None
        while at < len(text) and found is None:
            step = rng.randint(0, 5)
            found = scan.feed(text[at:at + step])
            at += step
        seen = text[:at]                                  # what had arrived when the search answered
        hits = [seen.find(s) for s in stops if s in seen]
        assert found == (min(hits) if hits else None), (text, stops)
        if found is not None:                             # it answered as soon as a stop string was complete
            assert not any(s in seen[:at - step] for s in stops)


def test_a_long_generation_ends_before_its_stop_string(server):
    body = {"model": "tiny", "prompt": prompt_ids(90, 64), "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=600) as c:
        free = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        # a stop string whose first occurrence is as late in the text as possible
        k = max(k for k in range(len(free) - 3) if free.find(free[k:k + 3]) == k)
        assert k > 15, "the greedy continuation needs a late unique 3-character string"
        stop = free[k:k + 3]
        out = c.post("/v1/completions", json={**body, "stop": [stop, "\x00never"]}).json()
        assert out["choices"][0]["text"] == free[:k] and out["choices"][0]["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] < 200
        text, finish = "", None
        with c.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):

                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        assert text == free[:k] and finish == "stop"
