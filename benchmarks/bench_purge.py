"""Purges by owner and by age on a real local Mooncake master and on disk (cache ABI v4), and what
the expiry horizons cost a load (docs/results/store.md, "Purge").

For each backend: ``--prefixes`` prefixes of each of two owners, each one ``full`` and one ``kda``
entry at 1024 tokens (synthetic tensors of the shapes below, ~1.9 MiB per pair), written through a
:class:`StoreTier`. Then

* loads: ``--loads`` rounds of ``load_many`` of one pair, alternating the tier as built (8 horizon
  slots read in the batch) with one whose horizon keys are patched away; CPU seconds of this process
  (``time.process_time``) and wall seconds per load, medians;
* purge by owner (one owner's entries, the other's must survive), then by age (after the age purge
  no load of the older entries returns bytes: each is an ``expired`` miss on Mooncake).

Run: ``PYTHONPATH=src nice -n 10 python benchmarks/bench_purge.py --out benchmarks/results/purge.json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from hybridkv.cache.purge import PurgeSelector
from hybridkv.store.disk import DiskStore
from hybridkv.tiers import store_tier
from hybridkv.tiers.purge import purge_store_detail
from hybridkv.tiers.store_tier import StoreTier

UNIT, ALIGN = 64, 1024
SHAPES = {"full": {"latents": ("float32", (4, ALIGN, 96))},
          "kda": {"recurrent": ("float32", (2, 4, 64, 64)), "conv.q": ("float32", (2, 256, 3)),
                  "conv.k": ("float32", (2, 256, 3)), "conv.v": ("float32", (2, 256, 3))}}
MODEL = b"M" * 32
OWNERS = (b"A" * 32, b"B" * 32)


def hashes_of(owner: bytes, i: int) -> list[bytes]:
    """Fake unit hashes of prefix ``i`` of ``owner`` (16 units: boundary 1024)."""
    return [owner[:4] + i.to_bytes(4, "big") + u.to_bytes(4, "big") + b"\0" * 20 for u in range(ALIGN // UNIT)]


def fill(tier: StoreTier, n: int) -> list[tuple[bytes, list[bytes]]]:
    g = torch.Generator().manual_seed(0)
    written = []
    for owner in OWNERS:
        for i in range(n):
            hs = hashes_of(owner, i)
            tensors = {grp: {c: torch.randn(shape, generator=g) for c, (_, shape) in comps.items()}
                       for grp, comps in SHAPES.items()}
            ok = tier.save_entries([tier.entry(hs, ALIGN, grp, tensors[grp]) for grp in SHAPES], owner=owner)
            assert ok == [True, True], ok
            written.append((owner, hs))
    return written


def time_loads(tier: StoreTier, owner: bytes, hs: list[bytes], rounds: int) -> dict:
    wanted = [(ALIGN, "full"), (ALIGN, "kda")]
    samples = {"with_horizons": ([], []), "without": ([], [])}
    for r in range(rounds):
        for name in ("with_horizons", "without") if r % 2 == 0 else ("without", "with_horizons"):
            ctx = mock.patch.object(store_tier, "reader_horizon_keys", lambda m, o: []) if name == "without" \
                else mock.patch.object(store_tier, "reader_horizon_keys", store_tier.reader_horizon_keys)
            with ctx:
                c0, w0 = time.process_time(), time.perf_counter()
                got = tier.load_many(hs, wanted, owner=owner)
                c1, w1 = time.process_time(), time.perf_counter()
            assert all(x is not None for x in got)
            samples[name][0].append(c1 - c0)
            samples[name][1].append(w1 - w0)
    return {name: {"cpu_s_median": statistics.median(c), "wall_s_median": statistics.median(w)}
            for name, (c, w) in samples.items()}


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def bench(store, label: str, n: int, rounds: int) -> dict:
    tier = StoreTier(store, MODEL, UNIT, ALIGN, SHAPES)
    _, _, fill_wall = timed(lambda: fill(tier, n))
    a, b = OWNERS
    loads = time_loads(tier, a, hashes_of(a, 0), rounds)
    got, cpu, wall = timed(lambda: purge_store_detail(store, PurgeSelector(owners={a})))
    by_owner = {"removed": got.removed, "cpu_s": cpu, "wall_s": wall}
    assert got.removed == 2 * n, got
    assert tier.exists([(hashes_of(a, i)[-1], g) for i in range(n) for g in SHAPES], a) == [False] * (2 * n)
    assert tier.exists([(hashes_of(b, i)[-1], g) for i in range(n) for g in SHAPES], b) == [True] * (2 * n)
    cutoff = time.time()
    got, cpu, wall = timed(lambda: purge_store_detail(store, PurgeSelector(created_before=cutoff)))
    by_age = {"removed": got.removed, "by_horizon": got.hidden_before is not None, "cpu_s": cpu, "wall_s": wall}
    reader = StoreTier(store, MODEL, UNIT, ALIGN, SHAPES)
    assert all(x is None for i in range(n) for x in reader.load_many(hashes_of(b, i), [(ALIGN, "full"),
                                                                                      (ALIGN, "kda")], owner=b))
    by_age["reader_misses"] = dict(reader.stats.misses)
    tier.close()
    reader.close()
    return {"backend": label, "prefixes_per_owner": n, "fill_wall_s": fill_wall, "loads": loads,
            "purge_by_owner": by_owner, "purge_by_age": by_age}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", type=int, default=100)
    ap.add_argument("--loads", type=int, default=200)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskStore(Path(tmp) / "disk")
        results.append(bench(disk, "disk", args.prefixes, args.loads))
        disk.close()
        from hybridkv.store.mooncake import procs, service
        from hybridkv.store.mooncake.client import MooncakeStore

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        port, metrics = procs.find_free_ports(2)
        handle = service.start_store(port, metrics, 1 << 30, Path(tmp) / "mc")
        try:
            client = MooncakeStore(handle.master)
            results.append(bench(client, "mooncake", args.prefixes, args.loads))
            client.close()
        finally:
            service.stop_store(handle.workdir)
    text = json.dumps({"results": results, "entry_pair_bytes": sum(
        4 * torch.Size(s).numel() for comps in SHAPES.values() for _, s in comps.values())}, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
