"""``open_store(url)``: the backend for a store URL (``none``, ``memory://``, ``disk:///PATH``,
``mooncake://HOST:PORT``). It sits above every backend, so :mod:`hybridkv.store.base` imports none of them."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

from hybridkv.store.base import ObjectStore
from hybridkv.store.disk import DiskStore
from hybridkv.store.memory import MemoryStore
from hybridkv.store.mooncake.client import MooncakeStore


def open_store(url: str, quota: float | None = None) -> ObjectStore | None:
    """Backend for a store URL.

    ``none`` -> ``None``; ``memory://`` -> :class:`~hybridkv.store.memory.MemoryStore`;
    ``disk:///PATH[?capacity=BYTES][&eviction=lru|value][&quota=F]`` ->
    :class:`~hybridkv.store.disk.DiskStore` (``quota``: fraction in (0, 1] of the capacity
    one owner may hold; default the ``quota`` argument, e.g. ``CacheConfig.tenant_quota``,
    applied only when the URL gives a capacity);
    ``mooncake://HOST:PORT[?quota_bytes=N | ?capacity=BYTES[&quota=F]]`` ->
    :class:`~hybridkv.store.mooncake.client.MooncakeStore` (a per-owner quota, per process:
    ``quota_bytes`` bytes, or ``F`` of the ``capacity`` the operator states for the store, which
    this client does not enforce (Mooncake evicts on its own); without ``quota=`` the ``quota``
    argument applies when the URL gives a capacity, as for ``disk``).

    Raises:
        ValueError: unknown scheme or malformed URL, a parameter blank, given twice or unknown to
            the scheme (message names it).
        StoreUnavailable: the service cannot be reached.
    """
    if url in ("none", ""):
        return None
    parsed = urlparse(url)
    query = {}
    for k, v in parse_qs(parsed.query, keep_blank_values=True).items():
        if len(v) > 1:
            raise ValueError(f"store URL {url!r}: parameter {k!r} given {len(v)} times")
        if not v[0]:
            raise ValueError(f"store URL {url!r}: parameter {k!r} has no value")
        query[k] = v[0]
    def share(cap: int | None) -> float | None:
        """The URL's ``quota=F`` (checked, needs a capacity), else the ``quota`` argument when a
        capacity is given."""
        if "quota" not in query:
            return quota if cap is not None else None
        try:
            f = float(query["quota"])
        except ValueError:
            raise ValueError(f"store URL {url!r}: quota={query['quota']!r} is not a fraction in (0, 1]") from None
        if not 0.0 < f <= 1.0:
            raise ValueError(f"store URL {url!r}: quota={query['quota']!r} is not a fraction in (0, 1]")
        if cap is None:
            raise ValueError(f"store URL {url!r}: quota={query['quota']!r} needs capacity=BYTES")
        return f

    def capacity() -> int | None:
        if "capacity" not in query:
            return None
        try:
            return int(query["capacity"])
        except ValueError:
            raise ValueError(f"store URL {url!r}: capacity={query['capacity']!r} is not a byte count") from None

    if parsed.scheme == "memory":
        if parsed.netloc or parsed.path:
            raise ValueError(f"store URL {url!r}: memory:// takes no host or path, got "
                             f"{(parsed.netloc + parsed.path)!r}")
        unknown = sorted(set(query) - {"capacity"})
        if unknown:
            raise ValueError(f"store URL {url!r}: unknown parameter {unknown[0]!r}; known: ['capacity']")
        cap = capacity()
        if cap is not None and cap < 0:
            raise ValueError(f"store URL {url!r}: capacity={query['capacity']!r} is not a byte count >= 0")
        return MemoryStore(cap)
    if parsed.scheme == "disk":
        if parsed.netloc or not parsed.path:
            raise ValueError(f"store URL {url!r}: use disk:///absolute/dir (three slashes, no host)")
        unknown = sorted(set(query) - {"capacity", "eviction", "quota"})
        if unknown:
            raise ValueError(f"store URL {url!r}: unknown parameter {unknown[0]!r}; "
                             "known: ['capacity', 'eviction', 'quota']")
        cap = capacity()
        return DiskStore(parsed.path, capacity_bytes=cap, eviction=query.get("eviction", "lru"), quota=share(cap))
    if parsed.scheme == "mooncake":
        if not parsed.hostname or not parsed.port:
            raise ValueError(f"store URL {url!r} needs host:port, e.g. mooncake://127.0.0.1:50051")
        known = {"segment_bytes", "local_buffer_bytes", "setup_retries", "timeout_s", "retry_interval_s",
                 "quota_bytes", "capacity", "quota"}
        unknown = sorted(set(query) - known)
        if unknown:
            raise ValueError(f"store URL {url!r}: unknown parameter {unknown[0]!r}; known: {sorted(known)}")
        cap = capacity()
        if cap is not None and cap <= 0:
            raise ValueError(f"store URL {url!r}: capacity={query['capacity']!r} is not a positive byte count")
        if "quota_bytes" in query:
            if "capacity" in query or "quota" in query:
                raise ValueError(f"store URL {url!r}: give quota_bytes=N or capacity=BYTES&quota=F, not both")
            text = query.pop("quota_bytes")
            try:
                limit = int(text)
            except ValueError:
                limit = 0
            if limit <= 0:
                raise ValueError(f"store URL {url!r}: quota_bytes={text!r} is not a positive byte count")
        else:
            f = share(cap)
            limit = None if f is None else max(1, int(f * cap))
        query.pop("capacity", None), query.pop("quota", None)
        return MooncakeStore(master=f"{parsed.hostname}:{parsed.port}", quota_bytes=limit, **query)
    raise ValueError(f"store URL {url!r}: scheme {parsed.scheme!r} is not one of none, memory, disk, mooncake")
