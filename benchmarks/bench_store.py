"""Save / load throughput of cache entries (KV segments + KDA checkpoints) through every store backend.

Run by hand (not part of the test suite)::

    python benchmarks/bench_store.py                         # 32 entries, 5 repeats, all backends
    python benchmarks/bench_store.py --entries 64 --repeats 7 --json out.json
    python benchmarks/bench_store.py --profile               # also cProfile one save+load pass per backend
    python benchmarks/bench_store.py --preset kimi-linear-48b-a3b --entries 4   # entries of the 48B model

What moves. ``--entries`` aligned boundaries (``store_alignment`` 512, unit 64) of
one synthetic prompt; at each boundary one ``kv`` entry (MLA latents
``float32[2, 512, 160]`` = 640 KiB for the ``small`` preset) and one ``kda``
entry (recurrent ``float32[6, 4, 64, 64]`` = 384 KiB + three conv parts of
18 KiB). A pass saves every entry with one :meth:`Tier.save_entries` call and
loads them back with one :meth:`Tier.load_many` call: the calls
``TierConnector.upload`` / ``fetch`` make (cache ABI v2: zero-copy puts whose
checksums are computed while the component put runs, XXH3-128, one batched
``get_into`` into the tier's reusable staging arena for the loads). The
tiers are shaped for ``--preset`` (default ``small``; entry shapes only, no
weights are built). GB/s = component payload bytes (manifests not counted) /
seconds, 1 GB = 1e9 bytes, median of ``--repeats`` passes with fresh keys (a new
namespace per pass) after one warm-up pass; every repeat runs every path once in
rotating order, and ratios are medians of per-repeat ratios.

Paths: ``HostTier`` (tensors in this process); ``StoreTier`` over
``MemoryStore``, ``DiskStore`` in a temp dir (reads come from the page cache)
and ``MooncakeStore`` against a loopback store started with
:func:`hybridkv.store.mooncake.service.start_store` (master + storage process holding the
segment; stopped at the end) when the mooncake package imports.

References on the same bytes (same object sizes):

* ``torch clone``: ``Tensor.clone`` of every component tensor (save), then a
  clone of those clones (load): one in-process copy each way;
* ``torch copy_ (preallocated)``: memcpy into tensors allocated once;
* ``raw mooncake, one batch``: one ``batch_put_from`` / ``batch_get_into`` of all
  component objects on buffers registered once (the floor of the backend; the
  reference of the targets);
* ``raw mooncake + manifests``: the same plus one 1 KiB object per entry, put in
  a second call after the components (the commit protocol's call pattern) and
  read in the same batch: the cost of the manifests alone.

The script re-executes itself once under :func:`hybridkv.store.mooncake.loopback.loopback_env`
so that its Mooncake listeners stay on loopback.
"""

from __future__ import annotations

import argparse
import contextlib
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

import numpy as np
import torch

from hybridkv.cache.groups import FullAttentionSpec, KDASpec, entry_shapes
from hybridkv.cache.namespace import chained_block_hashes
from hybridkv.model.config import PRESETS, HybridConfig
from hybridkv.model.state import KDACheckpoint
from hybridkv.store.disk import DiskStore
from hybridkv.store.memory import MemoryStore
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.layout import (
    checkpoint_components,
    checkpoint_from_components,
    checksum,
    tensor_view,
)
from hybridkv.tiers.store_tier import StoreTier

UNIT = 64
ALIGN = 512


