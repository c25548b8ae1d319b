"""Stateless helpers of the Mooncake backend (:mod:`hybridkv.store.mooncake.client`).

Mooncake's result codes and size limits, loading the client class, the
backend's exceptions, master address parsing and reachability, preparing
buffers for ``batch_put_from`` / ``batch_get_into`` (flat byte arrays, small
items packed into one staging buffer, temporary registrations), replica sizes,
keeping abandoned clients alive, running a call under a deadline, and the
warning about wildcard listeners. :mod:`hybridkv.store.mooncake.client` builds the
backend on them; other code imports them from this module. Nothing here imports
``mooncake`` except :func:`load_client_class`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridkv.store.base import Buffer

log = logging.getLogger("hybridkv.store.mooncake.client")  # the backend's logger, wherever the message comes from

INSTALL_HINT = (
    "the mooncake:// store needs the Mooncake transfer engine: "
    "pip install mooncake-transfer-engine-non-cuda (and the system library: apt-get install -y libibverbs1)"
)

# Mooncake ErrorCode values (mooncake-store types.h) that this backend tells apart.
NO_SPACE = -200
INVALID_PARAMS = -600  # also "destination buffer too small" on reads
REPLICA_IS_NOT_READY = -703  # another client's put of the key is still in flight
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
WRITE_FAIL = -500
RPC_FAIL = -900
TRANSFER_CODES = (TRANSFER_FAIL, WRITE_FAIL, LEASE_EXPIRED)
READ_MISS_CODES = (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, INVALID_PARAMS)  # INVALID_PARAMS: buffer too small

#: File-name stem of the LD_PRELOAD library that keeps Mooncake's listeners on loopback
#: (built by :func:`hybridkv.store.mooncake.service.loopback_shim`).
LOOPBACK_SHIM_NAME = "hybridkv_loopback_bind"

MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses smaller non-zero segments
MERGE_GAP_BYTES = 64  # spans this close are registered as one range (alignment padding)
SMALL_ITEM_BYTES = 64 << 10  # put items below this are packed into one staging buffer
NO_SPACE_RETRY_S = (0.02, 0.05, 0.1)
# Right after the master came back, segments are being remounted (~0.5 s measured) and
# every put answers "no space" meanwhile: within this window, puts wait longer.
REMOUNT_WINDOW_S = 5.0
REMOUNT_RETRY_S = (0.2, 0.3, 0.5)

_ABANDONED: list[object] = []  # clients whose master died; never destroyed (see abandon_client)
_warned_wildcard = False


class MooncakeNotInstalled(ImportError):
    """The ``mooncake`` package (or its system library) is missing; the message says how to install it."""


class MooncakeError(RuntimeError):
    """Mooncake answered a code this backend does not expect: a bug, not an outage."""


@dataclass(slots=True)
class MooncakeStats:
    """Counters of the things that are not plain hits or misses."""

    rpc_failures: int = 0
    transfer_failures: int = 0
    no_space: int = 0  # put items refused after the retries
    reconnects: int = 0  # clients created after the first
    abandoned_clients: int = 0


NATIVE_LOG_ENV = "HYBRIDKV_MOONCAKE_LOG"
"""Environment variable: a file that Mooncake's own (native) log goes to instead of stderr."""

_native_log: str | None = None


def native_log_path() -> str | None:
    """Where this process sends Mooncake's native log (``None``: to stderr as Mooncake does)."""
    return _native_log


def send_native_log_to_file() -> str | None:
    """Send Mooncake's native log (glog lines written to file descriptor 2 by the C++ library, also
    from its own threads) to the file named by :data:`NATIVE_LOG_ENV`, once per process.

    Descriptor 2 is pointed at the file (appended to); ``sys.stderr`` is rebound to a duplicate of
    the original descriptor (and logging handlers that wrote to the old ``sys.stderr`` are moved
    to it), so Python's own messages, warnings and tracebacks still reach the terminal. Does
    nothing when the variable is unset or empty. Returns the log path in use.

    Raises:
        OSError: the file cannot be opened (the message names it).
    """
    global _native_log
    path = os.environ.get(NATIVE_LOG_ENV, "")
    if not path or _native_log is not None:
        return _native_log
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:
        raise OSError(exc.errno, f"{NATIVE_LOG_ENV}={path}: cannot open Mooncake's log file: {exc.strerror}") from exc
    import sys

    sys.stderr.flush()
    terminal = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    old = sys.stderr
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=getattr(old, "encoding", None) or "utf-8",
                           errors="backslashreplace")
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):      # handlers made before now keep the terminal
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.setStream(sys.stderr)
    _native_log = path
    return path


def load_client_class():
    """``mooncake.store.MooncakeDistributedStore``, imported on first use (after
    :func:`send_native_log_to_file`).

    Raises:
        MooncakeNotInstalled: with the pip / apt-get commands.
    """
    send_native_log_to_file()
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as exc:
        raise MooncakeNotInstalled(f"{INSTALL_HINT} [{exc}]") from exc
    return MooncakeDistributedStore


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ValueError names a malformed address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"Mooncake master address {address!r} must be host:port, e.g. 127.0.0.1:50051")
    return host, int(port)


