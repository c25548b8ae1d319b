"""``open_store(url)``: the backend for a store URL (``none``, ``memory://``, ``disk:///PATH``,
``mooncake://HOST:PORT``). It sits above every backend, so :mod:`hybridkv.store.base` imports none of them.

Every URL is checked here, in one place, before a backend is built: the scheme, the host and port,
and each query parameter against the table of its scheme (:data:`PARAMETERS`: type and range). A
bad part is a ``ValueError`` naming the URL, the parameter and its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

from hybridkv.store.base import ObjectStore
from hybridkv.store.disk import DiskStore
from hybridkv.store.memory import MemoryStore
from hybridkv.store.mooncake.client import MooncakeStore


@dataclass(frozen=True, slots=True)
class Param:
    """One query parameter of a store URL: ``kind`` ``int``, ``float`` (finite) or ``choice``;
    numbers must be at least ``low`` (above it when ``low_open``) and at most ``high``;
    ``what`` is the phrase an error uses ("is not <what>")."""

    kind: str
    what: str
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    choices: tuple[str, ...] = ()


_BYTES = Param("int", "a byte count >= 0", low=0)
_POSITIVE_BYTES = Param("int", "a positive byte count", low=0, low_open=True)
_FRACTION = Param("float", "a fraction in (0, 1]", low=0.0, low_open=True, high=1.0)

#: Query parameters each scheme takes (bytes, seconds, counts, fractions).
PARAMETERS: dict[str, dict[str, Param]] = {
    "memory": {"capacity": _BYTES},
    "disk": {"capacity": _BYTES, "eviction": Param("choice", "one of lru, value", choices=("lru", "value")),
             "quota": _FRACTION},
    "mooncake": {"segment_bytes": _BYTES, "local_buffer_bytes": _BYTES,
                 "setup_retries": Param("int", "a count >= 1", low=1),
                 "timeout_s": Param("float", "a number of seconds > 0", low=0.0, low_open=True),
                 "retry_interval_s": Param("float", "a number of seconds >= 0", low=0.0),
                 "quota_bytes": _POSITIVE_BYTES, "capacity": _POSITIVE_BYTES, "quota": _FRACTION},
}


def _value(url: str, name: str, text: str, spec: Param) -> int | float | str:
    """``text`` converted and range-checked by ``spec``; ``ValueError`` naming ``name=text``."""
    bad = ValueError(f"store URL {url!r}: {name}={text!r} is not {spec.what}")
    if spec.kind == "choice":
        if text not in spec.choices:
            raise bad
        return text
    try:
        value = int(text) if spec.kind == "int" else float(text)
    except ValueError:
        raise bad from None
    if not math.isfinite(value):
        raise bad
    if spec.low is not None and (value <= spec.low if spec.low_open else value < spec.low):
        raise bad
    if spec.high is not None and value > spec.high:
        raise bad
    return value


def _port(url: str, netloc: str) -> int | None:
    """The port of ``netloc`` (``None`` when none is written).

    Raises:
        ValueError: the port is not an integer in 1..65535 (named).
    """
    host_end = netloc.rfind("]")                    # an IPv6 literal holds colons of its own
    head, sep, text = netloc[host_end + 1:].rpartition(":")
    if not sep:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"store URL {url!r}: port {text!r} is not a TCP port (1-65535)")
    return int(text)


def open_store(url: str, quota: float | None = None) -> ObjectStore | None:
    """Backend for a store URL.

    ``none`` -> ``None``; ``memory://`` -> :class:`~hybridkv.store.memory.MemoryStore` (a dict in
    this process, private to the one engine that opens it: engines in other processes, or other
    engines of this process, each get their own; to share a store use ``disk`` or ``mooncake``);
    ``disk:///PATH[?capacity=BYTES][&eviction=lru|value][&quota=F]`` ->
    :class:`~hybridkv.store.disk.DiskStore` (``quota``: fraction in (0, 1] of the capacity
    one owner may hold; default the ``quota`` argument, e.g. ``CacheConfig.tenant_quota``,
    applied only when the URL gives a capacity);
    ``mooncake://HOST:PORT[?quota_bytes=N | ?capacity=BYTES[&quota=F]]`` ->
    :class:`~hybridkv.store.mooncake.client.MooncakeStore` (a per-owner quota, per process:
    ``quota_bytes`` bytes, or ``F`` of the ``capacity`` the operator states for the store, which
    this client does not enforce (Mooncake evicts on its own); without ``quota=`` the ``quota``
    argument applies when the URL gives a capacity, as for ``disk``). A Mooncake URL also takes
    ``segment_bytes``, ``local_buffer_bytes`` (bytes >= 0), ``setup_retries`` (>= 1),
    ``timeout_s`` (seconds > 0) and ``retry_interval_s`` (seconds >= 0). Types and ranges of
    every parameter: :data:`PARAMETERS`.

    Raises:
        ValueError: unknown scheme or malformed URL; a port outside 1..65535; a parameter blank,
            given twice, unknown to the scheme, or of the wrong type or range (the message names
            the parameter and its value).
        StoreUnavailable: the service cannot be reached, or a disk store's directory cannot be
            created or written (e.g. a read-only file system; the message names the path).
    """
    checked = _check(url)
    if checked is None:
        return None
    scheme, where, query = checked
    cap = query.get("capacity")
    share = query.get("quota", quota if cap is not None else None)
    if scheme == "memory":
        return MemoryStore(cap)
    if scheme == "disk":
        return DiskStore(where, capacity_bytes=cap, eviction=query.get("eviction", "lru"), quota=share)
    if "quota_bytes" in query:
        limit = query.pop("quota_bytes")
    else:
        limit = None if share is None else max(1, int(share * cap))
    query.pop("capacity", None), query.pop("quota", None)
    return MooncakeStore(master=where, quota_bytes=limit, **query)


def check_store_url(url: str) -> None:
    """Check a store URL as :func:`open_store` does, opening nothing (for a command line to refuse
    a bad ``--store`` before it starts anything).

    Raises:
        ValueError: as :func:`open_store`.
    """
    _check(url)


def _check(url: str) -> tuple[str, str, dict[str, int | float | str]] | None:
    """``(scheme, where, parameters)`` of a valid URL (``where``: the disk path or the Mooncake
    ``host:port``; parameters converted by :data:`PARAMETERS`), ``None`` for ``none``.

    Raises:
        ValueError: as :func:`open_store`.
    """
    if url in ("none", ""):
        return None
    parsed = urlparse(url)
    table = PARAMETERS.get(parsed.scheme)
    if table is None:
        raise ValueError(f"store URL {url!r}: scheme {parsed.scheme!r} is not one of none, memory, disk, mooncake")
    query: dict[str, int | float | str] = {}
    texts: dict[str, str] = {}
    for k, v in parse_qs(parsed.query, keep_blank_values=True).items():
        if len(v) > 1:
            raise ValueError(f"store URL {url!r}: parameter {k!r} given {len(v)} times")
        if not v[0]:
            raise ValueError(f"store URL {url!r}: parameter {k!r} has no value")
        if k not in table:
            raise ValueError(f"store URL {url!r}: unknown parameter {k!r}; known: {sorted(table)}")
        query[k], texts[k] = _value(url, k, v[0], table[k]), v[0]
    if "quota" in query and "capacity" not in query:
        raise ValueError(f"store URL {url!r}: quota={texts['quota']!r} needs capacity=BYTES")
    if parsed.scheme == "memory":
        if parsed.netloc or parsed.path:
            raise ValueError(f"store URL {url!r}: memory:// takes no host or path, got "
                             f"{(parsed.netloc + parsed.path)!r}")
        return "memory", "", query
    if parsed.scheme == "disk":
        if parsed.netloc or not parsed.path:
            raise ValueError(f"store URL {url!r}: use disk:///absolute/dir (three slashes, no host)")
        return "disk", parsed.path, query
    port = _port(url, parsed.netloc)
    if not parsed.hostname or port is None:
        raise ValueError(f"store URL {url!r} needs host:port, e.g. mooncake://127.0.0.1:50051")
    if "quota_bytes" in query and ("capacity" in query or "quota" in query):
        raise ValueError(f"store URL {url!r}: give quota_bytes=N or capacity=BYTES&quota=F, not both")
    return "mooncake", f"{parsed.hostname}:{port}", query
