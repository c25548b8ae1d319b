"""The files behind :class:`~hybridkv.store.disk.DiskStore`: format, layout, temp files.

Stateless helpers; the store itself (locking, LRU accounting, error policy)
lives in :mod:`hybridkv.store.disk`.

Layout. ``ROOT/<h[:2]>/<h>`` where ``h = sha256(key UTF-8).hexdigest()``; the 256
fan-out subdirectories are created when the store opens. An object file is::

    b"HKVOBJ1\\0" | key length (u32 LE) | key (UTF-8) | payload length (u64 LE) | payload

or, for an object put with an owner (:meth:`DiskStore.put_owned`, quotas)::

    b"HKVOBJ2\\0" | key length (u32 LE) | key | owner length (u16 LE) | owner (ASCII) | payload length (u64 LE) | payload

The owner is the request-namespace digest (hex) the object was cached under: a digest
of the tenant's identity, never of content. Readers accept both forms.

Temp files. A put first writes ``ROOT/<h[:2]>/.tmp.<token>.<pid>@<host>``. One is
stale (deleted by the startup scan) when older than :data:`STALE_TMP_S`, not
named in this form, or written by a process of this host that no longer runs.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import socket
import struct
import time
from typing import BinaryIO

from hybridkv.store.base import Buffer, StoreUnavailable

MAGIC = b"HKVOBJ1\0"
MAGIC_OWNED = b"HKVOBJ2\0"
_OLEN = struct.Struct("<H")  # owner length
#: Longest owner a file records (bytes of ASCII); a request namespace digest is 64 hex.
OWNER_MAX = 256
_HEAD = struct.Struct("<8sI")  # magic, key length
_PLEN = struct.Struct("<Q")  # payload length
#: Bytes of the shortest valid object file (magic, key length, payload length; empty key and
#: payload): a shorter file (zero-length after a file-system crash) holds no object.
MIN_OBJECT_BYTES = _HEAD.size + _PLEN.size
TMP_PREFIX = ".tmp."
#: A temp file older than this (seconds) is stale whoever wrote it.
STALE_TMP_S = 3600.0
_OBJECT_NAME = re.compile(r"[0-9a-f]{64}")
SUBDIRS = tuple(f"{i:02x}" for i in range(256))
#: ``errno`` values that mean "no room" (a refused put), not "store unusable".
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# ------------------------------------------------------------------ format


def check_owner(owner: str | None) -> bytes:
    """The header bytes of ``owner`` (``b""`` for none).

    Raises:
        ValueError: ``owner`` is not ASCII letters/digits or longer than :data:`OWNER_MAX`.
    """
    if owner is None:
        return b""
    if not isinstance(owner, str) or not owner.isascii() or not owner.isalnum() or len(owner) > OWNER_MAX:
        raise ValueError(f"disk store owner {owner!r} must be 1..{OWNER_MAX} ASCII letters/digits (a hex digest)")
    return owner.encode("ascii")


def _owner_part(owner_bytes: bytes) -> bytes:
    return _OLEN.pack(len(owner_bytes)) + owner_bytes if owner_bytes else b""


def object_file_size(key: str, payload_bytes: int, owner: str | None = None) -> int:
    """Bytes one object occupies on disk (header + payload) for capacity accounting."""
    return _HEAD.size + len(key.encode("utf-8")) + len(_owner_part(check_owner(owner))) + _PLEN.size + payload_bytes


def encode_object(key: str, payload: Buffer, owner: str | None = None) -> bytes:
    """The full file image of one object (used by tests and tools; put streams it instead)."""
    kb = key.encode("utf-8")
    ob = check_owner(owner)
    data = memoryview(payload)
    return (_HEAD.pack(MAGIC_OWNED if ob else MAGIC, len(kb)) + kb + _owner_part(ob)
            + _PLEN.pack(data.nbytes) + data.tobytes())


def read_key_owner(path: str) -> tuple[str, str | None] | None:
    """``(key, owner or None)`` an object file names in its header, or ``None`` (gone, foreign
    or truncated).

    Raises:
        OSError: the file exists but cannot be read.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                return None
            magic, klen = _HEAD.unpack(head)
            if magic not in (MAGIC, MAGIC_OWNED):
                return None
            kb = f.read(klen)
            owner = None
            if magic == MAGIC_OWNED:
                ol = f.read(_OLEN.size)
                if len(ol) < _OLEN.size:
                    return None
                (olen,) = _OLEN.unpack(ol)
                ob = f.read(olen)
                if len(ob) != olen or not ob.isascii():
                    return None
                owner = ob.decode("ascii")
    except FileNotFoundError:
        return None
    if len(kb) != klen:
        return None
    try:
        return kb.decode("utf-8"), owner
    except UnicodeDecodeError:
        return None


