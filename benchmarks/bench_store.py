"""Save / load throughput of cache entries (KV segments + KDA checkpoints) through every store backend.

Run by hand (not part of the test suite)::

    python benchmarks/bench_store.py                         # 32 entries, 5 repeats, all backends
    python benchmarks/bench_store.py --entries 64 --repeats 7 --json out.json
    python benchmarks/bench_store.py --profile               # also cProfile one save+load pass per backend

What moves. ``--entries`` aligned boundaries (``store_alignment`` 512, unit 64) of
one synthetic prompt; at each boundary one ``kv`` entry (MLA latents
``float32[2, 512, 160]`` = 640 KiB for the ``small`` preset) and one ``kda``
entry (recurrent ``float32[6, 4, 64, 64]`` = 384 KiB + three conv parts of
18 KiB), written with :meth:`StoreTier.save_kv` / :meth:`StoreTier.save_checkpoint`
and read back with :meth:`StoreTier.load_kv` / :meth:`StoreTier.load_checkpoint`
(manifest, SHA-256 check, decode). The tier is built by
:func:`hybridkv.store.connector.tier_for` over a ``TorchBackend`` of the
``small`` preset. GB/s = component payload bytes (manifests not counted) /
seconds, 1 GB = 1e9 bytes, median of ``--repeats`` passes with fresh keys (a new
namespace per pass) after one warm-up pass.

Backends: ``MemoryStore``; ``DiskStore`` in a temp dir (reads come from the page
cache); ``MooncakeStore`` against a loopback store started with
:func:`hybridkv.store.service.start_store` (master + storage process holding the
segment; stopped at the end) when the mooncake package imports.

References on the same bytes (same object sizes):

* ``torch clone``: ``Tensor.clone`` of every component tensor (one in-process copy);
* ``bytes copy``: ``bytes(memoryview)`` of every component (one in-process copy);
* ``raw mooncake, one batch``: one ``batch_put_from`` / ``batch_get_into`` of all
  component objects on buffers registered once (the floor);
* ``raw mooncake, per entry``: one raw call per entry (the call pattern of the tier).

The script re-executes itself once under :func:`hybridkv.store.service.loopback_env`
so that its Mooncake listeners stay on loopback.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

from hybridkv.cache.namespace import chained_block_hashes
from hybridkv.engine.backend import TorchBackend
from hybridkv.model import HybridModel
from hybridkv.model.state import KDACheckpoint
from hybridkv.store.base import MemoryStore
from hybridkv.store.connector import tier_for
from hybridkv.store.disk import DiskStore
from hybridkv.store.layout import bytes_tensor, tensor_bytes

UNIT = 64
ALIGN = 512


def make_data(model, entries: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    zero = model.zero_checkpoint()
    lat = [torch.randn(cfg.num_mla_layers, ALIGN, cfg.kv_latent_dim, generator=g) for _ in range(entries)]
    ck = [KDACheckpoint(torch.randn(zero.recurrent.shape, generator=g),
                        torch.randn(zero.conv.shape, generator=g).to(zero.conv.dtype), (i + 1) * ALIGN)
          for i in range(entries)]
    tokens = torch.randint(3, cfg.vocab_size, (entries * ALIGN,), generator=g).numpy()
    return lat, ck, tokens


def components(lat, ck) -> list[torch.Tensor]:
    """Every component tensor in store order (contiguous copies, like the objects the tier writes)."""
    out = []
    for latents, c in zip(lat, ck):
        out.append(latents.contiguous())
        out.append(c.recurrent.contiguous())
        out.extend(t.contiguous() for t in c.conv.chunk(3, dim=1))
    return out


def tier_pass(tier, hashes, lat, ck, check: bool) -> tuple[float, float, dict]:
    """One save pass and one load pass; (save seconds, load seconds, per-call seconds)."""
    split = {"save_kv": 0.0, "save_checkpoint": 0.0, "load_kv": 0.0, "load_checkpoint": 0.0}
    bounds = [(i + 1) * ALIGN for i in range(len(lat))]
    t0 = time.perf_counter()
    for b, latents, c in zip(bounds, lat, ck):
        t = time.perf_counter()
        ok1 = tier.save_kv(hashes, b, latents)
        t1 = time.perf_counter()
        ok2 = tier.save_checkpoint(hashes, b, c)
        t2 = time.perf_counter()
        split["save_kv"] += t1 - t
        split["save_checkpoint"] += t2 - t1
        assert ok1 and ok2, (b, ok1, ok2)
    save = time.perf_counter() - t0
    got = []
    t0 = time.perf_counter()
    for b in bounds:
        t = time.perf_counter()
        kv = tier.load_kv(hashes, b)
        t1 = time.perf_counter()
        c = tier.load_checkpoint(hashes, b)
        t2 = time.perf_counter()
        split["load_kv"] += t1 - t
        split["load_checkpoint"] += t2 - t1
        got.append((kv, c))
    load = time.perf_counter() - t0
    if check:
        for (kv, c), latents, ref in zip(got, lat, ck):
            assert kv is not None and c is not None and torch.equal(kv, latents)
            assert torch.equal(c.recurrent, ref.recurrent) and torch.equal(c.conv, ref.conv)
    return save, load, split


def bench_backend(name, store, backend, hashes, lat, ck, repeats, profile: bool):
    """Median save / load seconds through a StoreTier over ``store`` (fresh namespace per pass)."""
    saves, loads, splits = [], [], []
    for rep in range(repeats + 1):
        ns = hashlib.sha256(f"bench_store/{name}/{rep}/{time.time_ns()}".encode()).digest()
        tier = tier_for(store, backend, ns, UNIT, ALIGN, name=name)
        s, l, sp = tier_pass(tier, hashes, lat, ck, check=(rep == 0))
        if rep:                      # pass 0 is the warm-up
            saves.append(s)
            loads.append(l)
            splits.append(sp)
        drop(store, tier, hashes, len(lat))
    prof_text = None
    if profile:
        ns = hashlib.sha256(f"bench_store/{name}/profile".encode()).digest()
        tier = tier_for(store, backend, ns, UNIT, ALIGN, name=name)
        pr = cProfile.Profile()
        pr.enable()
        tier_pass(tier, hashes, lat, ck, check=False)
        pr.disable()
        drop(store, tier, hashes, len(lat))
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
        prof_text = buf.getvalue()
    med = {k: statistics.median(sp[k] for sp in splits) for k in splits[0]}
    return statistics.median(saves), statistics.median(loads), med, prof_text


def drop(store, tier, hashes, entries):
    for i in range(entries):
        for group in ("kv", "kda"):
            tier.invalidate(hashes, (i + 1) * ALIGN, group)


def bench_copies(tensors, repeats) -> dict[str, float]:
    """Median seconds of one in-process copy of every component: torch clone, bytes copy."""
    out = {}
    views = [memoryview(t.numpy()).cast("B") for t in tensors]
    for label, fn in (("torch clone", lambda: [t.clone() for t in tensors]),
                      ("bytes copy", lambda: [bytes(v) for v in views])):
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            keep = fn()
            times.append(time.perf_counter() - t)
            del keep
        out[label] = statistics.median(times)
    return out


def bench_primitives(tensors, repeats) -> dict[str, float]:
    """Median seconds over all components of the per-byte steps the tier performs."""
    blobs = [tensor_bytes(t) for t in tensors]
    meta = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
    steps = {
        "tensor_bytes (numpy tobytes copy)": lambda: [tensor_bytes(t) for t in tensors],
        "sha256 hexdigest": lambda: [hashlib.sha256(b).hexdigest() for b in blobs],
        "bytes_tensor (frombuffer + copy)": lambda: [bytes_tensor(b, d, s) for b, (d, s) in zip(blobs, meta)],
        "torch.frombuffer (no copy)": lambda: [torch.frombuffer(b, dtype=torch.uint8) for b in blobs],
    }
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # frombuffer on immutable bytes warns
        for label, fn in steps.items():
            fn()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            out[label] = statistics.median(times)
    return out


def bench_raw_mooncake(master: str, tensors, repeats, entries) -> dict[str, tuple[float, float]]:
    """Median (put s, get s) of raw zero-copy calls on registered buffers, the same objects as the tier writes."""
    from hybridkv.store.mooncake import load_client_class

    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    src = np.empty(sum(sizes), dtype=np.uint8)
    for t, o, n in zip(tensors, offsets, sizes):
        src[o:o + n] = np.frombuffer(t.numpy().tobytes(), dtype=np.uint8)
    dst = np.zeros_like(src)
    client = load_client_class()()
    if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) != 0:
        raise RuntimeError("raw mooncake client setup failed")
    client.register_buffer(src.ctypes.data, src.nbytes)
    client.register_buffer(dst.ctypes.data, dst.nbytes)
    per = len(tensors) // entries                     # objects per boundary (kv latents + 4 kda parts)
    batches_entry = [g for i in range(entries) for g in ([i * per], list(range(i * per + 1, (i + 1) * per)))]
    out = {}
    try:
        for label, batches in (("raw mooncake, one batch", [list(range(len(tensors)))]),
                               ("raw mooncake, per entry", batches_entry)):
            puts, gets = [], []
            for rep in range(repeats + 1):
                keys = [f"bench_store/raw/{label}/{rep}/{time.time_ns()}/{i}" for i in range(len(tensors))]
                t = time.perf_counter()
                for b in batches:
                    codes = client.batch_put_from([keys[i] for i in b], [src.ctypes.data + int(offsets[i]) for i in b],
                                                  [sizes[i] for i in b])
                    assert all(c == 0 for c in codes), codes
                tp = time.perf_counter() - t
                dst[:] = 0
                t = time.perf_counter()
                for b in batches:
                    codes = client.batch_get_into([keys[i] for i in b], [dst.ctypes.data + int(offsets[i]) for i in b],
                                                  [sizes[i] for i in b])
                    assert codes == [sizes[i] for i in b], codes
                tg = time.perf_counter() - t
                assert np.array_equal(src, dst)
                client.batch_remove(keys, True)
                if rep:
                    puts.append(tp)
                    gets.append(tg)
            out[label] = (statistics.median(puts), statistics.median(gets))
    finally:
        client.unregister_buffer(src.ctypes.data)
        client.unregister_buffer(dst.ctypes.data)
        client.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="memory,disk,mooncake")
    p.add_argument("--profile", action="store_true", help="cProfile one save+load pass per backend")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    backends = args.backends.split(",")

    mooncake_ok, why = False, ""
    if "mooncake" in backends:
        try:
            from hybridkv.store import service
            from hybridkv.store.mooncake import LOOPBACK_SHIM_NAME, load_client_class
            load_client_class()
            mooncake_ok = True
        except ImportError as exc:
            why = str(exc)
        if mooncake_ok and LOOPBACK_SHIM_NAME not in os.environ.get("LD_PRELOAD", ""):
            env = service.loopback_env()
            if LOOPBACK_SHIM_NAME in env.get("LD_PRELOAD", ""):
                os.execve(sys.executable, [sys.executable, *sys.argv], env)

    torch.set_num_threads(1)
    model = HybridModel.from_preset("small", seed=0)
    backend = TorchBackend(model, 8, ALIGN)
    lat, ck, tokens = make_data(model, args.entries)
    hashes = chained_block_hashes(b"bench_store", tokens, UNIT)
    tensors = components(lat, ck)
    payload = sum(t.numel() * t.element_size() for t in tensors)

    results: dict[str, dict] = {}
    profiles: dict[str, str] = {}

    def record(name, save_s, load_s, split=None):
        results[name] = {"save_s": save_s, "load_s": load_s, "save_gbps": payload / save_s / 1e9,
                         "load_gbps": payload / load_s / 1e9, **({"split_s": split} if split else {})}

    for label, secs in bench_copies(tensors, args.repeats).items():
        record(label, secs, secs)
    prims = {k: {"s": v, "gbps": payload / v / 1e9} for k, v in bench_primitives(tensors, args.repeats).items()}

    if "memory" in backends:
        s, l, sp, prof = bench_backend("MemoryStore", MemoryStore(), backend, hashes, lat, ck, args.repeats,
                                       args.profile)
        record("MemoryStore", s, l, sp)
        profiles["MemoryStore"] = prof
    if "disk" in backends:
        with tempfile.TemporaryDirectory(prefix="hybridkv-bench-disk-") as d:
            s, l, sp, prof = bench_backend("DiskStore", DiskStore(d), backend, hashes, lat, ck, args.repeats,
                                           args.profile)
        record("DiskStore", s, l, sp)
        profiles["DiskStore"] = prof
    if "mooncake" in backends and mooncake_ok:
        from hybridkv.store.mooncake import MooncakeStore
        port, metrics_port = service.find_free_ports(2)
        with tempfile.TemporaryDirectory(prefix="hybridkv-bench-mc-") as work:
            handle = service.start_store(port, metrics_port, max(256 << 20, 8 * payload), work)
            try:
                store = MooncakeStore(handle.master)
                try:
                    s, l, sp, prof = bench_backend("MooncakeStore", store, backend, hashes, lat, ck, args.repeats,
                                                   args.profile)
                finally:
                    store.close()
                record("MooncakeStore", s, l, sp)
                profiles["MooncakeStore"] = prof
                for label, (tp, tg) in bench_raw_mooncake(handle.master, tensors, args.repeats,
                                                          args.entries).items():
                    record(label, tp, tg)
            finally:
                service.stop_store(work)
    elif "mooncake" in backends:
        print(f"mooncake skipped: {why}")

    print(f"{args.entries} entries x (kv {lat[0].numel() * 4} B + kda "
          f"{ck[0].nbytes} B) = {payload / 1e6:.1f} MB payload, median of {args.repeats}, "
          f"{os.cpu_count()} CPUs, torch threads 1")
    clone = results["torch clone"]["save_gbps"]
    raw = results.get("raw mooncake, one batch")
    raw_e = results.get("raw mooncake, per entry")
    head = f"{'path':<26}{'save GB/s':>10}{'load GB/s':>10}{'save/clone':>11}{'load/clone':>11}"
    if raw:
        head += f"{'save/raw':>9}{'load/raw':>9}{'save/rawE':>10}{'load/rawE':>10}"
    print(head)
    for name, r in results.items():
        line = (f"{name:<26}{r['save_gbps']:>10.3f}{r['load_gbps']:>10.3f}"
                f"{r['save_gbps'] / clone:>11.3f}{r['load_gbps'] / clone:>11.3f}")
        if raw:
            line += (f"{r['save_gbps'] / raw['save_gbps']:>9.3f}{r['load_gbps'] / raw['load_gbps']:>9.3f}"
                     f"{r['save_gbps'] / raw_e['save_gbps']:>10.3f}{r['load_gbps'] / raw_e['load_gbps']:>10.3f}")
        print(line)
    print("\nper-byte steps of the tier, over the same components (median):")
    for k, v in prims.items():
        print(f"  {k:<36}{1e3 * v['s']:8.2f} ms {v['gbps']:8.3f} GB/s")
    for name, r in results.items():
        if "split_s" in r:
            print(f"  {name:<14} " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in r["split_s"].items()))
    for name, text in profiles.items():
        if text:
            print(f"\n--- cProfile, one save+load pass, {name} (sorted by tottime) ---")
            print("\n".join(text.splitlines()[:30]))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, "
                       f"{os.cpu_count()} CPUs", "entries": args.entries, "repeats": args.repeats,
                       "payload_bytes": payload, "results": results, "primitives": prims,
                       "profiles": profiles}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
