"""Cache events: what an instance tells routers about its cache, and a router's view built from them.

Modelled on vLLM's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``)
plus the two a hybrid model needs: a boundary state (a KDA checkpoint, a DeepSeek-V4 ``swa``
state) published at a boundary, and one removed while its entries stay. Events name the *cache
group* they concern (``group``; :mod:`hybridkv.cache.groups`): ``blocks_*`` a prefix-closed group
(``full``; or a family's page entry, ``csa-hca``, which names all its prefix groups at once),
``checkpoints_*`` a boundary group (``kda``, ``swa``). An event without a group is read with the
Kimi Linear names (``full`` for ``blocks_*``, ``kda`` for ``checkpoints_*``), which a view of
another family reads as its page entry and its boundary group, so producers that name no group
still work. A view (:class:`InstanceView`) holds one key set per group of its
:class:`~hybridkv.cache.groups.Family`, and its joint hit is the family's rule
(:func:`~hybridkv.cache.groups.joint_hit`). Every event carries the instance's *epoch*: a restarted
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
from hybridkv.cache.groups import KIMI_LINEAR, Family, JointHit, KeySetPresence, joint_hit, page_entry_name


class EventKind(enum.Enum):
    """What happened to the keys of one :class:`CacheEvent`."""

    BLOCKS_STORED = "blocks_stored"              # a prefix group's entries of these units are cached
    BLOCKS_REMOVED = "blocks_removed"            # ... are gone (and any boundary state on them)
    CHECKPOINTS_STORED = "checkpoints_stored"    # a boundary group's state is published at these boundaries
    CHECKPOINTS_REMOVED = "checkpoints_removed"  # the state at these boundaries is gone, the entries stay
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
        group: the cache group the keys concern: for ``BLOCKS_*`` a prefix group or a family's
            page entry (:func:`~hybridkv.cache.groups.page_entry_name`, every prefix group of
            it), for ``CHECKPOINTS_*`` a boundary group; ``None``: not named (``full`` /
            ``kda``, read by a view as its family's page entry / boundary group).
    """

    instance: int
    epoch: int
    seq: int
    kind: EventKind
    keys: tuple[bytes, ...] = field(repr=False)
    boundaries: tuple[int, ...] = field(default=(), repr=False)
    first_unit: int | None = field(default=None, repr=False)
    group: str | None = None

    def __repr__(self) -> str:
        group = "" if self.group is None else f", group={self.group}"
        return (f"CacheEvent(instance={self.instance}, epoch={self.epoch}, seq={self.seq}, "
                f"kind={self.kind.value}{group}, keys={len(self.keys)})")


_PAGE_KINDS = (EventKind.BLOCKS_STORED, EventKind.BLOCKS_REMOVED)
_BLOCKS_STORED, _BLOCKS_REMOVED = _PAGE_KINDS
"""The kinds that concern a prefix group (the others but ``all_cleared`` a boundary group)."""


