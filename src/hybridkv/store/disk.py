"""Local-directory object store (``disk:///PATH``): the embedded default L3 tier (DESIGN §5).

Layout. ``ROOT/<h[:2]>/<h>``, ``h = sha256(key UTF-8).hexdigest()``: a header naming
the key, then the payload. File format, layout and temp files: :mod:`hybridkv.store.disk_files`;
this module is the store (locking, LRU accounting, error policy).

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
over the payload). The eviction order (:mod:`hybridkv.store.eviction`) is in memory:
``lru`` (recency, persisted as file mtimes, stamped at publish and re-stamped on
every hit, so a restart rebuilds it by a scan) or ``value`` (hits per byte with
GreedyDual aging: a byte store cannot see what an object saves, so ``C = 1``;
hit counts start again after a restart, in mtime order).
Quotas. With ``quota=F`` (a fraction in (0, 1], like ``CacheConfig.tenant_quota``) no owner
keeps more than ``F × capacity_bytes``. Objects put through :meth:`DiskStore.put_owned`
record their owner (a request-namespace digest: tenant identity, not content) in their
file header, so the owner bytes are rebuilt by the startup scan. A put by an owner over its
quota evicts that owner's own objects first (whole entries, see below), never another
owner's. An *entry* is the set of owned objects whose keys share everything up to the
last ``/`` (the cache ABI's ``.../<group>/r<rank>/<component>``); evicting any object of
an entry (for a quota or for capacity) removes the entry, its ``manifest`` object first,
so a reader sees a missing manifest, never a manifest whose components are gone for
good. A reader that already opened a file keeps reading it (POSIX unlink semantics), and
the cache ABI's checksums turn any component removed between its manifest read and its
own read into a miss, never wrong bytes.
An owned entry that does not fit whole is refused (the put of the object that would evict
its own entry's first objects returns ``False``), and so is a manifest whose entry was
evicted after its components were put.
Accounting is per process: objects another process publishes are adopted when
this process first sees them; eviction of an already-removed file is harmless. Several
processes writing for one owner can leave it over its quota on disk: owners over their quota
are trimmed at open and pay first whenever room is made for capacity. The startup scan and
adoption trust a header's key and owner only when the key hashes to the file's name.

Needs a filesystem with hard links (ext4, xfs, btrfs, NFS).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import BinaryIO

from hybridkv.store.base import DAMAGED, Buffer, ObjectStore, StoreUnavailable
from hybridkv.store.disk_files import (
    MIN_OBJECT_BYTES,
    NO_SPACE,
    BadObject,
    check_fanout_dir,
    check_owner,
    create_layout,
    drop_file,
    fsync_dir,
    object_digest,
    object_file_size,
    object_path,
    read_header,
    read_key,
    read_key_owner,
    read_payload,
    scan_layout,
    tmp_path,
    tmp_suffix,
    writable_bytes,
    write_object_file,
)
from hybridkv.store.eviction import make_order

log = logging.getLogger(__name__)

#: Evicted owned entries remembered so that their manifests put later are refused.
_EVICTED_KEEP = 65536


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
        eviction: ``lru`` or ``value`` (which object goes first for capacity).
        quota: fraction in (0, 1] of ``capacity_bytes`` one owner may hold (``None``:
            no quota); needs a ``capacity_bytes``. Owners come from :meth:`put_owned`.

    Raises:
        ValueError: ``path`` exists and is not a directory (or a fan-out name is a
            file), ``capacity_bytes`` is negative, ``eviction`` is unknown, or
            ``quota`` is not a number in (0, 1] or is given without a capacity.
        StoreUnavailable: the directory cannot be created or written: permissions, or a read-only
            file system, whether the store there is new, empty or already holds objects (a store
            writes as it reads: puts, recency stamps, dropping bad objects). The message names the
            path; an engine then warns and runs without the store (``store_required``: an error).

    Counters (read-only for callers): ``evictions`` objects evicted for capacity;
    ``bad_objects`` unreadable object files met (truncated / foreign / collision),
    with ``bad_reasons`` counting each reason.
    """

    scheme = "disk"
    lists_keys = True

    def __init__(self, path: str | os.PathLike, capacity_bytes: int | None = None, fsync: bool = False,
                 eviction: str = "lru", quota: float | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"disk store capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        if quota is not None:
            if isinstance(quota, bool) or not isinstance(quota, (int, float)) or not 0.0 < quota <= 1.0:
                raise ValueError(f"disk store quota={quota!r} must be a fraction in (0, 1]")
            if capacity_bytes is None:
                raise ValueError(f"disk store quota={quota!r} needs a capacity (it is a fraction of it)")
        self.quota = quota
        #: Bytes one owner may hold (``None``: no quota).
        self.quota_bytes = None if quota is None else int(quota * capacity_bytes)
        self.quota_evictions = 0
        # Entries of owned objects (under _lock): digest -> entry prefix, prefix -> {digest: is manifest}.
        self._entry_of: dict[str, str] = {}
        self._entries: dict[str, dict[str, bool]] = {}
        # Owned entries evicted whole, newest last (under _lock; at most _EVICTED_KEEP): a manifest
        # put for one of them is refused, its components being gone; a component put re-opens it.
        self._evicted_entries: dict[str, None] = {}
        self._order = make_order(eviction)       # members: every accounted object (digest)
        self.root = os.path.abspath(os.fspath(path))
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.evictions = 0
        self.bad_objects = 0
        self.bad_reasons: Counter[str] = Counter()
        self._lock = threading.Lock()
        # Invariant (under _lock): _bytes == sum(_lru.values()); _lru maps object
        # digest -> file bytes, and its keys are exactly the members of _order.
        # digest -> file bytes, least recently used first.
        self._lru: dict[str, int] = {}
        self._bytes = 0
        self._last_stamp = 0
        self._tmp_suffix = tmp_suffix()
        create_layout(self.root)
        for _, digest, size in scan_layout(self.root):  # oldest first; deletes stale temp files
            if size < MIN_OBJECT_BYTES:
                continue  # no object (e.g. zero-length after a crash): a bad object when read
            self._account(digest, size, *self._header_owner(digest))
        with self._lock:
            self._trim_quotas()  # other processes' puts may have left an owner over its quota
            self._make_room(0)

    # ----------------------------------------------------------------- public

    @property
    def used_bytes(self) -> int:
        """File bytes currently accounted to this store (this process's view)."""
        return self._bytes

    @_os_errors_unavailable
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key holds an object (header checked, payload not read). A damaged file
        under the key (truncated, foreign) counts as present and is left in place: the read that
        follows reports it :data:`~hybridkv.store.base.DAMAGED` (a counted, damaged miss, not an
        absent or evicted one) and deletes it."""
        return [self._probe(key.encode("utf-8"), drop_bad=False) in ("ok", "damaged") for key in keys]

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
    def put_owned(self, items: Sequence[tuple[str, Buffer]], owner: bytes | str | None) -> list[bool]:
        """:meth:`put` recording ``owner`` (a request-namespace digest, bytes or hex) in each
        new object's header; under a quota, a put over the owner's quota first evicts the
        owner's own entries, and an object larger than the quota is refused (``False``).

        Raises:
            ValueError: ``owner`` is not a digest (bytes, or ASCII letters/digits).
            StoreUnavailable: the directory vanished or is not writable.
        """
        if isinstance(owner, (bytes, bytearray)):
            owner = bytes(owner).hex()
        check_owner(owner)
        return [self._put_one(key, data, owner) for key, data in items]

    def owner_bytes(self, owner: bytes | str) -> int:
        """File bytes accounted to ``owner`` (bytes digest or hex) in this process's view."""
        if isinstance(owner, (bytes, bytearray)):
            owner = bytes(owner).hex()
        with self._lock:
            return self._order.owner_bytes.get(owner, 0)

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
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        """Read each payload from its file straight into its buffer (no intermediate copy).

        A repeated key is read into each of its buffers; locking, LRU touch and
        bad-file handling are those of :meth:`get`. A buffer's capacity is its
        size in bytes, whatever its item format.

        Returns:
            Per key, payload bytes written at the start of its buffer (the rest is
            untouched), or ``-1``: absent, bad (the buffer may be partly written)
            or larger than the buffer (the buffer is untouched), or
            :data:`~hybridkv.store.base.DAMAGED`: the file was bad (truncated, foreign, unreadable;
            counted in ``bad_reasons`` and deleted; the buffer may be partly written).

        Raises:
            ValueError: ``keys`` and ``buffers`` differ in length, or a buffer is
                read-only or not contiguous (checked before anything is read).
            StoreUnavailable: the directory vanished or is not readable.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"DiskStore.get_into: {len(keys)} keys but {len(buffers)} buffers")
        views = [writable_bytes(buf) for buf in buffers]
        return [self._read(key, view) for key, view in zip(keys, views)]

    @_os_errors_unavailable
    def remove(self, keys: Sequence[str]) -> None:
        """Delete keys; absent keys are ignored.

        Raises:
            StoreUnavailable: the directory vanished or is not writable.
        """
        for key in keys:
            digest = object_digest(key.encode("utf-8"))
            with self._lock:
                self._unlink(self._path(digest))
                self._forget(digest)

    @_os_errors_unavailable
    def list_keys(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` of every object file in the directory (other processes'
        included), read from each file's header.

        Raises:
            StoreUnavailable: the directory cannot be listed or read.
        """
        out = []
        for _, digest, _ in scan_layout(self.root):
            key = read_key(self._path(digest))
            if key is not None and key.startswith(prefix):
                out.append(key)
        return out

    def check_invariants(self) -> None:
        """Assert the accounting invariants (tests call this; single-process use)."""
        with self._lock:
            assert self._bytes == sum(self._lru.values()), (self._bytes, sum(self._lru.values()))
            assert all(size > 0 for size in self._lru.values())
            assert set(self._order) == set(self._lru), "eviction order out of sync"
            if self.capacity_bytes is not None:
                assert self._bytes <= self.capacity_bytes, (self._bytes, self.capacity_bytes)
            if self.quota_bytes is not None:
                for owner, held in self._order.owner_bytes.items():
                    assert held <= self.quota_bytes, (owner, held, self.quota_bytes)
            assert set(self._entry_of) <= set(self._lru)
            assert sum(len(e) for e in self._entries.values()) == len(self._entry_of)

    def __repr__(self) -> str:
        return f"DiskStore({self.root!r}, capacity_bytes={self.capacity_bytes}, used={self._bytes})"

    # ------------------------------------------------------------------ paths

    def _path(self, digest: str) -> str:
        return object_path(self.root, digest)

    def _unavailable(self, what: str, err: OSError) -> StoreUnavailable:
        return StoreUnavailable(f"disk store {self.root!r}: {what} {err.filename or ''!s}: {err.strerror}")

    # ------------------------------------------------------------- accounting

    def _next_stamp(self) -> int:
        stamp = max(time.time_ns(), self._last_stamp + 1)
        self._last_stamp = stamp
        return stamp

    def _forget(self, digest: str) -> None:
        size = self._lru.pop(digest, None)
        self._order.forget(digest)
        if size is not None:
            self._bytes -= size
        prefix = self._entry_of.pop(digest, None)
        if prefix is not None:
            members = self._entries[prefix]
            del members[digest]
            if not members:
                del self._entries[prefix]

    def _header_owner(self, digest: str) -> tuple[str | None, str | None]:
        """``(key, owner)`` the file ``digest`` records, for quota accounting; ``(None, None)``
        without a quota, for an unreadable header, or when the header's key is not the one the
        file is named after (a misplaced or corrupt file must not join another key's entry,
        whose eviction would then take a tenant's objects with it)."""
        if self.quota_bytes is None:
            return None, None
        found = read_key_owner(self._path(digest))
        if found is None or object_digest(found[0].encode("utf-8")) != digest:
            return None, None
        return found

    def _account(self, digest: str, size: int, key: str | None = None, owner: str | None = None) -> None:
        self._lru[digest] = size
        self._bytes += size
        self._order.describe(digest, size, owner=owner)
        self._order.add(digest)
        if owner is not None and key is not None:
            prefix, _, name = key.rpartition("/")
            if name != "manifest":
                self._evicted_entries.pop(prefix, None)
            self._entry_of[digest] = prefix
            self._entries.setdefault(prefix, {})[digest] = name == "manifest"

    def _evict(self, digest: str) -> None:
        """Evict the object ``digest`` and, if it is part of an owned entry, the whole entry,
        its manifest first. Caller holds the lock."""
        prefix = self._entry_of.get(digest)
        members = [digest] if prefix is None else sorted(self._entries[prefix], key=lambda d: not self._entries[prefix][d])
        if prefix is not None:
            self._evicted_entries.pop(prefix, None)
            self._evicted_entries[prefix] = None
            if len(self._evicted_entries) > _EVICTED_KEEP:
                del self._evicted_entries[next(iter(self._evicted_entries))]
        for d in members:
            self._forget(d)
            self._unlink(self._path(d))
            self.evictions += 1

    def _make_room(self, size: int, owner: str | None = None, entry: str | None = None) -> bool:
        """Evict until ``size`` more bytes fit: first ``owner``'s own victims while it is over its
        quota, then the first victims of the eviction order for capacity. ``False`` (nothing more
        evicted) when the next victim belongs to ``entry``, the owned entry being put: an entry
        that does not fit whole is refused rather than published with its first objects evicted
        (its manifest would then name components gone for good). Caller holds the lock."""
        if self.quota_bytes is not None and owner is not None:
            while self._order.owner_bytes.get(owner, 0) + size > self.quota_bytes:
                victim = self._order.victim(owner)
                if victim is None:
                    break
                if not self._evict_victim(victim, entry):
                    return False
                self.quota_evictions += 1
        if self.capacity_bytes is None:
            return True
        while self._lru and self._bytes + size > self.capacity_bytes:
            over = self._over_quota_victim()  # an owner over its quota pays for room first
            victim = self._order.victim() if over is None else over
            if victim is None:
                break
            if not self._evict_victim(victim, entry):
                return False
            self.quota_evictions += over is not None
        return True

    def _evict_victim(self, victim: str, entry: str | None) -> bool:
        """Evict the order's ``victim`` (with its whole entry) unless it belongs to ``entry``,
        the owned entry being put; ``False`` then, nothing evicted. Caller holds the lock."""
        if entry is not None and self._entry_of.get(victim) == entry:
            return False
        self._order.evicted(victim)
        self._evict(victim)
        return True

    def _over_quota_victim(self):
        """The next victim of an owner over its quota (in this process's view, which adopts other
        processes' objects), or ``None``. Caller holds the lock."""
        if self.quota_bytes is None:
            return None
        for owner, held in self._order.owner_bytes.items():
            if held > self.quota_bytes:
                victim = self._order.victim(owner)
                if victim is not None:
                    return victim
        return None

    def _trim_quotas(self) -> None:
        """Evict every owner's own objects while it is over its quota. Caller holds the lock."""
        while (victim := self._over_quota_victim()) is not None:
            self._order.evicted(victim)
            self._evict(victim)
            self.quota_evictions += 1

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            check_fanout_dir(self.root, path)
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
                self._account(digest, st.st_size, *self._header_owner(digest))
            elif not touch:
                return
            else:
                self._order.hit(digest)
            stamp = self._next_stamp()
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass  # recency across restarts is best effort (file gone or not ours)

    def _bad(self, path: str, f: BinaryIO | None, err: BadObject) -> None:
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
            check_fanout_dir(self.root, path)
            return None
        except PermissionError as e:
            raise self._unavailable("cannot read", e) from e
        except IsADirectoryError:
            self._bad(path, None, BadObject("not a regular file"))
            return None

    def _probe(self, key_bytes: bytes, drop_bad: bool = True) -> str:
        """``"ok"`` (valid object), ``"absent"`` (none, or a bad one now deleted) or ``"collision"``;
        with ``drop_bad=False`` a bad file that is not another key's object is ``"damaged"``, left
        as it is and not counted."""
        digest = object_digest(key_bytes)
        path = self._path(digest)
        f = self._open(path)
        if f is None:
            return "absent"
        with f:
            try:
                read_header(f, key_bytes)
            except BadObject as err:
                if not drop_bad and not err.collision:
                    return "damaged"
                self._bad(path, f, err)
                return "collision" if err.collision else "absent"
            self._seen(digest, path, f, touch=False)
        return "ok"

    def _read(self, key: str, into: memoryview | None) -> bytes | None | int:
        """Payload of ``key`` as bytes (``into is None``) or its length read into byte view ``into``.

        ``None`` / ``-1`` if absent or, for ``into``, too small; a bad file (counted, see
        :meth:`_bad`) is ``None`` / :data:`DAMAGED` (another key's object at this name: absent).
        """
        key_bytes = key.encode("utf-8")
        digest = object_digest(key_bytes)
        path = self._path(digest)
        miss = None if into is None else -1
        f = self._open(path)
        if f is None:
            return miss
        with f:
            try:
                result = read_payload(f, key_bytes, into)
            except BadObject as err:
                self._bad(path, f, err)
                return miss if into is None or err.collision else DAMAGED
            except OSError as e:
                self._bad(path, f, BadObject(f"read error: {e.strerror}"))
                return None if into is None else DAMAGED
            if into is not None and result == -1:
                return -1  # too small for the buffer: not read, not a hit
            self._seen(digest, path, f, touch=True)
        return result

    # ----------------------------------------------------------------- writes

    def _put_one(self, key: str, data: Buffer, owner: str | None = None) -> bool:
        key_bytes = key.encode("utf-8")
        payload = memoryview(data)
        size = object_file_size(key, payload.nbytes, owner)
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            return False
        if self.quota_bytes is not None and owner is not None and size > self.quota_bytes:
            return False
        state = self._probe(key_bytes)
        if state != "absent":
            if state == "ok" and owner is not None and not key.endswith("/manifest"):
                with self._lock:  # present again (another writer): its entry is not gone
                    self._evicted_entries.pop(key.rpartition("/")[0], None)
            return state == "ok"
        digest = object_digest(key_bytes)
        path = self._path(digest)
        tmp = self._write_tmp(path, key_bytes, payload, owner)
        if tmp is None:
            return False
        try:
            with self._lock:
                if digest in self._lru and os.path.exists(path):
                    return True  # another thread published it meanwhile
                entry = None if owner is None else key.rpartition("/")[0]
                if entry is not None and key.endswith("/manifest") and entry in self._evicted_entries:
                    return False  # its components were evicted since they were put: refused
                if not self._make_room(size, owner, entry):
                    return False  # the rest of its own entry would have to go: refused
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return True  # another process won the race; its object stands
                except (FileNotFoundError, PermissionError) as e:
                    raise self._unavailable("cannot publish", e) from e
                except OSError as e:
                    if e.errno in NO_SPACE:
                        return False
                    raise
                self._forget(digest)
                self._account(digest, size, key, owner)
            if self.fsync:
                fsync_dir(os.path.dirname(path))
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        return True

    def _write_tmp(self, path: str, key_bytes: bytes, payload: memoryview, owner: str | None = None) -> str | None:
        """Write a complete object file next to ``path``; its name, or ``None`` if the disk is full."""
        tmp = tmp_path(os.path.dirname(path), self._tmp_suffix)
        try:
            write_object_file(tmp, key_bytes, payload, self.fsync, owner)
            with self._lock:
                stamp = self._next_stamp()
            os.utime(tmp, ns=(stamp, stamp))
        except (FileNotFoundError, PermissionError) as e:
            drop_file(tmp)
            raise self._unavailable("cannot write", e) from e
        except OSError as e:
            drop_file(tmp)
            if e.errno in NO_SPACE:
                return None
            raise
        return tmp
