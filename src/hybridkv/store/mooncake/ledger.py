"""Per-owner quotas of a :class:`~hybridkv.store.mooncake.client.MooncakeStore`
(docs/how-to/purge-and-quotas.md, "Quotas per tenant").

Mooncake keeps no owner of an object and cannot list its keys, so a quota is enforced from
what this process wrote: :class:`OwnerLedger` records, per owner (a request-namespace digest,
hex), the objects this store object put through ``put_owned`` (key and payload bytes),
grouped into *entries* as the disk store groups them (the objects whose keys share
everything up to the last ``/``: the cache ABI's ``.../<group>/r<rank>/<component>``), in
least-recently-used order of entries (a put or a read of any object of an entry refreshes
it).

Per process, stated plainly: objects other processes wrote are not in this ledger, so N writer
processes of one tenant can hold up to N x its quota in Mooncake (as with the disk store).
Objects Mooncake evicted on its own (or another process removed) stay charged until this process
finds them absent (a read or an existence query: :meth:`OwnerLedger.drop`); they are never
charged forever once looked at. The ledger holds keys and owners in memory only; nothing here
logs them.
"""

from __future__ import annotations

import re
from collections import OrderedDict

#: Entries evicted or refused whole, remembered so that their manifests put later are refused.
TORN_KEEP = 65536

_OWNER_MAX = 128


def owner_hex(owner: bytes | bytearray | str | None) -> str | None:
    """``owner`` as the ledger names it: a bytes digest as hex, a string as given.

    Raises:
        ValueError: a string that is not 1..128 ASCII letters/digits (the message gives its
            length, never the value: owners are tenant digests).
    """
    if owner is None:
        return None
    if isinstance(owner, (bytes, bytearray)):
        owner = bytes(owner).hex()
    if not isinstance(owner, str) or not owner.isascii() or not owner.isalnum() or len(owner) > _OWNER_MAX:
        size = len(owner) if isinstance(owner, (str, bytes)) else "?"
        raise ValueError(f"Mooncake store owner must be a digest (bytes, or 1..{_OWNER_MAX} ASCII letters/digits);"
                         f" got a {type(owner).__name__} of length {size}")
    return owner


def entry_of(key: str) -> tuple[str, bool]:
    """``(entry prefix, is manifest)`` of a key: everything up to its last ``/``."""
    prefix, _, name = key.rpartition("/")
    return prefix, name == "manifest"


class OwnerLedger:
    """Objects one process wrote per owner, in entries, least recently used entry first.

    Args:
        quota_bytes: payload bytes one owner may hold through this process, > 0.

    Not thread-safe: the store calls it under its own lock.
    """

    def __init__(self, quota_bytes: int) -> None:
        self.quota_bytes = quota_bytes
        self._where: dict[str, tuple[str, str]] = {}            # key -> (owner, entry prefix)
        self._entries: dict[str, OrderedDict[str, dict[str, int]]] = {}  # owner -> prefix -> key -> bytes
        self._bytes: dict[str, int] = {}                          # owner -> payload bytes
        self._torn: OrderedDict[tuple[str, str], None] = OrderedDict()  # (owner, prefix), newest last

    # ----------------------------------------------------------------- queries

    def owner_bytes(self, owner: str) -> int:
        return self._bytes.get(owner, 0)

    def holds(self, key: str) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def oldest_entry(self, owner: str, exclude: str) -> str | None:
        """``owner``'s least recently used entry other than ``exclude`` (``None``: none)."""
        for prefix in self._entries.get(owner, ()):
            if prefix != exclude:
                return prefix
        return None

    def is_torn(self, owner: str, prefix: str) -> bool:
        """Whether the entry was evicted or refused since its components were last accepted."""
        return (owner, prefix) in self._torn

    # ----------------------------------------------------------------- updates

    def add(self, key: str, owner: str, nbytes: int) -> None:
        """Charge ``owner`` for ``key`` (``nbytes`` payload bytes); its entry becomes most recent."""
        prefix, manifest = entry_of(key)
        self.drop([key])
        entries = self._entries.setdefault(owner, OrderedDict())
        entries.setdefault(prefix, {})[key] = nbytes
        entries.move_to_end(prefix)
        self._where[key] = (owner, prefix)
        self._bytes[owner] = self._bytes.get(owner, 0) + nbytes
        if not manifest:
            self._torn.pop((owner, prefix), None)

    def touch(self, keys) -> None:
        """Make the entries of the ledgered ``keys`` most recent (a read)."""
        for key in keys:
            where = self._where.get(key)
            if where is not None:
                self._entries[where[0]].move_to_end(where[1])

    def drop(self, keys) -> None:
        """Forget ``keys`` (removed, or found absent: Mooncake evicted them); unknown keys are ignored."""
        for key in keys:
            where = self._where.pop(key, None)
            if where is None:
                continue
            owner, prefix = where
            entries = self._entries[owner]
            members = entries[prefix]
            self._bytes[owner] -= members.pop(key)
            if not members:
                del entries[prefix]
            if not entries:
                del self._entries[owner], self._bytes[owner]

    def drop_matching(self, pattern: str) -> None:
        """Forget every ledgered key the anchored regular expression ``pattern`` matches (a
        removal by prefix)."""
        regex = re.compile(pattern, re.DOTALL)
        self.drop([k for k in self._where if regex.match(k)])

    def mark_torn(self, owner: str, prefix: str) -> None:
        """Remember that the entry lost (or never got) objects: its manifest is refused until a
        component of it is accepted again."""
        self._torn.pop((owner, prefix), None)
        self._torn[(owner, prefix)] = None
        if len(self._torn) > TORN_KEEP:
            self._torn.popitem(last=False)

    def evict_entry(self, owner: str, prefix: str) -> list[str]:
        """Forget ``owner``'s entry ``prefix`` and mark it torn; its keys, the manifest first."""
        keys = sorted(self._entries[owner][prefix], key=lambda k: not entry_of(k)[1])
        self.drop(keys)
        self.mark_torn(owner, prefix)
        return keys

    def check_invariants(self) -> None:
        """Assert the accounting invariants (tests call this)."""
        for owner, entries in self._entries.items():
            assert entries, owner
            assert self._bytes[owner] == sum(sum(m.values()) for m in entries.values())
            assert self._bytes[owner] <= self.quota_bytes, (self._bytes[owner], self.quota_bytes)
            for prefix, members in entries.items():
                assert members
                for key in members:
                    assert self._where[key] == (owner, prefix)
        assert len(self._where) == sum(len(m) for e in self._entries.values() for m in e.values())
        assert set(self._bytes) == set(self._entries)
