"""A routing decision on a large fleet reads only its candidates (the instances in ``live``)."""

from __future__ import annotations

import hashlib
import random

import pytest

from hybridkv.fleet.costmodel import h200_kimi_linear_48b
from hybridkv.fleet.events import CacheEvent, EventKind, InstanceView
from hybridkv.fleet.routers import FleetState, HybridOptions, HybridRouter, InstanceLoad, RouteRequest

UNIT = 64


def _chain(parts: str) -> list[bytes]:
    out, prev = [], b""
    for p in parts:
        prev = hashlib.sha256(prev + p.encode()).digest()
        out.append(prev)
    return out


def _view(instance: int, hashes: list[bytes]) -> InstanceView:
    v = InstanceView(UNIT)
    v.apply(CacheEvent(instance, 0, 0, EventKind.BLOCKS_STORED, tuple(hashes)))
    v.apply(CacheEvent(instance, 0, 1, EventKind.CHECKPOINTS_STORED, tuple(hashes[-1:])))
    return v


def _fleet(n: int, seed: int) -> tuple[list[InstanceView], list[InstanceLoad], list[bytes]]:
    rng = random.Random(seed)
    prompt = _chain("abcdefghijkl")
    views = [_view(j, prompt[:rng.randrange(len(prompt) + 1)] or _chain("z")) for j in range(n)]
    loads = [InstanceLoad(outstanding_tokens=w * 900, queued_seconds=w * 0.05, in_flight=w + rng.randrange(3),
                          in_flight_tokens=(w + 1) * 1500, waiting=w, decode_tokens=rng.randrange(400),
                          routed=rng.randrange(50))
             for w in (rng.randrange(6) for _ in range(n))]
    return views, loads, prompt


@pytest.mark.parametrize("own_waiting", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("waiting_weight", [1.0, 8.0])
def test_waiting_among_is_waiting_counts_of_those_instances(own_waiting, waiting_weight):
    _, loads, _ = _fleet(40, 1)
    opts = HybridOptions(own_waiting=own_waiting, waiting_weight=waiting_weight)
    live = [j for j in range(40) if j % 3]
    among = [1, 5, 7, 38]
    full = opts.waiting_counts(loads, live)
    assert opts.waiting_among(loads, live, among) == [full[j] for j in among]


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_decision_reads_only_the_live_instances(seed):
    """Instances outside ``live`` have no load or view to read (``None``): the decision is made,
    and it is the one made with their loads and views present."""
    n = 256
    views, loads, prompt = _fleet(n, seed)
    live = sorted(random.Random(seed).sample(range(n), 20))
    tokens = len(prompt) * UNIT + 5
    req = RouteRequest(hashes=prompt, prompt_tokens=tokens, limit=(tokens - 1) // UNIT * UNIT, output_tokens=64)
    cost = h200_kimi_linear_48b()
    whole = HybridRouter(cost, max_num_seqs=4).route(req, FleetState(views=views, loads=loads, live=live))
    bare_views = [views[j] if j in live else None for j in range(n)]
    bare_loads = [loads[j] if j in live else None for j in range(n)]
    bare = HybridRouter(cost, max_num_seqs=4).route(req, FleetState(views=bare_views, loads=bare_loads, live=live))
    assert bare == whole
    assert whole in live
