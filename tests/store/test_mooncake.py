"""MooncakeStore and the loopback store service against a real mooncake_master (DESIGN §5, §11).

Every master here binds 127.0.0.1 on free ports; every process is stopped by
PID. Skipped only when the mooncake package cannot be imported.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from mooncake_helpers import MiB, require_mooncake, start

from hybridkv.store.base import StoreUnavailable
from hybridkv.store.mooncake.client import MooncakeStore

require_mooncake(allow_module_level=True)

from hybridkv.store.mooncake import loopback, procs, service

FAST_S = 6.0  # "a few seconds": Mooncake's own RPC timeout against a dead master is ~4.5 s


@pytest.fixture(scope="module")
def store_service(tmp_path_factory):
    handle = start(tmp_path_factory, segment_mb=64)
    yield handle
    service.stop_store(handle.workdir)


@pytest.fixture(scope="module")
def store(store_service):
    with MooncakeStore(store_service.master) as s:
        yield s


@pytest.fixture
def ns():
    """A key prefix of its own for each test."""
    return f"t/{uuid.uuid4().hex[:8]}/"


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# ------------------------------------------------------------------ contract


def test_put_get_exists_remove_roundtrip(store, ns):
    a, b = payload(1000, 1), payload(200_000, 2)
    assert store.put([(ns + "a", a), (ns + "b", bytearray(b))]) == [True, True]
    assert store.exists([ns + "a", ns + "b", ns + "missing"]) == [True, True, False]
    assert store.get([ns + "b", ns + "a"]) == [b, a]
    store.remove([ns + "a", ns + "missing"])
    assert store.exists([ns + "a", ns + "b"]) == [False, True]
    assert store.get([ns + "a"]) == [None]


def test_put_never_overwrites(store, ns):
    first, second = payload(4096, 3), payload(4096, 4)
    assert store.put([(ns + "k", first)]) == [True]
    assert store.put([(ns + "k", second)]) == [True]
    assert store.put([(ns + "j", first), (ns + "j", second)]) == [True, True]  # first wins inside a batch too
    assert store.get([ns + "k", ns + "j"]) == [first, first]


def test_missing_key_is_none_and_minus_one(store, ns):
    assert store.get([ns + "nope"]) == [None]
    assert store.get_into([ns + "nope"], [memoryview(bytearray(16))]) == [-1]
    assert store.exists([]) == [] and store.get([]) == [] and store.put([]) == []


def test_duplicate_key_in_one_batch_fills_every_destination(store, ns):
    data = payload(3 * MiB, 5)
    store.put([(ns + "dup", data)])
    assert store.get([ns + "dup", ns + "x", ns + "dup"]) == [data, None, data]
    bufs = [np.zeros(4 * MiB, np.uint8) for _ in range(3)]
    small = np.zeros(16, np.uint8)
    got = store.get_into([ns + "dup", ns + "dup", ns + "dup", ns + "dup"],
                         [memoryview(bufs[0]), memoryview(bufs[1]), memoryview(small), memoryview(bufs[2])])
    assert got == [len(data), len(data), -1, len(data)]
    for buf in bufs:
        assert buf[: len(data)].tobytes() == data


def test_get_into_reads_into_caller_memory(store, ns):
    src = np.random.default_rng(6).integers(0, 256, (8, MiB), dtype=np.uint8)
    items = [(ns + f"row{i}", memoryview(src[i])) for i in range(8)]  # zero-copy put from caller memory
    assert store.put(items) == [True] * 8
    dst = np.zeros((8, MiB), np.uint8)
    assert store.get_into([k for k, _ in items], [memoryview(dst[i]) for i in range(8)]) == [MiB] * 8
    assert np.array_equal(src, dst)
    too_small = np.zeros(MiB - 1, np.uint8)
    assert store.get_into([ns + "row0"], [memoryview(too_small)]) == [-1]


def test_non_contiguous_and_registered_buffers(store, ns):
    grid = np.arange(64 * 64, dtype=np.uint8).reshape(64, 64)
    column = memoryview(grid[:, 3])  # strided: copied before the put
    assert store.put([(ns + "col", column)]) == [True]
    assert store.get([ns + "col"]) == [grid[:, 3].tobytes()]
    pool = np.zeros(2 * MiB, np.uint8)
    store.register_memory(memoryview(pool))
    assert store.get_into([ns + "col"], [memoryview(pool[MiB:])]) == [64]
    assert pool[MiB:MiB + 64].tobytes() == grid[:, 3].tobytes()
    with pytest.raises(ValueError):
        store.get_into([ns + "col"], [memoryview(b"read-only")])


def test_empty_object_is_a_bug(store, ns):
    with pytest.raises(ValueError, match="empty"):
        store.put([(ns + "empty", b"")])


# ------------------------------------------------------------------ processes

CLIENT = r"""
import sys, time
from hybridkv.store.mooncake.client import MooncakeStore
master, key, fill, go_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
store = MooncakeStore(master)
data = bytes([fill]) * (2 << 20)
while time.time() < go_at:
    pass
