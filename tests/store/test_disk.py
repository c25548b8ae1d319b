"""DiskStore: the ObjectStore contract on a directory, restart, LRU capacity, bad files, concurrency."""

import errno
import hashlib
import multiprocessing as mp
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from hybridkv.store import disk as disk_module
from hybridkv.store.base import DAMAGED, StoreUnavailable
from hybridkv.store.disk import DiskStore
from hybridkv.store.disk_files import encode_object, object_file_size


def object_path(root: Path, key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return root / digest[:2] / digest


def temp_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/.tmp.*"))


def test_roundtrip_and_layout(tmp_path):
    store = DiskStore(tmp_path / "s")
    assert store.put([("a", b"alpha"), ("b", bytearray(b"")), ("c", memoryview(b"xyz"))]) == [True] * 3
    assert store.get(["a", "b", "c"]) == [b"alpha", b"", b"xyz"]
    assert store.exists(["a", "b", "c", "d"]) == [True, True, True, False]
    path = object_path(tmp_path / "s", "a")
    assert path.read_bytes() == encode_object("a", b"alpha")
    assert path.read_bytes().startswith(b"HKVOBJ1\0")
    assert store.used_bytes == sum(object_file_size(k, n) for k, n in [("a", 5), ("b", 0), ("c", 3)])
    assert temp_files(tmp_path / "s") == []
    store.check_invariants()


def test_put_never_overwrites(tmp_path):
    store = DiskStore(tmp_path)
    assert store.put([("k", b"first")]) == [True]
    assert store.put([("k", b"second, longer")]) == [True]
    assert store.get(["k"]) == [b"first"]
    # Same key twice in one batch: the first wins there too.
    assert store.put([("j", b"one"), ("j", b"two")]) == [True, True]
    assert store.get(["j"]) == [b"one"]
    store.check_invariants()


def test_get_missing_and_duplicates(tmp_path):
    store = DiskStore(tmp_path)
    store.put([("x", b"xx")])
    assert store.get(["nope"]) == [None]
    assert store.get(["x", "nope", "x"]) == [b"xx", None, b"xx"]
    assert store.bad_objects == 0


def test_get_into(tmp_path):
    store = DiskStore(tmp_path)
    store.put([("a", b"hello"), ("b", b"0123456789"), ("e", b"")])
    bufs = [memoryview(bytearray(b"\xee" * 8)) for _ in range(4)]
    assert store.get_into(["a", "b", "missing", "e"], bufs) == [5, -1, -1, 0]
    assert bytes(bufs[0]) == b"hello" + b"\xee" * 3  # payload at the start, the rest untouched
    assert bytes(bufs[1]) == b"\xee" * 8  # too small: untouched
    assert bytes(bufs[2]) == b"\xee" * 8  # absent: untouched
    assert bytes(bufs[3]) == b"\xee" * 8  # empty object: nothing written
    exact = bytearray(10)
    assert store.get_into(["b"], [exact]) == [10] and exact == b"0123456789"
    assert store.get_into([], []) == []
    assert store.bad_objects == 0
    store.check_invariants()


def test_get_into_capacity_is_bytes_not_items(tmp_path):
    store = DiskStore(tmp_path)
    payload = bytes(range(12))
    store.put([("k", payload)])
    words = np.zeros(3, np.uint32)  # 3 items, 12 bytes
    assert store.get_into(["k"], [memoryview(words)]) == [12]
    assert words.tobytes() == payload
    assert store.get_into(["k"], [memoryview(np.zeros(2, np.uint32))]) == [-1]
    grid = np.zeros((3, 4), np.uint8)  # C-contiguous, 2-D
    assert store.get_into(["k"], [memoryview(grid)]) == [12]
    assert grid.tobytes() == payload


def test_get_into_repeated_key_fills_every_buffer(tmp_path):
    store = DiskStore(tmp_path)
    store.put([("d", b"dup-data"), ("x", b"x")])
    bufs = [bytearray(8), bytearray(16), bytearray(4), bytearray(1), bytearray(8)]
    got = store.get_into(["d", "d", "d", "x", "d"], [memoryview(b) for b in bufs])
    assert got == [8, 8, -1, 1, 8]
    assert bufs[0] == b"dup-data" and bufs[1][:8] == b"dup-data" and bufs[4] == b"dup-data"
    assert bufs[2] == bytes(4) and bufs[3] == b"x"


def test_get_into_touches_lru_like_get(tmp_path):
    one = object_file_size("a", 100)
    store = DiskStore(tmp_path, capacity_bytes=3 * one)
    store.put([(k, k.encode() * 100) for k in "abc"])
    buf = bytearray(100)
    assert store.get_into(["a"], [memoryview(buf)]) == [100]  # a is now most recent; b is the LRU
    assert store.get_into(["b"], [memoryview(bytearray(10))]) == [-1]  # too small: not a hit
    store.put([("d", b"d" * 100)])
    assert store.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    store.check_invariants()


def test_get_into_bad_files_are_absent(tmp_path):
    store = DiskStore(tmp_path)
    store.put([("t", b"payload" * 10), ("s", b"payload" * 10)])
    for key in "ts":
        path = object_path(tmp_path, key)
        path.write_bytes(path.read_bytes()[:-3])  # truncated payload
    object_path(tmp_path, "f").write_bytes(b"not an object at all, just some bytes")
    object_path(tmp_path, "dir").mkdir()
    bufs = [bytearray(b"\xee" * 128) for _ in range(3)]
    small = bytearray(4)  # the header is checked before the size: still counted bad
    assert store.exists(["t", "f", "s"]) == [True] * 3     # damaged files are there until a read drops them
    assert store.bad_objects == 0
    got = store.get_into(["t", "f", "dir", "s"], [memoryview(b) for b in bufs] + [memoryview(small)])
    assert got == [DAMAGED, DAMAGED, -1, DAMAGED]         # damaged, told apart from absent (a directory: no file)
    assert small == bytes(4)
    assert store.bad_objects == 4
    assert store.bad_reasons["foreign file (bad magic)"] == 1
    assert store.bad_reasons["not a regular file"] == 1
    assert sum(n for r, n in store.bad_reasons.items() if r.startswith("truncated payload")) == 2
    assert not object_path(tmp_path, "t").exists() and not object_path(tmp_path, "s").exists()
    assert store.put([("t", b"fresh")]) == [True]
    assert store.get_into(["t"], [memoryview(bufs[0])]) == [5] and bufs[0][:5] == b"fresh"
    store.check_invariants()


def test_get_into_read_error_is_a_bad_object(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    store.put([("k", b"value")])

    def failing_read(f, key_bytes, into):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_module, "read_payload", failing_read)
    assert store.get_into(["k"], [memoryview(bytearray(8))]) == [DAMAGED]
    assert store.bad_reasons["read error: Input/output error"] == 1
    monkeypatch.undo()
    assert store.get(["k"]) == [None]  # like get: an unreadable file is dropped
    store.check_invariants()


def test_get_into_rejects_unusable_buffers(tmp_path):
    store = DiskStore(tmp_path)
    store.put([("a", b"abc")])
    good = bytearray(8)
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        store.get_into(["a", "a"], [memoryview(good)])
    with pytest.raises(ValueError, match="writable"):
        store.get_into(["a", "a"], [memoryview(good), memoryview(b"read-only")])
    with pytest.raises(ValueError, match="contiguous"):
        store.get_into(["a"], [memoryview(bytearray(16))[::2]])
    assert good == bytes(8)  # checked before anything is read


def test_remove(tmp_path):
    store = DiskStore(tmp_path)
    store.put([("a", b"1"), ("b", b"2")])
    store.remove(["a", "never-there"])
    assert store.get(["a", "b"]) == [None, b"2"]
    assert store.put([("a", b"new")]) == [True]
    assert store.get(["a"]) == [b"new"]
    store.check_invariants()


def test_restart_survives(tmp_path):
    with DiskStore(tmp_path) as store:
        store.put([(f"k{i}", bytes([i]) * (i + 1)) for i in range(20)])
        used = store.used_bytes
    again = DiskStore(tmp_path)
    assert again.used_bytes == used
    assert again.get([f"k{i}" for i in range(20)]) == [bytes([i]) * (i + 1) for i in range(20)]
    again.check_invariants()


def test_capacity_evicts_least_recently_used(tmp_path):
    one = object_file_size("a", 100)
    store = DiskStore(tmp_path, capacity_bytes=3 * one)
    store.put([(k, k.encode() * 100) for k in "abc"])
    assert store.get(["a"]) == [b"a" * 100]  # a is now most recent; b is the LRU
    assert store.put([("d", b"d" * 100)]) == [True]
    assert store.evictions == 1
    assert store.exists(["a", "b", "c", "d"]) == [True, False, True, True]
    store.check_invariants()
    # Recency survives a restart (mtimes): c is now the LRU.
    again = DiskStore(tmp_path, capacity_bytes=3 * one)
    again.put([("e", b"e" * 100)])
    assert again.exists(["a", "c", "d", "e"]) == [True, False, True, True]
    again.check_invariants()


def test_capacity_refuses_oversize_and_shrinks_on_restart(tmp_path):
    one = object_file_size("a", 100)
    store = DiskStore(tmp_path, capacity_bytes=2 * one)
    assert store.put([("big", bytes(2 * one))]) == [False]
    store.put([("a", bytes(100)), ("b", bytes(100))])
    assert store.evictions == 0
    smaller = DiskStore(tmp_path, capacity_bytes=one)  # restart with less room: evicts down to it
    assert smaller.exists(["a", "b"]) == [False, True]
    smaller.check_invariants()


def test_truncated_and_foreign_files_are_absent(tmp_path):
    store = DiskStore(tmp_path)
    store.put([("t", b"payload" * 10), ("h", b"short header victim")])
    path = object_path(tmp_path, "t")
    path.write_bytes(path.read_bytes()[:-3])  # truncated payload
    object_path(tmp_path, "h").write_bytes(b"HKVOBJ1\0\x01")  # truncated header
    object_path(tmp_path, "f").write_bytes(b"not an object at all, just some bytes")
    # A well-formed object of another key under this key's name (collision / misplaced).
    object_path(tmp_path, "m").write_bytes(encode_object("other", b"wrong bytes"))

    assert store.get(["t", "h", "f", "m"]) == [None] * 4
    assert store.get_into(["m"], [memoryview(bytearray(64))]) == [-1]
    assert store.bad_objects == 5
    assert store.bad_reasons["foreign file (bad magic)"] == 1
    assert store.bad_reasons["key mismatch (hash collision or misplaced file)"] == 2
    # Bad files of the key are cleared so the key can be stored again; the other key's is kept.
    assert store.put([("t", b"fresh"), ("f", b"fine"), ("m", b"refused")]) == [True, True, False]
    assert store.get(["t", "f"]) == [b"fresh", b"fine"]
    assert object_path(tmp_path, "m").read_bytes() == encode_object("other", b"wrong bytes")
    store.check_invariants()


def test_leftover_temp_files_cleaned_at_startup(tmp_path):
    store = DiskStore(tmp_path)
    store.put([("a", b"1")])
    sub = object_path(tmp_path, "a").parent
    dead = _dead_pid()
    host = os.uname().nodename
    stale = [sub / f".tmp.abc.{dead}@{host}", sub / ".tmp.garbage", tmp_path / "00" / f".tmp.old.{os.getpid()}@{host}"]
    for p in stale:
        p.write_bytes(b"HKVOBJ1\0partial")
    os.utime(stale[2], (1, 1))  # ancient, even though its writer (us) is alive
    live = tmp_path / "01" / f".tmp.inflight.{os.getpid()}@{host}"
    live.write_bytes(b"HKVOBJ1\0")
    again = DiskStore(tmp_path)
    assert temp_files(tmp_path) == [live]
    assert again.get(["a"]) == [b"1"]
    assert again.used_bytes == object_file_size("a", 1)


def _dead_pid() -> int:
    proc = mp.get_context("spawn").Process(target=int)
    proc.start()
    proc.join()
    return proc.pid


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="file"):
        DiskStore(f)
    with pytest.raises(ValueError, match="not a directory"):
        DiskStore(f / "below")
    with pytest.raises(ValueError, match="capacity"):
        DiskStore(tmp_path / "ok", capacity_bytes=-1)


