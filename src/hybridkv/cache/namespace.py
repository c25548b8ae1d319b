"""Cache identity (namespace) and chained block hashes (DESIGN §4, §6).

Hash choice: SHA-256 from :mod:`hashlib` (FIPS 180-4). Block hashes key shared
state across requests and tenants, so they must resist deliberate collisions;
a 256-bit cryptographic hash leaves ~128-bit collision resistance, the floor
the design asks for, and is fast enough (about 1 µs per 64-token unit here).

Every namespace field is encoded as ``tag || len(value) || value`` (lengths as
8-byte big-endian), so two fields can never collide by string coincidence:
an adapter named like a tenant hashes differently because the tag differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import numpy as np

CACHE_ABI_VERSION = "1"
KDA_STATE_LAYOUT_VERSION = "kda-fp32-hkv-conv-qkv-1"


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """Everything that makes cached state interchangeable (DESIGN §6).

    Sampling parameters are deliberately absent. Cross-tenant sharing happens
    only when a deployment gives tenants the same ``tenant`` value.
    All fields are strings; the empty string means "not applicable". ``cache_salt`` is a
    per-request secret (as an OpenAI-style server takes it) that isolates a request's
    entries from everyone who does not send the same salt.
    """

    model_repo: str = ""
    weight_digest: str = ""
    tokenizer_version: str = ""
    chat_template_version: str = ""
    quantization: str = "none"
    kv_dtype: str = "float32"
    kda_state_dtype: str = "float32"
    kda_layout_version: str = KDA_STATE_LAYOUT_VERSION
    adapter_id: str = ""
    adapter_version: str = ""
    tp_size: str = "1"
    pp_size: str = "1"
    pcp_size: str = "1"
    dcp_size: str = "1"
    rank: str = "0"
    cache_abi_version: str = CACHE_ABI_VERSION
    multimodal_version: str = ""
    position_config: str = "nope"
    tenant: str = "default"
    cache_salt: str = ""

    def digest(self) -> bytes:
        """32-byte SHA-256 namespace digest over every field, tagged and length-prefixed."""
        h = hashlib.sha256(b"hybridkv.namespace.v1")
        for f in fields(self):
            _absorb(h, f.name.encode(), getattr(self, f.name).encode("utf-8"))
        return h.digest()


def bind_namespace(namespace: bytes, binding: bytes) -> bytes:
    """The namespace digest a cache actually hashes with: ``namespace`` bound to what the
    compute backend says its state depends on (weights digest, state layout).

    A caller's :class:`CacheIdentity` may omit the weight digest or name another model; the
    binding comes from the backend itself, so entries of other weights never match.
    Returns 32 bytes (SHA-256, tagged and length-prefixed).
    """
    h = hashlib.sha256(b"hybridkv.namespace.bound.v1")
    _absorb(h, b"namespace", namespace)
    _absorb(h, b"binding", binding)
    return h.digest()


def _absorb(h, tag: bytes, value: bytes) -> None:
    h.update(len(tag).to_bytes(8, "big"))
    h.update(tag)
    h.update(len(value).to_bytes(8, "big"))
    h.update(value)


def chained_block_hashes(namespace: bytes, token_ids, unit: int, max_units: int | None = None) -> list[bytes]:
    """Chained hashes ``h_i = SHA256(h_{i-1} || namespace || tokens_i)`` every ``unit`` tokens.

    Args:
        namespace: namespace digest (bytes).
        token_ids: sequence / ``int64`` array of token ids (exact ids, never text).
        unit: tokens per hashed unit (``prefix_match_unit``).
        max_units: hash at most this many whole units.

    Returns:
        One 32-byte digest per *whole* unit (a trailing partial unit is not hashed).
    """
    arr = np.asarray(token_ids, dtype=np.int64)
    n = len(arr) // unit
    if max_units is not None:
        n = min(n, max_units)
    out: list[bytes] = []
    prev = b"hybridkv.root"
    data = arr[: n * unit].tobytes()
    step = unit * 8
    sha = hashlib.sha256
    for i in range(n):
        h = sha(prev)
        h.update(namespace)
        h.update(data[i * step:(i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def chain_payloads(namespace: bytes, payloads: list[bytes]) -> list[bytes]:
    """Chained hashes ``h_i = SHA256(h_{i-1} || namespace || payloads[i])`` (32-byte digests,
    ``h_{-1}`` the same root as :func:`chained_block_hashes`): that function's chain over
    unit payloads given by the caller instead of token bytes.

    Raises:
        ValueError: a payload whose length is a multiple of 8 (naming its index and length):
            those lengths are a unit's token bytes (``int64``), so no payload can pose as tokens.
    """
    out: list[bytes] = []
    prev = b"hybridkv.root"
    sha = hashlib.sha256
    for p in payloads:
        if not len(p) & 7:
            raise ValueError(f"unit payload {len(out)} is {len(p)} bytes, a multiple of 8 (reserved for token ids)")
        prev = sha(prev + namespace + p).digest()
        out.append(prev)
    return out


class PeriodicMemo:
    """Memo of :func:`chain_periodic`'s whole blocks for one namespace and one list of heads.

    The ``H`` hashes of a whole block (payloads ``heads[a] + tail``, ``a < H``) depend only on the
    chained hash before the block and the block's ``tail``, so a memo from ``(previous hash,
    tail)`` to the block's tuple of hashes gives the same hashes with one dict probe per block
    wherever a prefix repeats (a conversation's turns re-send their history). It holds one entry
    per distinct ``(previous hash, tail)`` it was asked for, at most the whole blocks of the
    prompts it chained (about 0.6 KB an entry with ``H = 8``: the key tuple, the hash tuple, and
    the digests, which the returned lists share); drop it to free them.

    Attributes:
        namespace: the bound namespace its hashes are chained under.
        heads: the heads (a unit's offset in its block) of every chain it serves, as a tuple.
        blocks: ``(previous hash, tail) -> tuple of H hashes``.
    """

    __slots__ = ("namespace", "heads", "blocks")

    def __init__(self, namespace: bytes, heads: list[bytes]) -> None:
        self.namespace = namespace
        self.heads = tuple(heads)
        self.blocks: dict[tuple[bytes, bytes], tuple[bytes, ...]] = {}


def chain_periodic(namespace: bytes, heads: list[bytes], tails: list[bytes], n: int,
                   memo: PeriodicMemo | None = None) -> list[bytes]:
    """:func:`chain_payloads` over the ``n`` payloads ``heads[i % H] + tails[i // H]`` (``H =
    len(heads)``) without making them: the namespace is joined to each head once, so a unit costs
    one concatenation fewer (a trace's units: a few offsets in a block, then the block's ids).
    With ``memo`` (made for this ``namespace`` and ``heads``), a whole block already chained
    after the same hash is taken from it instead of hashed again, and new whole blocks are added
    to it: the same hashes.

    Raises:
        ValueError: ``heads`` empty or fewer than ``n`` payloads described; a payload whose length
            is a multiple of 8 (naming its index and length, as :func:`chain_payloads` does);
            ``memo`` made for another namespace or other heads.
    """
    h = len(heads)
    if n < 0 or (n and (not h or n > h * len(tails))):
        raise ValueError(f"{n} payloads from {h} heads and {len(tails)} tails")
    blocks = -(-n // h) if n else 0
    # tail length -> first tail of that length, built in C: over the tails last to first, the
    # first tail of each length is the last one stored
    first_of = dict(zip(map(len, reversed(tails[:blocks])), range(blocks - 1, -1, -1)))
    bad = [b * h + a for size, b in first_of.items() for a, head in enumerate(heads)
           if not (len(head) + size) & 7 and b * h + a < n]
    if bad:
        i = min(bad)
        raise ValueError(f"unit payload {i} is {len(heads[i % h]) + len(tails[i // h])} bytes, a multiple of 8 "
                         "(reserved for token ids)")
    if memo is not None:
        if memo.namespace != namespace or memo.heads != tuple(heads):
            raise ValueError("memo was made for another namespace or other heads")
        return _chain_periodic_memo(namespace, heads, tails, n, memo.blocks)
    out: list[bytes] = []
    append = out.append
    prev = b"hybridkv.root"
    sha = hashlib.sha256
    joined = [namespace + head for head in heads]
    full, rest = divmod(n, h) if n else (0, 0)
    for tail in tails[:full]:
        for nh in joined:
            prev = sha(prev + nh + tail).digest()
            append(prev)
    if rest:
        tail = tails[full]
        for nh in joined[:rest]:
            prev = sha(prev + nh + tail).digest()
            append(prev)
    return out


def _chain_periodic_memo(namespace: bytes, heads: list[bytes], tails: list[bytes], n: int,
                         blocks: dict[tuple[bytes, bytes], tuple[bytes, ...]]) -> list[bytes]:
    """:func:`chain_periodic`'s chain (arguments already checked) through the memo ``blocks``."""
    out: list[bytes] = []
    extend = out.extend
    prev = b"hybridkv.root"
    sha = hashlib.sha256
    joined = [namespace + head for head in heads]
    h = len(heads)
    full, rest = divmod(n, h) if n else (0, 0)
    get = blocks.get
    if h == 1:                                         # a unit a block: one hash each, no list made a block
        append, nh = out.append, joined[0]
        for tail in tails[:full]:
            key = (prev, tail)
            done = get(key)
            if done is None:
                prev = sha(prev + nh + tail).digest()
                blocks[key] = (prev,)
            else:
                prev = done[0]
            append(prev)
        return out                                     # rest is 0
    for tail in tails[:full]:
        key = (prev, tail)
        done = get(key)
        if done is None:                               # each unit chained on the one before it
            done = blocks[key] = tuple([prev := sha(prev + nh + tail).digest() for nh in joined])
        extend(done)
        prev = done[-1]
    if rest:
        tail = tails[full]
        done = get((prev, tail))
        if done is not None:
            extend(done[:rest])
        else:
            for nh in joined[:rest]:
                prev = sha(prev + nh + tail).digest()
                out.append(prev)
    return out
