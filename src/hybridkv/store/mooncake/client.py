"""Mooncake Store backend (``mooncake://127.0.0.1:50051``), DESIGN §5 and §11.

Where the bytes live: a Mooncake master only keeps metadata. Object bytes live
in the memory *segments* that client processes mount. An engine's
:class:`MooncakeStore` mounts no segment by default (``segment_bytes=0``), so
its objects land in the segment of the long-lived storage process started by
``hybridkv store start`` (:mod:`hybridkv.store.mooncake.service`) and survive engines
exiting. When the process holding a segment exits, its objects vanish (the
master notices after ~10 s; until then ``exists`` may still say True and a read
fails). Killing the master forgets every object; the storage process remounts
its segment when a master comes back on the same port.

How Mooncake's answers map onto the :class:`ObjectStore` contract:

* data moves only through ``batch_put_from`` / ``batch_get_into`` on
  registered memory (zero-copy for ``get_into`` and for large ``put`` items);
  Mooncake's bytes ``get`` returns ``b''`` for a miss and for a failed
  transfer alike, so it is never used;
* put of an existing key leaves it unchanged and reports True (Mooncake
  answers 0, or -705 while another client's put of the key is in flight);
* no space (-200) is retried briefly (eviction runs in the background and frees
  space within tens of ms), then reported as False; eviction itself is silent;
* a key missing on read is ``None`` / ``-1`` (-704); a key named twice in one
  batch read is fetched once and copied to every destination (Mooncake itself
  fills only one of them and reports success for both);
* master RPC failure (-900), or the master port refusing connections, raises
  :class:`StoreUnavailable`; so does a failed transfer (-800, the process
  holding the bytes is gone). After an RPC failure, calls fail fast (no
  Mooncake call) for ``retry_interval_s``; then one TCP probe of the master
  decides whether to try again; a client that keeps failing while the master
  answers is replaced by a new one;
* remove uses ``force=True``: every read leases the object for ~10 s and a
  plain remove would fail with -706 during that time.

Quotas (``quota_bytes``, docs/how-to/purge-and-quotas.md "Quotas per tenant"): Mooncake records no owner and cannot list
keys, so this backend keeps a ledger (:class:`~hybridkv.store.mooncake.ledger.OwnerLedger`) of
the objects it wrote through :meth:`MooncakeStore.put_owned` per owner, in whole entries (keys
sharing everything up to the last ``/``), least recently used first (its own puts and reads
refresh an entry). A put by an owner over its quota first removes that owner's own oldest whole
entries (manifests first, through :meth:`MooncakeStore.remove`), never another owner's; an
object that would not fit even then, or is larger than the quota, is refused (``False``), and so
is the manifest of an entry that lost objects that way. The accounting is **per process**: N
writer processes of one tenant can hold up to N x its quota in Mooncake. Objects Mooncake
evicted on its own stay charged until a read or existence query of this process finds them
absent, which drops them from the ledger.

Blocking: a Mooncake call against a dead master returns after its own RPC
timeout (measured ~4.5 s here); only the first call after the master dies pays
it. Setup is preceded by a TCP probe, so an absent master fails in
milliseconds. A client whose master is gone is never closed: its destructor
blocks for 10-20 s, so it is kept alive until the process exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from hybridkv.store.base import Buffer, ObjectStore, StoreUnavailable, check_key_pattern, key_pattern_regex
from hybridkv.store.mooncake.ledger import OwnerLedger, entry_of, owner_hex
from hybridkv.store.mooncake.support import (
    MIN_SEGMENT_BYTES,
    NO_SPACE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    READ_MISS_CODES,
    RPC_FAIL,
    TRANSFER_CODES,
    MooncakeError,
    MooncakeStats,
    abandon_client,
    byte_array,
    load_client_class,
    master_answers,
    master_reachable,
    memory_sizes,
    no_space_pauses,
    pack_small,
    register_temp,
    run_with_deadline,
    split_address,
    unregister_temp,
    warn_wildcard_listeners,
    writable_array,
)

log = logging.getLogger(__name__)


def _quota_bytes(value: int | str | None) -> int | None:
    """``quota_bytes`` as a positive int (``None``: no quota).

    Raises:
        ValueError: not a positive whole number of bytes (the message names the value).
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            n = int(value)
        except ValueError:
            n = 0
    elif isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        n = 0
    if n <= 0:
        raise ValueError(f"Mooncake store quota_bytes={value!r} must be a positive whole number of bytes")
    return n


