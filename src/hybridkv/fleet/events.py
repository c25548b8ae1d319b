"""Cache events: what an instance tells routers about its cache, and a router's view built from them.

Modelled on vLLM's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``)
plus the two a hybrid model needs: a KDA checkpoint published at a boundary, and one
removed while its KV stays. Every event carries the instance's *epoch*: a restarted
instance starts a new epoch, and a view that sees a newer epoch forgets everything it
knew of that instance, so cache lost in a restart stops attracting traffic even if the
instance's sequence numbers start again at 0.

Keys are chained hashes of ``[0, end)`` per ``prefix_match_unit`` (they identify a
prefix; they are not token ids). They stay inside the process: an event's ``repr``
shows only how many keys it carries, and nothing here logs them.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from itertools import islice, takewhile

from hybridkv.cache.coordinator import EvictedEntry
from hybridkv.cache.groups import FULL, KDA, KIMI_LINEAR, JointHit, KeySetPresence, joint_hit


class EventKind(enum.Enum):
    """What happened to the keys of one :class:`CacheEvent`."""

    BLOCKS_STORED = "blocks_stored"              # KV of these units is cached
    BLOCKS_REMOVED = "blocks_removed"            # KV (and any checkpoint) of these units is gone
    CHECKPOINTS_STORED = "checkpoints_stored"    # a KDA checkpoint is published at these boundaries
    CHECKPOINTS_REMOVED = "checkpoints_removed"  # the checkpoint at these boundaries is gone, KV stays
    ALL_CLEARED = "all_cleared"                  # the instance holds nothing (restart, purge)


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """One event of one instance.

    Attributes:
        instance: index of the emitting instance.
        epoch: the instance's epoch (incremented by every restart).
        seq: 0-based sequence number within ``(instance, epoch)``.
        kind: what happened.
        keys: chained unit hashes concerned (empty for ``ALL_CLEARED``).
        boundaries: for ``CHECKPOINTS_STORED``, the boundary of each key in tokens (the
            checkpoint at key ``i`` is ``C(P_boundaries[i])``), so a consumer can tell which lie
            on a store's entry boundaries; empty when the emitter does not say (then a
            consumer must treat every checkpoint as possibly anywhere).
        first_unit: for ``BLOCKS_STORED``, the index of the first key's unit in its prompt (key
            ``i`` is the chained hash of ``[0, (first_unit + i + 1) * prefix_match_unit)``), so a
            consumer can tell which keys end a store entry; ``None`` when the emitter does not
            say.
    """

    instance: int
    epoch: int
    seq: int
    kind: EventKind
    keys: tuple[bytes, ...] = field(repr=False)
    boundaries: tuple[int, ...] = field(default=(), repr=False)
    first_unit: int | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (f"CacheEvent(instance={self.instance}, epoch={self.epoch}, seq={self.seq}, "
                f"kind={self.kind.value}, keys={len(self.keys)})")


class EventPublisher:
    """An engine's :class:`~hybridkv.engine.engine.CacheListener` that turns its calls into
    :class:`CacheEvent` s, buffered until :meth:`drain` (the fleet delivers them when the
    step that caused them ends).

    Args:
        instance: index of the instance.
    """

    def __init__(self, instance: int) -> None:
        self.instance = instance
        self.epoch = 0
        self._seq = 0
        self._buffer: list[CacheEvent] = []

    def _emit(self, kind: EventKind, keys, boundaries=(), first_unit: int | None = None) -> None:
        if keys or kind is EventKind.ALL_CLEARED:
            self._buffer.append(CacheEvent(self.instance, self.epoch, self._seq, kind, tuple(keys),
                                           tuple(boundaries), first_unit))
            self._seq += 1

    def stored(self, unit_keys: list[bytes], checkpoint_keys: list[bytes], retired_keys: list[bytes],
               checkpoint_boundaries: list[int] = (), first_unit: int | None = None) -> None:
        """KV units cached (``unit_keys``, consecutive units of one prompt from unit index
        ``first_unit`` on, when known), checkpoints published (at ``checkpoint_boundaries``,
        tokens, one per key, when known), tail checkpoints retired (one publish call).

        Raises:
            ValueError: boundaries given that do not pair one-to-one with ``checkpoint_keys``;
                a negative ``first_unit``.
        """
        if checkpoint_boundaries and len(checkpoint_boundaries) != len(checkpoint_keys):
            raise ValueError(f"{len(checkpoint_boundaries)} checkpoint boundaries for "
                             f"{len(checkpoint_keys)} checkpoint keys")
        if first_unit is not None and first_unit < 0:
            raise ValueError(f"first_unit={first_unit!r} must be >= 0 (or None: not known)")
        self._emit(EventKind.BLOCKS_STORED, unit_keys, (), first_unit)
        self._emit(EventKind.CHECKPOINTS_STORED, checkpoint_keys, checkpoint_boundaries)
        self._emit(EventKind.CHECKPOINTS_REMOVED, retired_keys)

    def evicted(self, entries: list[EvictedEntry]) -> None:
        """Entries about to be evicted: a page's units (with their checkpoints), or a checkpoint alone."""
        self._emit(EventKind.BLOCKS_REMOVED, [e.key for e in entries if e.page is not None])
        self._emit(EventKind.CHECKPOINTS_REMOVED, [e.key for e in entries if e.page is None])

    def restart(self) -> None:
        """A new epoch (the instance lost its cache): sequence numbers start again at 0."""
        self.epoch += 1
        self._seq = 0
        self._emit(EventKind.ALL_CLEARED, ())

    def drain(self) -> list[CacheEvent]:
        """Events emitted since the last drain, oldest first."""
        out, self._buffer = self._buffer, []
        return out


