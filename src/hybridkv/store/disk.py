"""Local-directory object store (``disk:///PATH``): the embedded default L3 tier (DESIGN §5).

Layout. ``ROOT/<h[:2]>/<h>`` where ``h = sha256(key UTF-8).hexdigest()``; the 256
fan-out subdirectories are created when the store opens. An object file is::

    b"HKVOBJ1\\0" | key length (u32 LE) | key (UTF-8) | payload length (u64 LE) | payload

A reader checks the magic, that the stored key is the key it asked for and that
the file length matches the header, so a truncated, foreign or colliding file is
reported absent (counted in ``bad_objects``, reason in ``bad_reasons``), never
returned as wrong bytes.

Publishing. A put writes ``ROOT/<h[:2]>/.tmp.<token>.<pid>@<host>``, then
``os.link``\\ s it to the final name and unlinks the temp file. ``link`` fails if
the final name exists, so a published key is never overwritten and two writers
of one key (threads or processes) agree: the first link wins, the other sees the
key present. Readers only ever open final names, i.e. complete files.

Capacity. Sizes are file sizes in bytes (header included: 20 + len(key) bytes
over the payload). Recency is an in-memory LRU, persisted as file mtimes
(stamped at publish, re-stamped on every hit) so a restart rebuilds it by a scan.
Accounting is per process: objects another process publishes are adopted when
this process first sees them; eviction of an already-removed file is harmless.

Needs a filesystem with hard links (ext4, xfs, btrfs, NFS).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from typing import BinaryIO, Sequence

from hybridkv.store.base import Buffer, ObjectStore, StoreUnavailable

log = logging.getLogger(__name__)

MAGIC = b"HKVOBJ1\0"
_HEAD = struct.Struct("<8sI")  # magic, key length
_PLEN = struct.Struct("<Q")  # payload length
_TMP_PREFIX = ".tmp."
#: A temp file older than this (seconds) is stale whoever wrote it.
STALE_TMP_S = 3600.0
_OBJECT_NAME = re.compile(r"[0-9a-f]{64}")
_SUBDIRS = tuple(f"{i:02x}" for i in range(256))
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def object_file_size(key: str, payload_bytes: int) -> int:
    """Bytes one object occupies on disk (header + payload) for capacity accounting."""
    return _HEAD.size + len(key.encode("utf-8")) + _PLEN.size + payload_bytes


def encode_object(key: str, payload: Buffer) -> bytes:
    """The full file image of one object (used by tests and tools; put streams it instead)."""
    kb = key.encode("utf-8")
    data = memoryview(payload)
    return _HEAD.pack(MAGIC, len(kb)) + kb + _PLEN.pack(data.nbytes) + data.tobytes()


class _BadObject(Exception):
    """Internal: an object file that must be treated as absent. ``collision`` = valid file of another key."""

    def __init__(self, reason: str, collision: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.collision = collision


def _read_header(f: BinaryIO, key_bytes: bytes) -> int:
    """Check an open object file against ``key_bytes``; return its payload length in bytes.

    Leaves ``f`` positioned at the payload. Raises :class:`_BadObject` with a reason.
    """
    size = os.fstat(f.fileno()).st_size
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size:
        raise _BadObject(f"truncated header ({size} bytes)")
    magic, klen = _HEAD.unpack(head)
    if magic != MAGIC:
        raise _BadObject("foreign file (bad magic)")
    if _HEAD.size + klen + _PLEN.size > size:
        raise _BadObject(f"truncated header (key length {klen}, file {size} bytes)")
    stored_key = f.read(klen)
    if stored_key != key_bytes:
        raise _BadObject("key mismatch (hash collision or misplaced file)", collision=True)
    (plen,) = _PLEN.unpack(f.read(_PLEN.size))
    expected = _HEAD.size + klen + _PLEN.size + plen
    if size < expected:
        raise _BadObject(f"truncated payload ({size} of {expected} bytes)")
    if size > expected:
        raise _BadObject(f"trailing bytes ({size} bytes, header says {expected})")
    return plen


def _os_errors_unavailable(method):
    """Any ``OSError`` a public method did not handle means the directory is unusable."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            raise self._unavailable(f"{method.__name__} failed:", e) from e
    return wrapper


