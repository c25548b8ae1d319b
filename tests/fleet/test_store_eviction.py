"""The simulated store's batched eviction walk against the walk one entry at a time it replaced."""

from __future__ import annotations

import random

import pytest

from hybridkv.fleet.events import CacheEvent, EventKind
from hybridkv.fleet.store import StoreView

UNIT = 64


class OneAtATime(StoreView):
    """The walk before batching (one entry a step), kept as the reference order."""

    def _evict_to_fit(self) -> None:
        uses, kv, ck, ck_last = self._uses, self.kv, self.checkpoints, self._ck_last
        held, evicted, cap = self.bytes_held, self.evicted_bytes, self.capacity_bytes
        unit_b, ck_b = self._unit_bytes, self._ckpt_bytes
        i = self._head
        while held > cap and (kv or ck_last):
            stamp, entries = uses[0]
            n = len(entries)
            while i < n and held > cap:
                key = entries[i]
                i += 1
                if type(key) is tuple:
                    key = key[1]
                    if ck_last.get(key) != stamp:
                        continue
                    del ck_last[key]
                    held -= ck_b
                    evicted += ck_b
                    ck.discard(key)
                    continue
                if kv.get(key) != stamp:
                    continue
                del kv[key]
                held -= unit_b
                evicted += unit_b
                if key in ck:
                    ck.discard(key)
                    if ck_last.pop(key, None) is not None:
                        held -= ck_b
                        evicted += ck_b
            if i >= n:
                uses.popleft()
                i = 0
        self._head = i
        self.bytes_held, self.evicted_bytes = held, evicted


def _state(v: StoreView) -> tuple:
    return dict(v.kv), dict(v._ck_last), set(v.checkpoints), v.bytes_held, v.bytes_peak, v.evicted_bytes


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("ckpt_bytes", [1, 700, 6400, 50_000])
def test_batched_eviction_equals_one_entry_at_a_time(seed: int, ckpt_bytes: int) -> None:
    """Random stored units (chains sharing prefixes), checkpoints on and off entry boundaries, and
    loads (touch), under capacities from a few units to dozens: after every call both walks hold
    the same entries with the same stamps and the same byte counts."""
    rng = random.Random(seed * 31 + ckpt_bytes)
    unit_bytes = UNIT * 100
    cap = rng.choice([3, 7, 20, 60]) * unit_bytes + rng.randrange(0, 3) * ckpt_bytes + rng.randrange(unit_bytes)
    views = [cls(UNIT, 128, capacity_bytes=cap, kv_bytes_per_token=100, checkpoint_bytes=ckpt_bytes)
             for cls in (StoreView, OneAtATime)]
    chains = [[bytes([c, d]) * 16 for d in range(40)] for c in range(6)]
    evicted = 0
    for seq in range(300):
        chain = rng.choice(chains)
        lo = rng.randrange(0, 30)
        hi = rng.randrange(lo + 1, 41)
        op = rng.random()
        if op < 0.45:
            event = CacheEvent(0, 0, seq, EventKind.BLOCKS_STORED, tuple(chain[lo:hi]))
        elif op < 0.75:
            ends = sorted(rng.sample(range(lo, hi), min(hi - lo, rng.randrange(1, 4))))
            bounds = tuple((e + 1) * UNIT for e in ends) if rng.random() < 0.8 else ()
            event = CacheEvent(0, 0, seq, EventKind.CHECKPOINTS_STORED, tuple(chain[e] for e in ends), bounds)
        else:
            event = None
            end = rng.randrange(0, 41) * UNIT
        for v in views:
            if event is None:
                v.touch(chain, end)
            else:
                v.apply(event)
        assert _state(views[0]) == _state(views[1]), f"step {seq}"
        assert views[0].bytes_held <= cap
        evicted = views[0].evicted_bytes
    assert evicted > 0                          # the capacity was reached
