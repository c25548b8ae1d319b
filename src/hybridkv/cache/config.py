"""Typed cache configuration, validated once at the entry point (DESIGN §1, §3).

Everything here is plain values; core classes receive these objects and never
re-validate. Errors are :class:`ConfigError` (a ``ValueError``) naming the
offending field and value, and the other value it conflicts with.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridkv.store.eviction import EVICTION_POLICIES

KERNEL_CHUNK = 64
CHECKPOINT_EVICTIONS = ("utility",)
"""Orders the device checkpoint pool may use instead of ``eviction``'s (``CacheConfig.checkpoint_eviction``)."""
"""Tokens per chunk of the chunked KDA algorithm (DESIGN §1)."""


class Mechanism(enum.Enum):
    """How a prefill step yields the KDA states at planned checkpoint boundaries (DESIGN §3).

    ``EXTRACT``: steps run to the token budget; the backend hands back the
    intermediate states at the boundaries inside the step. ``SPLIT``: a step
    ends exactly at the next boundary, so its end state is the checkpoint.
    Both give identical bytes (tests/engine/test_scenarios.py).
    """

    EXTRACT = "extract"
    SPLIT = "split"

    @classmethod
    def parse(cls, value: Mechanism | str) -> Mechanism:
        """A :class:`Mechanism` from itself or its name.

        Raises:
            ConfigError: ``value`` is not ``extract`` or ``split``.
        """
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"mechanism={value!r} must be one of {[m.value for m in cls]}") from None

    def chunk(self, start: int, end: int, inside: list[int]) -> tuple[int, list[int]]:
        """Where a prefill chunk ``[start, end)`` with planned boundaries ``inside`` (ascending,
        in ``(start, end]``) ends, and the boundaries it captures (tokens)."""
        if self is Mechanism.SPLIT and inside:
            return inside[0], inside[:1]
        return end, inside

    def backend_captures(self, captures: list[int]) -> list[int]:
        """Boundaries whose intermediate states the backend must hand back for a chunk."""
        return list(captures) if self is Mechanism.EXTRACT else []

    def checkpoint(self, boundary: int, chunk_end: int, end_state, intermediate: dict):
        """The state at ``boundary`` of a chunk ending at ``chunk_end``: its end state under
        ``SPLIT``, the backend's intermediate state under ``EXTRACT``."""
        if self is Mechanism.SPLIT and boundary == chunk_end:
            return end_state
        return intermediate[boundary]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and value."""


HOST_PROBATION = 0.25
"""Default share of a host tier's bytes for speculative (host-only, not yet used) checkpoints
while other entries need the room: the A1in size recommended for 2Q (T. Johnson and D. Shasha,
VLDB 1994)."""


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Which boundaries get a KDA checkpoint (DESIGN §3). Policies combine.

    Attributes:
        branch: create the checkpoint at the branching boundary once.
        tail: create one at the prompt end aligned down to ``tail_alignment``,
            and, when the prompt length is itself aligned, one ``tail_alignment``
            earlier too: an identical resend reuses at most ``T - 1`` tokens.
        tail_alignment: tokens; ``None`` means ``prefix_match_unit``.
        interval: create one every ``interval`` tokens inside prefills
            (``None``: off).
        hint: create ones at caller-supplied boundaries (request hints).
        supersede: when a request that continued from a tail checkpoint
            publishes its own tail further along the same path, the older tail
            is retired: the conversation has moved on, and only a request
            branching between the two would have used it.
    """

    branch: bool = True
    tail: bool = True
    tail_alignment: int | None = None
    interval: int | None = None
    hint: bool = False
    supersede: bool = False

    def __post_init__(self) -> None:
        for name in ("tail_alignment", "interval"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ConfigError(f"policy {name}={v!r} must be a positive integer or None")

    @classmethod
    def parse(cls, text: str) -> CheckpointPolicy:
        """Parse ``"branch+tail"``, ``"tail=512+interval=2048+branch+supersede"``, ``"hint"``, ``"none"``.

        Terms are joined by ``+`` or ``,``. ``tail=N`` sets the tail alignment
        in tokens; ``interval=N`` the spacing in tokens. ``none`` (no checkpoints) stands alone.

        Raises:
            ConfigError: empty text, an empty or unknown term, ``none`` combined with other terms,
                or a non-positive / non-integer number.
        """
        kw: dict = {"branch": False, "tail": False, "tail_alignment": None, "interval": None, "hint": False, "supersede": False}
        terms = [t.strip() for t in text.replace(",", "+").split("+")]
        if not any(terms):
            raise ConfigError(f"policy {text!r} is empty; use e.g. 'branch+tail', or 'none' for no checkpoints")
        if not all(terms):
            raise ConfigError(f"policy {text!r} has an empty term; join terms with a single '+'")
        if "none" in terms and len(terms) > 1:
            raise ConfigError(f"policy {text!r} combines 'none' (no checkpoints) with other terms; give one or the other")
        for term in terms:
            name, _, value = term.partition("=")
            if name == "none" and not value:
                continue
            if name in ("branch", "hint", "supersede") and not value:
                kw[name] = True
            elif name == "tail":
                kw["tail"] = True
                if value:
                    kw["tail_alignment"] = _positive_int("policy tail", value)
            elif name == "interval" and value:
                kw["interval"] = _positive_int("policy interval", value)
            else:
                raise ConfigError(
                    f"policy term {term!r} in {text!r} is not one of branch, tail, tail=N, interval=N, "
                    "hint, supersede, none")
        return cls(**kw)

    def names(self) -> list[str]:
        """Counter names of the enabled policies (keys of ``checkpoints_created``)."""
        out = []
        for name in ("branch", "tail", "interval", "hint"):
            if getattr(self, name):
                out.append(name)
        return out

    def __str__(self) -> str:
        parts = []
        if self.tail:
            parts.append("tail" if self.tail_alignment is None else f"tail={self.tail_alignment}")
        if self.interval:
            parts.append(f"interval={self.interval}")
        if self.branch:
            parts.append("branch")
        if self.hint:
            parts.append("hint")
        if self.supersede:
            parts.append("supersede")
        return "+".join(parts) or "none"


def _positive_int(what: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{what}={value!r} is not an integer") from None
    if n <= 0:
        raise ConfigError(f"{what}={n} must be positive")
    return n


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Cache and scheduler settings (all lengths in tokens).

    Attributes:
        block_size: page size of the full-attention KV pool (P_KV).
        prefix_match_unit: hash / lookup granularity G; divides ``block_size``
            and is a multiple of the 64-token KDA kernel chunk.
        max_num_batched_tokens: scheduler budget per step (prefill + decode).
        num_kv_pages: pages in the device KV pool.
        num_checkpoint_slots: published-checkpoint slots in the device pool.
        policy: checkpoint placement policy.
        mechanism: :class:`Mechanism` (its name is accepted and converted):
            ``extract`` (intermediate states of one long step) or ``split``
            (end a step exactly at each boundary).
        max_num_seqs: requests admitted at once.
        store_alignment: the only boundaries that may become store entries
            (A_store); a multiple of ``block_size`` (hence of
            ``prefix_match_unit``). ``None`` means ``block_size``.
        eviction: ``lru`` (least recently used first) or ``value`` (lowest
            ``p·C_saved/(M·T_residence)`` first; :mod:`hybridkv.store.eviction`)
            in the device page and checkpoint pools.
        host_eviction: the same choice for a host tier that :func:`~hybridkv.engine.build.build_engine`
            builds. Default ``lru`` whatever ``eviction`` is: the host holds the device's victims
            (demoted on eviction), already ranked lowest by the device, and on the whole bundled
            trace with a host at 2x the device's bytes ``value`` on the host lost 2.3-7.3 points
            of the oracle to ``lru`` at 1-10% device capacity (docs/concepts/eviction.md).
        host_probation: fraction in ``[0, 1]`` of a host tier's bytes that speculative host-only
            checkpoints (``host_interval``) may hold while entries the device evicted or holds need
            the room (:class:`~hybridkv.tiers.host.HostTier`'s probation; 2Q's A1in share, default
            :data:`HOST_PROBATION`).
        host_protected_share: fraction in ``(0, 1]`` of a host tier's bytes kept as a protected
            segment (a segmented LRU) for checkpoints that were loaded from it before: the tier's
            other entries go first while the protected ones hold at most this share
            (:class:`~hybridkv.tiers.host.HostTier`'s ``protected_share``; with ``host_eviction``
            ``lru`` only). ``None`` (default): one recency order.
        tenant_quota: fraction in ``(0, 1]`` of each device pool's bytes that one
            namespace (tenant) may keep cached; a namespace over it evicts its own
            entries first. ``None``: no quota.
        checkpoint_probation: fraction in ``[0, 1]`` of the device checkpoint pool's slots that
            checkpoints placed on speculation (the policy's ``interval`` term) may hold, until a
            request uses them, while the others (``branch``, ``tail``, ``hint``, and any that was
            used) need the room (:class:`~hybridkv.store.eviction.ProbationOrder`; with ``lru``
            eviction only). ``None``: one recency order for all (docs/concepts/eviction.md).
        checkpoint_eviction: ``"utility"``: the device checkpoint pool evicts by expected saving
            (:class:`~hybridkv.cache.pools.UtilityOrder`: a checkpoint's hits, or its placing
            term's observed use share, times the tokens it saves over the checkpoint below it, aged
            GreedyDual-style), whatever ``eviction`` the page pool uses. ``None``: the pool follows
            ``eviction``. Not with ``checkpoint_probation``.
        host_interval: tokens; every ``host_interval`` tokens of a prefill a checkpoint is
            captured for the lower tiers only (label ``host``: written through to the host tier,
            never published on the device), so the host holds denser checkpoints than the device.
            A multiple of ``block_size`` (host entries are page-aligned). ``None``: off.

    Raises:
        ConfigError: from :meth:`validate` (called by ``__post_init__``).
    """

    block_size: int = 1024
    prefix_match_unit: int = 64
    max_num_batched_tokens: int = 8192
    num_kv_pages: int = 1024
    num_checkpoint_slots: int = 64
    policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    mechanism: Mechanism = Mechanism.EXTRACT
    max_num_seqs: int = 8
    store_alignment: int | None = None
    eviction: str = "lru"
    host_eviction: str = "lru"
    host_probation: float = HOST_PROBATION
    host_protected_share: float | None = None
    tenant_quota: float | None = None
    host_interval: int | None = None
    checkpoint_probation: float | None = None
    checkpoint_eviction: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mechanism", Mechanism.parse(self.mechanism))
        self.validate()

    def validate(self) -> None:
        """Check every field and their relations; see class docstring."""
        if not isinstance(self.policy, CheckpointPolicy):
            raise ConfigError(f"policy={self.policy!r} must be a CheckpointPolicy "
                              "(CheckpointPolicy.parse('branch+tail'))")
        for name in ("block_size", "prefix_match_unit", "max_num_batched_tokens",
                     "num_kv_pages", "num_checkpoint_slots", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        g, b = self.prefix_match_unit, self.block_size
        if g % KERNEL_CHUNK:
            raise ConfigError(
                f"prefix_match_unit={g} must be a multiple of the KDA kernel chunk {KERNEL_CHUNK}")
        if b % g:
            raise ConfigError(f"prefix_match_unit={g} must divide block_size={b}")
        a = self.store_alignment
        if a is not None and (not isinstance(a, int) or a <= 0 or a % b):
            raise ConfigError(f"store_alignment={a!r} must be a positive multiple of block_size={b} "
                              f"(and so of prefix_match_unit={g})")
        for name in ("eviction", "host_eviction"):
            if getattr(self, name) not in EVICTION_POLICIES:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be one of {list(EVICTION_POLICIES)}")
        hp = self.host_probation
        if isinstance(hp, bool) or not isinstance(hp, (int, float)) or not 0 <= hp <= 1:
            raise ConfigError(f"host_probation={hp!r} must be a fraction in [0, 1]")
        ps = self.host_protected_share
        if ps is not None and (isinstance(ps, bool) or not isinstance(ps, (int, float)) or not 0 < ps <= 1):
            raise ConfigError(f"host_protected_share={ps!r} must be a fraction in (0, 1] or None")
        if ps is not None and self.host_eviction != "lru":
            raise ConfigError(f"host_protected_share={ps!r} works with host_eviction='lru', not {self.host_eviction!r}")
        cp = self.checkpoint_probation
        if cp is not None and (isinstance(cp, bool) or not isinstance(cp, (int, float)) or not 0 <= cp <= 1):
            raise ConfigError(f"checkpoint_probation={cp!r} must be a fraction in [0, 1] or None")
        if cp is not None and self.eviction != "lru":
            raise ConfigError(f"checkpoint_probation={cp!r} works with eviction='lru', not {self.eviction!r}")
        ce = self.checkpoint_eviction
        if ce is not None and ce not in CHECKPOINT_EVICTIONS:
            raise ConfigError(f"checkpoint_eviction={ce!r} must be one of {list(CHECKPOINT_EVICTIONS)} or None "
                              f"(None: the checkpoint pool follows eviction={self.eviction!r})")
        if ce is not None and cp is not None:
            raise ConfigError(f"checkpoint_eviction={ce!r} and checkpoint_probation={cp!r} exclude each other")
        q = self.tenant_quota
        if q is not None and (isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1):
            raise ConfigError(f"tenant_quota={q!r} must be a fraction in (0, 1] or None")
        h = self.host_interval
        if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h <= 0 or h % b):
            raise ConfigError(f"host_interval={h!r} must be a positive multiple of block_size={b} "
                              "or None (off; --host-interval 0)")
        if not isinstance(self.mechanism, Mechanism):
            raise ConfigError(f"mechanism={self.mechanism!r} must be a Mechanism")
        p = self.policy
        if p.tail_alignment is not None and p.tail_alignment % g:
            raise ConfigError(
                f"policy tail={p.tail_alignment} must be a multiple of prefix_match_unit={g}")
        if p.interval is not None and p.interval % g:
            raise ConfigError(
                f"policy interval={p.interval} must be a multiple of prefix_match_unit={g}")

    @property
    def store_boundary(self) -> int:
        """``store_alignment`` with its default applied (tokens)."""
        return self.store_alignment or self.block_size

    @property
    def tail_alignment(self) -> int:
        """Alignment of tail checkpoints in tokens."""
        return self.policy.tail_alignment or self.prefix_match_unit
