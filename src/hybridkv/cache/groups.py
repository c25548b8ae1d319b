"""Cache groups, known by their spec (DESIGN §1, §4, §13). Everything that decides what is
reusable lives here, once:

* :class:`GroupSpec`: one kind of per-layer state, by what the hit rule and the tiers need
  to know of it: its name, its direction (:data:`PREFIX`: prefix-closed entries, searched left
  to right, e.g. ``full`` MLA KV per token, DeepSeek-V4's ``csa`` / ``hca`` compressed entries
  per 4 / 128 tokens; :data:`BOUNDARY`: a fixed-size state at a boundary, sparse, searched right
  to left, e.g. ``kda`` checkpoints, V4's ``swa`` window + compressor tails + CSA overlap), its
  granularity in tokens and its entry components (dtype, shape), hence its bytes per entry;
* how a hit restores a boundary group (:class:`SavedAtHit`, :class:`SavedEvery`,
  :class:`RecomputeCone`), which gives the token where computation resumes;
* :class:`Family`: a model family's groups and restore strategies (:data:`KIMI_LINEAR` =
  ``full`` + ``kda`` saved at the hit; :func:`kimi_linear` with entry shapes);
* the presence protocol (:class:`Presence`): what the hit rule asks of whatever holds entries
  (the device index, a tier's ``exists`` answer, a router's view of an instance or of the
  store), each through an adapter that may answer in its own fast way;
* :func:`joint_hit`: THE joint-hit rule: the deepest boundary at which every group is
  restorable, the restart point (``<= hit``) and the branching boundary;
* :func:`reuse_cap`: at most ``T - 1`` tokens of a ``T``-token prompt are reused;
* the Kimi Linear model-sized specs (:class:`FullAttentionSpec`, :class:`KDASpec`) and the
  entry shapes they imply (:func:`entry_shapes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice, takewhile
from typing import Protocol

FULL = "full"
"""Group of the full-attention (MLA) layers: paged KV latents."""
KDA = "kda"
"""Group of the linear-attention (KDA) layers: whole-model checkpoints."""
GROUP_NAMES = (FULL, KDA)
"""Groups of the Kimi Linear family, in the order reports list them."""

PREFIX = "prefix"
"""Direction of a prefix-closed group: entries ``[0, L)`` present means every shorter prefix's
are too; its hit is the run of entries from token 0 (searched left to right)."""
BOUNDARY = "boundary"
"""Direction of a boundary-state group: one fixed-size state per boundary, sparse and
irreversible; its hit is the deepest restorable boundary at or below a limit (searched right
to left)."""

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per value of each dtype an entry component may have."""