def master_reachable(address: str, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to the master's RPC port is accepted (within ``timeout_s`` seconds).

    Raises ValueError for a malformed address (see :func:`split_address`).
    """
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def master_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something that speaks a request/response protocol listens at ``address``.

    Sends 64 zero bytes (not a valid RPC header) and waits up to ``timeout_s`` seconds for any
    answer: a Mooncake master closes such a connection at once (6 ms measured), while a port that
    accepts and never answers (a hung process, another program) stays silent. Mooncake's own
    setup would block this process for its 30 s RPC timeout there, holding the GIL, so no
    deadline of ours could interrupt it.
    """
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"\0" * 64)
            sock.settimeout(timeout_s)
            sock.recv(1)                  # b"" (closed) or any byte: it answers
            return True
    except TimeoutError:
        return False
    except OSError:                       # reset or refused: something answered (or nothing listens)
        return True


# ---------------------------------------------------------------------- client lifetime


def abandon_client(client, stats: MooncakeStats | None = None) -> None:
    """Keep ``client`` alive until the process exits (counted in ``stats.abandoned_clients``).

    Its destructor unmounts segments through the master and blocks for
    10-20 s when the master is gone, also at interpreter exit; an extra
    reference taken at the C level keeps it from ever running.
    """
    _ABANDONED.append(client)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))
    if stats is not None:
        stats.abandoned_clients += 1


def no_space_pauses(recovered_at: float) -> tuple[float, ...]:
    """Seconds to wait before each retry of puts refused for lack of space.

    Longer while a remount may be in progress: within ``REMOUNT_WINDOW_S`` of
    ``recovered_at`` (a ``time.monotonic()`` value, when the store last came back).
    """
    pauses = NO_SPACE_RETRY_S
    if time.monotonic() - recovered_at < REMOUNT_WINDOW_S:
        pauses += REMOUNT_RETRY_S
    return pauses


def run_with_deadline(fn: Callable[[], object], what: str, timeout_s: float) -> bool:
    """Run ``fn`` in a daemon thread; False if it is still running after ``timeout_s`` seconds."""
    worker = threading.Thread(target=fn, name=f"mooncake-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive()


def warn_wildcard_listeners() -> None:
    """Say once per process when Mooncake's listeners are not confined to loopback."""
    global _warned_wildcard
    if _warned_wildcard or LOOPBACK_SHIM_NAME in os.environ.get("LD_PRELOAD", ""):
        return
    _warned_wildcard = True
    log.warning("mooncake: this process's transfer engine listens on all interfaces (0.0.0.0 and [::]) whatever "
                "MC_TCP_BIND_ADDRESS says; start it with hybridkv.store.mooncake.service.loopback_env() to confine it "
                "to loopback")


# ---------------------------------------------------------------------- buffers


def register_temp(client, spans: list[tuple[int, int]], regions: list[tuple[int, int, np.ndarray]]) -> list[int]:
    """Register the ``(address, bytes)`` spans not inside one of ``regions``; returns the registered start addresses.

    ``regions`` are the long-lived registrations ``(start, end, owner)``. Spans
    that touch or lie within ``MERGE_GAP_BYTES`` of each other (slots of one
    arena, separated only by alignment padding) are registered as one range. A
    range Mooncake refuses to register is left out (the transfer then reports it).
    """
    outside = sorted((ptr, ptr + size) for ptr, size in spans
                     if size and not any(s <= ptr and ptr + size <= e for s, e, _ in regions))
    merged: list[list[int]] = []
    for start, end in outside:
        if merged and start <= merged[-1][1] + MERGE_GAP_BYTES:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    temp = []
    for start, end in merged:
        if client.register_buffer(start, end - start) == 0:
            temp.append(start)
    return temp


def unregister_temp(client, temp: list[int]) -> None:
    """Undo :func:`register_temp` (``temp`` is what it returned)."""
    for ptr in temp:
        client.unregister_buffer(ptr)


def byte_array(data: Buffer) -> np.ndarray:
    """A flat uint8 array over ``data`` (no copy when it is contiguous)."""
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return np.frombuffer(view.cast("B"), dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)


def writable_array(buffer: Buffer) -> np.ndarray:
    """A flat uint8 array over ``buffer`` (no copy); ValueError if it is read-only or not contiguous."""
    view = memoryview(buffer)
    if view.readonly or not view.c_contiguous:
        raise ValueError("get_into and register_memory need writable, contiguous buffers")
    return byte_array(view)


def pack_small(arrays: list[np.ndarray]) -> tuple[np.ndarray | None, list[int]]:
    """Copy the small arrays into one staging buffer; the address of every item's bytes.

    Arrays under ``SMALL_ITEM_BYTES`` are packed when there are at least two of
    them; the staging buffer (None when nothing was packed) must outlive the
    transfer that reads from the returned addresses.
    """
    small = [i for i, a in enumerate(arrays) if a.nbytes < SMALL_ITEM_BYTES]
    ptrs = [a.ctypes.data for a in arrays]
    if len(small) < 2:
        return None, ptrs
    staging = np.empty(sum(arrays[i].nbytes for i in small), dtype=np.uint8)
    offset = 0
    for i in small:
        n = arrays[i].nbytes
        staging[offset:offset + n] = arrays[i]
        ptrs[i] = staging.ctypes.data + offset
        offset += n
    return staging, ptrs


def memory_sizes(descriptors: dict) -> dict[str, int]:
    """Object sizes in bytes from ``batch_get_replica_desc`` (first complete memory replica per key)."""
    sizes = {}
    for key, replicas in descriptors.items():
        for replica in replicas:
            if replica.is_memory_replica() and replica.status.name == "COMPLETE":
                sizes[key] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                break
    return sizes
