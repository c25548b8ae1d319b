"""A store wrapper that injects faults at the object-store boundary (issue 11, item 2), for tests
and the soak (:mod:`hybridkv.replay.soak`).

:class:`FaultyStore` delegates to any :class:`~hybridkv.store.base.ObjectStore` and, per call or
per key, injects one of :data:`FAULT_KINDS`:

* ``unavailable``: the call raises :class:`~hybridkv.store.base.StoreUnavailable`.
* ``slow``: the call sleeps ``slow_seconds`` first (bounded).
* ``lost_manifest``: a put of a manifest key (ends with ``manifest_suffix``) reports success but
  stores nothing, as when a writer dies between its component put and its manifest put.
* ``corrupt``: a read returns the object with one byte flipped (the stored object is intact).
* ``vanish``: the object is removed just before a read, as when another process evicts it
  between the existence check and the read.
* ``no_space``: a put of one item is refused (``False``), as a full disk refuses it.
* ``two_writers``: another writer's object for the same key lands just before this put: the
  same length with one byte different (a second instance that computed the entry with other
  rounding, or a torn one). The store keeps the first object, so this put reports success
  while the key holds the other writer's bytes; readers see a mix of two writers' components
  and manifest, which only checksums can tell apart.

Decisions are deterministic: each comes from a hash of ``(seed, kind, operation, key, how many
times this key saw this operation)``, not from a shared random stream, so threads calling in a
different order make the same decisions per key.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Sequence

from hybridkv.store.base import Buffer, ObjectStore, StoreUnavailable

FAULT_KINDS = ("unavailable", "slow", "lost_manifest", "corrupt", "vanish", "no_space", "two_writers")


def _flip_one_byte(data) -> bytes:
    """A copy of ``data`` (bytes-like, non-empty) with its middle byte inverted."""
    blob = bytearray(memoryview(data).cast("B"))
    blob[len(blob) // 2] ^= 0xFF
    return bytes(blob)


class FaultyStore(ObjectStore):
    """Delegates to ``inner`` and injects faults (see the module docstring).

    Args:
        inner: the store that holds the objects.
        rates: fault kind -> probability per decision (call for ``unavailable`` / ``slow``,
            key for the others); kinds left out never happen.
        seed: seed of the decisions.
        slow_seconds: sleep of one ``slow`` fault (seconds).
        manifest_suffix: how manifest keys end (cache ABI v3: ``/manifest``).
        close_inner: :meth:`close` also closes ``inner``.

    Attributes:
        injected: fault kind -> faults injected so far.
        max_call_seconds: longest wall time of any call so far (seconds).

    Raises:
        ValueError: an unknown fault kind or a rate outside ``[0, 1]``.
    """

    def __init__(self, inner: ObjectStore, rates: dict[str, float], seed: int = 0, slow_seconds: float = 0.01,
                 manifest_suffix: str = "/manifest", close_inner: bool = True) -> None:
        for kind, rate in rates.items():
            if kind not in FAULT_KINDS:
                raise ValueError(f"fault kind {kind!r} is not one of {FAULT_KINDS}")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate {kind}={rate!r} must lie in [0, 1]")
        self.inner = inner
        self.scheme = inner.scheme
        self.lists_keys = getattr(inner, "lists_keys", False)
        self.rates = dict(rates)
        self.seed = seed
        self.slow_seconds = slow_seconds
        self.manifest_suffix = manifest_suffix
        self.close_inner = close_inner
        self.injected: Counter = Counter({k: 0 for k in FAULT_KINDS})
        self.max_call_seconds = 0.0
        self._seen: Counter = Counter()
        self._lock = threading.Lock()

    # -- decisions ------------------------------------------------------------------------------
    def _roll(self, kind: str, op: str, key: str) -> bool:
        rate = self.rates.get(kind, 0.0)
        if rate <= 0.0:
            return False
        with self._lock:
            n = self._seen[(kind, op, key)]
            self._seen[(kind, op, key)] = n + 1
        h = hashlib.blake2b(f"{self.seed}|{kind}|{op}|{key}|{n}".encode(), digest_size=8).digest()
        hit = int.from_bytes(h, "little") / 2**64 < rate
        if hit:
            with self._lock:
                self.injected[kind] += 1
        return hit

    def _enter(self, op: str, keys: Sequence[str]) -> float:
        """Call-level faults; returns the start time."""
        t0 = time.monotonic()
        first = keys[0] if keys else ""
        if self._roll("slow", op, first):
            time.sleep(self.slow_seconds)
        if self._roll("unavailable", op, first):
            self._leave(t0)
            raise StoreUnavailable(f"injected fault: {op} unavailable")
        return t0

    def _leave(self, t0: float) -> None:
        dt = time.monotonic() - t0
        with self._lock:
            self.max_call_seconds = max(self.max_call_seconds, dt)

    # -- ObjectStore -----------------------------------------------------------------------------
    def exists(self, keys):
        t0 = self._enter("exists", keys)
        try:
            return self.inner.exists(keys)
        finally:
            self._leave(t0)

    def put(self, items):
        items = list(items)
        t0 = self._enter("put", [k for k, _ in items])
        try:
            keep, out = [], []
            for key, data in items:
                if key.endswith(self.manifest_suffix) and self._roll("lost_manifest", "put", key):
                    out.append(True)                          # reported stored, never stored
                elif self._roll("no_space", "put", key):
                    out.append(False)
                else:
                    if self._roll("two_writers", "put", key):
                        self.inner.put([(key, _flip_one_byte(data))])
                    out.append(None)
                    keep.append((key, data))
            landed = iter(self.inner.put(keep) if keep else [])
            return [next(landed) if o is None else o for o in out]
        finally:
            self._leave(t0)

    def _before_read(self, keys: Sequence[str]) -> None:
        gone = [k for k in keys if self._roll("vanish", "get", k)]
        if gone:
            self.inner.remove(gone)

    def get(self, keys):
        keys = list(keys)
        t0 = self._enter("get", keys)
        try:
            self._before_read(keys)
            out = self.inner.get(keys)
            for i, (k, data) in enumerate(zip(keys, out)):
                if data and self._roll("corrupt", "get", k):
                    out[i] = _flip_one_byte(data)
            return out
        finally:
            self._leave(t0)

    def get_into(self, keys, buffers):
        keys = list(keys)
        t0 = self._enter("get", keys)
        try:
            self._before_read(keys)
            out = self.inner.get_into(keys, buffers)
            for k, n, buf in zip(keys, out, buffers):
                if n > 0 and self._roll("corrupt", "get", k):
                    view = memoryview(buf).cast("B")
                    view[n // 2] ^= 0xFF
            return out
        finally:
            self._leave(t0)

    def list_keys(self, prefix):
        """The inner store's keys starting with ``prefix`` (no faults injected)."""
        return self.inner.list_keys(prefix)

    def remove_prefix(self, prefix, suffix=""):
        """The inner store's :meth:`remove_prefix` (no faults injected)."""
        return self.inner.remove_prefix(prefix, suffix)

    def remove(self, keys):
        t0 = self._enter("remove", keys)
        try:
            return self.inner.remove(keys)
        finally:
            self._leave(t0)

    def register_memory(self, buffer: Buffer) -> None:
        self.inner.register_memory(buffer)

    def unregister_memory(self, buffer: Buffer) -> None:
        self.inner.unregister_memory(buffer)

    def close(self) -> None:
        if self.close_inner:
            self.inner.close()