def reuse_cap(num_tokens: int, unit: int) -> int:
    """Most tokens of a ``num_tokens`` prompt that may be reused: ``T - 1`` rounded down to ``unit``.

    The last prompt position is always computed, so the request has logits to
    sample its first token from (tokens).
    """
    return max(num_tokens - 1, 0) // unit * unit


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` (a :data:`DTYPE_BYTES` name) and ``shape``.

    Raises:
        KeyError: ``dtype`` is not one of :data:`DTYPE_BYTES`.
    """
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Spec of the ``full`` group: paged MLA latents.

    Attributes:
        block_size: tokens per page.
        num_layers: MLA layers.
        latent_dim: ``kv_lora_rank + qk_rope_head_dim`` values per token per layer.
        dtype_bytes: bytes per value in the device pool (entries are float32).
    """

    block_size: int
    num_layers: int
    latent_dim: int
    dtype_bytes: int = 4

    @classmethod
    def for_model(cls, config, block_size: int, dtype_bytes: int = 4) -> FullAttentionSpec:
        """Spec of a :class:`~hybridkv.model.config.HybridConfig` with pages of ``block_size`` tokens."""
        return cls(block_size, config.num_mla_layers, config.kv_latent_dim, dtype_bytes)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all MLA layers."""
        return self.num_layers * self.latent_dim * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page over all MLA layers."""
        return self.block_size * self.bytes_per_token

    def entry_shape(self, segment: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Components of a ``full`` entry of ``segment`` tokens: ``latents`` ``float32[L_mla, segment, D]``."""
        return {"latents": ("float32", (self.num_layers, segment, self.latent_dim))}

    def group_spec(self) -> GroupSpec:
        """The ``full`` :class:`GroupSpec`: prefix-closed, one entry per token, ``latents``
        ``float32[L_mla, tokens, D]`` (its :meth:`entry_shape`)."""
        return GroupSpec(FULL, PREFIX, 1, (("latents", "float32", (self.num_layers, 1, self.latent_dim)),))


@dataclass(frozen=True, slots=True)
class KDASpec:
    """Spec of the ``kda`` group: whole-model checkpoints.

    Attributes:
        num_layers: KDA layers.
        num_heads, head_dim: per layer; recurrent state ``float32[H, K, K]``.
        conv_dim: ``3 * H * K`` channels of the conv window.
        conv_width: ``kernel_size - 1`` rows of the conv window.
        conv_dtype: dtype name of the conv window (the model's compute dtype).
    """

    num_layers: int
    num_heads: int
    head_dim: int
    conv_dim: int
    conv_width: int
    conv_dtype: str = "float32"

    @classmethod
    def for_model(cls, config, conv_dtype: str = "float32") -> KDASpec:
        """Spec of a :class:`~hybridkv.model.config.HybridConfig` whose compute dtype is ``conv_dtype``."""
        return cls(config.num_kda_layers, config.kda_num_heads, config.kda_head_dim, config.conv_dim,
                   config.conv_kernel_size - 1, conv_dtype)

    def entry_shape(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Components of a ``kda`` entry: ``recurrent`` ``float32[L_kda, H, K, K]`` and the q | k | v
        thirds of the conv window, ``conv.q`` / ``conv.k`` / ``conv.v`` each ``[L_kda, H*K, width]``."""
        third = (self.num_layers, self.conv_dim // 3, self.conv_width)
        return {"recurrent": ("float32", (self.num_layers, self.num_heads, self.head_dim, self.head_dim)),
                "conv.q": (self.conv_dtype, third), "conv.k": (self.conv_dtype, third),
                "conv.v": (self.conv_dtype, third)}

    def group_spec(self) -> GroupSpec:
        """The ``kda`` :class:`GroupSpec`: a boundary state (every layer's recurrent state and conv
        window, :meth:`entry_shape`), takeable at any unit boundary."""
        return GroupSpec(KDA, BOUNDARY, 1, tuple((c, d, s) for c, (d, s) in self.entry_shape().items()))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one checkpoint (every KDA layer: recurrent fp32 + conv)."""
        return sum(nbytes(dtype, shape) for dtype, shape in self.entry_shape().values())


def entry_shapes(full: FullAttentionSpec, kda: KDASpec, segment: int) -> dict[str, dict]:
    """group -> component -> ``(dtype name, shape)`` of this model's lower-tier entries, whose
    ``full`` entries hold ``segment`` tokens (the tier's alignment): :meth:`Family.entry_shapes`
    of :func:`kimi_linear`."""
    return kimi_linear(full, kda).entry_shapes(segment)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What the hit rule and the tiers know of one cache group.

    Attributes:
        name: the group's name (object keys, events, reports), e.g. ``full``, ``kda``.
        direction: :data:`PREFIX` or :data:`BOUNDARY`.
        granularity: tokens per entry: a prefix group's entry summarises this many tokens
            (``full`` 1, V4's ``csa`` 4 and ``hca`` 128); for a boundary group the spacing of
            the boundaries where its state may be taken (tokens; 1 = any).
        components: ``(component, dtype name, shape)`` of one entry. A prefix group's shape has
            an entries axis at ``entries_axis`` whose length in ``shape`` is ignored (an entry of
            ``n`` tokens has ``n / granularity`` there); a boundary group's shape is the whole
            state. Empty: a spec without a layout (what a router knows: names and directions).
        entries_axis: position of the entries axis in a prefix group's shapes.

    Raises:
        ValueError: an unknown direction, a granularity below 1, a dtype not in
            :data:`DTYPE_BYTES` (each naming the value).
    """

    name: str
    direction: str
    granularity: int = 1
    components: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    entries_axis: int = 1

    def __post_init__(self) -> None:
        if self.direction not in (PREFIX, BOUNDARY):
            raise ValueError(f"group {self.name!r}: direction={self.direction!r} must be {PREFIX!r} or {BOUNDARY!r}")
        if isinstance(self.granularity, bool) or not isinstance(self.granularity, int) or self.granularity < 1:
            raise ValueError(f"group {self.name!r}: granularity={self.granularity!r} must be a positive int (tokens)")
        for comp, dtype, _ in self.components:
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"group {self.name!r}: component {comp!r} has dtype {dtype!r}, "
                                 f"not one of {sorted(DTYPE_BYTES)}")

    @property
    def prefix_closed(self) -> bool:
        """Whether this is a prefix-closed group (:data:`PREFIX`)."""
        return self.direction == PREFIX

    @property
    def bytes_per_entry(self) -> int:
        """Bytes of one entry over all its components: one ``granularity`` of a prefix group
        (its entries axis taken as 1), one boundary's state of a boundary group."""
        total = 0
        for _, dtype, shape in self.components:
            if self.prefix_closed:
                shape = shape[:self.entries_axis] + (1,) + shape[self.entries_axis + 1:]
            total += nbytes(dtype, shape)
        return total

    def entry_shape(self, tokens: int | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
        """component -> ``(dtype name, shape)`` of a tier entry: for a prefix group the entries of
        ``tokens`` tokens (a multiple of ``granularity``), for a boundary group its state.

        Raises:
            ValueError: a prefix group's ``tokens`` missing or not a positive multiple of its
                granularity (naming both).
        """
        if not self.prefix_closed:
            return {comp: (dtype, shape) for comp, dtype, shape in self.components}
        if tokens is None or tokens <= 0 or tokens % self.granularity:
            raise ValueError(f"group {self.name!r}: an entry of tokens={tokens!r} is not a positive multiple "
                             f"of its granularity {self.granularity}")
        n, ax = tokens // self.granularity, self.entries_axis
        return {comp: (dtype, shape[:ax] + (n,) + shape[ax + 1:]) for comp, dtype, shape in self.components}


class Presence(Protocol):
    """What :func:`joint_hit` asks of whatever holds a prompt's entries (tokens throughout).

    An adapter answers for one prompt (its unit hashes are the adapter's business) and for the
    groups it holds; asked about a group it does not know it raises ``KeyError`` naming it.
    """

    def prefix_run(self, group: str, limit: int) -> int:
        """End of the run of ``group``'s entries from token 0, at most ``limit``: the deepest
        boundary ``b <= limit`` (one the adapter can name) such that ``[0, b)`` is held."""

    def deepest_state(self, group: str, at_most: int) -> int:
        """The deepest boundary ``<= at_most`` at which ``group``'s state is held; 0 (the zero
        state at token 0, always available) when none is."""


class Presences(Protocol):
    """:class:`Presence` of several holders of one prompt's entries, asked for all at once (a
    router's views of every instance on every arrival: one call per question, not per holder).
    Lists are per holder, in the adapter's order."""

    def prefix_runs(self, group: str, limit: int) -> list[int]:
        """:meth:`Presence.prefix_run` of each holder."""

    def deepest_states(self, group: str, at_most: list[int]) -> list[int]:
        """:meth:`Presence.deepest_state` of each holder, at its own ``at_most``."""


@dataclass(frozen=True, slots=True)
class SavedAtHit:
    """Restore a boundary group from its state saved at the hit itself: the hit moves down to
    the deepest boundary holding a state; computation resumes there (``restart = hit``).
    Kimi Linear's ``kda`` checkpoints; V4's ``window`` strategy."""

    def resolve(self, presence: Presence, group: str, hit: int) -> tuple[int, int]:
        """``(hit, restart)`` this group allows at a candidate ``hit`` (tokens)."""
        saved = presence.deepest_state(group, hit)
        return saved, saved

    def resolve_many(self, presences: Presences, group: str, hits: list[int]) -> tuple[list[int], list[int]]:
        """:meth:`resolve` for every holder of ``presences``: ``(hits, restarts)``."""
        saved = presences.deepest_states(group, hits)
        return saved, saved


@dataclass(frozen=True, slots=True)
class SavedEvery:
    """Restore from the nearest state saved at or below the hit (saved every ``period`` tokens)
    and recompute from there: the hit stays, ``restart`` is that state's boundary (0 when none).
    V4's ``periodic=P`` strategy.

    Raises:
        ValueError: ``period`` below 1.
    """

    period: int

    def __post_init__(self) -> None:
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"period={self.period!r} must be a positive int (tokens)")

    def resolve(self, presence: Presence, group: str, hit: int) -> tuple[int, int]:
        """``(hit, restart)`` this group allows at a candidate ``hit`` (tokens)."""
        return hit, presence.deepest_state(group, hit)

    def resolve_many(self, presences: Presences, group: str, hits: list[int]) -> tuple[list[int], list[int]]:
        """:meth:`resolve` for every holder of ``presences``: ``(hits, restarts)``."""
        return hits, presences.deepest_states(group, hits)


@dataclass(frozen=True, slots=True)
class RecomputeCone:
    """Save nothing: recompute the last ``tokens`` positions before the hit (the dependency cone
    of the state at the hit, the prefix groups' entries of ``[0, hit)`` loaded). The hit stays,
    ``restart = max(0, hit - tokens)``. V4's ``recompute`` strategy.

    Raises:
        ValueError: ``tokens`` negative.
    """

    tokens: int

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"cone tokens={self.tokens!r} must be a non-negative int")

    def resolve(self, presence: Presence, group: str, hit: int) -> tuple[int, int]:
        """``(hit, restart)`` this group allows at a candidate ``hit`` (tokens)."""
        return hit, max(0, hit - self.tokens)

    def resolve_many(self, presences: Presences, group: str, hits: list[int]) -> tuple[list[int], list[int]]:
        """:meth:`resolve` for every holder of ``presences``: ``(hits, restarts)``."""
        return hits, [max(0, h - self.tokens) for h in hits]


Restore = SavedAtHit | SavedEvery | RecomputeCone
"""How a hit restores a boundary group."""

SAVED_AT_HIT = SavedAtHit()


@dataclass(frozen=True, slots=True)
class Family:
    """A model family's cache groups: a tuple of specs and, per boundary group, how a hit
    restores it.

    Attributes:
        name: the family's name (e.g. ``kimi-linear``).
        groups: its specs, in the order reports list them; at least one prefix group.
        restore: boundary group name -> its :data:`Restore`; every boundary group has one.
        prefix_names / boundary: derived: the prefix groups' names, ``(name, restore)`` of the
            boundary groups (what :func:`joint_hit` walks).
        saved_pair: derived: ``(prefix group, boundary group)`` when the family has exactly one
            of each and the boundary group is :class:`SavedAtHit` (Kimi Linear), else ``None``.

    Raises:
        ValueError: duplicate group names, no prefix group, a boundary group without a restore
            strategy or a strategy naming no boundary group (each naming it).
    """

    name: str
    groups: tuple[GroupSpec, ...]
    restore: Mapping[str, Restore] = field(default_factory=dict)
    prefix_names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    boundary: tuple[tuple[str, Restore], ...] = field(init=False, repr=False, compare=False)
    saved_pair: tuple[str, str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"family {self.name!r}: duplicate group names in {names}")
        prefix = tuple(g.name for g in self.groups if g.prefix_closed)
        if not prefix:
            raise ValueError(f"family {self.name!r} has no prefix-closed group (groups {names})")
        bnames = [g.name for g in self.groups if not g.prefix_closed]
        for b in bnames:
            if b not in self.restore:
                raise ValueError(f"family {self.name!r}: boundary group {b!r} has no restore strategy")
        for r in self.restore:
            if r not in bnames:
                raise ValueError(f"family {self.name!r}: restore strategy for {r!r}, which is not a boundary group")
        object.__setattr__(self, "prefix_names", prefix)
        object.__setattr__(self, "boundary", tuple((b, self.restore[b]) for b in bnames))
        # one prefix group and one boundary group saved at the hit (Kimi Linear): the rule's
        # short form (two questions, no loop), which every lookup and every router takes
        simple = len(prefix) == 1 and len(bnames) == 1 and isinstance(self.restore[bnames[0]], SavedAtHit)
        object.__setattr__(self, "saved_pair", (prefix[0], bnames[0]) if simple else None)

    @property
    def names(self) -> tuple[str, ...]:
        """Every group's name, in order."""
        return tuple(g.name for g in self.groups)

    def spec(self, name: str) -> GroupSpec:
        """The spec of the group ``name``.

        Raises:
            KeyError: no such group (naming it).
        """
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"family {self.name!r} has no group {name!r} (groups {self.names})")

    def entry_shapes(self, tokens: int) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
        """group -> component -> ``(dtype name, shape)`` of this family's tier entries, whose prefix
        groups' entries hold ``tokens`` tokens (the tier's alignment)."""
        return {g.name: g.entry_shape(tokens) for g in self.groups}


KIMI_LINEAR = Family("kimi-linear", (GroupSpec(FULL, PREFIX), GroupSpec(KDA, BOUNDARY)), {KDA: SAVED_AT_HIT})
"""Kimi Linear (MLA + KDA) without a layout: what the hit rule needs (``full`` prefix-closed
per token; ``kda`` checkpoints, restored from the one saved at the hit)."""


def kimi_linear(full: FullAttentionSpec, kda: KDASpec) -> Family:
    """:data:`KIMI_LINEAR` with the entry shapes of a model (its specs)."""
    return Family(KIMI_LINEAR.name, (full.group_spec(), kda.group_spec()), {KDA: SAVED_AT_HIT})


class JointHit:
    """What every group of a family agrees can be reused (tokens).

    Attributes:
        hit: joint hit: the deepest boundary at which every group is restorable (tokens whose
            state the request takes from the cache).
        kv_hit: the prefix groups' hit: the shortest of their runs from token 0 (``full``'s KV
            run for Kimi Linear).
        restart: where computation resumes (``<= hit``): ``[restart, hit)`` is recomputed to
            rebuild boundary state only (``== hit`` when every boundary group is saved at the hit).
        per_group: group name -> its own hit: a prefix group's run under the limit, a boundary
            group's hit at the joint hit's resolution (for :class:`SavedAtHit` its deepest saved
            state inside the prefix hit). Built on first read for a family's short form.
    """

    __slots__ = ("hit", "kv_hit", "restart", "_per_group", "_pair")

    def __init__(self, hit: int, kv_hit: int, restart: int, per_group: dict[str, int] | None = None,
                 pair: tuple[str, str] | None = None) -> None:
        self.hit, self.kv_hit, self.restart, self._per_group, self._pair = hit, kv_hit, restart, per_group, pair

    @property
    def per_group(self) -> dict[str, int]:
        if self._per_group is None:
            p, b = self._pair
            self._per_group = {p: self.kv_hit, b: self.hit}
        return self._per_group

    @property
    def branching_boundary(self) -> int | None:
        """``kv_hit`` when it exceeds the joint hit (entries there, no restorable state: the place
        to create one), else ``None``."""
        return self.kv_hit if self.kv_hit > self.hit else None

    def __eq__(self, other) -> bool:
        return (isinstance(other, JointHit) and (self.hit, self.kv_hit, self.restart, self.per_group)
                == (other.hit, other.kv_hit, other.restart, other.per_group))

    __hash__ = None

    def __repr__(self) -> str:
        return (f"JointHit(hit={self.hit}, kv_hit={self.kv_hit}, restart={self.restart}, "
                f"per_group={self.per_group})")


def joint_hit(family: Family, presence: Presence, limit: int) -> JointHit:
    """The joint-hit rule (DESIGN §4, §13), one for every holder of entries.

    1. The prefix hit: the shortest run from token 0 of the family's prefix groups, at most
       ``limit`` (each group's run is its :meth:`Presence.prefix_run`).
    2. Each boundary group resolves a candidate hit under its restore strategy (a saved-at-hit
       group moves it down to its deepest saved state; the others keep it and name a restart);
       the groups are looped to agreement (a prefix-closed run holds at any shorter hit).
    3. ``restart`` is the lowest restart the boundary groups name at the agreed hit.

    A family of one prefix group and one boundary group saved at the hit
    (:attr:`Family.saved_pair`, Kimi Linear) takes the rule's short form: the run, then the
    deepest saved state inside it (a saved state's own fixed point, so no loop).

    Args:
        family: the model family (its groups and restore strategies).
        presence: an adapter over what holds the prompt's entries (:class:`Presence`).
        limit: most tokens reusable (usually :func:`reuse_cap`).

    Returns:
        The :class:`JointHit`; ``branching_boundary`` is the prefix hit when it exceeds the hit.
    """
    pair = family.saved_pair
    if pair is not None:
        kv = presence.prefix_run(pair[0], limit)
        hit = presence.deepest_state(pair[1], kv)
        return JointHit(hit, kv, hit, None, pair)
    runs = {name: presence.prefix_run(name, limit) for name in family.prefix_names}
    kv = hit = min(runs.values())
    boundary = family.boundary
    while True:
        resolved = [how.resolve(presence, name, hit) for name, how in boundary]
        agreed = min((h for h, _ in resolved), default=hit)
        if agreed == hit:
            break
        hit = agreed
    for (name, _), (h, _) in zip(boundary, resolved):
        runs[name] = h
    return JointHit(hit, kv, min((r for _, r in resolved), default=hit), runs)


def joint_hits(family: Family, presences: Presences, limit: int) -> tuple[list[int], list[int], list[int]]:
    """:func:`joint_hit` for every holder of ``presences`` at once (the same rule, on lists):
    ``(kv_hits, hits, restarts)``, one entry per holder (tokens).

    Args:
        family: the model family.
        presences: an adapter over several holders of the prompt's entries (:class:`Presences`).
        limit: most tokens reusable.
    """
    pair = family.saved_pair
    if pair is not None:
        kvs = presences.prefix_runs(pair[0], limit)
        hits = presences.deepest_states(pair[1], kvs)
        return kvs, hits, hits
    kvs = None
    for name in family.prefix_names:
        runs = presences.prefix_runs(name, limit)
        kvs = runs if kvs is None else list(map(min, kvs, runs))
    hits, boundary = kvs, family.boundary
    while True:
        resolved = [how.resolve_many(presences, name, hits) for name, how in boundary]
        agreed = list(map(min, *(h for h, _ in resolved))) if len(resolved) > 1 else (
            resolved[0][0] if resolved else hits)
        if agreed == hits:
            break
        hits = agreed
    restarts = (list(map(min, *(r for _, r in resolved))) if len(resolved) > 1
                else resolved[0][1] if resolved else hits)
    return kvs, hits, restarts


# -- adapters over explicit boundary lists ---------------------------------------------------------


class Boundary(Protocol):
    """What :class:`BoundaryList` reads of one Kimi Linear boundary (an index node or a lower
    tier's entry pair).

    Attributes:
        end: the boundary in tokens.
        has_kv: the KV of the segment ending here is available.
        has_checkpoint: ``C(P_end)`` is available.
    """

    end: int
    has_kv: bool
    has_checkpoint: bool


@dataclass(frozen=True, slots=True)
class EntryPresence:
    """A :class:`Boundary` whose availability a lower tier reported (tokens, flags)."""

    end: int
    has_kv: bool
    has_checkpoint: bool


KIMI_FLAGS = {FULL: "has_kv", KDA: "has_checkpoint"}
"""Which :class:`Boundary` attribute says a Kimi Linear group is held there."""


class BoundaryList:
    """:class:`Presence` over consecutive ascending boundaries (each one's segment starts where
    the previous one ends, the first one at token 0), each saying per group whether it is held.

    Args:
        boundaries: the boundaries (objects with ``end`` and one flag attribute per group).
        flags: group name -> attribute of a boundary saying the group is held there
            (default :data:`KIMI_FLAGS`).
    """

    __slots__ = ("boundaries", "flags")

    def __init__(self, boundaries: Sequence, flags: Mapping[str, str] = KIMI_FLAGS) -> None:
        self.boundaries, self.flags = boundaries, flags

    def prefix_run(self, group: str, limit: int) -> int:
        attr, hit = self.flags[group], 0
        for b in self.boundaries:
            if b.end > limit or not getattr(b, attr):
                break
            hit = b.end
        return hit

    def deepest_state(self, group: str, at_most: int) -> int:
        attr = self.flags[group]
        for b in reversed(self.boundaries):
            if b.end <= at_most and getattr(b, attr):
                return b.end
        return 0


class HeldBoundaries:
    """:class:`Presence` over sets of held boundaries per group, on a grid of ``unit`` tokens.

    A prefix group is held at ``b`` when its entries of the segment ending at ``b`` are (its run
    walks ``unit, 2 unit, ...``); a boundary group when its state at ``b`` is.

    Args:
        unit: spacing of the boundaries (tokens).
        held: group name -> boundaries (tokens) where it is held.
    """

    __slots__ = ("unit", "held")

    def __init__(self, unit: int, held: Mapping[str, Iterable[int]]) -> None:
        self.unit, self.held = unit, {g: frozenset(b) for g, b in held.items()}

    def prefix_run(self, group: str, limit: int) -> int:
        held, u, b = self.held[group], self.unit, 0
        while b + u <= limit and b + u in held:
            b += u
        return b

    def deepest_state(self, group: str, at_most: int) -> int:
        held, u = self.held[group], self.unit
        b = at_most // u * u
        while b > 0 and b not in held:
            b -= u
        return max(b, 0)


class KeySetPresence:
    """:class:`Presence` over sets of chained unit keys per group (a router's view of an instance
    or of the store, built from cache events): a group is held at boundary ``b`` when the chained
    hash of ``[0, b)`` is in its set.

    Boundaries lie every ``step`` units (a store's entries: ``alignment / unit``); the run and the
    scan are counted in C where they can (``takewhile`` over a slice of the prompt's keys).

    Args:
        keys: the prompt's chained unit hashes (one per whole ``unit``).
        unit: ``prefix_match_unit`` in tokens.
        held: group name -> the keys at which the group is held (any container).
        step: units per boundary (default 1).
    """

    __slots__ = ("keys", "unit", "held", "step")

    def __init__(self, keys: Sequence[bytes], unit: int, held: Mapping[str, object], step: int = 1) -> None:
        self.keys, self.unit, self.held, self.step = keys, unit, held, step

    def prefix_run(self, group: str, limit: int) -> int:
        step = self.step
        run = len(list(takewhile(self.held[group].__contains__, islice(self.keys, step - 1, limit // self.unit, step))))
        return run * self.unit * step

    def deepest_state(self, group: str, at_most: int) -> int:
        held, keys, step = self.held[group], self.keys, self.step
        k = min(at_most // self.unit, len(keys)) // step * step          # units, on a boundary
        while k and keys[k - 1] not in held:
            k -= step
        return k * self.unit


# -- tier entries: storage by lifetime -------------------------------------------------------------


def page_entry_name(family: Family) -> str:
    """Name of a family's *page entry* in lower tiers: the prefix groups of one aligned segment
    share one page id on the device, so a tier stores them as one entry under one manifest. With
    one prefix group it is that group's name (``full``); with several, their names joined by ``-``
    (``csa-hca``)."""
    return "-".join(family.prefix_names)


def tier_entry_shapes(family: Family, tokens: int) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """entry kind -> component -> ``(dtype name, shape)`` of a family's lower-tier entries whose
    segments hold ``tokens`` tokens (the tier's alignment), in the order *page entry, state entry*:

    * the page entry (:func:`page_entry_name`): every prefix group's entries of the segment; with
      one prefix group its components keep their names (``latents``), with several each is
      named ``<group>.<component>`` (``csa.kv``, ``csa.index``, ``hca.kv``);
    * the state entry: the family's boundary group at one boundary (``kda``, ``swa``), its
      components as its spec names them.

    Raises:
        ValueError: a family with other than one boundary group, or ``tokens`` not a multiple of a
            prefix group's granularity (naming them).
    """
    bnames = [name for name, _ in family.boundary]
    if len(bnames) != 1:
        raise ValueError(f"family {family.name!r}: lower tiers store one boundary group per boundary, "
                         f"this family has {bnames}")
    prefix = [family.spec(n) for n in family.prefix_names]
    if len(prefix) == 1:
        page = prefix[0].entry_shape(tokens)
    else:
        page = {f"{g.name}.{c}": ds for g in prefix for c, ds in g.entry_shape(tokens).items()}
    return {page_entry_name(family): page, bnames[0]: family.spec(bnames[0]).entry_shape()}


def split_page_entry(family: Family, components: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """A page entry's components (:func:`tier_entry_shapes`) per prefix group: group -> component
    -> value (the inverse of the naming there)."""
    if len(family.prefix_names) == 1:
        return {family.prefix_names[0]: dict(components)}
    out: dict[str, dict[str, object]] = {g: {} for g in family.prefix_names}
    for name, value in components.items():
        g, _, c = name.partition(".")
        out[g][c] = value
    return out


def join_page_entry(family: Family, per_group: Mapping[str, Mapping[str, object]]) -> dict[str, object]:
    """Inverse of :func:`split_page_entry`: one page entry's components from group -> component -> value."""
    if len(family.prefix_names) == 1:
        return dict(per_group[family.prefix_names[0]])
    return {f"{g}.{c}": v for g in family.prefix_names for c, v in per_group[g].items()}
