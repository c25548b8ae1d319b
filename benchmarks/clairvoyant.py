"""Clairvoyant checkpoint placement: how much of the every-block reuse a cache that knows the
future keeps with a given number of checkpoint slots (the bound beside the memory frontier,
docs/results/memory.md).

Run by hand (not part of the test suite)::

    python benchmarks/clairvoyant.py                               # the bundled trace
    python benchmarks/clairvoyant.py --trace t.jsonl --fractions 0.01 0.02 0.05 0.1

Model (block level, as the frontier's every-block run sees the trace): prompts are chains of
512-token blocks keyed by their prefix-chained hash ids. A request computes its whole prompt,
so after it every boundary ``j`` (``j * 512 <= input_length``) of its path could hold a
checkpoint. With a checkpoint at every such boundary and nothing evicted (the every-block run),
a request reuses ``512 * j`` tokens for the deepest boundary ``j`` an earlier request computed
with ``512 * j <= input_length - 1`` (the last prompt token is always computed). That boundary
is the request's *target*.

The clairvoyant placement creates a checkpoint only at a boundary that is some later request's
target, and keeps at most ``C`` of them: when a request has computed, each of its boundaries
with a future use is offered, and the resident set keeps the ``C`` whose next use is soonest
(Belady's MIN rule; a newcomer whose next use is later than every resident's is not kept). A
request whose target is not resident falls back to the deepest resident checkpoint on its path.

Reported per capacity: reused tokens as a share of the every-block reuse. Also: the number of
distinct targets (every checkpoint clairvoyance ever needs) and the most targets ever *live* at
once (created and still to be used), both as fractions of the every-block checkpoint count: with
that many slots the clairvoyant placement keeps all of the every-block reuse.

MIN is optimal for hit counts with equal sizes; here hits are weighted by depth and a miss may
fall back to a shallower checkpoint, so the figure is the result of a clairvoyant heuristic, a
reference for what placement can reach, not a proven maximum. The capacity is in checkpoints;
the frontier gives the device (and host) bytes as fractions of the every-block run's peak
checkpoint bytes, which is its checkpoint count times the slot size, so a fraction ``f`` of it
is ``f`` times the every-block count here. The every-block reuse computed here is checked
against the simulator's (``--check``).
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import defaultdict

from hybridkv.replay.trace import TRACE_BLOCK_TOKENS, load_trace

B = TRACE_BLOCK_TOKENS


def targets(reqs) -> tuple[list[int], int, list[list[int]]]:
    """``(target depth per request, every-block checkpoint count, reachable paths)``.

    A request's target depth is the deepest ``j`` whose prefix an earlier request computed
    (``512 * j <= its input_length``) with ``512 * j <= input_length - 1``; 0 for none. The
    every-block count is the number of distinct computed boundaries. ``paths[i]`` is request
    ``i``'s hash ids up to its last computed boundary.
    """
    computed: set[int] = set()
    depth, paths = [], []
    for r in reqs:
        ids = r.hash_ids
        n_comp = r.input_length // B                 # boundaries this request computes
        n_use = (r.input_length - 1) // B             # deepest boundary it may reuse
        j = 0
        while j < n_use and ids[j] in computed:
            j += 1
        depth.append(j)
        paths.append(list(ids[:n_comp]))
        computed.update(ids[:n_comp])
    return depth, len(computed), paths


def every_block_reuse(reqs) -> int:
    """Tokens the every-block run reuses (512 x the target depth, summed)."""
    depth, _, _ = targets(reqs)
    return B * sum(depth)


def clairvoyant(reqs, capacities: list[int]) -> dict:
    """Reused tokens of the clairvoyant placement at each capacity (checkpoints), and the
    need figures (see the module docstring)."""
    depth, total, paths = targets(reqs)
    ids_of = [r.hash_ids for r in reqs]
    uses: dict[int, list[int]] = defaultdict(list)         # target key -> requests that target it
    for i, d in enumerate(depth):
        if d:
            uses[ids_of[i][d - 1]].append(i)
    # most live targets: a target is live from the first request that computes it to its last use
    first_comp: dict[int, int] = {}
    for i, p in enumerate(paths):
        for h in p:
            if h in uses and h not in first_comp:
                first_comp[h] = i
    events = []
    for h, us in uses.items():
        events.append((first_comp[h], 1))
        events.append((us[-1], -1))
    events.sort(key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    out = {"every_block_checkpoints": total, "every_block_reused_tokens": B * sum(depth),
           "targets": len(uses), "targets_fraction": len(uses) / total,
           "peak_live_targets": peak, "peak_live_fraction": peak / total, "by_capacity": []}
    for cap in capacities:
        reused = _min_run(depth, ids_of, paths, uses, cap)
        out["by_capacity"].append({"capacity": cap, "fraction_of_every_block": cap / total,
                                   "reused_tokens": reused,
                                   "share": reused / max(1, out["every_block_reused_tokens"])})
    return out


def _min_run(depth, ids_of, paths, uses, cap: int) -> int:
    INF = 1 << 60
    pos = {h: 0 for h in uses}                  # index into uses[h] of the next use
    resident: dict[int, int] = {}               # key -> its next use (request index)
    heap: list[tuple[int, int]] = []            # (-next use, key), lazily invalid
    reused = 0

    def next_use(h: int, after: int) -> int:
        us = uses[h]
        k = pos[h]
        while k < len(us) and us[k] <= after:
            k += 1
        pos[h] = k
        return us[k] if k < len(us) else INF

    for i, d in enumerate(depth):
        ids = ids_of[i]
        if d:
            got = 0
            for j in range(d, 0, -1):          # deepest resident checkpoint within the target
                if ids[j - 1] in resident:
                    got = j
                    break
            reused += B * got
            if got:
                h = ids[got - 1]
                nu = next_use(h, i)
                if nu == INF:
                    del resident[h]
                else:
                    resident[h] = nu
                    heapq.heappush(heap, (-nu, h))
        for h in paths[i]:                      # offer this request's boundaries with a future use
            if h not in uses or h in resident:
                continue
            nu = next_use(h, i)
            if nu == INF:
                continue
            if len(resident) >= cap:
                while heap and resident.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if not heap or -heap[0][0] <= nu:
                    continue                     # every resident is needed sooner: not kept
                _, v = heapq.heappop(heap)
                del resident[v]
            resident[h] = nu
            heapq.heappush(heap, (-nu, h))
    return reused


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=None, help="Mooncake-format trace (default: the bundled one)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05],
                   help="capacities as fractions of the every-block checkpoint count")
    p.add_argument("--check", action="store_true",
                   help="also run the simulator's every-block replay and compare its reused tokens")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    reqs = load_trace(args.trace).requests
    _, total, _ = targets(reqs)
    res = clairvoyant(reqs, [max(1, round(f * total)) for f in args.fractions])
    if args.check:
        from rich.console import Console

        from hybridkv.replay.runner import ReplayOptions, run_replay
        r = run_replay(ReplayOptions(trace=args.trace, limit=None, simulate=True, progress=False, host_bytes=0,
                                     policy=f"interval={B}", block_tokens=B), Console(stderr=True))
        res["simulator_every_block_reused_tokens"] = r.reused_tokens
        res["simulator_every_block_checkpoints"] = r.checkpoints_created
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