print(store.put([(key, data)])[0], flush=True)
store.close()
"""


def run_clients(handle: service.StoreHandle, key: str, fills: list[int], delay_s: float) -> list[str]:
    """Run one client process per fill byte; each puts 2 MiB of it under ``key`` at the same moment."""
    go_at = time.time() + delay_s
    env = loopback.loopback_env(cache_dir=handle.workdir)
    master = handle.master
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, master, key, str(f), str(go_at)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for f in fills]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        outs.append(out.strip())
    return outs


def test_two_processes_put_the_same_key_at_once(store_service, store, ns):
    key = ns + "race"
    assert run_clients(store_service, key, [0x11, 0x22], delay_s=2.5) == ["True", "True"]
    got = store.get([key])[0]
    assert got in (bytes([0x11]) * (2 << 20), bytes([0x22]) * (2 << 20))


def test_objects_outlive_the_client_that_wrote_them(store_service, store, ns):
    run_clients(store_service, ns + "left", [0x33], delay_s=0.0)
    assert store.get([ns + "left"]) == [bytes([0x33]) * (2 << 20)]


def test_master_and_storage_process_listen_on_loopback_only(store_service):
    if loopback.loopback_shim(store_service.workdir) is None:
        pytest.skip("no C compiler to build the loopback LD_PRELOAD library")
    for pid in (store_service.master_pid, store_service.storage_pid):
        addrs = loopback.listen_addresses(pid)
        assert addrs and all(loopback.is_loopback(a) for a, _ in addrs), (pid, addrs)


# ------------------------------------------------------------------ faults


def test_master_absent_at_setup_fails_fast():
    (port,) = procs.find_free_ports(1)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="not accepting"):
        MooncakeStore(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 3.0


def test_master_killed_then_restarted(tmp_path_factory):
    handle = start(tmp_path_factory, segment_mb=32)
    try:
        store = MooncakeStore(handle.master, retry_interval_s=0.5)
        other = MooncakeStore(handle.master)
        assert store.put([("before", b"x" * 1000)]) == [True]
        service.kill_master(handle.workdir)
        t0 = time.monotonic()
        other.close()  # would block 10-20 s in Mooncake; the client is set aside instead
        assert time.monotonic() - t0 < 2.0 and other.stats.abandoned_clients == 1
        buf = memoryview(bytearray(1000))
        calls = [lambda: store.exists(["before"]), lambda: store.get(["before"]),
                 lambda: store.put([("during", b"y" * 1000)]), lambda: store.get_into(["before"], [buf]),
                 lambda: store.remove(["before"])]
        for call in calls:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                call()
            assert time.monotonic() - t0 < FAST_S
        service.restart_master(handle.workdir)
        deadline = time.monotonic() + 15
        while True:
            try:
                if store.put([("after", b"z" * 1000)]) == [True]:
                    break
            except StoreUnavailable:
                pass
            assert time.monotonic() < deadline, "store did not recover after the master restart"
            time.sleep(0.25)
        assert store.get(["after", "before"]) == [b"z" * 1000, None]  # the dead master forgot "before"
        assert store.stats.rpc_failures >= 1
        store.close()
    finally:
        service.stop_store(handle.workdir)


class _FailingClient:
    """Fault injection: a Mooncake client whose is_exist always answers RPC failure (-900)."""

    def __init__(self, inner):
        self.inner = inner

    def batch_is_exist(self, keys):
        return [-900] * len(keys)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_client_that_keeps_failing_while_master_answers_is_replaced(store_service):
    store = MooncakeStore(store_service.master, retry_interval_s=0.0)
    store._client = _FailingClient(store._client)
    for _ in range(2):
        with pytest.raises(StoreUnavailable, match="-900"):
            store.exists(["t/k"])
    assert store.exists(["t/k"]) == [False]  # third call: a new client
    assert (store.stats.rpc_failures, store.stats.reconnects, store.stats.abandoned_clients) == (2, 1, 1)
    store.close()


def test_silent_eviction_in_a_full_segment(tmp_path_factory):
    handle = start(tmp_path_factory, segment_mb=16)
    try:
        with MooncakeStore(handle.master) as store:
            keys = [f"ev/{i}" for i in range(40)]
            stored = [store.put([(k, bytes([i]) * MiB)])[0] for i, k in enumerate(keys)]
            assert sum(stored) > 16  # more than fits: room was made by evicting
            present = store.exists(keys)
            assert not all(present[:8])  # the oldest are gone, without any error
            assert present[-1] and store.get([keys[-1]]) == [bytes([39]) * MiB]
            gone = [k for k, p in zip(keys, present) if not p]
            assert store.get(gone) == [None] * len(gone)
    finally:
        service.stop_store(handle.workdir)


def test_expiry_horizons_are_pinned_against_eviction(tmp_path_factory):
    """A horizon (raised as a purge by age raises it) is hard-pinned: the master's eviction under
    memory pressure removes an unpinned object of the same size put after it, never the horizon."""
    from hybridkv.tiers.purge import raise_horizon, read_horizon

    handle = start(tmp_path_factory, segment_mb=16)
    try:
        with MooncakeStore(handle.master) as store:
            cutoff = time.time()
            assert raise_horizon(store, None, None, cutoff) >= cutoff
            store.put([("plain/h", b"%.3f" % cutoff)])
            keys = [f"ev/{i}" for i in range(40)]
            stored = [store.put([(k, bytes([i]) * MiB)])[0] for i, k in enumerate(keys)]
            assert sum(stored) > 16 and not all(store.exists(keys[:8]))   # eviction ran
            assert store.exists(["plain/h"]) == [False]
            assert read_horizon(store, None, None) >= cutoff
    finally:
        service.stop_store(handle.workdir)


def test_cli_start_status_stop(tmp_path, capsys):
    port, metrics_port = procs.find_free_ports(2)
    argv = ["--port", str(port), "--metrics-port", str(metrics_port), "--segment-mb", "16", "--workdir", str(tmp_path)]
    try:
        assert service.main(["store", "start", *argv]) == 0
        assert f"mooncake://127.0.0.1:{port}" in capsys.readouterr().out
        assert service.main(["store", "start", *argv]) == 2  # already running
        assert "already running" in capsys.readouterr().err
        assert service.main(["store", "status", *argv]) == 0
        assert "running" in capsys.readouterr().out
    finally:
        assert service.main(["store", "stop", *argv]) == 0
    assert service.main(["store", "status", *argv]) == 1
    assert service.main(["store", "start", *argv[:4], "--segment-mb", "8"]) == 2


def test_start_after_the_master_died_replaces_what_is_left(tmp_path_factory):
    """`status` says a store whose master died is not running; `start` agrees and starts afresh
    (before: "a store is already running ... stop it first")."""
    handle = start(tmp_path_factory, segment_mb=32)
    try:
        service.kill_master(handle.workdir)
        assert service.status(handle.workdir)["running"] is False
        port, metrics_port = procs.find_free_ports(2)
        fresh = service.start_store(port, metrics_port, 32 * MiB, handle.workdir)
        assert service.status(handle.workdir)["running"] is True
        assert not procs.alive(handle.storage_pid)                 # the orphan storage process is gone
        assert fresh.master_pid != handle.master_pid
    finally:
        service.stop_store(handle.workdir)


def test_replay_sends_mooncakes_own_log_to_a_file_and_says_where(store_service, tmp_path):
    """Before: 68 lines of Mooncake's native log on stderr buried hybridkv's own warnings. The CLI
    now sends them to a file, names it once, and keeps Python's messages on stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_MOONCAKE_LOG"}
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "replay", "--model", "tiny", "--limit", "2",
                          "--no-progress", "--store", f"mooncake://{store_service.master}"],
                         env=env, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    logs = list(tmp_path.glob("hybridkv-mooncake-*.log"))
    assert len(logs) == 1 and f"Mooncake's own log: {logs[0]}" in out.stderr
    native = [ln for ln in out.stderr.splitlines() if ln[:1] in "IWEF" and ln[1:5].isdigit()]
    assert native == [], native[:5]                                    # glog lines: I1201 03:00:10 ...
    assert sum(1 for ln in logs[0].read_text().splitlines() if ln[:1] in "IWEF" and ln[1:5].isdigit()) >= 5


