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
import contextlib
import cProfile
import hashlib
import importlib.util
import inspect
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
import zlib

import numpy as np
import torch

from hybridkv.cache.namespace import chained_block_hashes
from hybridkv.engine.backend import TorchBackend
from hybridkv.model import HybridModel
from hybridkv.model.state import KDACheckpoint
from hybridkv.store.base import MemoryStore
from hybridkv.store.connector import tier_for
from hybridkv.store.tier import checkpoint_components
from hybridkv.store.disk import DiskStore
from hybridkv.store.layout import bytes_tensor, decode_manifest, encode_entry, entry_key, tensor_bytes

UNIT = 64
ALIGN = 512
_DECODE_TAKES_KEYS = "keys" in inspect.signature(decode_manifest).parameters   # newer layout.py checks keys


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


def tier_path(name, store, backend, hashes, lat, ck):
    """A timed save+load pass through a StoreTier over ``store``, fresh keys (a new namespace) per call."""
    def run(rep: int):
        ns = hashlib.sha256(f"bench_store/{name}/{rep}/{time.time_ns()}".encode()).digest()
        tier = tier_for(store, backend, ns, UNIT, ALIGN, name=name)
        out = tier_pass(tier, hashes, lat, ck, check=(rep == 0))
        drop(tier, hashes, len(lat))
        return out
    return run


def tier_batched_path(name, store, backend, hashes, lat, ck):
    """The library's batched upload (``StoreTier.save_entries``: one put for every component of
    the pass, one for the manifests), then the per-entry loads; fresh namespace per call."""
    bounds = [(i + 1) * ALIGN for i in range(len(lat))]

    def run(rep: int):
        ns = hashlib.sha256(f"bench_store/{name}/batched/{rep}/{time.time_ns()}".encode()).digest()
        tier = tier_for(store, backend, ns, UNIT, ALIGN, name=name)
        t = time.perf_counter()
        entries = []
        for b, latents, c in zip(bounds, lat, ck):
            entries.append(tier.entry(hashes, b, "kv", {"latents": latents}))
            entries.append(tier.entry(hashes, b, "kda", checkpoint_components(c)))
        assert all(tier.save_entries(entries))
        save = time.perf_counter() - t
        t = time.perf_counter()
        for b in bounds:
            assert tier.load_kv(hashes, b) is not None and tier.load_checkpoint(hashes, b) is not None
        load = time.perf_counter() - t
        drop(tier, hashes, len(lat))
        return save, load, None
    return run


