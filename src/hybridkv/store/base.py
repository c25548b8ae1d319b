"""Object-store interface shared by every backend (DESIGN §5, STYLE 9).

A store holds immutable byte objects under string keys. Every backend
implements the whole interface; batched forms are the primitive. Contract:

* ``put`` never overwrites a published key: putting an existing key is a
  no-op that reports success (idempotent puts).
* ``get`` returns ``None`` for a key that is absent (never ``b""`` for "absent").
* A backend that cannot reach its service raises :class:`StoreUnavailable`;
  the caller turns that into a counted miss with reason ``unreachable``.
  Any other exception is a bug and propagates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

Buffer = bytes | bytearray | memoryview


class StoreUnavailable(RuntimeError):
    """The backing service cannot be reached (or timed out); the message says which."""


class ObjectStore(ABC):
    """Batched put / get / exists / remove of immutable byte objects."""

    #: URL scheme this backend answers to (``disk``, ``mooncake``, ``memory``).
    scheme = ""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present."""

    @abstractmethod
    def put(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store each ``(key, bytes)``; existing keys are left as they are.

        Returns:
            Per item: ``True`` if the key holds an object afterwards (new or
            already present), ``False`` if the backend refused it (no space).
        """

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Objects for ``keys`` (``None`` where absent). A key may repeat; each slot is filled."""

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        """Read each object into a caller buffer; returns bytes read or ``-1`` if absent / too small.

        Backends with a zero-copy path override this; the default copies.
        """
        out = []
        for data, buf in zip(self.get(keys), buffers):
            if data is None or len(data) > len(buf):
                out.append(-1)
                continue
            buf[: len(data)] = data
            out.append(len(data))
        return out

    def register_memory(self, buffer: Buffer) -> None:
        """Declare a long-lived writable buffer that later ``put`` / ``get_into`` calls use
        views of (backends that register memory for transfers do it once here). No-op by default."""

    def unregister_memory(self, buffer: Buffer) -> None:
        """Undo :meth:`register_memory`. No-op by default."""

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> None:
        """Delete keys (absent keys are ignored)."""

    def close(self) -> None:
        """Release connections / handles. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemoryStore(ObjectStore):
    """In-process dict backend for unit tests (``memory://``).

    Args:
        capacity_bytes: evict oldest objects beyond this total (silently, like
            Mooncake); ``None`` = unlimited.
    """

    scheme = "memory"

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self.capacity_bytes = capacity_bytes
        self.available = True

    def _check(self) -> None:
        if not self.available:
            raise StoreUnavailable("memory store marked unavailable")

    def exists(self, keys):
        self._check()
        return [k in self._data for k in keys]

    def put(self, items):
        self._check()
        out = []
        for key, data in items:
            if key not in self._data:
                blob = bytes(data)
                self._data[key] = blob
                self._bytes += len(blob)
            out.append(True)
        while self.capacity_bytes is not None and self._bytes > self.capacity_bytes and self._data:
            oldest = next(iter(self._data))
            self._bytes -= len(self._data.pop(oldest))
        return out

    def get(self, keys):
        self._check()
        return [self._data.get(k) for k in keys]

    def remove(self, keys):
        self._check()
        for k in keys:
            blob = self._data.pop(k, None)
            if blob is not None:
                self._bytes -= len(blob)

    def corrupt(self, key: str, offset: int = 0) -> None:
        """Test hook: flip one byte of a stored object."""
        blob = bytearray(self._data[key])
        blob[offset] ^= 0xFF
        self._data[key] = bytes(blob)


def open_store(url: str) -> ObjectStore | None:
    """Backend for a store URL.

    ``none`` -> ``None``; ``memory://`` -> :class:`MemoryStore`;
    ``disk:///PATH[?capacity=BYTES]`` -> :class:`~hybridkv.store.disk.DiskStore`;
    ``mooncake://HOST:PORT`` -> :class:`~hybridkv.store.mooncake.MooncakeStore`.

    Raises:
        ValueError: unknown scheme or malformed URL (message names it).
        StoreUnavailable: the service cannot be reached.
    """
    from urllib.parse import parse_qs, urlparse

    if url in ("none", ""):
        return None
    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    def capacity() -> int | None:
        if "capacity" not in query:
            return None
        try:
            return int(query["capacity"])
        except ValueError:
            raise ValueError(f"store URL {url!r}: capacity={query['capacity']!r} is not a byte count") from None

    if parsed.scheme == "memory":
        return MemoryStore(capacity())
    if parsed.scheme == "disk":
        from hybridkv.store.disk import DiskStore
        if parsed.netloc or not parsed.path:
            raise ValueError(f"store URL {url!r}: use disk:///absolute/dir (three slashes, no host)")
        return DiskStore(parsed.path, capacity_bytes=capacity())
    if parsed.scheme == "mooncake":
        from hybridkv.store.mooncake import MooncakeStore
        if not parsed.hostname or not parsed.port:
            raise ValueError(f"store URL {url!r} needs host:port, e.g. mooncake://127.0.0.1:50051")
        known = {"segment_bytes", "local_buffer_bytes", "setup_retries", "timeout_s", "retry_interval_s"}
        unknown = sorted(set(query) - known)
        if unknown:
            raise ValueError(f"store URL {url!r}: unknown parameter {unknown[0]!r}; known: {sorted(known)}")
        return MooncakeStore(master=f"{parsed.hostname}:{parsed.port}", **query)
    raise ValueError(f"store URL {url!r}: scheme {parsed.scheme!r} is not one of none, memory, disk, mooncake")