_GENERATIONS = itertools.count()
"""Source of :attr:`InstanceView.generation` tokens, unique in the process."""


class InstanceView:
    """What a router knows of one instance's cache: the keys with KV and those with a
    checkpoint, from events only.

    Invariant: every key in ``checkpoints`` is in ``kv`` (a checkpoint hangs on a cached unit).

    ``generation`` names the cache the view describes: a token unique in the process, new on
    every view and whenever the instance is known to have lost its cache (an event of a newer
    epoch than one already heard, or ``all_cleared``). The first epoch a fresh view hears is
    adopted without a new generation, since a view that has heard nothing has forgotten nothing:
    what a router recorded of the instance before its first event (prompts routed there,
    :class:`~hybridkv.fleet.routers.RoutedPrompts`) stays valid. ``epoch`` is ``-1`` until then.

    Args:
        unit: ``prefix_match_unit`` in tokens (the spacing of the keys).
    """

    family = KIMI_LINEAR
    """The model family whose joint-hit rule :meth:`match` follows."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.epoch = -1
        self.kv: set[bytes] = set()
        self.checkpoints: set[bytes] = set()
        self.stale_dropped = 0          # events of an older epoch, ignored
        self.generation = next(_GENERATIONS)

    def apply(self, event: CacheEvent) -> None:
        """Update the view; an event of an older epoch is dropped, one of a newer epoch first
        forgets everything known of the old one."""
        if event.epoch < self.epoch:
            self.stale_dropped += 1
            return
        if event.epoch > self.epoch:
            if self.epoch >= 0:                  # a restart: the cache known of the old epoch is gone
                self.generation = next(_GENERATIONS)
            self.epoch = event.epoch
            self.kv.clear()
            self.checkpoints.clear()
        kind, keys = event.kind, event.keys
        if kind is EventKind.BLOCKS_STORED:
            self.kv.update(keys)
        elif kind is EventKind.CHECKPOINTS_STORED:
            self.checkpoints.update(filter(self.kv.__contains__, keys))
        elif kind is EventKind.BLOCKS_REMOVED:
            self.kv.difference_update(keys)
            self.checkpoints.difference_update(keys)
        elif kind is EventKind.CHECKPOINTS_REMOVED:
            self.checkpoints.difference_update(keys)
        else:
            self.generation = next(_GENERATIONS)
            self.kv.clear()
            self.checkpoints.clear()

    def kv_run(self, hashes: list[bytes], limit: int) -> int:
        """Contiguous KV from token 0 over ``hashes`` (whole units), at most ``limit`` tokens."""
        # the units up to the first one without KV, counted in C (no copy of the prompt's hashes)
        return len(list(takewhile(self.kv.__contains__, islice(hashes, limit // self.unit)))) * self.unit

    def match(self, hashes: list[bytes], limit: int) -> JointHit:
        """The joint hit this instance would give a prompt with unit hashes ``hashes``, under
        ``limit`` tokens (:func:`~hybridkv.cache.groups.reuse_cap`): the rule of
        :func:`~hybridkv.cache.groups.joint_hit` over the keys the events reported
        (:meth:`presence`)."""
        return joint_hit(self.family, self.presence(hashes), limit)

    def presence(self, hashes: list[bytes]) -> KeySetPresence:
        """The :class:`~hybridkv.cache.groups.Presence` of this view for a prompt's unit hashes:
        ``full`` where a key has KV, ``kda`` where it has a checkpoint."""
        return KeySetPresence(hashes, self.unit, {FULL: self.kv, KDA: self.checkpoints})

    def hits(self, hashes: list[bytes], limit: int) -> tuple[int, int]:
        """``(kv_hit, hit)`` of :meth:`match` (tokens)."""
        m = self.match(hashes, limit)
        return m.kv_hit, m.hit
