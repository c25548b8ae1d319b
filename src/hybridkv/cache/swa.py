"""DeepSeek-V4's cache groups and the seed's three SWA recovery strategies (DESIGN §12, §13).

A V4 model's cached state is three groups, known here by their specs only (no model import):

* ``csa``: prefix-closed, one compressed entry per ``csa_rate`` (4) tokens per CSA layer, with
  the Lightning Indexer's key of the same window;
* ``hca``: prefix-closed, one entry per ``hca_rate`` tokens per HCA layer;
* ``swa``: the boundary state (every layer's sliding window, each compressor's unfinished tail
  and CSA's overlap slice), fixed size, stored in checkpoint slots like KDA checkpoints.

The prefix groups share one page id per ``block_size`` block (each group's pool holds
``block_size / granularity`` entries of it), so ``block_size`` must be a multiple of the largest
granularity (:func:`check_block_size`).

How a hit restores ``swa`` is the run's ``--swa-recovery`` (:class:`SwaRecovery`):

* ``window``: the boundary state saved at the hit (:class:`~hybridkv.cache.groups.SavedAtHit`),
  placed by the checkpoint policy like a KDA checkpoint;
* ``periodic=P``: saved every ``P`` tokens; a hit at ``h`` resumes from the nearest saved state
  ``c <= h`` and recomputes ``[c, h)`` writing only boundary state
  (:class:`~hybridkv.cache.groups.SavedEvery`);
* ``recompute``: nothing saved; a hit recomputes the dependency cone of the boundary state at
  ``h`` from the cached compressed entries and the raw tokens
  (:class:`~hybridkv.cache.groups.RecomputeCone`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.cache.config import CheckpointPolicy, ConfigError
from hybridkv.cache.groups import (BOUNDARY, PREFIX, SAVED_AT_HIT, Family, GroupSpec, RecomputeCone,
                                   Restore, SavedEvery)

CSA = "csa"
"""Group of the CSA layers' compressed entries (with their indexer keys)."""
HCA = "hca"
"""Group of the HCA layers' compressed entries."""
SWA = "swa"
"""Boundary-state group of DeepSeek-V4: sliding windows, compressor tails, CSA overlaps."""
V4_FAMILY_NAME = "deepseek-v4"

WINDOW, PERIODIC, RECOMPUTE = "window", "periodic", "recompute"
SWA_RECOVERY_KINDS = (WINDOW, PERIODIC, RECOMPUTE)
DEFAULT_SWA_RECOVERY = WINDOW
"""Default strategy: restoring the saved window costs no recompute, and the boundary state is
a few kilobytes per checkpoint on the bundled presets (docs/concepts/v4.md, Sizes)."""