def test_remove_prefix_removes_a_namespace_without_listing(store, ns):
    """Mooncake cannot list keys; a purge of a whole namespace still works (remove_by_regex):
    manifests first, then the rest; other namespaces and near-miss keys stay."""
    other = ns[:-1] + "x/"                                   # shares every character but the last
    keys = [ns + "e1/manifest", ns + "e1/kv.0", ns + "e2/manifest", ns + "e2.kv", other + "e1/manifest"]
    assert store.put([(k, payload(64, i)) for i, k in enumerate(keys)]) == [True] * 5
    assert store.remove_prefix(ns, "/manifest") == 2
    assert store.exists(keys) == [False, True, False, True, True]
    assert store.remove_prefix(ns) == 2
    assert store.exists(keys) == [False, False, False, False, True]
    with pytest.raises(ValueError, match=r"'\*'"):
        store.remove_prefix(ns + "*")


def test_remove_prefix_with_a_wildcard_segment(store, ns):
    """``a/*/b/``: one owner's entries under every model, in one remove_by_regex; a wildcard
    never spans a '/', and '*' is refused anywhere but as a whole segment."""
    keys = [ns + "m1/o1/e/manifest", ns + "m2/o1/e/manifest", ns + "m1/o2/e/manifest", ns + "m1/x/o1/e/manifest",
            ns + "m1/o1/e/latents"]
    assert store.put([(k, payload(64, i)) for i, k in enumerate(keys)]) == [True] * 5
    assert store.remove_prefix(ns + "*/o1/", "/manifest") == 2
    assert store.exists(keys) == [False, False, True, True, True]
    assert store.remove_prefix(ns + "*/o1/") == 1
    assert store.exists(keys) == [False, False, True, True, False]
    for bad in (ns + "m*/o1/", "*/" + ns):
        with pytest.raises(ValueError):
            store.remove_prefix(bad)