def batched_path(store, ns_prefix, hashes, lat, ck, shapes):
    """PROTOTYPE of the proposed fix, not the library path: the same ABI objects (``encode_entry``,
    SHA-256 manifests), but one ``put`` for every component of the pass, then one for every
    manifest; one ``get`` for the manifests, then one ``get_into`` for every component straight into
    one preallocated buffer (sizes from the manifests), checksummed in place and decoded with
    ``torch.frombuffer`` (no copy)."""
    bounds = [(i + 1) * ALIGN for i in range(len(lat))]

    def entries(ns):
        for b, latents, c in zip(bounds, lat, ck):
            h = hashes[b // UNIT - 1]
            parent = hashes[(b - ALIGN) // UNIT - 1] if b > ALIGN else None
            q, k, v = c.conv.chunk(3, dim=1)
            yield ns, h, parent, "kv", b, {"latents": latents}
            yield ns, h, parent, "kda", b, {"recurrent": c.recurrent, "conv.q": q, "conv.k": k, "conv.v": v}

    def run(rep):
        ns = hashlib.sha256(f"{ns_prefix}/{rep}/{time.time_ns()}".encode()).digest()
        t = time.perf_counter()
        comps, manifests = [], []
        for e_ns, h, parent, group, b, tensors in entries(ns):
            c, m = encode_entry(e_ns, h, parent, group, b, ALIGN, tensors)
            comps += c
            manifests.append(m)
        assert all(store.put(comps)) and all(store.put(manifests))
        save = time.perf_counter() - t
        del comps
        t = time.perf_counter()
        mkeys = [m[0] for m in manifests]
        blobs = store.get(mkeys)
        listed = []
        for (e_ns, h, parent, group, b, _), blob in zip(entries(ns), blobs):
            expected = getattr(shapes, group)
            extra = ({n: entry_key(e_ns, h, group, n) for n in expected},) if _DECODE_TAKES_KEYS else ()
            listed += decode_manifest(blob, group, b, expected, *extra)
        buf = np.empty(sum(c.nbytes for c in listed), dtype=np.uint8)
        views, off = [], 0
        for c in listed:
            views.append(memoryview(buf[off:off + c.nbytes]))
            off += c.nbytes
        got = store.get_into([c.key for c in listed], views)
        out = []
        for c, v, n in zip(listed, views, got):
            assert n == c.nbytes and hashlib.sha256(v).hexdigest() == c.sha256
            out.append(torch.frombuffer(v, dtype=torch.float32).reshape(c.shape))
        load = time.perf_counter() - t
        if rep == 0:
            assert torch.equal(out[0], lat[0]) and torch.equal(out[1], ck[0].recurrent)
        store.remove([c.key for c in listed] + mkeys)
        return save, load, None
    return run


def fast_path(store, ns_prefix, hashes, lat, ck):
    """PROTOTYPE, further: as :func:`batched_path`, and also zero-copy puts (memoryviews of the
    tensors, no ``tobytes``) and an xxh3-128 checksum instead of SHA-256 (needs the ``xxhash``
    package; manifests are JSON like ABI v1 but with an ``xxh3_128`` field, so not ABI-compatible)."""
    import xxhash

    bounds = [(i + 1) * ALIGN for i in range(len(lat))]

    def objects(ns):
        for b, latents, c in zip(bounds, lat, ck):
            h = hashes[b // UNIT - 1]
            q, k, v = (x.contiguous() for x in c.conv.chunk(3, dim=1))
            for group, tensors in (("kv", {"latents": latents}),
                                   ("kda", {"recurrent": c.recurrent, "conv.q": q, "conv.k": k, "conv.v": v})):
                yield entry_key(ns, h, group, "manifest"), [
                    (entry_key(ns, h, group, name), memoryview(t.numpy()).cast("B"), tuple(t.shape))
                    for name, t in tensors.items()]

    def run(rep):
        ns = hashlib.sha256(f"{ns_prefix}/{rep}/{time.time_ns()}".encode()).digest()
        t = time.perf_counter()
        comps, manifests = [], []
        for mkey, parts in objects(ns):
            listing = []
            for key, view, shape in parts:
                comps.append((key, view))
                listing.append({"key": key, "nbytes": view.nbytes, "shape": list(shape),
                                "xxh3_128": xxhash.xxh3_128_hexdigest(view)})
            manifests.append((mkey, json.dumps({"components": listing}).encode()))
        assert all(store.put(comps)) and all(store.put(manifests))
        save = time.perf_counter() - t
        t = time.perf_counter()
        mkeys = [m[0] for m in manifests]
        listed = [c for blob in store.get(mkeys) for c in json.loads(blob)["components"]]
        buf = np.empty(sum(c["nbytes"] for c in listed), dtype=np.uint8)
        views, off = [], 0
        for c in listed:
            views.append(memoryview(buf[off:off + c["nbytes"]]))
            off += c["nbytes"]
        got = store.get_into([c["key"] for c in listed], views)
        out = []
        for c, v, n in zip(listed, views, got):
            assert n == c["nbytes"] and xxhash.xxh3_128_hexdigest(v) == c["xxh3_128"]
            out.append(torch.frombuffer(v, dtype=torch.float32).reshape(c["shape"]))
        load = time.perf_counter() - t
        if rep == 0:
            assert torch.equal(out[0], lat[0]) and torch.equal(out[1], ck[0].recurrent)
        store.remove([c["key"] for c in listed] + mkeys)
        return save, load, None
    return run


def profile_path(name, store, backend, hashes, lat, ck) -> str:
    """cProfile text (top 14 by tottime) of one save+load pass."""
    ns = hashlib.sha256(f"bench_store/{name}/profile/{time.time_ns()}".encode()).digest()
    tier = tier_for(store, backend, ns, UNIT, ALIGN, name=name)
    pr = cProfile.Profile()
    pr.enable()
    tier_pass(tier, hashes, lat, ck, check=False)
    pr.disable()
    drop(tier, hashes, len(lat))
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
    return buf.getvalue()


def drop(tier, hashes, entries):
    for i in range(entries):
        for group in ("kv", "kda"):
            tier.invalidate(hashes, (i + 1) * ALIGN, group)


def copy_paths(tensors):
    """In-process copies of every component: ``torch clone`` (save: clone; load: clone of the clones;
    fresh memory, like a store that keeps what it saved), ``bytes copy`` (save: bytes of each buffer;
    load: bytes of those bytes) and ``torch copy_`` into preallocated tensors (memcpy, no page faults)."""
    views = [memoryview(t.numpy()).cast("B") for t in tensors]

    def clone(rep):
        t = time.perf_counter()
        a = [x.clone() for x in tensors]
        t1 = time.perf_counter()
        b = [x.clone() for x in a]
        t2 = time.perf_counter()
        del a, b
        return t1 - t, t2 - t1, None

    def copy(rep):
        t = time.perf_counter()
        a = [bytes(v) for v in views]
        t1 = time.perf_counter()
        b = [bytes(memoryview(x)) for x in a]
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

    return {"torch clone": clone, "bytes copy": copy, "torch copy_ (preallocated)": copy_into}


def bench_primitives(tensors, repeats) -> dict[str, float]:
    """Median seconds over all components of the per-byte steps the tier performs."""
    blobs = [tensor_bytes(t) for t in tensors]
    meta = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
    steps = {
        "tensor_bytes (numpy tobytes copy)": lambda: [tensor_bytes(t) for t in tensors],
        "sha256 hexdigest": lambda: [hashlib.sha256(b).hexdigest() for b in blobs],
        "bytes_tensor (frombuffer + copy)": lambda: [bytes_tensor(b, d, s) for b, (d, s) in zip(blobs, meta)],
        "torch.frombuffer (no copy)": lambda: [torch.frombuffer(b, dtype=torch.uint8) for b in blobs],
        "zlib.crc32 (stdlib)": lambda: [zlib.crc32(b) for b in blobs],
    }
    try:                                             # only if installed; not a project dependency
        import xxhash
        steps["xxhash.xxh3_128 (not installed by default)"] = lambda: [xxhash.xxh3_128_hexdigest(b) for b in blobs]
    except ImportError:
        pass
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


class RawMooncake:
    """Raw zero-copy calls of one Mooncake client on buffers registered once, same objects as the tier writes."""

    def __init__(self, master: str, tensors, entries: int) -> None:
        from hybridkv.store.mooncake import load_client_class

        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.src = np.empty(sum(self.sizes), dtype=np.uint8)
        for t, o, n in zip(tensors, self.offsets, self.sizes):
            self.src[o:o + n] = np.frombuffer(t.numpy().tobytes(), dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        self.small = np.zeros(1024, dtype=np.uint8)
        self.client = load_client_class()()
        if self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) != 0:
            raise RuntimeError("raw mooncake client setup failed")
        for a in (self.src, self.dst, self.small):
            self.client.register_buffer(a.ctypes.data, a.nbytes)
        per = len(tensors) // entries          # objects per boundary: kv latents + 4 kda parts
        self.batches = {
            "raw mooncake, one batch": [list(range(len(tensors)))],
            "raw mooncake, per entry": [b for i in range(entries)
                                        for b in ([i * per], list(range(i * per + 1, (i + 1) * per)))],
        }

    def path(self, label):
        batches = self.batches[label]
        c, src, dst, off, sizes = self.client, self.src, self.dst, self.offsets, self.sizes

        def run(rep):
            keys = [f"bench_store/raw/{rep}/{time.time_ns()}/{i}" for i in range(len(sizes))]
            t = time.perf_counter()
            for b in batches:
                codes = c.batch_put_from([keys[i] for i in b], [src.ctypes.data + int(off[i]) for i in b],
                                         [sizes[i] for i in b])
                assert all(x == 0 for x in codes), codes
            tp = time.perf_counter() - t
            dst[:] = 0
            t = time.perf_counter()
            for b in batches:
                codes = c.batch_get_into([keys[i] for i in b], [dst.ctypes.data + int(off[i]) for i in b],
                                         [sizes[i] for i in b])
                assert codes == [sizes[i] for i in b], codes
            tg = time.perf_counter() - t
            assert np.array_equal(src, dst)
            c.batch_remove(keys, True)
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
    p.add_argument("--backends", default="memory,disk,mooncake")
    p.add_argument("--profile", action="store_true", help="cProfile one save+load pass per backend")
    p.add_argument("--prototype", action="store_true",
                   help="also run prototypes of the proposed fix (rows marked *; the +xxh3 rows need xxhash)")
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
            env.setdefault("GLOG_minloglevel", "1")      # Mooncake's INFO lines
            if LOOPBACK_SHIM_NAME in env.get("LD_PRELOAD", ""):
                os.execve(sys.executable, [sys.executable, *sys.argv], env)

    torch.set_num_threads(1)
    model = HybridModel.from_preset("small", seed=0)
    backend = TorchBackend(model, 8, ALIGN)
    lat, ck, tokens = make_data(model, args.entries)
    hashes = chained_block_hashes(b"bench_store", tokens, UNIT)
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
            from hybridkv.store.mooncake import MooncakeStore
            port, metrics_port = service.find_free_ports(2)
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
        shapes = tier_for(MemoryStore(), backend, b"", UNIT, ALIGN).shapes
        for name, store in stores:
            paths[name] = tier_path(name, store, backend, hashes, lat, ck)
            paths[f"{name} save_entries"] = tier_batched_path(name, store, backend, hashes, lat, ck)
        if args.prototype:
            for name, store in stores:
                paths[f"{name} batched*"] = batched_path(store, f"bench_store/{name}/batched", hashes, lat, ck,
                                                         shapes)
            if importlib.util.find_spec("xxhash") is not None:
                for name, store in stores:
                    paths[f"{name} batched+xxh3*"] = fast_path(store, f"bench_store/{name}/fast", hashes, lat, ck)
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
            for name, store in stores:
                profiles[name] = profile_path(name, store, backend, hashes, lat, ck)

    results: dict[str, dict] = {}
    refs = [r for r in ("torch clone", "raw mooncake, one batch", "raw mooncake, per entry") if r in times]
    for name in names:
        runs = times[name]
        r = {"save_gbps": payload / statistics.median(x[0] for x in runs) / 1e9,
             "load_gbps": payload / statistics.median(x[1] for x in runs) / 1e9,
             "save_s": [x[0] for x in runs], "load_s": [x[1] for x in runs]}
        for ref in refs:    # median over repeats of (ref seconds / path seconds) = throughput ratio
            r[f"save_vs_{ref}"] = statistics.median(b[0] / a[0] for a, b in zip(runs, times[ref]))
            r[f"load_vs_{ref}"] = statistics.median(b[1] / a[1] for a, b in zip(runs, times[ref]))
        if runs[0][2] is not None:
            r["split_s"] = {k: statistics.median(x[2][k] for x in runs) for k in runs[0][2]}
        results[name] = r

    print(f"{args.entries} entries x (kv {lat[0].numel() * 4} B + kda "
          f"{ck[0].nbytes} B) = {payload / 1e6:.1f} MB payload, {args.repeats} interleaved repeats (medians), "
          f"{os.cpu_count()} CPUs, torch threads 1")
    short = {"torch clone": "clone", "raw mooncake, one batch": "raw", "raw mooncake, per entry": "rawE"}
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
    if args.prototype:
        print("* prototypes of the proposed fix in this script, not the library path: 'batched' = ABI v1 "
              "objects, one put/get per pass, loads into one buffer without extra copies; '+xxh3' = also "
              "zero-copy puts and xxh3-128 instead of SHA-256")
    print("\nper-byte steps of the tier, over the same components (median):")
    for k, v in prims.items():
        print(f"  {k:<36}{1e3 * v['s']:8.2f} ms {v['gbps']:8.3f} GB/s")
    if latency:
        print("raw Mooncake per-call latency, one 1 KiB object (median of 40): "
              + ", ".join(f"{k} {1e6 * v:.0f} us" for k, v in latency.items()))
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
                       "mooncake_call_latency_s": latency,
                       "profiles": profiles}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