class EventPublisher:
    """An engine's :class:`~hybridkv.engine.engine.CacheListener` that turns its calls into
    :class:`CacheEvent` s, buffered until :meth:`drain` (the fleet delivers them when the
    step that caused them ends).

    With ``merge_removals``, the removals of consecutive :meth:`evicted` calls (nothing stored
    or cleared between them) are buffered as two key lists and emitted as one ``blocks_removed``
    and one ``checkpoints_removed`` event when anything else is emitted or at :meth:`drain`: a
    view applying them ends in the same state (each is a removal from key sets, so their order
    among themselves does not matter), at one event an eviction run rather than one a victim
    (the fleet simulator's instances, whose events a view applies only a whole drain at a time).

    Args:
        instance: index of the instance.
        family: the engine's cache groups (:attr:`family`); ``None``: events name no group.
        merge_removals: merge consecutive evictions' removals (above).
    """

    def __init__(self, instance: int, family: Family | None = None, merge_removals: bool = False) -> None:
        self.instance = instance
        self.epoch = 0
        self._seq = 0
        self._buffer: list[CacheEvent] = []
        self.page_group: str | None = None
        self.state_group: str | None = None
        self.family = family
        self.merge_removals = merge_removals
        self._removed: tuple[list[bytes], list[bytes]] | None = None   # (page entries, checkpoints) not yet emitted

    @property
    def family(self) -> Family | None:
        """The cache groups of the engine it hears: its events name the family's page entry
        (``blocks_*``; the engine's prefix groups share a page) and its boundary group
        (``checkpoints_*``); ``None``: they name none (read as ``full`` / ``kda``)."""
        return self._family

    @family.setter
    def family(self, family: Family | None) -> None:
        self._family = family
        self.page_group = page_entry_name(family) if family is not None else None
        self.state_group = family.boundary[0][0] if family is not None and family.boundary else None

    def _emit(self, kind: EventKind, keys, boundaries=(), first_unit: int | None = None) -> None:
        if self._removed is not None:
            self._flush_removed()
        if keys or kind is EventKind.ALL_CLEARED:
            group = (None if kind is EventKind.ALL_CLEARED else
                     self.page_group if kind in _PAGE_KINDS else self.state_group)
            self._buffer.append(CacheEvent(self.instance, self.epoch, self._seq, kind, tuple(keys),
                                           tuple(boundaries), first_unit, group))
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
        if self.merge_removals:
            removed = self._removed
            if removed is None:
                removed = self._removed = ([], [])
            pages, states = removed
            for e in entries:
                (pages if e.page is not None else states).append(e.key)
            return
        self._emit(EventKind.BLOCKS_REMOVED, [e.key for e in entries if e.page is not None])
        self._emit(EventKind.CHECKPOINTS_REMOVED, [e.key for e in entries if e.page is None])

    def _flush_removed(self) -> None:
        """Emit the merged removals (:attr:`merge_removals`) buffered so far."""
        pages, states = self._removed
        self._removed = None
        self._emit(EventKind.BLOCKS_REMOVED, pages)
        self._emit(EventKind.CHECKPOINTS_REMOVED, states)

    def restart(self) -> None:
        """A new epoch (the instance lost its cache): sequence numbers start again at 0."""
        if self._removed is not None:                # the old epoch's removals, in the old epoch
            self._flush_removed()
        self.epoch += 1
        self._seq = 0
        self._emit(EventKind.ALL_CLEARED, ())

    def drain(self) -> list[CacheEvent]:
        """Events emitted since the last drain, oldest first."""
        if self._removed is not None:
            self._flush_removed()
        out, self._buffer = self._buffer, []
        return out


_GENERATIONS = itertools.count()
"""Source of :attr:`InstanceView.generation` tokens, unique in the process."""


