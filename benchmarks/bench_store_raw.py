"""Mooncake Store throughput: raw zero-copy calls vs MooncakeStore vs an in-process memcpy.

Run by hand (not part of the test suite)::

    python benchmarks/bench_store_raw.py                    # 64 objects of 4 MiB, 3 repeats
    python benchmarks/bench_store_raw.py --objects 16 --object-mb 16 --json out.json

Starts its own loopback store (master + storage process on free ports), then
moves the same bytes four ways, each repeated ``--repeats`` times with fresh
keys, and prints the median GB/s (1 GB = 1e9 bytes) and the ratios:

* ``raw``: ``batch_put_from`` / ``batch_get_into`` of one Mooncake client on
  registered memory (the floor of what the backend can do);
* ``MooncakeStore.put`` / ``get_into`` on views of the same arrays;
* ``MooncakeStore.get`` (bytes objects: one extra copy);
* ``raw, segment in this process``: the raw calls against a bare master whose
  only segment is mounted by the benchmark's own client (Mooncake then copies
  with memcpy instead of TCP);
* ``memcpy``: ``numpy.copyto`` of the whole array in this process.

In the first three the bytes live in the storage process, so every put and
get crosses a loopback TCP connection. The script re-executes itself once under
:func:`hybridkv.store.mooncake.loopback.loopback_env` so that its own Mooncake listeners
stay on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridkv.store.mooncake import loopback, procs, service
from hybridkv.store.mooncake.client import MooncakeStore
from hybridkv.store.mooncake.support import LOOPBACK_SHIM_NAME, load_client_class


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _raw_round(client, src: np.ndarray, dst: np.ndarray, prefix: str, times: dict[str, list[float]]) -> None:
    """One timed ``batch_put_from`` + ``batch_get_into`` of every row of ``src`` (into ``dst``), then remove."""
    objects, object_bytes = src.shape
    keys = [f"{prefix}/{i}" for i in range(objects)]
    sizes = [object_bytes] * objects
    t = time.perf_counter()
    codes = client.batch_put_from(keys, [src[i].ctypes.data for i in range(objects)], sizes)
    times["raw put"].append(time.perf_counter() - t)
    dst[:] = 0
    t = time.perf_counter()
    got = client.batch_get_into(keys, [dst[i].ctypes.data for i in range(objects)], sizes)
    times["raw get"].append(time.perf_counter() - t)
    assert codes == [0] * objects and got == sizes and np.array_equal(src, dst), (codes[:4], got[:4])
    client.batch_remove(keys, True)


def bench_local_segment(work: str, objects: int, object_bytes: int, repeats: int) -> tuple[float, float]:
    """(put, get) GB/s of the raw calls when this process mounts the only segment (after one warm-up round)."""
    port, metrics_port = procs.find_free_ports(2)
    master = procs.spawn_master(Path(work), port, metrics_port)
    try:
        procs.wait_for(lambda: any(p == port for _, p in loopback.listen_addresses(master.pid)), master,
                         Path(work) / "master.log", 30.0, "mooncake_master")
        src = np.random.default_rng(1).integers(0, 256, (objects, object_bytes), dtype=np.uint8)
        dst = np.zeros_like(src)
        client = load_client_class()()
        if client.setup("127.0.0.1", "P2PHANDSHAKE", 3 * src.nbytes, 0, "tcp", "", f"127.0.0.1:{port}") != 0:
            raise SystemExit("local-segment client setup failed")
        client.register_buffer(src.ctypes.data, src.nbytes)
        client.register_buffer(dst.ctypes.data, dst.nbytes)
        times: dict[str, list[float]] = {"raw put": [], "raw get": []}
        _raw_round(client, src, dst, "warmup", times)  # first touch of the segment's pages
        times = {"raw put": [], "raw get": []}
        for rep in range(repeats):
            _raw_round(client, src, dst, f"local/{rep}", times)
        client.unregister_buffer(src.ctypes.data)
        client.unregister_buffer(dst.ctypes.data)
        client.close()
    finally:
        master.terminate()
        master.wait(30)
    return _median_gbps(src.nbytes, times["raw put"]), _median_gbps(src.nbytes, times["raw get"])


def bench(master: str, objects: int, object_bytes: int, repeats: int) -> dict[str, tuple[float, float | None]]:
    """``{path: (put GB/s, get GB/s)}`` through the storage process, and the in-process memcpy."""
    total = objects * object_bytes
    src = np.random.default_rng(0).integers(0, 256, (objects, object_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    sizes = [object_bytes] * objects
    times: dict[str, list[float]] = {k: [] for k in ("raw put", "raw get", "store put", "store get_into",
                                                     "store get", "memcpy")}

    raw = load_client_class()()
    if raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) != 0:
        raise SystemExit("raw client setup failed")
    raw.register_buffer(src.ctypes.data, src.nbytes)
    raw.register_buffer(dst.ctypes.data, dst.nbytes)
    store = MooncakeStore(master)
    try:
        for rep in range(repeats):
            _raw_round(raw, src, dst, f"bench/raw/{rep}", times)

            keys = [f"bench/store/{rep}/{i}" for i in range(objects)]
            t = time.perf_counter()
            ok = store.put([(k, memoryview(src[i])) for i, k in enumerate(keys)])
            times["store put"].append(time.perf_counter() - t)
            dst[:] = 0
            t = time.perf_counter()
            got = store.get_into(keys, [memoryview(dst[i]) for i in range(objects)])
            times["store get_into"].append(time.perf_counter() - t)
            assert all(ok) and got == sizes and np.array_equal(src, dst)
            t = time.perf_counter()
            blobs = store.get(keys)
            times["store get"].append(time.perf_counter() - t)
            assert all(b == src[i].tobytes() for i, b in enumerate(blobs))
            del blobs
            store.remove(keys)

            t = time.perf_counter()
            np.copyto(dst, src)
            times["memcpy"].append(time.perf_counter() - t)
    finally:
        store.close()
        raw.unregister_buffer(src.ctypes.data)
        raw.unregister_buffer(dst.ctypes.data)
        raw.close()
    gbps = {k: _median_gbps(total, v) for k, v in times.items()}
    return {
        "raw": (gbps["raw put"], gbps["raw get"]),
        "MooncakeStore put/get_into": (gbps["store put"], gbps["store get_into"]),
        "MooncakeStore get (bytes)": (None, gbps["store get"]),
        "memcpy": (gbps["memcpy"], gbps["memcpy"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=64)
    p.add_argument("--object-mb", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", dest="json_path", help="write the figures here")
    args = p.parse_args(argv)
    if LOOPBACK_SHIM_NAME not in os.environ.get("LD_PRELOAD", ""):
        env = loopback.loopback_env()
        if LOOPBACK_SHIM_NAME in env.get("LD_PRELOAD", ""):
            os.execve(sys.executable, [sys.executable, *sys.argv], env)

    object_bytes = args.object_mb << 20
    total = args.objects * object_bytes
    segment = max(64 << 20, 3 * total)  # stays below the 90 % eviction watermark
    port, metrics_port = procs.find_free_ports(2)
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-") as work:
        handle = service.start_store(port, metrics_port, segment, work)
        try:
            results = bench(handle.master, args.objects, object_bytes, args.repeats)
        finally:
            service.stop_store(work)
        local = bench_local_segment(work, args.objects, object_bytes, args.repeats)
    results = {**{k: v for k, v in results.items() if k != "memcpy"}, "raw, segment in this process": local,
               "memcpy": results["memcpy"]}

    raw_put, raw_get = results["raw"]
    print(f"{args.objects} objects x {args.object_mb} MiB = {total / 1e6:.0f} MB, median of {args.repeats}, "
          f"{os.cpu_count()} CPUs, storage in another process (loopback TCP)")
    print(f"{'path':<30} {'put GB/s':>9} {'get GB/s':>9} {'put/raw':>8} {'get/raw':>8} {'get/memcpy':>11}")
    memcpy = results["memcpy"][1]
    for name, (put, get) in results.items():
        cells = [f"{put:9.2f}" if put else f"{'-':>9}", f"{get:9.2f}",
                 f"{put / raw_put:8.2f}" if put else f"{'-':>8}", f"{get / raw_get:8.2f}", f"{get / memcpy:11.3f}"]
        print(f"{name:<30} " + " ".join(cells))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"objects": args.objects, "object_bytes": object_bytes, "repeats": args.repeats,
                       "gbps": {k: {"put": v[0], "get": v[1]} for k, v in results.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