def test_missing_directory_created(tmp_path):
    root = tmp_path / "a" / "b"
    DiskStore(root).put([("k", b"v")])
    assert len([p for p in root.iterdir() if p.is_dir()]) == 256


def test_vanished_directory_unavailable(tmp_path):
    root = tmp_path / "gone"
    store = DiskStore(root)
    store.put([("k", b"v")])
    shutil.rmtree(root)
    calls = (lambda: store.get(["k"]), lambda: store.put([("k2", b"v")]), lambda: store.exists(["k"]),
             lambda: store.get_into(["k"], [memoryview(bytearray(8))]))
    for call in calls:
        with pytest.raises(StoreUnavailable, match="gone"):
            call()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions")
def test_unwritable_directory_unavailable(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(StoreUnavailable, match="ro"):
            DiskStore(root)
    finally:
        root.chmod(0o700)


def test_threads_share_one_store(tmp_path):
    one = object_file_size("t0-0", 64)
    store = DiskStore(tmp_path, capacity_bytes=40 * one)
    errors = []

    def work(t):
        try:
            for i in range(60):
                key = f"t{t % 2}-{i}"  # pairs of threads race on the same keys
                assert store.put([(key, key.encode().ljust(64, b"."))]) == [True]
                got = store.get([key])[0]
                assert got is None or got == key.encode().ljust(64, b".")
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store.check_invariants()
    assert store.evictions > 0 and store.bad_objects == 0
    assert temp_files(tmp_path) == []


def _race_worker(root, tag, barrier, queue):
    store = DiskStore(root)
    keys = [f"key{i}" for i in range(200)]
    barrier.wait()
    ok = store.put([(k, bytes([tag]) * 4096) for k in keys])
    seen = [None if b is None else b[0] for b in store.get(keys)]
    queue.put((all(ok), seen, store.bad_objects))


def test_two_processes_put_same_keys(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(tmp_path), tag, barrier, queue)) for tag in (1, 2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    store = DiskStore(tmp_path)
    final = store.get([f"key{i}" for i in range(200)])
    for blob in final:
        assert blob is not None and len(blob) == 4096 and blob == bytes([blob[0]]) * 4096
    winners = [blob[0] for blob in final]
    for all_ok, seen, bad in results:
        assert all_ok and bad == 0
        assert seen == winners  # both processes read the same first-published object
    assert temp_files(tmp_path) == []
    assert store.bad_objects == 0


@pytest.fixture
def small_filesystem(tmp_path):
    """A 512 KiB tmpfs mounted for the test (skipped where mounting is not permitted)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], check=False, capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def test_a_real_full_disk_refuses_puts_and_keeps_what_it_holds(small_filesystem):
    """A filesystem that runs out of space (ENOSPC from the kernel, no capacity set on the store):
    puts answer False instead of raising, no temporary file is left behind, every object stored
    before stays readable, and once room is made puts succeed again."""
    store = DiskStore(small_filesystem / "store")
    blob = bytes(range(256)) * 256                        # 64 KiB
    results = [store.put([(f"k{i}", blob)])[0] for i in range(16)]
    assert results[0] and not all(results)                  # it filled up
    stored = [f"k{i}" for i, ok in enumerate(results) if ok]
    assert results == [True] * len(stored) + [False] * (16 - len(stored))
    assert temp_files(small_filesystem / "store") == []
    assert store.get(stored) == [blob] * len(stored)
    store.remove(stored[:2])
    assert store.put([("again", blob)]) == [True] and store.get(["again"]) == [blob]


@pytest.mark.parametrize("kind", ["disk", "memory"])
def test_remove_prefix_by_listing(tmp_path, kind):
    """The default ``remove_prefix`` lists and removes; bad characters and an empty prefix are refused."""
    from hybridkv.store.memory import MemoryStore
    store = DiskStore(tmp_path / "s") if kind == "disk" else MemoryStore()
    keys = ["hkv4/aa/e1/manifest", "hkv4/aa/e1/kv", "hkv4/ab/e1/manifest"]
    assert store.put([(k, b"x" * 8) for k in keys]) == [True] * 3
    assert store.remove_prefix("hkv4/aa/", "/manifest") == 1
    assert store.exists(keys) == [False, True, True]
    assert store.remove_prefix("hkv4/aa/") == 1
    assert store.exists(keys) == [False, False, True]
    with pytest.raises(ValueError, match="non-empty"):
        store.remove_prefix("")
    with pytest.raises(ValueError, match=r"'\['"):
        store.remove_prefix("hkv4/[a]/")
    more = ["hkv4/m1/o1/e/manifest", "hkv4/m2/o1/e/manifest", "hkv4/m1/o2/e/manifest", "hkv4/m1/o1/e/kv"]
    assert store.put([(k, b"x" * 8) for k in more]) == [True] * 4
    assert store.remove_prefix("hkv4/*/o1/", "/manifest") == 2          # one owner under every model
    assert store.exists(more) == [False, False, True, True]
    assert store.remove_prefix("hkv4/*/o1/") == 1
    with pytest.raises(ValueError, match=r"'\*'"):
        store.remove_prefix("hkv4/m*/")
    store.close()


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_empty_object_file_at_startup_is_absent_not_a_crash(tmp_path, eviction):
    """A zero-length object file (a crash of the file system after the rename, before the data
    reached the disk) must not stop the store from opening: it is a bad object, absent on read,
    the key can be put again and the other objects stay readable."""
    store = DiskStore(tmp_path, eviction=eviction)
    store.put([("keep", b"kept bytes"), ("gone", b"payload" * 10)])
    object_path(tmp_path, "gone").write_bytes(b"")

    reopened = DiskStore(tmp_path, capacity_bytes=10_000, eviction=eviction)   # raised ValueError before
    assert reopened.get(["keep", "gone"]) == [b"kept bytes", None]
    assert reopened.bad_objects == 1
    assert reopened.put([("gone", b"fresh")]) == [True]
    assert reopened.get(["gone"]) == [b"fresh"]
    reopened.check_invariants()
