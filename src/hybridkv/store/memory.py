"""In-process dict backend (``memory://``): tests, and a store that lives as long as the process."""

from __future__ import annotations

from hybridkv.store.base import ObjectStore, StoreUnavailable


class MemoryStore(ObjectStore):
    """In-process dict backend for unit tests (``memory://``).

    Args:
        capacity_bytes: evict oldest objects beyond this total (silently, like
            Mooncake); ``None`` = unlimited.
    """

    scheme = "memory"
    lists_keys = True

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

    def list_keys(self, prefix):
        """Keys starting with ``prefix``."""
        self._check()
        return [k for k in self._data if k.startswith(prefix)]

    def corrupt(self, key: str, offset: int = 0) -> None:
        """Test hook: flip one byte of a stored object."""
        blob = bytearray(self._data[key])
        blob[offset] ^= 0xFF
        self._data[key] = bytes(blob)