# ------------------------------------------------------------------ per-owner quotas (put_owned)

OWNER_A, OWNER_B = "aa" * 32, "bb" * 32


def entry(ns, tag, i, comp_bytes=1000, manifest_bytes=100):
    """One entry's objects: a component and its manifest (keys share everything up to the last '/')."""
    return [(f"{ns}{tag}/e{i}/g/r0/c0", b"c" * comp_bytes), (f"{ns}{tag}/e{i}/g/r0/manifest", b"m" * manifest_bytes)]


def test_a_flood_over_the_quota_evicts_only_the_flooders_own_oldest_entries_whole(store_service, store, ns):
    with MooncakeStore(store_service.master, quota_bytes=10_000) as quota:
        for i in range(2):
            assert quota.put_owned(entry(ns, "B", i), OWNER_B) == [True, True]
        b_bytes = quota.owner_bytes(OWNER_B)
        for i in range(20):
            assert quota.put_owned(entry(ns, "A", i), bytes.fromhex(OWNER_A)) == [True, True]  # bytes owner too
        quota.check_ledger()
        assert b_bytes == 2200 and quota.owner_bytes(OWNER_B) == b_bytes
        assert quota.owner_bytes(OWNER_A) == 9 * 1100 and quota.quota_evictions == 11
    # read back through another client: B whole, A's 9 newest whole, A's 11 oldest gone whole
    assert all(store.exists([k for i in range(2) for k, _ in entry(ns, "B", i)]))
    assert all(store.exists([k for i in range(11, 20) for k, _ in entry(ns, "A", i)]))
    assert not any(store.exists([k for i in range(11) for k, _ in entry(ns, "A", i)]))


def test_reads_refresh_an_entry_and_keys_found_absent_leave_the_ledger(store_service, store, ns):
    with MooncakeStore(store_service.master, quota_bytes=3300) as quota:
        for i in range(3):
            quota.put_owned(entry(ns, "A", i), OWNER_A)
        assert quota.get([entry(ns, "A", 0)[0][0]]) == [b"c" * 1000]            # e0 is now the most recent
        quota.put_owned(entry(ns, "A", 3), OWNER_A)
        assert store.exists([entry(ns, "A", 0)[1][0], entry(ns, "A", 1)[1][0]]) == [True, False]  # e1 went
        # another process removes e2 (as Mooncake's own eviction would): this process finds it absent
        store.remove([k for k, _ in entry(ns, "A", 2)])
        assert quota.owner_bytes(OWNER_A) == 3300
        assert quota.exists([entry(ns, "A", 2)[1][0]]) == [False]
        assert quota.owner_bytes(OWNER_A) == 3200                                 # manifest dropped
        buf = memoryview(bytearray(2000))
        assert quota.get_into([entry(ns, "A", 2)[0][0]], [buf]) == [-1]
        assert quota.owner_bytes(OWNER_A) == 2200                                 # component dropped
        assert quota.put_owned(entry(ns, "A", 4), OWNER_A) == [True, True]        # fits: nothing evicted
        assert quota.quota_evictions == 1 and all(store.exists([k for k, _ in entry(ns, "A", 0)]))
        assert quota.remove_prefix(f"{ns}A/") == 6 and quota.owner_bytes(OWNER_A) == 0
        quota.check_ledger()