@dataclass(frozen=True, slots=True)
class SwaRecovery:
    """How a hit restores V4's ``swa`` boundary state.

    Attributes:
        kind: ``window``, ``periodic`` or ``recompute``.
        period: tokens between saved states for ``periodic`` (a positive multiple of
            ``prefix_match_unit``, checked by :meth:`check`); ``None`` otherwise.

    Raises:
        ConfigError: an unknown kind, or a period missing / given where it does not belong.
    """

    kind: str = DEFAULT_SWA_RECOVERY
    period: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SWA_RECOVERY_KINDS:
            raise ConfigError(f"swa_recovery={self.kind!r} must be one of window, periodic=P, recompute")
        if (self.kind == PERIODIC) != (self.period is not None):
            raise ConfigError(f"swa_recovery {self.kind!r}: a period (periodic=P, tokens) goes with periodic only")
        if self.period is not None and (isinstance(self.period, bool) or not isinstance(self.period, int)
                                        or self.period < 1):
            raise ConfigError(f"swa_recovery periodic={self.period!r}: P must be a positive integer (tokens)")

    @classmethod
    def parse(cls, value: SwaRecovery | str | None) -> SwaRecovery:
        """``window``, ``periodic=P`` (``P`` tokens) or ``recompute``; ``None``: the default.

        Raises:
            ConfigError: anything else, naming the text.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"swa_recovery={value!r} must be window, periodic=P or recompute")
        name, sep, p = value.strip().partition("=")
        if name == PERIODIC and sep:
            try:
                period = int(p)
            except ValueError:
                raise ConfigError(f"swa_recovery={value!r}: P={p!r} is not an integer (tokens)") from None
            if period < 1:
                raise ConfigError(f"swa_recovery={value!r}: P={period} must be positive (tokens)")
            return cls(PERIODIC, period)
        if sep or name not in (WINDOW, RECOMPUTE):
            raise ConfigError(f"swa_recovery={value!r} must be window, periodic=P (P tokens) or recompute")
        return cls(name)

    def __str__(self) -> str:
        return f"{PERIODIC}={self.period}" if self.kind == PERIODIC else self.kind

    def check(self, prefix_match_unit: int) -> None:
        """A ``periodic`` period must be a multiple of ``prefix_match_unit`` (tokens; states are
        taken at unit boundaries only).

        Raises:
            ConfigError: naming both values.
        """
        g = prefix_match_unit
        if self.kind == PERIODIC and self.period % g:
            raise ConfigError(f"swa_recovery periodic={self.period}: P must be a multiple of "
                              f"prefix_match_unit={g} (tokens)")

    def policy(self, configured: CheckpointPolicy) -> CheckpointPolicy:
        """The checkpoint policy that places this strategy's saved states: ``window`` keeps the
        configured one, ``periodic=P`` saves every ``P`` tokens only, ``recompute`` saves none."""
        if self.kind == PERIODIC:
            return CheckpointPolicy(branch=False, tail=False, interval=self.period)
        if self.kind == RECOMPUTE:
            return CheckpointPolicy(branch=False, tail=False)
        return configured

    def restore(self, cone_tokens: int) -> Restore:
        """The :data:`~hybridkv.cache.groups.Restore` of ``swa``; ``cone_tokens``: the largest
        recompute cone at any unit boundary (tokens; used by ``recompute`` only)."""
        if self.kind == PERIODIC:
            return SavedEvery(self.period)
        if self.kind == RECOMPUTE:
            return RecomputeCone(cone_tokens)
        return SAVED_AT_HIT


def check_block_size(block_size: int, granularities: dict[str, int]) -> None:
    """Every prefix group's entries of a block must fill whole entries: ``block_size`` a
    multiple of each group's granularity (tokens).

    Raises:
        ConfigError: naming ``block_size``, the group and its granularity.
    """
    for name, m in granularities.items():
        if block_size % m:
            biggest = max(granularities.values())
            raise ConfigError(f"block_size={block_size} must be a multiple of the {name!r} group's "
                              f"granularity {m} tokens (every group's: use a multiple of {biggest})")


def v4_family(csa: GroupSpec, hca: GroupSpec, swa: GroupSpec, restore: Restore) -> Family:
    """The DeepSeek-V4 :class:`~hybridkv.cache.groups.Family`: prefix groups ``csa`` and ``hca``,
    boundary group ``swa`` restored by ``restore``.

    Raises:
        ValueError: specs of the wrong name or direction (naming them).
    """
    for spec, name, direction in ((csa, CSA, PREFIX), (hca, HCA, PREFIX), (swa, SWA, BOUNDARY)):
        if spec.name != name or spec.direction != direction:
            raise ValueError(f"V4 group {name!r} must be a {direction} spec, got {spec.name!r} ({spec.direction})")
    return Family(V4_FAMILY_NAME, (csa, hca, swa), {SWA: restore})


def saves_state(family: Family) -> bool:
    """Whether any boundary group of ``family`` keeps saved states (a recompute cone keeps none)."""
    return any(not isinstance(how, RecomputeCone) for _, how in family.boundary)