def read_key(path: str) -> str | None:
    """The key an object file names in its header, or ``None`` (gone, foreign or truncated).

    Raises:
        OSError: the file exists but cannot be read.
    """
    found = read_key_owner(path)
    return None if found is None else found[0]


class BadObject(Exception):
    """An object file that must be treated as absent.

    Attributes:
        reason: short fixed text (the key of ``DiskStore.bad_reasons``).
        collision: the file is a valid object of *another* key (keep it).
    """

    def __init__(self, reason: str, collision: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.collision = collision


def read_header(f: BinaryIO, key_bytes: bytes) -> int:
    """Check an open object file against ``key_bytes``; return its payload length in bytes.

    Leaves ``f`` positioned at the payload. The file length must match the header
    exactly.

    Raises:
        BadObject: truncated, foreign (bad magic), another key's object, or trailing bytes.
        OSError: the file cannot be read.
    """
    size = os.fstat(f.fileno()).st_size
    head = f.read(_HEAD.size)
    if len(head) < _HEAD.size:
        raise BadObject(f"truncated header ({size} bytes)")
    magic, klen = _HEAD.unpack(head)
    if magic not in (MAGIC, MAGIC_OWNED):
        raise BadObject("foreign file (bad magic)")
    olen_size = _OLEN.size if magic == MAGIC_OWNED else 0
    if _HEAD.size + klen + olen_size + _PLEN.size > size:
        raise BadObject(f"truncated header (key length {klen}, file {size} bytes)")
    stored_key = f.read(klen)
    if stored_key != key_bytes:
        raise BadObject("key mismatch (hash collision or misplaced file)", collision=True)
    owner_part = 0
    if olen_size:
        (olen,) = _OLEN.unpack(f.read(_OLEN.size))
        owner_part = _OLEN.size + olen
        if _HEAD.size + klen + owner_part + _PLEN.size > size:
            raise BadObject(f"truncated header (owner length {olen}, file {size} bytes)")
        f.seek(olen, os.SEEK_CUR)
    (plen,) = _PLEN.unpack(f.read(_PLEN.size))
    expected = _HEAD.size + klen + owner_part + _PLEN.size + plen
    if size < expected:
        raise BadObject(f"truncated payload ({size} of {expected} bytes)")
    if size > expected:
        raise BadObject(f"trailing bytes ({size} bytes, header says {expected})")
    return plen


def writable_bytes(buffer: Buffer) -> memoryview:
    """A flat byte view of a caller's buffer (no copy), to read payloads into.

    Its length is the buffer's size in bytes, whatever the item format.

    Raises:
        ValueError: ``buffer`` is read-only or not C-contiguous.
    """
    view = memoryview(buffer)
    if view.readonly or not view.c_contiguous:
        raise ValueError("DiskStore.get_into needs writable, contiguous buffers")
    return view.cast("B")


def read_payload(f: BinaryIO, key_bytes: bytes, into: memoryview | None) -> bytes | int:
    """Check open file ``f`` as the object of ``key_bytes`` and read its payload.

    Args:
        into: ``None`` to return the payload as bytes; else a byte view
            (:func:`writable_bytes`) to read it into, from its start.

    Returns:
        The payload (``into is None``); else its length in bytes, or ``-1`` if it
        is larger than ``into`` (``into`` is then left untouched).

    Raises:
        BadObject: as :func:`read_header`, or the file ended early (short read).
        OSError: a read failed (``into`` may be partly written).
    """
    plen = read_header(f, key_bytes)
    if into is None:
        data = f.read(plen)
        got = len(data)
    else:
        if plen > into.nbytes:
            return -1
        got = 0
        while got < plen:
            n = f.readinto(into[got:plen])
            if not n:
                break
            got += n
    if got != plen:
        raise BadObject(f"short read ({got} of {plen} bytes)")
    return data if into is None else got


def write_object_file(path: str, key_bytes: bytes, payload: memoryview, fsync: bool,
                      owner: str | None = None) -> None:
    """Create ``path`` (which must not exist) holding one complete object (``owner`` recorded in
    its header when given); ``fsync`` it if asked.

    Raises:
        OSError: from create / write / fsync (``FileExistsError`` if ``path`` exists);
            a partly written file is left for the caller to remove.
    """
    ob = check_owner(owner)
    with open(path, "xb") as f:
        f.write(_HEAD.pack(MAGIC_OWNED if ob else MAGIC, len(key_bytes)))
        f.write(key_bytes)
        f.write(_owner_part(ob))
        f.write(_PLEN.pack(payload.nbytes))
        f.write(payload)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


# ------------------------------------------------------------------ layout


def object_digest(key_bytes: bytes) -> str:
    """The file name of a key's object: SHA-256 hex of its UTF-8 bytes."""
    return hashlib.sha256(key_bytes).hexdigest()


def object_path(root: str, digest: str) -> str:
    """Path of the object named ``digest`` under store directory ``root``."""
    return os.path.join(root, digest[:2], digest)


def _on_read_only_fs(path: str) -> bool:
    """Whether ``path`` (an existing directory) lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def create_layout(root: str) -> None:
    """Create ``root`` (with parents) and its 256 fan-out subdirectories; check access.

    A store writes as it reads (recency stamps, dropping bad objects, stale temp files), so a
    directory it cannot write is unusable, whether it is new, empty or already holds objects: on a
    read-only file system or without write permission every case raises
    :class:`StoreUnavailable` naming the path (an engine then warns and runs without the store,
    or refuses to start when the store is required).

    Raises:
        ValueError: ``root`` or a fan-out name exists and is not a directory.
        StoreUnavailable: a directory cannot be created (read-only file system, permissions, no
            space: the message names the path and the reason), or ``root`` is not readable and
            writable.
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"disk store path {root!r} exists and is not a directory")
    try:
        os.makedirs(root, exist_ok=True)
        for sub in SUBDIRS:
            os.makedirs(os.path.join(root, sub), exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ValueError(f"disk store path {root!r}: {e.filename!r} is not a directory") from e
    except PermissionError as e:
        raise StoreUnavailable(f"disk store {root!r}: permission denied creating {e.filename!r}") from e
    except OSError as e:
        why = "read-only file system" if e.errno == errno.EROFS else (e.strerror or type(e).__name__)
        raise StoreUnavailable(f"disk store {root!r}: cannot create {e.filename!r}: {why}") from e
    if _on_read_only_fs(root):
        raise StoreUnavailable(f"disk store {root!r}: directory is on a read-only file system "
                               "(a disk store needs to write: puts, recency stamps, dropping bad objects)")
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        raise StoreUnavailable(f"disk store {root!r}: directory is not readable and writable")


def check_fanout_dir(root: str, path: str) -> None:
    """Called when object ``path`` is missing: a miss only while its directory exists.

    A fan-out directory that vanished while ``root`` is still there is made
    again (the store recovers once its root is back).

    Raises:
        StoreUnavailable: the fan-out directory is gone and cannot be made again.
    """
    sub = os.path.dirname(path)
    if os.path.isdir(sub):
        return
    if os.path.isdir(root):
        try:
            os.makedirs(sub, exist_ok=True)
            return
        except OSError:
            pass
    raise StoreUnavailable(f"disk store {root!r}: directory {sub!r} vanished")


def scan_layout(root: str) -> list[tuple[int, str, int]]:
    """Delete stale temp files under ``root``; list its object files.

    Returns:
        ``(mtime_ns, digest, file bytes)`` per object file, oldest first.

    Raises:
        StoreUnavailable: a fan-out directory cannot be listed (permissions).
        OSError: other failures listing a directory or deleting a stale temp file.
    """
    found: list[tuple[int, str, int]] = []
    now = time.time()
    for sub in SUBDIRS:
        subdir = os.path.join(root, sub)
        try:
            entries = list(os.scandir(subdir))
        except PermissionError as e:
            raise StoreUnavailable(f"disk store {root!r}: cannot list {subdir!r}") from e
        for entry in entries:
            try:
                if entry.name.startswith(TMP_PREFIX):
                    if tmp_is_stale(entry.name, entry.stat().st_mtime, now):
                        os.unlink(entry.path)
                elif (
                    _OBJECT_NAME.fullmatch(entry.name)
                    and entry.name[:2] == sub
                    and entry.is_file(follow_symlinks=False)
                ):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
            except FileNotFoundError:
                continue  # removed by another process meanwhile
    found.sort()
    return found


# -------------------------------------------------------------- temp files


def tmp_suffix() -> str:
    """The ``.<pid>@<host>`` end of this process's temp file names."""
    return f".{os.getpid()}@{socket.gethostname()}"


def tmp_path(directory: str, suffix: str) -> str:
    """A fresh temp file name in ``directory`` (random token; ``suffix`` from :func:`tmp_suffix`)."""
    return os.path.join(directory, f"{TMP_PREFIX}{secrets.token_hex(8)}{suffix}")


def tmp_is_stale(name: str, mtime: float, now: float) -> bool:
    """Whether temp file ``name`` (last modified at ``mtime``, epoch seconds) may be deleted.

    Stale: older than :data:`STALE_TMP_S`, not a name :func:`tmp_path` makes, or
    written by a process of this host that no longer exists.
    """
    if now - mtime > STALE_TMP_S:
        return True
    _, _, owner = name[len(TMP_PREFIX):].partition(".")
    pid_text, _, host = owner.partition("@")
    if not pid_text.isdigit():
        return True  # not a name this module makes
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


def drop_file(path: str) -> None:
    """Delete ``path`` if possible; every ``OSError`` is ignored (best-effort cleanup)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_dir(directory: str) -> None:
    """fsync a directory so entries linked into it survive power loss.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