def test_an_entry_larger_than_the_quota_is_refused_not_published_without_its_components(store_service, store, ns):
    """Three 400-byte components and a manifest under a 1000-byte quota: the third component and the
    manifest are refused, so no reader sees a manifest naming a component that is not there."""
    with MooncakeStore(store_service.master, quota_bytes=1000) as quota:
        comps = [(f"{ns}e1/g/r0/c{i}", b"x" * 400) for i in range(3)]
        assert quota.put_owned(comps, OWNER_A) == [True, True, False]
        assert quota.put_owned([(f"{ns}e1/g/r0/manifest", b"m" * 50)], OWNER_A) == [False]
        assert quota.put_owned([(f"{ns}big/g/r0/c0", b"x" * 1001)], OWNER_A) == [False]   # one object over it
        assert store.exists([f"{ns}e1/g/r0/manifest", comps[0][0], comps[2][0]]) == [False, True, False]
        # the owner's next entry evicts the refused entry's leftovers, whole
        assert quota.put_owned([(f"{ns}e2/g/r0/c0", b"y" * 400), (f"{ns}e2/g/r0/manifest", b"m" * 50)],
                               OWNER_A) == [True, True]
        assert store.exists([k for k, _ in comps[:2]]) == [False, False]
        assert quota.quota_refused == 3
        quota.check_ledger()


def test_a_manifest_is_refused_once_its_entrys_components_were_evicted(store_service, store, ns):
    """Two entries' components in one put (as the store tier batches them) under a quota that holds
    one entry: the first entry's components are refused (the second's evicted them before anything
    was put), and so is its manifest; the second entry is complete."""
    with MooncakeStore(store_service.master, quota_bytes=1000) as quota:
        comps = [(f"{ns}e{e}/g/r0/c{i}", b"x" * 300) for e in (1, 2) for i in range(2)]
        assert quota.put_owned(comps, OWNER_A) == [False, False, True, True]
        manifests = [(f"{ns}e{e}/g/r0/manifest", b"m" * 20) for e in (1, 2)]
        assert quota.put_owned(manifests, OWNER_A) == [False, True]
        assert store.exists([k for k, _ in comps]) == [False, False, True, True]
        assert store.exists([k for k, _ in manifests]) == [False, True]
        quota.check_ledger()


def test_bad_quota_values_and_owners_are_refused_by_name(store_service):
    for bad in ("abc", "0", "-5", "1.5", 0, True):
        with pytest.raises(ValueError, match=f"quota_bytes={bad!r}"):
            MooncakeStore(store_service.master, quota_bytes=bad)
    with MooncakeStore(store_service.master, quota_bytes=1000) as quota:
        with pytest.raises(ValueError, match="owner must be a digest") as err:
            quota.put_owned([("t/k", b"x")], "a/b")
        assert "a/b" not in str(err.value)   # owners are tenant digests: never echoed


def test_objects_mooncake_evicted_on_its_own_are_not_charged_once_looked_at(tmp_path_factory):
    """A 16 MiB segment filled with 40 one-MiB owned entries through a 64 MiB quota: Mooncake's own
    eviction removes the oldest; an existence query drops them from the ledger, so the owner is
    charged only for what is still there."""
    handle = start(tmp_path_factory, segment_mb=16)
    try:
        with MooncakeStore(handle.master, quota_bytes=64 * MiB) as quota:
            keys = [f"ev/e{i}/g/r0/c0" for i in range(40)]
            stored = [quota.put_owned([(k, bytes([i]) * MiB)], OWNER_A)[0] for i, k in enumerate(keys)]
            charged = quota.owner_bytes(OWNER_A)
            assert charged == sum(stored) * MiB
            present = quota.exists(keys)
            assert not all(present)                                              # eviction ran
            assert quota.owner_bytes(OWNER_A) == sum(present) * MiB < charged
            quota.check_ledger()
    finally:
        service.stop_store(handle.workdir)
