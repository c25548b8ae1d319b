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

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview


#: What :meth:`ObjectStore.get_into` gives for an object that was there but unreadable (a
#: truncated or foreign file): the backend counted and dropped it. ``-1`` is absent / too small.
DAMAGED = -2


class StoreUnavailable(RuntimeError):
    """The backing service cannot be reached (or timed out); the message says which."""


_KEY_PATTERN_CHARS = re.compile(r"[0-9A-Za-z/_.\-]*")


def check_key_pattern(prefix: str, suffix: str = "") -> None:
    """Check the arguments of :meth:`ObjectStore.remove_prefix`.

    ``prefix`` may hold ``*`` as a whole segment followed by ``/`` (``hkv5/*/<owner>/``): it
    matches any one non-empty key segment.

    Raises:
        ValueError: ``prefix`` is empty or starts with a wildcard, or ``prefix`` / ``suffix``
            holds a character other than letters, digits and ``/ _ . -`` (the error names
            it, never the whole key).
    """
    if not prefix:
        raise ValueError("remove_prefix needs a non-empty prefix (it would remove every key)")
    if prefix.startswith("*"):
        raise ValueError("remove_prefix needs a literal first segment, not '*'")
    literal = re.sub(r"(?<=/)\*(?=/)", "", prefix)
    for name, text in (("prefix", literal), ("suffix", suffix)):
        if not _KEY_PATTERN_CHARS.fullmatch(text):
            bad = next(c for c in text if not _KEY_PATTERN_CHARS.fullmatch(c))
            raise ValueError(f"remove_prefix {name} holds {bad!r}: only letters, digits and / _ . - are allowed"
                             " (and '*' as a whole segment of the prefix)")


def key_pattern_regex(prefix: str, suffix: str = "") -> str:
    """The anchored regular expression of the keys ``remove_prefix(prefix, suffix)`` removes
    (arguments checked by :func:`check_key_pattern`): ``.`` literal, a ``*`` segment ``[^/]+``."""
    head = "/".join("[^/]+" if seg == "*" else seg.replace(".", "\\.") for seg in prefix.split("/"))
    return f"^{head}.*{suffix.replace('.', chr(92) + '.')}$"


class ObjectStore(ABC):
    """Batched put / get / exists / remove of immutable byte objects."""

    #: URL scheme this backend answers to (``disk``, ``mooncake``, ``memory``).
    scheme = ""

    #: Whether :meth:`list_keys` works. A store tier reads expiry horizons only from a store
    #: that cannot list (a purge by age writes them only there: docs/concepts/commit-protocol.md).
    lists_keys = False

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

    def put_owned(self, items: Sequence[tuple[str, Buffer]], owner: bytes | str | None) -> list[bool]:
        """:meth:`put` on behalf of ``owner`` (a request-namespace digest). Backends with
        per-owner quotas (:class:`~hybridkv.store.disk.DiskStore`,
        :class:`~hybridkv.store.mooncake.client.MooncakeStore`) record it; the default
        ignores it."""
        return self.put(items)

    def put_pinned(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """:meth:`put` of objects this backend's own eviction must never remove (expiry horizons,
        docs/concepts/commit-protocol.md): only :meth:`remove` does. Mooncake hard-pins them
        (:class:`~hybridkv.store.mooncake.client.MooncakeStore`); the default is :meth:`put`, right
        for backends that never evict on their own (memory) and for those that list their keys
        (disk), where no purge writes a horizon."""
        return self.put(items)

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Objects for ``keys`` (``None`` where absent). A key may repeat; each slot is filled."""

    def get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        """Read each object into a caller buffer; returns bytes read, ``-1`` if absent / too small,
        or :data:`DAMAGED` (``-2``) where the backend found the object damaged (a truncated or
        foreign file; only backends that can tell return it).

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

    def list_keys(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix`` (for purges; order unspecified).

        Raises:
            NotImplementedError: the backend cannot enumerate its keys (a purge by age then
                raises an expiry horizon instead: :func:`hybridkv.tiers.purge.purge_store_detail`).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot list its keys")

    def remove_prefix(self, prefix: str, suffix: str = "") -> int:
        """Delete every key that starts with ``prefix`` and ends with ``suffix`` (a whole
        namespace, for purges). ``prefix`` and ``suffix`` may hold only letters, digits and
        ``/ _ . -`` (keys of the cache ABI: docs/reference/cache-abi.md), and ``prefix`` a ``*`` segment
        (``a/*/b/``: any one segment there). The default lists the keys
        (:meth:`list_keys`) and removes them; a backend that can match keys itself overrides it.

        Returns:
            Keys removed.

        Raises:
            ValueError: ``prefix`` or ``suffix`` holds another character, or ``prefix`` is empty.
            NotImplementedError: the backend can neither list nor match its keys.
        """
        check_key_pattern(prefix, suffix)
        pattern = re.compile(key_pattern_regex(prefix, suffix), re.DOTALL)
        keys = [k for k in self.list_keys(prefix.split("*", 1)[0]) if pattern.match(k)]
        for i in range(0, len(keys), 256):
            self.remove(keys[i:i + 256])
        return len(keys)

    def close(self) -> None:
        """Release connections / handles. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