class MooncakeStore(ObjectStore):
    """Client of a Mooncake Store master on loopback (tcp, P2P handshake).

    Args:
        master: the master's ``host:port``.
        segment_bytes: memory this client contributes to the store; 0 (engines)
            or at least 16 MiB (the storage process). Objects in it die with
            this process.
        local_buffer_bytes: Mooncake's staging buffer for its bytes API, which
            this backend does not use; 0 is fine.
        setup_retries: ``MC_STORE_CLIENT_SETUP_RETRIES`` (Mooncake's default
            retries for ~90 s).
        timeout_s: deadline of setup and close.
        retry_interval_s: after a failure, how long calls fail fast before the
            master is probed again.
        local_hostname: address this client advertises; loopback only here.
        quota_bytes: payload bytes one owner may hold through this process's
            :meth:`put_owned` (``None``: no quota). Per process (see the module docstring).

    Every argument may be given as a string (they come from URL query
    parameters). Raises StoreUnavailable if the master cannot be reached, and
    ValueError for a bad argument (the message names it: ``quota_bytes='abc'``).

    Counters (read-only for callers): ``quota_evictions`` entries removed for a quota;
    ``quota_refused`` objects refused for a quota.
    """

    scheme = "mooncake"

    def __init__(
        self,
        master: str = "127.0.0.1:50051",
        segment_bytes: int | str = 0,
        local_buffer_bytes: int | str = 0,
        setup_retries: int | str = 1,
        timeout_s: float | str = 5.0,
        retry_interval_s: float | str = 1.0,
        local_hostname: str = "127.0.0.1",
        quota_bytes: int | str | None = None,
    ) -> None:
        split_address(master)
        self.quota_bytes = _quota_bytes(quota_bytes)
        self.quota_evictions = 0
        self.quota_refused = 0
        self._ledger = None if self.quota_bytes is None else OwnerLedger(self.quota_bytes)
        self.master = master
        self.segment_bytes = int(segment_bytes)
        self.local_buffer_bytes = int(local_buffer_bytes)
        self.setup_retries = int(setup_retries)
        self.timeout_s = float(timeout_s)
        self.retry_interval_s = float(retry_interval_s)
        self.local_hostname = local_hostname
        if self.segment_bytes and self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes={self.segment_bytes}: Mooncake needs 0 or at least {MIN_SEGMENT_BYTES}")
        for name, ok, rule in (("local_buffer_bytes", self.local_buffer_bytes >= 0, ">= 0"),
                               ("setup_retries", self.setup_retries >= 1, ">= 1"),
                               ("timeout_s", 0 < self.timeout_s < float("inf"), "> 0 and finite"),
                               ("retry_interval_s", 0 <= self.retry_interval_s < float("inf"), ">= 0 and finite")):
            if not ok:
                raise ValueError(f"MooncakeStore {name}={getattr(self, name)!r} must be {rule}")
        self.stats = MooncakeStats()
        self._cls = load_client_class()
        self._lock = threading.RLock()
        self._client = None  # None after close, or while no client could be set up
        self._closed = False
        self._healthy = False  # invariant: True only while _client is not None
        self._failures = 0  # consecutive failed calls since the last success
        self._retry_at = 0.0  # monotonic time before which calls fail fast
        self._down_reason = ""
        self._recovered_at = float("-inf")  # monotonic time the store last came back after a failure
        self._regions: list[tuple[int, int, np.ndarray]] = []  # long-lived registrations: (start, end, owner)
        self._pinned_config = None  # ReplicateConfig(with_hard_pin=True), made on first put_pinned
        with self._lock:
            self._connect()

    # ------------------------------------------------------------------ public API

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._lock:
            client = self._ready()
            codes = client.batch_is_exist(list(keys))
            if any(c not in (0, 1) for c in codes):
                self._rpc_failed("is_exist", min(codes))
            self._succeeded()
            if self._ledger is not None:  # gone (Mooncake's own eviction, another process): no longer charged
                self._ledger.drop([k for k, c in zip(keys, codes) if c == 0])
            return [c == 1 for c in codes]

    def put(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        return self._put(items, pinned=False)

    def put_pinned(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """:meth:`put` with Mooncake's hard pin (``ReplicateConfig.with_hard_pin``): the master's
        eviction under memory pressure never removes these objects; only :meth:`remove` (or a
        master restart) does. For the few tiny objects that must outlive every entry they govern
        (expiry horizons: docs/concepts/commit-protocol.md); never for entries, which must stay evictable."""
        return self._put(items, pinned=True)

    def put_owned(self, items: Sequence[tuple[str, Buffer]], owner: bytes | str | None) -> list[bool]:
        """:meth:`put` on behalf of ``owner`` (a request-namespace digest, bytes or hex). Without
        ``quota_bytes`` (or without an owner) it is :meth:`put`.

        Under a quota, item by item in order: an object whose key this process already ledgered
        is put as is (Mooncake keeps the first copy); otherwise, while the owner's ledgered bytes
        plus the object's exceed ``quota_bytes``, the owner's least recently used entry other than
        the object's own is evicted whole (its objects already in Mooncake removed, manifests
        first, before anything of this call is put; its objects still pending in this call are
        refused). Refused (``False``): an object larger than the quota; one that would not fit
        once the owner has no other entry; the manifest of an entry evicted or refused since its
        components were last accepted; and, in this call, every later object of an entry one of
        whose objects was evicted or refused. Only objects Mooncake accepted are ledgered.

        Raises:
            ValueError: ``owner`` is not a digest, or a key / object is invalid (see :meth:`put`).
            StoreUnavailable: the master cannot be reached (nothing of this call is ledgered).
        """
        owner = owner_hex(owner)
        if self._ledger is None or owner is None:
            return self.put(items)
        for key, data in items:
            if not isinstance(key, str) or not key:
                raise ValueError("store keys must be non-empty strings")
            if memoryview(data).nbytes == 0:
                raise ValueError("empty objects are never stored")
        ledger, quota = self._ledger, self.quota_bytes
        with self._lock:
            result: list[bool | None] = [None] * len(items)   # None: to put
            pending: dict[str, int] = {}                       # key ledgered by this call -> its item
            again: dict[str, int] = {}                         # key ledgered before, put again -> its item
            closed: set[str] = set()                           # entries evicted or refused in this call
            victims: list[str] = []                            # keys to remove first, manifests first
            first: dict[str, int] = {}
            for i, (key, data) in enumerate(items):
                if key in first:                               # a repeated key: as its first item
                    result[i] = result[first[key]]
                    continue
                first[key] = i
                if ledger.holds(key):
                    again[key] = i
                    continue
                prefix, manifest = entry_of(key)
                n = memoryview(data).nbytes
                refused = prefix in closed or n > quota or (manifest and ledger.is_torn(owner, prefix))
                while not refused and ledger.owner_bytes(owner) + n > quota:
                    victim = ledger.oldest_entry(owner, exclude=prefix)
                    if victim is None:
                        refused = True
                        break
                    for k in ledger.evict_entry(owner, victim):
                        if k in pending:
                            result[pending.pop(k)] = False
                            self.quota_refused += 1
                        else:
                            victims.append(k)
                            if k in again:                     # removed now: not put back uncharged
                                result[again.pop(k)] = False
                    closed.add(victim)
                    self.quota_evictions += 1
                if refused:
                    result[i] = False
                    self.quota_refused += 1
                    closed.add(prefix)
                    ledger.mark_torn(owner, prefix)
                    continue
                ledger.add(key, owner, n)
                pending[key] = i
            for i, r in enumerate(result):                     # repeats of keys refused later on
                if r is None and items[i][0] in first and result[first[items[i][0]]] is False:
                    result[i] = False
            try:
                if victims:
                    manifests = [k for k in victims if entry_of(k)[1]]
                    self.remove(manifests)
                    self.remove([k for k in victims if not entry_of(k)[1]])
                todo = [i for i, r in enumerate(result) if r is None]
                done = self._put([items[i] for i in todo], pinned=False) if todo else []
            except BaseException:
                ledger.drop(list(pending))
                raise
            for i, ok in zip(todo, done):
                result[i] = ok
                if not ok and pending.get(items[i][0]) == i:
                    ledger.drop([items[i][0]])             # no space: not in Mooncake, not charged
        return [bool(r) for r in result]

    def owner_bytes(self, owner: bytes | str) -> int:
        """Payload bytes ``owner`` holds through this process's :meth:`put_owned` (0 without a quota)."""
        with self._lock:
            return 0 if self._ledger is None else self._ledger.owner_bytes(owner_hex(owner))

    def check_ledger(self) -> None:
        """Assert the quota ledger's invariants (tests call this; no-op without a quota)."""
        with self._lock:
            if self._ledger is not None:
                self._ledger.check_invariants()

    def _read_back(self, read, absent) -> None:
        """After a read: the entries of the keys ``read`` become most recent, the keys found
        ``absent`` (Mooncake evicted them, or another process removed them) are no longer charged.
        Caller holds the lock."""
        if self._ledger is not None:
            self._ledger.touch(read)
            self._ledger.drop(absent)

    def _pin_config(self):
        """A ``ReplicateConfig`` with ``with_hard_pin`` set (made on first use)."""
        if self._pinned_config is None:
            import sys

            config = sys.modules[self._cls.__module__].ReplicateConfig()
            config.with_hard_pin = True
            self._pinned_config = config
        return self._pinned_config

    def _put(self, items: Sequence[tuple[str, Buffer]], pinned: bool) -> list[bool]:
        if not items:
            return []
        extra = (self._pin_config(),) if pinned else ()
        first: dict[str, int] = {}
        for i, (key, data) in enumerate(items):
            if not isinstance(key, str) or not key:
                raise ValueError(f"store key {key!r} must be a non-empty string")
            if memoryview(data).nbytes == 0:
                raise ValueError(f"object {key!r} is empty; empty objects are never stored")
            first.setdefault(key, i)
        keys = list(first)
        arrays = [byte_array(items[i][1]) for i in first.values()]
        staging, ptrs = pack_small(arrays)
        sizes = [a.nbytes for a in arrays]
        spans = [(a.ctypes.data, a.nbytes) for a, p in zip(arrays, ptrs) if p == a.ctypes.data]
        if staging is not None:
            spans.append((staging.ctypes.data, staging.nbytes))
        with self._lock:
            client = self._ready()
            temp = register_temp(client, spans, self._regions)
            try:
                codes = client.batch_put_from(keys, ptrs, sizes, *extra)
                for pause in no_space_pauses(self._recovered_at):  # eviction (or a remount) frees space meanwhile
                    retry = [i for i, c in enumerate(codes) if c == NO_SPACE]
                    if not retry:
                        break
                    time.sleep(pause)
                    again = client.batch_put_from([keys[i] for i in retry], [ptrs[i] for i in retry],
                                                  [sizes[i] for i in retry], *extra)
                    for i, c in zip(retry, again):
                        codes[i] = c
            finally:
                unregister_temp(client, temp)
            result = {}
            for key, code in zip(keys, codes):
                if code in (0, OBJECT_ALREADY_EXISTS):
                    result[key] = True
                elif code == NO_SPACE:
                    self.stats.no_space += 1
                    result[key] = False
                else:
                    self._check_failure("put", code)
            self._succeeded()
        return [result[key] for key, _ in items]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        unique = list(dict.fromkeys(keys))
        with self._lock:
            client = self._ready()
            sizes = memory_sizes(client.batch_get_replica_desc(unique))
            unseen = [k for k in unique if k not in sizes]
            absent = []
            if unseen:  # absent, or the descriptor query failed: is_exist tells which
                codes = client.batch_is_exist(unseen)
                if any(c < 0 for c in codes):
                    self._rpc_failed("get", min(codes))
                absent = [k for k, c in zip(unseen, codes) if c == 0]
            present = [k for k in unique if k in sizes]
            found: dict[str, bytes] = {}
            if present:
                lengths = [sizes[k] for k in present]
                buf = np.empty(sum(lengths), dtype=np.uint8)
                offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
                base = buf.ctypes.data
                temp = register_temp(client, [(base, buf.nbytes)], self._regions)
                try:
                    codes = client.batch_get_into(present, [base + int(o) for o in offsets], lengths)
                finally:
                    unregister_temp(client, temp)
                for key, off, n, code in zip(present, offsets, lengths, codes):
                    if code == n:
                        found[key] = buf[off:off + n].tobytes()
                    elif code == OBJECT_NOT_FOUND:
                        absent.append(key)
                    elif code not in READ_MISS_CODES:  # else: not ready or replaced since the query
                        self._check_failure("get", code)
            self._succeeded()
            self._read_back(found, absent)
        return [found.get(k) for k in keys]

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        arrays = [writable_array(b) for b in buffers]
        ptrs = [arrays[i].ctypes.data for i in first.values()]
        caps = [arrays[i].nbytes for i in first.values()]
        with self._lock:
            client = self._ready()
            temp = register_temp(client, list(zip(ptrs, caps)), self._regions)
            try:
                codes = client.batch_get_into(list(first), ptrs, caps)
            finally:
                unregister_temp(client, temp)
            read = {}
            for key, code in zip(first, codes):
                if code >= 0:
                    read[key] = code
                elif code in READ_MISS_CODES:  # absent, not yet complete, or buffer too small
                    read[key] = -1
                else:
                    self._check_failure("get_into", code)
            self._succeeded()
            self._read_back([k for k, n in read.items() if n >= 0],
                            [k for k, c in zip(first, codes) if c == OBJECT_NOT_FOUND])
        out = []
        for i, key in enumerate(keys):
            n = read[key]
            if i != first[key] and n >= 0:  # a repeated key: copy from its first destination
                if arrays[i].nbytes < n:
                    n = -1
                else:
                    arrays[i][:n] = arrays[first[key]][:n]
            out.append(n)
        return out

    def remove(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        with self._lock:
            client = self._ready()
            codes = client.batch_remove(list(dict.fromkeys(keys)), True)
            for code in codes:
                if code not in (0, OBJECT_NOT_FOUND):
                    self._check_failure("remove", code)
            self._succeeded()
            if self._ledger is not None:
                self._ledger.drop(keys)

    def remove_prefix(self, prefix: str, suffix: str = "") -> int:
        """Delete every key that starts with ``prefix`` and ends with ``suffix`` in one master
        call (Mooncake's ``remove_by_regex``, forced like :meth:`remove`), although Mooncake
        cannot list keys. See :meth:`ObjectStore.remove_prefix`.

        Raises:
            ValueError: a character outside letters, digits and ``/ _ . -``.
            StoreUnavailable: the master cannot be reached.
        """
        check_key_pattern(prefix, suffix)
        with self._lock:
            client = self._ready()
            # '.' is the only regex metacharacter check_key_pattern lets through; '*' a whole segment
            pattern = key_pattern_regex(prefix, suffix)
            n = client.remove_by_regex(pattern, True)
            if n < 0:
                self._check_failure("remove_by_regex", n)
            self._succeeded()
            if self._ledger is not None:
                self._ledger.drop_matching(pattern)
        return int(n)

    def register_memory(self, buffer: Buffer) -> None:
        """Register a long-lived writable buffer (e.g. a host KV pool) once.

        Reads and writes through views inside it then skip the per-call
        registration (which matters on RDMA, where registering pins memory).
        """
        array = writable_array(buffer)
        with self._lock:
            client = self._ready()
            code = client.register_buffer(array.ctypes.data, array.nbytes)
            if code != 0:
                raise MooncakeError(f"register_buffer of {array.nbytes} bytes failed with code {code}")
            self._regions.append((array.ctypes.data, array.ctypes.data + array.nbytes, array))

    def unregister_memory(self, buffer: Buffer) -> None:
        """Undo :meth:`register_memory` for ``buffer`` (no-op if it is not registered)."""
        start = writable_array(buffer).ctypes.data
        with self._lock:
            kept = [r for r in self._regions if r[0] != start]
            if len(kept) == len(self._regions):
                return
            self._regions = kept
            if self._client is not None and self._healthy:
                self._client.unregister_buffer(start)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client, self._healthy = self._client, None, False
            if client is None:
                return
            if not master_reachable(self.master, timeout_s=0.5):
                abandon_client(client, self.stats)
                return
            for start, _, _ in self._regions:
                client.unregister_buffer(start)
            self._regions.clear()
            if not run_with_deadline(client.close, "close", self.timeout_s):
                abandon_client(client, self.stats)

    # ------------------------------------------------------------------ connection state

    def _connect(self) -> None:
        """Create and set up a new client; raises StoreUnavailable."""
        if not master_reachable(self.master, timeout_s=min(1.0, self.timeout_s)):
            self._mark_down(f"Mooncake master {self.master} is not accepting connections")
        if not master_answers(self.master, timeout_s=min(2.0, self.timeout_s)):
            self._mark_down(f"{self.master} accepts connections but does not answer within "
                            f"{min(2.0, self.timeout_s):g} s: not a working Mooncake master")
        warn_wildcard_listeners()
        os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = str(self.setup_retries)
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_hostname)
        client = self._cls()
        code: list[int] = []

        def setup() -> None:
            code.append(client.setup(self.local_hostname, "P2PHANDSHAKE", self.segment_bytes,
                                     self.local_buffer_bytes, "tcp", "", self.master))

        if not run_with_deadline(setup, "setup", self.timeout_s):
            abandon_client(client, self.stats)
            self._mark_down(f"Mooncake setup against {self.master} did not finish within {self.timeout_s:g} s")
        if code[0] != 0:
            abandon_client(client, self.stats)
            self._mark_down(f"Mooncake setup against {self.master} failed with code {code[0]}")
        for start, end, _ in self._regions:
            client.register_buffer(start, end - start)
        self._client, self._healthy, self._failures = client, True, 0

    def _ready(self):
        """The client to call now, or StoreUnavailable (fast while the master is known down)."""
        if self._closed:
            raise RuntimeError("MooncakeStore used after close()")
        if self._healthy:
            return self._client
        now = time.monotonic()
        if now < self._retry_at:
            raise StoreUnavailable(f"{self._down_reason} (next retry in {self._retry_at - now:.1f} s)")
        self._retry_at = now + self.retry_interval_s
        if not master_reachable(self.master, timeout_s=0.5):
            self._mark_down(f"Mooncake master {self.master} is not accepting connections")
        if self._client is None or self._failures >= 2:
            if self._client is not None:
                abandon_client(self._client, self.stats)
                self._client = None
            self._connect()
            self.stats.reconnects += 1
            log.info("mooncake: new client for master %s", self.master)
        self._healthy = True
        self._recovered_at = time.monotonic()
        return self._client

    def _succeeded(self) -> None:
        self._failures = 0

    def _check_failure(self, op: str, code: int) -> None:
        """Raise for a per-key failure code of ``op``."""
        if code in TRANSFER_CODES:
            self.stats.transfer_failures += 1
            raise StoreUnavailable(f"Mooncake {op}: transfer failed with code {code} "
                                   "(the process holding the object is gone?)")
        if code == RPC_FAIL or code <= -1000:
            self._rpc_failed(op, code)
        raise MooncakeError(f"Mooncake {op} answered unexpected code {code}")

    def _rpc_failed(self, op: str, code: int) -> None:
        self.stats.rpc_failures += 1
        self._failures += 1
        self._mark_down(f"Mooncake {op} against master {self.master} failed with code {code}")

    def _mark_down(self, reason: str) -> None:
        self._healthy = False
        self._down_reason = reason
        self._retry_at = time.monotonic() + self.retry_interval_s
        raise StoreUnavailable(reason)

