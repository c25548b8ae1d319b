"""EventPublisher(merge_removals=True), the fleet simulator's publisher: the removals of
consecutive evictions leave as one blocks_removed and one checkpoints_removed event, flushed
before anything else is emitted (stored, a restart's all_cleared) and at drain, and a view that
applies them ends as it would with one event per eviction."""

import hashlib

from hybridkv.cache.coordinator import EvictedEntry
from hybridkv.fleet.events import EventKind, EventPublisher, InstanceView

UNIT = 64


def _k(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest()


def _page(i: int) -> EvictedEntry:
    return EvictedEntry(_k(i), None, (i + 1) * UNIT, i, None, None)


def _state(i: int) -> EvictedEntry:
    return EvictedEntry(_k(i), None, (i + 1) * UNIT, None, 7, None)


def _script(pub: EventPublisher) -> list:
    """Stores, evictions between them, a restart after evictions; every drain's events."""
    pub.stored([_k(i) for i in range(8)], [_k(2), _k(5), _k(7)], [], [3 * UNIT, 6 * UNIT, 8 * UNIT], 0)
    pub.evicted([_page(7)])
    pub.evicted([_state(5), _page(6)])
    pub.evicted([_state(2)])
    first = pub.drain()
    pub.evicted([_page(5)])
    pub.stored([_k(i) for i in range(5, 9)], [_k(8)], [], [9 * UNIT], 5)
    pub.evicted([_page(8), _page(4)])
    pub.restart()
    pub.stored([_k(0)], [], [], [], 0)
    pub.evicted([_page(0)])
    return [first, pub.drain()]


def _views(batches) -> list:
    view, out = InstanceView(UNIT), []
    for batch in batches:
        for ev in batch:
            view.apply(ev)
        out.append((view.epoch, set(view.kv), set(view.checkpoints)))
    return out


def test_merged_removals_leave_the_view_as_one_event_an_eviction():
    merged = _script(EventPublisher(0, merge_removals=True))
    plain = _script(EventPublisher(0))
    assert _views(merged) == _views(plain)
    kinds = [[(e.kind, e.epoch, len(e.keys)) for e in batch] for batch in merged]
    assert kinds == [
        [(EventKind.BLOCKS_STORED, 0, 8), (EventKind.CHECKPOINTS_STORED, 0, 3),
         (EventKind.BLOCKS_REMOVED, 0, 2), (EventKind.CHECKPOINTS_REMOVED, 0, 2)],
        [(EventKind.BLOCKS_REMOVED, 0, 1), (EventKind.BLOCKS_STORED, 0, 4), (EventKind.CHECKPOINTS_STORED, 0, 1),
         (EventKind.BLOCKS_REMOVED, 0, 2), (EventKind.ALL_CLEARED, 1, 0), (EventKind.BLOCKS_STORED, 1, 1),
         (EventKind.BLOCKS_REMOVED, 1, 1)]]
    assert [e.keys for e in merged[0][2:]] == [(_k(7), _k(6)), (_k(5), _k(2))]     # eviction order kept
    assert sum(len(b) for b in plain) > sum(len(b) for b in merged)
    for batch in merged:                       # sequence numbers stay consecutive within an epoch
        for epoch in {e.epoch for e in batch}:
            seqs = [e.seq for e in batch if e.epoch == epoch]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_without_merge_each_eviction_is_its_own_event():
    pub = EventPublisher(0)
    pub.evicted([_page(1)])
    pub.evicted([_page(2)])
    assert [e.keys for e in pub.drain()] == [(_k(1),), (_k(2),)]