class DiskStore(ObjectStore):
    """Objects as files under one directory; survives restart; LRU-evicting cache.

    Args:
        path: store directory; created (with parents) if missing.
        capacity_bytes: total file bytes (headers included) to keep; least-recently
            used objects are evicted silently to make room. ``None`` = unlimited.
        fsync: fsync each object and its directory before a put returns
            (durable across power loss; slower). Default ``False``.

    Raises:
        ValueError: ``path`` exists and is not a directory (or a fan-out name is a
            file), or ``capacity_bytes`` is negative.
        StoreUnavailable: the directory cannot be created or written (permissions).

    Counters (read-only for callers): ``evictions`` objects evicted for capacity;
    ``bad_objects`` unreadable object files met (truncated / foreign / collision),
    with ``bad_reasons`` counting each reason.
    """

    scheme = "disk"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int | None = None, fsync: bool = False) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"disk store capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.root = os.path.abspath(os.fspath(path))
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.evictions = 0
        self.bad_objects = 0
        self.bad_reasons: Counter[str] = Counter()
        self._lock = threading.Lock()
        # Invariant (under _lock): _bytes == sum(_lru.values()); _lru maps object
        # digest -> file bytes, least recently used first.
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._last_stamp = 0
        self._tmp_suffix = f".{os.getpid()}@{socket.gethostname()}"
        self._open_root()
        self._scan()
        with self._lock:
            self._make_room(0)

    # ----------------------------------------------------------------- public

    @property
    def used_bytes(self) -> int:
        """File bytes currently accounted to this store (this process's view)."""
        return self._bytes

    @_os_errors_unavailable
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds a readable object (header checked, payload not read)."""
        return [self._probe(key.encode("utf-8")) == "ok" for key in keys]

    @_os_errors_unavailable
    def put(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Publish each ``(key, bytes)``; an existing key is kept as it is.

        Returns:
            Per item: ``True`` if the key holds an object afterwards; ``False`` if
            refused: larger than ``capacity_bytes``, disk full, or the name is
            taken by another key's object (hash collision).

        Raises:
            StoreUnavailable: the directory vanished or is not writable.
        """
        return [self._put_one(key, data) for key, data in items]

    @_os_errors_unavailable
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Payload bytes per key, ``None`` where absent or the file is bad. Repeated keys are read once.

        Raises:
            StoreUnavailable: the directory vanished or is not readable.
        """
        seen: dict[str, bytes | None] = {}
        for key in keys:
            if key not in seen:
                seen[key] = self._read(key, None)
        return [seen[key] for key in keys]

    @_os_errors_unavailable
    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        """Read each payload straight into its buffer; bytes read, or ``-1`` if absent / bad / too small."""
        return [self._read(key, buf) for key, buf in zip(keys, buffers)]

    @_os_errors_unavailable
    def remove(self, keys: Sequence[str]) -> None:
        """Delete keys; absent keys are ignored.

        Raises:
            StoreUnavailable: the directory vanished or is not writable.
        """
        for key in keys:
            digest = self._digest(key.encode("utf-8"))
            with self._lock:
                self._unlink(self._path(digest))
                self._forget(digest)

    def check_invariants(self) -> None:
        """Assert the accounting invariants (tests call this; single-process use)."""
        with self._lock:
            assert self._bytes == sum(self._lru.values()), (self._bytes, sum(self._lru.values()))
            assert all(size > 0 for size in self._lru.values())
            if self.capacity_bytes is not None:
                assert self._bytes <= self.capacity_bytes, (self._bytes, self.capacity_bytes)

    def __repr__(self) -> str:
        return f"DiskStore({self.root!r}, capacity_bytes={self.capacity_bytes}, used={self._bytes})"

    # --------------------------------------------------------------- startup

    def _open_root(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ValueError(f"disk store path {self.root!r} exists and is not a directory")
        try:
            os.makedirs(self.root, exist_ok=True)
            for sub in _SUBDIRS:
                os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise ValueError(f"disk store path {self.root!r}: {e.filename!r} is not a directory") from e
        except PermissionError as e:
            raise StoreUnavailable(f"disk store {self.root!r}: permission denied creating {e.filename!r}") from e
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise StoreUnavailable(f"disk store {self.root!r}: directory is not readable and writable")

    def _scan(self) -> None:
        """Rebuild the LRU from file sizes and mtimes; delete stale temp files."""
        found: list[tuple[int, str, int]] = []
        now = time.time()
        for sub in _SUBDIRS:
            subdir = os.path.join(self.root, sub)
            try:
                entries = list(os.scandir(subdir))
            except PermissionError as e:
                raise StoreUnavailable(f"disk store {self.root!r}: cannot list {subdir!r}") from e
            for entry in entries:
                try:
                    if entry.name.startswith(_TMP_PREFIX):
                        if self._tmp_is_stale(entry.name, entry.stat().st_mtime, now):
                            os.unlink(entry.path)
                    elif _OBJECT_NAME.fullmatch(entry.name) and entry.name[:2] == sub:
                        if entry.is_file(follow_symlinks=False):
                            st = entry.stat(follow_symlinks=False)
                            found.append((st.st_mtime_ns, entry.name, st.st_size))
                except FileNotFoundError:
                    continue  # removed by another process meanwhile
        found.sort()
        for _, digest, size in found:
            self._lru[digest] = size
            self._bytes += size

    def _tmp_is_stale(self, name: str, mtime: float, now: float) -> bool:
        """A temp file is stale if old, or written by a dead process on this host."""
        if now - mtime > STALE_TMP_S:
            return True
        _, _, owner = name[len(_TMP_PREFIX):].partition(".")
        pid_text, _, host = owner.partition("@")
        if not pid_text.isdigit():
            return True  # not a name this class writes
        if host != socket.gethostname():
            return False  # another host's writer: only age tells
        pid = int(pid_text)
        if pid == os.getpid() or pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False  # exists but not ours to signal
        return False

    # ------------------------------------------------------------------ paths

    @staticmethod
    def _digest(key_bytes: bytes) -> str:
        return hashlib.sha256(key_bytes).hexdigest()

    def _path(self, digest: str) -> str:
        return os.path.join(self.root, digest[:2], digest)

    def _unavailable(self, what: str, err: OSError) -> StoreUnavailable:
        return StoreUnavailable(f"disk store {self.root!r}: {what} {err.filename or ''!s}: {err.strerror}")

    def _check_dir(self, path: str) -> None:
        """A missing object is a miss only while its directory exists.

        A fan-out directory that vanished while the root is still there is
        made again (the store recovers once its root is back).
        """
        sub = os.path.dirname(path)
        if os.path.isdir(sub):
            return
        if os.path.isdir(self.root):
            try:
                os.makedirs(sub, exist_ok=True)
                return
            except OSError:
                pass
        raise StoreUnavailable(f"disk store {self.root!r}: directory {sub!r} vanished")

    # ------------------------------------------------------------- accounting

    def _next_stamp(self) -> int:
        stamp = max(time.time_ns(), self._last_stamp + 1)
        self._last_stamp = stamp
        return stamp

    def _forget(self, digest: str) -> None:
        size = self._lru.pop(digest, None)
        if size is not None:
            self._bytes -= size

    def _make_room(self, size: int) -> None:
        """Evict least-recently-used objects until ``size`` more bytes fit. Caller holds the lock."""
        if self.capacity_bytes is None:
            return
        while self._lru and self._bytes + size > self.capacity_bytes:
            digest, victim = self._lru.popitem(last=False)
            self._bytes -= victim
            self._unlink(self._path(digest))
            self.evictions += 1

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            self._check_dir(path)
        except PermissionError as e:
            raise self._unavailable("cannot delete", e) from e

    def _seen(self, digest: str, path: str, f: BinaryIO, touch: bool) -> None:
        """Record a valid object read through ``f`` as present (and, if ``touch``, most recent)."""
        st = os.fstat(f.fileno())
        with self._lock:
            if digest not in self._lru:
                try:
                    if os.stat(path).st_ino != st.st_ino:
                        return  # replaced or evicted meanwhile; the next look adopts it
                except FileNotFoundError:
                    return
                self._lru[digest] = st.st_size
                self._bytes += st.st_size
            elif not touch:
                return
            self._lru.move_to_end(digest)
            stamp = self._next_stamp()
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass  # recency across restarts is best effort (file gone or not ours)

    def _bad(self, path: str, f: BinaryIO | None, err: _BadObject) -> None:
        """Count a bad object; delete it (so the key can be put again) unless it is another key's object."""
        log.warning("disk store: ignoring %s: %s", path, err.reason)
        ino = None if f is None or err.collision else os.fstat(f.fileno()).st_ino
        with self._lock:
            self.bad_objects += 1
            self.bad_reasons[err.reason] += 1
            if ino is None:
                return
            try:
                if os.stat(path).st_ino != ino:
                    return  # replaced meanwhile by a fresh object: keep it
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                return  # not ours to delete: it stays absent
            self._forget(os.path.basename(path))

    # ------------------------------------------------------------------ reads

    def _open(self, path: str) -> BinaryIO | None:
        try:
            return open(path, "rb")
        except FileNotFoundError:
            self._check_dir(path)
            return None
        except PermissionError as e:
            raise self._unavailable("cannot read", e) from e
        except IsADirectoryError:
            self._bad(path, None, _BadObject("not a regular file"))
            return None

    def _probe(self, key_bytes: bytes) -> str:
        """``"ok"`` (valid object), ``"absent"`` (none, or a bad one now deleted) or ``"collision"``."""
        digest = self._digest(key_bytes)
        path = self._path(digest)
        f = self._open(path)
        if f is None:
            return "absent"
        with f:
            try:
                _read_header(f, key_bytes)
            except _BadObject as err:
                self._bad(path, f, err)
                return "collision" if err.collision else "absent"
            self._seen(digest, path, f, touch=False)
        return "ok"

    def _read(self, key: str, into: memoryview | None) -> bytes | None | int:
        """Payload of ``key`` as bytes (``into is None``) or its length read into ``into`` (``-1`` if not)."""
        key_bytes = key.encode("utf-8")
        digest = self._digest(key_bytes)
        path = self._path(digest)
        miss = None if into is None else -1
        f = self._open(path)
        if f is None:
            return miss
        with f:
            try:
                plen = _read_header(f, key_bytes)
                if into is None:
                    result: bytes | int = f.read(plen)
                    got = len(result)
                else:
                    dest = memoryview(into).cast("B")
                    if plen > dest.nbytes:
                        return -1
                    got = 0
                    while got < plen:
                        n = f.readinto(dest[got:plen])
                        if not n:
                            break
                        got += n
                    result = got
                if got != plen:
                    raise _BadObject(f"short read ({got} of {plen} bytes)")
            except _BadObject as err:
                self._bad(path, f, err)
                return miss
            except OSError as e:
                self._bad(path, f, _BadObject(f"read error: {e.strerror}"))
                return miss
            self._seen(digest, path, f, touch=True)
        return result

    # ----------------------------------------------------------------- writes

    def _put_one(self, key: str, data: Buffer) -> bool:
        key_bytes = key.encode("utf-8")
        payload = memoryview(data)
        size = _HEAD.size + len(key_bytes) + _PLEN.size + payload.nbytes
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            return False
        state = self._probe(key_bytes)
        if state != "absent":
            return state == "ok"
        digest = self._digest(key_bytes)
        path = self._path(digest)
        tmp = self._write_tmp(path, key_bytes, payload)
        if tmp is None:
            return False
        try:
            with self._lock:
                if digest in self._lru and os.path.exists(path):
                    return True  # another thread published it meanwhile
                self._make_room(size)
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return True  # another process won the race; its object stands
                except (FileNotFoundError, PermissionError) as e:
                    raise self._unavailable("cannot publish", e) from e
                except OSError as e:
                    if e.errno in _NO_SPACE:
                        return False
                    raise
                self._forget(digest)
                self._lru[digest] = size
                self._bytes += size
            if self.fsync:
                self._fsync_dir(os.path.dirname(path))
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        return True

    def _write_tmp(self, path: str, key_bytes: bytes, payload: memoryview) -> str | None:
        """Write a complete object file next to ``path``; its name, or ``None`` if the disk is full."""
        tmp = os.path.join(os.path.dirname(path), f"{_TMP_PREFIX}{secrets.token_hex(8)}{self._tmp_suffix}")
        try:
            with open(tmp, "xb") as f:
                f.write(_HEAD.pack(MAGIC, len(key_bytes)))
                f.write(key_bytes)
                f.write(_PLEN.pack(payload.nbytes))
                f.write(payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            with self._lock:
                stamp = self._next_stamp()
            os.utime(tmp, ns=(stamp, stamp))
        except (FileNotFoundError, PermissionError) as e:
            self._drop_tmp(tmp)
            raise self._unavailable("cannot write", e) from e
        except OSError as e:
            self._drop_tmp(tmp)
            if e.errno in _NO_SPACE:
                return None
            raise
        return tmp

    @staticmethod
    def _drop_tmp(tmp: str) -> None:
        try:
            os.unlink(tmp)
        except OSError:
            pass

    def _fsync_dir(self, directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