def make_data(cfg, conv_dtype: torch.dtype, entries: int, seed: int = 0):
    """Random latents, checkpoints and prompt tokens shaped for ``cfg`` (a HybridConfig)."""
    g = torch.Generator().manual_seed(seed)
    lat = [torch.randn(cfg.num_mla_layers, ALIGN, cfg.kv_latent_dim, generator=g) for _ in range(entries)]
    ck = [KDACheckpoint(torch.randn(cfg.recurrent_state_shape, generator=g),
                        torch.randn(cfg.conv_state_shape, generator=g).to(conv_dtype), (i + 1) * ALIGN)
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


def tier_run(name, tier_factory, tokens, lat, ck):
    """A timed pass: one ``save_entries`` of every entry, then one ``load_many``. One tier per path for
    the whole run (as in an engine: its staging arena is reused); fresh keys per pass (the chained
    hashes are salted with the pass)."""
    bounds = [(i + 1) * ALIGN for i in range(len(lat))]
    tier = tier_factory(hashlib.sha256(f"bench_store/{name}".encode()).digest())

    def run(rep: int):
        hashes = chained_block_hashes(f"bench_store/{name}/{rep}/{time.time_ns()}".encode(), tokens, UNIT)
        entries = []
        for b, latents, c in zip(bounds, lat, ck):
            entries.append(tier.entry(hashes, b, "full", {"latents": latents}))
            entries.append(tier.entry(hashes, b, "kda", checkpoint_components(c)))
        wanted = [(b, g) for b in bounds for g in ("full", "kda")]
        t = time.perf_counter()
        ok = tier.save_entries(entries)
        t1 = time.perf_counter()
        got = tier.load_many(hashes, wanted, **({"staging": True} if isinstance(tier, StoreTier) else {}))
        t2 = time.perf_counter()
        assert all(ok) and all(x is not None for x in got), (name, ok.count(False), got.count(None))
        if rep == 0:
            for i, (latents, c) in enumerate(zip(lat, ck)):
                assert torch.equal(got[2 * i]["latents"], latents)
                back = checkpoint_from_components(got[2 * i + 1], bounds[i])
                assert torch.equal(back.recurrent, c.recurrent) and torch.equal(back.conv, c.conv)
        for b in bounds:
            for g in ("full", "kda"):
                tier.invalidate(hashes, b, g)
        return t1 - t, t2 - t1, None
    return run


def profile_run(run) -> str:
    """cProfile text (top 14 by tottime) of one pass of ``run``."""
    pr = cProfile.Profile()
    pr.enable()
    run(1)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
    return buf.getvalue()


def copy_paths(tensors):
    """In-process copies of every component: ``torch clone`` (save: clone; load: clone of the clones;
    fresh memory, like a store that keeps what it saved) and ``torch copy_`` into preallocated
    tensors (memcpy, no page faults)."""
    def clone(rep):
        t = time.perf_counter()
        a = [x.clone() for x in tensors]
        t1 = time.perf_counter()
        b = [x.clone() for x in a]
        t2 = time.perf_counter()
        del a, b
        return t1 - t, t2 - t1, None

    dst1 = [torch.empty_like(x) for x in tensors]
    dst2 = [torch.empty_like(x) for x in tensors]

    def copy_into(rep):
        t = time.perf_counter()
        for d, x in zip(dst1, tensors):
            d.copy_(x)
        t1 = time.perf_counter()
        for d, x in zip(dst2, dst1):
            d.copy_(x)
        t2 = time.perf_counter()
        return t1 - t, t2 - t1, None

    return {"torch clone": clone, "torch copy_ (preallocated)": copy_into}


def bench_primitives(tensors, repeats) -> dict[str, float]:
    """Median seconds over all components of the per-byte steps of the ABI v2 path (SHA-256 for reference)."""
    views = [tensor_view(t) for t in tensors]
    steps = {
        "tensor_view (no copy)": lambda: [tensor_view(t) for t in tensors],
        "xxh3_128 checksum": lambda: [checksum(v) for v in views],
        "sha256 (ABI v1's checksum)": lambda: [hashlib.sha256(v).hexdigest() for v in views],
        "bytes(view) copy": lambda: [bytes(v) for v in views],
        "torch.frombuffer (no copy)": lambda: [torch.frombuffer(bytearray(16), dtype=torch.uint8) for _ in views],
    }
    out = {}
    for label, fn in steps.items():
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[label] = statistics.median(times)
    return out


class RawMooncake:
    """Raw zero-copy calls of one Mooncake client on buffers registered once, same objects as the tier writes."""

    def __init__(self, master: str, tensors, entries: int) -> None:
        from hybridkv.store.mooncake.support import load_client_class

        manifests = 2 * entries                  # one ~1 KiB manifest per kv and per kda entry
        self.sizes = [t.numel() * t.element_size() for t in tensors] + [1024] * manifests
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.src = np.ones(sum(self.sizes), dtype=np.uint8)
        for t, o, n in zip(tensors, self.offsets, self.sizes):
            self.src[o:o + n] = np.frombuffer(tensor_view(t), dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        self.small = np.zeros(1024, dtype=np.uint8)
        self.client = load_client_class()()
        if self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) != 0:
            raise RuntimeError("raw mooncake client setup failed")
        for a in (self.src, self.dst, self.small):
            self.client.register_buffer(a.ctypes.data, a.nbytes)
        comps = list(range(len(tensors)))
        extra = list(range(len(tensors), len(self.sizes)))
        self.batches = {   # label -> (put batches, get batches)
            "raw mooncake, one batch": ([comps], [comps]),
            "raw mooncake + manifests": ([comps, extra], [comps + extra]),
        }

    def path(self, label):
        puts, gets = self.batches[label]
        c, src, dst, off, sizes = self.client, self.src, self.dst, self.offsets, self.sizes
        used = sorted(i for b in puts for i in b)

        def run(rep):
            keys = [f"bench_store/raw/{rep}/{time.time_ns()}/{i}" for i in range(len(sizes))]
            t = time.perf_counter()
            for b in puts:
                codes = c.batch_put_from([keys[i] for i in b], [src.ctypes.data + int(off[i]) for i in b],
                                         [sizes[i] for i in b])
                assert all(x == 0 for x in codes), codes
            tp = time.perf_counter() - t
            dst[:] = 0
            t = time.perf_counter()
            for b in gets:
                codes = c.batch_get_into([keys[i] for i in b], [dst.ctypes.data + int(off[i]) for i in b],
                                         [sizes[i] for i in b])
                assert codes == [sizes[i] for i in b], codes
            tg = time.perf_counter() - t
            end = int(off[used[-1]]) + sizes[used[-1]]
            assert np.array_equal(src[:end], dst[:end])
            c.batch_remove([keys[i] for i in used], True)
            return tp, tg, None
        return run

    def latency(self, n: int = 40) -> dict[str, float]:
        """Median seconds of one call on one 1 KiB object: put, get_into, get_replica_desc, is_exist."""
        c, ptr = self.client, self.small.ctypes.data
        lat = {"put 1 KiB": [], "get_into 1 KiB": [], "get_replica_desc": [], "is_exist": []}
        for i in range(n + 1):
            key = [f"bench_store/raw/small/{time.time_ns()}/{i}"]
            t = time.perf_counter()
            c.batch_put_from(key, [ptr], [1024])
            t1 = time.perf_counter()
            c.batch_get_replica_desc(key)
            t2 = time.perf_counter()
            c.batch_get_into(key, [ptr], [1024])
            t3 = time.perf_counter()
            c.batch_is_exist(key)
            t4 = time.perf_counter()
            c.batch_remove(key, True)
            if i:
                for k, v in zip(lat, (t1 - t, t3 - t2, t2 - t1, t4 - t3)):
                    lat[k].append(v)
        return {k: statistics.median(v) for k, v in lat.items()}

    def close(self) -> None:
        for a in (self.src, self.dst, self.small):
            self.client.unregister_buffer(a.ctypes.data)
        self.client.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="host,memory,disk,mooncake")
    p.add_argument("--preset", default="small", choices=PRESETS,
                   help="entry shapes of this model preset (no weights are built); kimi-linear-48b-a3b: "
                        "a 512-token kv entry is 14.7 MB and a checkpoint 42.5 MB (bf16 conv)")
    p.add_argument("--profile", action="store_true", help="cProfile one save+load pass per tier")
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    backends = args.backends.split(",")

    mooncake_ok, why = False, ""
    if "mooncake" in backends:
        try:
            from hybridkv.store.mooncake import loopback, procs, service
            from hybridkv.store.mooncake.support import (
                LOOPBACK_SHIM_NAME,
                load_client_class,
            )
            load_client_class()
            mooncake_ok = True
        except ImportError as exc:
            why = str(exc)
        if mooncake_ok and LOOPBACK_SHIM_NAME not in os.environ.get("LD_PRELOAD", ""):
            env = loopback.loopback_env()
            env.setdefault("GLOG_minloglevel", "1")      # Mooncake's INFO lines
            if LOOPBACK_SHIM_NAME in env.get("LD_PRELOAD", ""):
                os.execve(sys.executable, [sys.executable, *sys.argv], env)

    torch.set_num_threads(1)
    cfg = HybridConfig.preset(args.preset)
    conv_dtype = torch.float32 if args.preset in ("tiny", "small") else torch.bfloat16
    shapes = entry_shapes(FullAttentionSpec.for_model(cfg, ALIGN),
                          KDASpec.for_model(cfg, str(conv_dtype).removeprefix("torch.")), ALIGN)
    lat, ck, tokens = make_data(cfg, conv_dtype, args.entries)
    tensors = components(lat, ck)
    payload = sum(t.numel() * t.element_size() for t in tensors)

    prims = {k: {"s": v, "gbps": payload / v / 1e9} for k, v in bench_primitives(tensors, args.repeats).items()}
    paths = dict(copy_paths(tensors))
    stores = []
    profiles: dict[str, str] = {}
    latency: dict[str, float] = {}
    times: dict[str, list] = {}
    with contextlib.ExitStack() as stack:
        if "memory" in backends:
            stores.append(("MemoryStore", MemoryStore()))
        if "disk" in backends:
            d = stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridkv-bench-disk-"))
            stores.append(("DiskStore", DiskStore(d)))
        raw = None
        if "mooncake" in backends and mooncake_ok:
            from hybridkv.store.mooncake.client import MooncakeStore
            port, metrics_port = procs.find_free_ports(2)
            work = stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridkv-bench-mc-"))
            service.start_store(port, metrics_port, max(256 << 20, 8 * payload), work)
            stack.callback(service.stop_store, work)
            master = f"127.0.0.1:{port}"
            store = MooncakeStore(master)
            stack.callback(store.close)
            stores.append(("MooncakeStore", store))
            raw = RawMooncake(master, tensors, args.entries)
            stack.callback(raw.close)
        elif "mooncake" in backends:
            print(f"mooncake skipped: {why}")
        tiers = {}
        if "host" in backends:
            tiers["HostTier"] = lambda ns: HostTier(4 * payload, ns, UNIT, ALIGN, shapes)
        for name, store in stores:
            tiers[name] = lambda ns, store=store: StoreTier(store, ns, UNIT, ALIGN, shapes)
        for name, factory in tiers.items():
            paths[name] = tier_run(name, factory, tokens, lat, ck)
        if raw is not None:
            for label in raw.batches:
                paths[label] = raw.path(label)
        names = list(paths)
        # Interleaved: every repeat runs every path once (rotating the order), so the per-repeat
        # ratios compare paths measured within seconds of each other; pass 0 is a warm-up.
        for rep in range(args.repeats + 1):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                out = paths[name](rep)
                if rep:
                    times.setdefault(name, []).append(out)
        if raw is not None:
            latency = raw.latency()
        if args.profile:
            for name in tiers:
                profiles[name] = profile_run(paths[name])

    results: dict[str, dict] = {}
    refs = [r for r in ("torch clone", "raw mooncake, one batch") if r in times]
    for name in names:
        runs = times[name]
        r = {"save_gbps": payload / statistics.median(x[0] for x in runs) / 1e9,
             "load_gbps": payload / statistics.median(x[1] for x in runs) / 1e9,
             "save_s": [x[0] for x in runs], "load_s": [x[1] for x in runs]}
        for ref in refs:    # median over repeats of (ref seconds / path seconds) = throughput ratio
            r[f"save_vs_{ref}"] = statistics.median(b[0] / a[0] for a, b in zip(runs, times[ref]))
            r[f"load_vs_{ref}"] = statistics.median(b[1] / a[1] for a, b in zip(runs, times[ref]))
        results[name] = r

    print(f"preset {args.preset}: {args.entries} entries x (kv {lat[0].numel() * 4} B + kda "
          f"{sum(t.numel() * t.element_size() for t in components(lat[:1], ck[:1])[1:])} B) = {payload / 1e6:.1f} MB payload, {args.repeats} interleaved repeats (medians), "
          f"{os.cpu_count()} CPUs, torch threads 1")
    short = {"torch clone": "clone", "raw mooncake, one batch": "raw"}
    head = f"{'path':<30}{'save GB/s':>10}{'load GB/s':>10}"
    for ref in refs:
        head += f"{'save/' + short[ref]:>11}{'load/' + short[ref]:>11}"
    print(head)
    for name, r in results.items():
        line = f"{name:<30}{r['save_gbps']:>10.3f}{r['load_gbps']:>10.3f}"
        for ref in refs:
            line += f"{r['save_vs_' + ref]:>11.3f}{r['load_vs_' + ref]:>11.3f}"
        print(line)
    print("(ratios: median over repeats of the per-repeat throughput ratio)")
    print("\nper-byte steps of the tier, over the same components (median):")
    for k, v in prims.items():
        print(f"  {k:<36}{1e3 * v['s']:8.2f} ms {v['gbps']:8.3f} GB/s")
    if latency:
        print("raw Mooncake per-call latency, one 1 KiB object (median of 40): "
              + ", ".join(f"{k} {1e6 * v:.0f} us" for k, v in latency.items()))
    for name, text in profiles.items():
        if text:
            print(f"\n--- cProfile, one save+load pass, {name} (sorted by tottime) ---")
            print("\n".join(text.splitlines()[:30]))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "preset": args.preset, "machine": f"{platform.machine()}, "
                       f"{os.cpu_count()} CPUs", "entries": args.entries, "repeats": args.repeats,
                       "payload_bytes": payload, "results": results, "primitives": prims,
                       "mooncake_call_latency_s": latency,
                       "profiles": profiles}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