class InstanceView:
    """What a router knows of one instance's cache: per cache group of its family, the keys at
    which that group is held, from events only.

    ``held`` maps every group of ``family`` to a set of chained unit keys: a prefix group's keys
    whose segment is cached, a boundary group's keys whose boundary has a saved state. ``kv`` is
    the first prefix group's set (``full`` for Kimi Linear), ``checkpoints`` the first boundary
    group's (``kda``; an empty set of its own for a family without one). Invariant: every key in
    a boundary group's set is in ``kv`` (a state hangs on cached units).

    ``generation`` names the cache the view describes: a token unique in the process, new on
    every view and whenever the instance is known to have lost its cache (an event of a newer
    epoch than one already heard, or ``all_cleared``). The first epoch a fresh view hears is
    adopted without a new generation, since a view that has heard nothing has forgotten nothing:
    what a router recorded of the instance before its first event (prompts routed there,
    :class:`~hybridkv.fleet.routers.RoutedPrompts`) stays valid. ``epoch`` is ``-1`` until then.

    Args:
        unit: ``prefix_match_unit`` in tokens (the spacing of the keys).
        family: the instance's cache groups and restore strategies (default
            :data:`~hybridkv.cache.groups.KIMI_LINEAR`); :meth:`match` follows its joint-hit rule.
    """

    def __init__(self, unit: int, family: Family = KIMI_LINEAR) -> None:
        self.unit = unit
        self.family = family
        self.epoch = -1
        self.held: dict[str, set[bytes]] = {g.name: set() for g in family.groups}
        self.kv: set[bytes] = self.held[family.prefix_names[0]]
        self.checkpoints: set[bytes] = self.held[family.boundary[0][0]] if family.boundary else set()
        self._targets: dict[tuple[bool, str | None], tuple[set[bytes], ...]] = {}
        self.stale_dropped = 0          # events of an older epoch, ignored
        self.generation = next(_GENERATIONS)

    def group_sets(self, kind: EventKind, group: str | None) -> tuple[set[bytes], ...]:
        """The key sets an event of ``kind`` naming ``group`` updates: for ``blocks_*`` the prefix
        group's (every prefix group's for the family's page entry, or for ``None``), for
        ``checkpoints_*`` the boundary group's (the first boundary group's for ``None``).

        Raises:
            ValueError: ``group`` is not a group of that direction in the view's family (naming
                the group, the event kind and the family's groups).
        """
        blocks = kind in _PAGE_KINDS
        sets = self._targets.get((blocks, group))
        if sets is not None:
            return sets
        fam, held = self.family, self.held
        bnames = tuple(b for b, _ in fam.boundary)
        if blocks:
            names = (fam.prefix_names if group is None or group == page_entry_name(fam)
                     else (group,) if group in fam.prefix_names else None)
        else:
            names = bnames[:1] if group is None else (group,) if group in bnames else None
        if names is None or not names:
            raise ValueError(f"cache event {kind.value} names group {group!r}, which is not a "
                             f"{'prefix' if blocks else 'boundary'} group of the {fam.name} family "
                             f"(groups {', '.join(fam.names)})")
        sets = self._targets[(blocks, group)] = tuple(held[n] for n in names)
        return sets

    def _clear(self) -> None:
        for keys in self.held.values():
            keys.clear()
        self.checkpoints.clear()

    def apply(self, event: CacheEvent) -> None:
        """Update the view; an event of an older epoch is dropped, one of a newer epoch first
        forgets everything known of the old one.

        Raises:
            ValueError: the event names a group its kind cannot concern in this family
                (:meth:`group_sets`).
        """
        if event.epoch != self.epoch:
            if event.epoch < self.epoch:
                self.stale_dropped += 1
                return
            if self.epoch >= 0:                  # a restart: the cache known of the old epoch is gone
                self.generation = next(_GENERATIONS)
            self.epoch = event.epoch
            self._clear()
        kind, keys = event.kind, event.keys
        if kind is EventKind.ALL_CLEARED:
            self.generation = next(_GENERATIONS)
            self._clear()
            return
        sets = self._targets.get((kind is _BLOCKS_STORED or kind is _BLOCKS_REMOVED, event.group))
        if sets is None:                         # first of its direction and group: checked, cached
            sets = self.group_sets(kind, event.group)
        if kind is EventKind.BLOCKS_STORED:
            for held in sets:
                held.update(keys)
        elif kind is EventKind.CHECKPOINTS_STORED:
            kept = list(filter(self.kv.__contains__, keys))
            for held in sets:
                held.update(kept)
        elif kind is EventKind.BLOCKS_REMOVED:
            for held in sets:
                held.difference_update(keys)
            for name, _ in self.family.boundary:          # a state on removed entries goes with them
                self.held[name].difference_update(keys)
        else:
            for held in sets:
                held.difference_update(keys)

    def kv_run(self, hashes: list[bytes], limit: int) -> int:
        """Contiguous entries of every prefix group from token 0 over ``hashes`` (whole units), at
        most ``limit`` tokens (the shortest run of the family's prefix groups)."""
        # the units up to the first one without an entry, counted in C (no copy of the prompt's hashes)
        n = limit // self.unit
        return min(len(list(takewhile(self.held[g].__contains__, islice(hashes, n))))
                   for g in self.family.prefix_names) * self.unit

    def match(self, hashes: list[bytes], limit: int) -> JointHit:
        """The joint hit this instance would give a prompt with unit hashes ``hashes``, under
        ``limit`` tokens (:func:`~hybridkv.cache.groups.reuse_cap`): the rule of
        :func:`~hybridkv.cache.groups.joint_hit` for the view's family over the keys the events
        reported (:meth:`presence`)."""
        return joint_hit(self.family, self.presence(hashes), limit)

    def presence(self, hashes: list[bytes]) -> KeySetPresence:
        """The :class:`~hybridkv.cache.groups.Presence` of this view for a prompt's unit hashes:
        each group held where its set has the key (``full`` where a key has KV, ``kda`` where it
        has a checkpoint, for Kimi Linear)."""
        return KeySetPresence(hashes, self.unit, self.held)

    def hits(self, hashes: list[bytes], limit: int) -> tuple[int, int]:
        """``(kv_hit, hit)`` of :meth:`match` (tokens)."""
        m = self.match(hashes, limit)
        return m.kv_hit, m.hit

