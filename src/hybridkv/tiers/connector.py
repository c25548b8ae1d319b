"""Moves entries between the device cache and lower tiers (DESIGN §4, §5).

At admission, :meth:`TierConnector.fetch` asks each tier (in order) for a
per-group result; when a tier's joint boundary beats the device hit, the
verified KV segments and the checkpoint are installed into the device pools as
cached entries, and the device lookup is repeated. The last tier's *missing
branching boundary* (remote KV longer than any remote checkpoint) is returned
so the scheduler computes once up to it, creates the checkpoint and
:meth:`TierConnector.upload` commits it with its pages — a second instance then
gets the full hit (SCENARIOS S9).

The connector keeps its per-request state itself (background prefetches,
upload marks), keyed by a handle the engine passes (its request object), from
:meth:`~TierConnector.prefetch` or :meth:`~TierConnector.fetch` until
:meth:`~TierConnector.forget`. It reads device state only through the
coordinator's methods (``lookup``, ``install_*``, ``read_checkpoint``,
``checkpoint_at``) and hears of evictions through
:meth:`~TierConnector.write_back`, the coordinator's ``on_evict`` callback.

A directory hit is not data: the computed-token count moves only through the
repeated device lookup, after transfer, checksum and install.

Reuse only when it pays (issue 9, item 3; the seed's rule): before installing
from a tier, the predicted ``T_lookup + T_load + T_transfer + T_install`` (the
tier's measured seconds per installed entry, times the entries needed) is
compared with ``T_prefill`` of the tokens it would save (the engine's measured
compute seconds per token, :meth:`TierConnector.note_compute`); the load is
skipped, and counted as declined, when it would be slower. Until both rates are
measured, loads are taken. A background prefetch applies the same rule before it
loads (and times its loads too); a load it already made is taken at admission.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.cache.config import HOST_PROBATION
from hybridkv.cache.coordinator import (
    Allocation,
    EvictedEntry,
    HybridCacheCoordinator,
    MatchResult,
)
from hybridkv.cache.groups import reuse_cap, tier_entry_shapes
from hybridkv.store.base import ObjectStore
from hybridkv.tiers.base import Tier
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.store_tier import StoreTier

log = logging.getLogger("hybridkv.store")

def tier_for(store: ObjectStore, backend, namespace: bytes, unit: int, alignment: int,
             name: str = "store", write_through: bool = True) -> StoreTier:
    """A :class:`StoreTier` shaped for ``backend``'s model (its ``tier_family``'s entries, page entries of
    ``alignment`` tokens)."""
    return StoreTier(store, namespace, unit, alignment, tier_entry_shapes(backend.tier_family, alignment),
                     name=name, write_through=write_through, family=backend.tier_family)


def host_tier_for(capacity_bytes: int, backend, namespace: bytes, unit: int, block_size: int,
                  write_through: bool = False, eviction: str = "lru", quota: float | None = None,
                  payload: bool = True, groups: tuple[str, ...] | None = None,
                  through_groups: tuple[str, ...] | None = None,
                  probation_share: float = HOST_PROBATION, protected_share: float | None = None) -> HostTier:
    """A write-back :class:`HostTier` of ``capacity_bytes`` for ``backend``'s model (one entry per page);
    ``quota``: fraction of the capacity one request namespace may hold (``CacheConfig.tenant_quota``);
    ``payload=False``: byte accounting only (simulation); ``groups``: the entry kinds it holds (default
    both: the page entry and the state entry, e.g. ``("full", "kda")`` or ``("csa-hca", "swa")``);
    ``through_groups``: with ``write_through``, the groups written through (default all held);
    ``probation_share``, ``protected_share``: see :class:`HostTier`."""
    return HostTier(capacity_bytes, namespace, unit, block_size,
                    tier_entry_shapes(backend.tier_family, block_size), write_through=write_through,
                    eviction=eviction, quota_bytes=None if quota is None else max(1, int(quota * capacity_bytes)),
                    payload=payload, groups=groups, through_groups=through_groups,
                    probation_share=probation_share, family=backend.tier_family, protected_share=protected_share)


EWMA_WEIGHT = 0.3
"""Weight of the newest sample in the connector's measured rates (compute, load)."""


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample


class TimingSink(Protocol):
    """Hears how long each cache operation took (seconds); used for a server's histograms.

    ``kind`` is one of :data:`TIMING_KINDS`; ``tier`` is the tier it concerns (``device`` for the
    device index, a lower tier's name, ``None`` for ``saved_prefill``). Called from the engine
    thread and, for background prefetch loads and lookups, from a store tier's worker thread, so
    an implementation must be thread-safe. It never receives keys, ids or content.
    """

    def observe(self, kind: str, seconds: float, tier: str | None = None) -> None:
        """One operation of ``kind`` took ``seconds``."""


TIMING_KINDS = ("lookup", "load", "transfer", "install", "saved_prefill")
"""What a :class:`TimingSink` hears, per event:

* ``lookup``: one device index lookup at an admission attempt (tier ``device``), or one lookup
  of a lower tier's directory (its name), at admission or by a background prefetch;
* ``load``: one batched read of a tier's entries into host memory (``load_many``), at admission
  or in a background prefetch;
* ``transfer``: the copy of one install's page entries into device pages (``write_page_entry``);
* ``install``: one install's remaining work: page allocation, indexing, checkpoint decode and
  attach (the checkpoint's copy into its slot is part of it);
* ``saved_prefill``: per admitted request that reused ``h > 0`` tokens, ``h`` times the engine's
  measured compute seconds per token (:class:`ComputeRate`) at admission: the prefill time the
  hit is estimated to save (not reported before the first step is measured).
"""


class ComputeRate:
    """The engine's recent compute speed: EWMAs (weight :data:`EWMA_WEIGHT`) of step seconds and
    step tokens, whose ratio is seconds per token, so a one-token decode step moves it little
    against a long prefill step."""

    def __init__(self) -> None:
        self._seconds: float | None = None
        self._tokens: float | None = None

    def note(self, tokens: int, seconds: float) -> None:
        """One step computed ``tokens`` tokens in ``seconds`` of model time (ignored unless both > 0)."""
        if tokens > 0 and seconds > 0:
            self._seconds = _ewma(self._seconds, seconds)
            self._tokens = _ewma(self._tokens, float(tokens))

    @property
    def seconds_per_token(self) -> float | None:
        """Recent compute seconds per token (``None``: no step measured yet)."""
        if self._seconds is None or not self._tokens:
            return None
        return self._seconds / self._tokens


@dataclass(slots=True)
class Prefetch:
    """Background loads for one waiting request (see :meth:`TierConnector.prefetch`).

    Attributes:
        kv_from: the device KV hit (tokens) the loads started from.
        jobs: tier name -> future of ``(boundary, {(b, group): components or None}, reserved bytes)``.
        release: called with each job's reserved bytes once its loads are dropped
            (taken, cancelled or stale), so the connector's prefetch budget is returned.
        pending: called with +1 when a cancelled job's release is deferred to its
            completion, and with -1 once that release ran (:meth:`TierConnector.drain`
            waits for the count to reach 0).
        purges: tier name -> its :attr:`Tier.purges` when the jobs were started: loads read
            before a later purge are not installed (a purge by horizon leaves the bytes, so the
            admission lookup may still name them).
    """

    kv_from: int
    jobs: dict[str, Future]
    release: Callable[[int], None] = lambda nbytes: None
    pending: Callable[[int], None] = lambda delta: None
    purges: dict[str, int] = field(default_factory=dict)

    def take(self, tier: str, best_joint: int, kv_hit: int, purges: int | None = None) -> dict | None:
        """The loaded entries of ``tier`` if they are for ``best_joint``, the device still holds
        the KV they start from (``kv_hit >= kv_from``) and the tier was not purged since they were
        started (``purges``: its :attr:`Tier.purges` now); waits for the job. ``None`` otherwise."""
        job = self.jobs.pop(tier, None)
        if job is None:
            return None
        boundary, loaded, nbytes = job.result()
        self.release(nbytes)
        if kv_hit < self.kv_from or (purges is not None and self.purges.get(tier) != purges):
            return None
        return loaded if boundary == best_joint and loaded else None

    def cancel(self) -> None:
        """Drop every job: not started yet ones are cancelled, running ones finish and are discarded;
        their reserved bytes are released either way."""
        for job in self.jobs.values():
            if not job.cancel():
                self.pending(1)
                job.add_done_callback(self._release_done)
        self.jobs.clear()

    def _release_done(self, job: Future) -> None:
        try:
            if job.cancelled():
                return
            if job.exception() is not None:     # a bug in a job nobody waits for any more: say so
                log.error("prefetch job failed: %r", job.exception())
                return
            self.release(job.result()[2])
        finally:
            self.pending(-1)


@dataclass(slots=True)
class FetchResult:
    """What :meth:`TierConnector.fetch` found (tokens).

    Attributes:
        match: the device lookup after every install.
        missing_branching_boundary: where the last tier has KV but no checkpoint
            beyond the joint hit (plan a checkpoint there), or ``None``.
        spans: tier name -> the ``[start, end)`` token ranges of the hit its installs added.
    """

    match: MatchResult
    missing_branching_boundary: int | None
    spans: dict[str, list[tuple[int, int]]]

    def credit(self, hit: int) -> dict[str, int]:
        """Tier name -> tokens of ``[0, hit)`` it supplied: what to credit when a request is admitted
        with a hit of ``hit`` tokens (the fetched one, or a shorter one when pages are short)."""
        return {name: sum(max(0, min(end, hit) - start) for start, end in ranges)
                for name, ranges in self.spans.items()}

    @property
    def gains(self) -> dict[str, int]:
        """Tier name -> hit tokens it added to :attr:`match`; credited by :meth:`TierConnector.admitted`."""
        return self.credit(self.match.hit)


@dataclass(slots=True)
class _RequestState:
    """What the connector remembers of one request between calls."""

    prefetch: Prefetch | None = None
    prefetch_tried: bool = False
    hashes: list[bytes] = field(default_factory=list)
    start: int = 0                      # the joint hit it was admitted with (tokens)
    prompt_len: int = 0
    marks: dict[str, int] = field(default_factory=dict)   # tier -> KV tokens known to be there
    uploads: int = 0


class TierConnector:
    """Fetch from and upload to lower tiers for one engine.

    Args:
        cache: the device coordinator.
        backend: the compute backend (``read_page_entry`` / ``page_entry`` / ``write_page_entry`` and
            ``state_codec``: the page and state entries of its ``tier_family``).
        tiers: lower tiers, nearest first (host, then store).
        prefetch_limit_bytes: most bytes that background prefetches may hold
            at once (loaded and not yet installed); a prefetch that would
            exceed it loads nothing and the request loads at admission.
        compute: the engine's compute rate (shared with the engine, which notes each step);
            default a fresh one fed by :meth:`note_compute`.

    Attributes:
        timings: told the seconds of each lookup, load, transfer and install
            (:class:`TimingSink`), or ``None``.
        on_install: told of every install into the device pools, when it ends, as
            ``on_install(hashes, kv_start, kv_end, state)`` (tokens): the page entries of
            ``[kv_start, kv_end)`` now cached (``kv_start == kv_end``: none), and the state entry
            attached at ``state`` (0: none), keyed by the prompt's chained unit ``hashes``. What
            an install left on the device when it failed part-way is told too. The engine sets it
            so its cache listener announces installed entries as it announces computed ones
            (:meth:`~hybridkv.engine.engine.Engine._tell_installed`); ``None``: nobody is told.

    Raises:
        ValueError: two tiers share a name, or a write-back tier's alignment is
            not the device ``block_size``.
    """

    def __init__(self, cache: HybridCacheCoordinator, backend, tiers: list[Tier],
                 prefetch_limit_bytes: int = 512 << 20, compute: ComputeRate | None = None) -> None:
        self.cache = cache
        self.backend = backend
        self.tiers = tiers
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"lower tiers need distinct names (they key reports, prefetches and upload marks), "
                             f"got {names}")
        self._back = [t for t in tiers if t.write_back]
        for t in self._back:
            if t.alignment != cache.config.block_size:
                raise ValueError(f"write-back tier {t.name}: alignment {t.alignment} must equal "
                                 f"block_size={cache.config.block_size}")
        self.prefetch_used = 0          # installs served by a background prefetch
        self.prefetch_skipped = 0       # prefetches not loaded: over the byte budget
        self.prefetch_limit_bytes = prefetch_limit_bytes
        self.prefetch_held_bytes = 0    # loaded (or being loaded) by prefetches not yet taken
        self._prefetch_lock = threading.Lock()
        self._jobs: set[Future] = set()  # every prefetch job not finished yet
        self._deferred = 0               # cancelled jobs whose release has not run yet
        self._deferred_done = threading.Condition()
        self._requests: dict[Hashable, _RequestState] = {}
        self.compute = compute if compute is not None else ComputeRate()
        self.load_seconds_per_entry: dict[str, float] = {}     # EWMA per tier, installs timed whole
        self.timings: TimingSink | None = None
        self.on_install: Callable[[list[bytes], int, int, int], None] | None = None

    def note_compute(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` tokens in ``seconds`` of model time (one step)."""
        self.compute.note(tokens, seconds)

    @property
    def compute_seconds_per_token(self) -> float | None:
        """Recent compute seconds per token (:attr:`ComputeRate.seconds_per_token`; ``None``: no step yet)."""
        return self.compute.seconds_per_token

    def _timed(self, kind: str, seconds: float, tier: str | None) -> None:
        if self.timings is not None:
            self.timings.observe(kind, seconds, tier)

    def _lookup(self, tier: Tier, hashes, cap: int, kv_hit: int, owner: bytes | None = None):
        """``tier.lookup`` timed (``lookup``); ``owner``: the request namespace ``hashes`` were made under."""
        t0 = time.perf_counter()
        try:
            return tier.lookup(hashes, cap, kv_hit, owner=owner)
        finally:
            self._timed("lookup", time.perf_counter() - t0, tier.name)

    def worth_loading(self, tier: Tier, entries: int, tokens_saved: int) -> bool:
        """Whether installing ``entries`` entries from ``tier`` is predicted no slower than computing
        the ``tokens_saved`` tokens they save (``True`` until both rates are measured)."""
        per_entry, per_token = self.load_seconds_per_entry.get(tier.name), self.compute_seconds_per_token
        if per_entry is None or per_token is None:
            return True
        return per_entry * entries <= per_token * tokens_saved

    @property
    def writes_back(self) -> bool:
        """Some tier saves evicted device entries (the coordinator should call :meth:`write_back`)."""
        return bool(self._back)

    # -- per-request state ------------------------------------------------
    def _state(self, key: Hashable) -> _RequestState:
        st = self._requests.get(key)
        if st is None:
            st = self._requests[key] = _RequestState()
        return st

    def forget(self, key: Hashable) -> None:
        """Drop what the connector holds for a request (finished, cancelled or rejected): its
        prefetch is cancelled and its bytes released once the job ends."""
        st = self._requests.pop(key, None)
        if st is not None and st.prefetch is not None:
            st.prefetch.cancel()

    @property
    def num_requests(self) -> int:
        """Requests the connector holds state for (0 once every request was forgotten)."""
        return len(self._requests)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for every prefetch job started so far and for the release of the bytes of every
        cancelled one; ``True`` if all that ended within ``timeout_s`` (seconds)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._prefetch_lock:
            jobs = list(self._jobs)
        _, pending = wait(jobs, timeout=timeout_s)
        if pending:
            return False
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        with self._deferred_done:
            return self._deferred_done.wait_for(lambda: self._deferred == 0, timeout=left)

    def _defer(self, delta: int) -> None:
        with self._deferred_done:
            self._deferred += delta
            if self._deferred == 0:
                self._deferred_done.notify_all()

    def prefetching(self, key: Hashable) -> bool:
        """Background loads were started for the request and not yet used or dropped."""
        st = self._requests.get(key)
        return st is not None and st.prefetch is not None

    def upload_marks(self, key: Hashable) -> dict[str, int]:
        """Tier name -> tokens of the request's KV known to be in that write-through tier (a copy)."""
        st = self._requests.get(key)
        return dict(st.marks) if st is not None else {}

    # -- prefetch ---------------------------------------------------------
    def prefetch(self, key: Hashable, prompt, namespace: bytes | None = None,
                 hashes: list[bytes] | None = None) -> bool:
        """Start loading what write-through tiers hold beyond the device hit, in the background.

        Called for requests near the head of the waiting queue, before their
        admission; once per admission attempt (later calls return at once until
        :meth:`fetch` ran). On each
        write-through store tier's worker thread: a remote lookup from the
        device's current KV hit, then one batched load of the best checkpoint's
        missing KV segments and the checkpoint itself. Nothing is installed
        here; :meth:`fetch` uses the verified results at admission.

        Args:
            key: the request's identity for this connector (its state until release).
            prompt: token ids, ``(T,)``.
            namespace: the request's namespace digest, or ``None`` (the engine's).
            hashes: the prompt's unit hashes under ``namespace`` if already computed
                (``Request.hashes``), so the lookup does not hash the prompt again.

        Returns:
            Whether loads were started now.
        """
        st = self._state(key)
        if st.prefetch_tried:
            return False
        st.prefetch_tried = True
        remote = [t for t in self.tiers if t.write_through and isinstance(t, StoreTier)]
        cap = reuse_cap(len(prompt), self.cache.config.prefix_match_unit)
        if not remote or cap == 0:
            return False
        match = self.cache.lookup(prompt, namespace, touch=False, hashes=hashes)
        if match.hit >= cap:
            return False
        purges = {t.name: t.purges for t in remote}      # before the jobs start: a purge from now on drops them
        jobs = {t.name: t.submit(self._prefetch_job, t, match.hashes, cap, match.kv_hit, match.hit, match.namespace)
                for t in remote}
        with self._prefetch_lock:
            self._jobs.update(jobs.values())
        for job in jobs.values():                   # outside the lock: a finished job calls back at once
            job.add_done_callback(self._job_done)
        st.prefetch = Prefetch(kv_from=match.kv_hit, jobs=jobs, release=self._release, pending=self._defer,
                               purges=purges)
        return True

    def _job_done(self, job: Future) -> None:
        with self._prefetch_lock:
            self._jobs.discard(job)

    def _prefetch_job(self, tier: Tier, hashes, cap: int, local_kv: int, hit: int, owner: bytes | None = None):
        """Worker side of :meth:`prefetch`: ``(boundary, loaded, reserved bytes)`` with ``loaded[(b, group)]``
        verified. Loads nothing when they would take the bytes held by prefetches past
        ``prefetch_limit_bytes``."""
        rm = self._lookup(tier, hashes, cap, local_kv, owner)
        if rm is None or rm.best_joint <= hit or not rm.candidates:
            return 0, {}, 0
        boundary, state = rm.candidates[0]
        wanted = self._wanted(tier, local_kv, boundary, state)
        if not self.worth_loading(tier, len(wanted), boundary - hit):
            return 0, {}, 0                         # admission will recompute (and count it declined)
        need = sum(tier.entry_nbytes(grp) for _, grp in wanted)
        with self._prefetch_lock:
            if self.prefetch_held_bytes + need > self.prefetch_limit_bytes:
                self.prefetch_skipped += 1
                return 0, {}, 0
            self.prefetch_held_bytes += need
        t0 = time.perf_counter()
        try:
            loaded = tier.load_many(hashes, wanted, owner=owner)
        except BaseException:
            self._release(need)
            raise
        seconds = time.perf_counter() - t0
        self._timed("load", seconds, tier.name)
        self._note_load(tier, seconds, len(wanted))
        return boundary, dict(zip(wanted, loaded)), need

    def _note_load(self, tier: Tier, seconds: float, entries: int) -> None:
        """A load (and install, at admission) of ``entries`` entries from ``tier`` took ``seconds``.
        A payload-free tier moves no bytes, so its loads are not timed (and always taken)."""
        if not tier.payload:
            return
        with self._prefetch_lock:                   # prefetch jobs report from the tiers' threads
            self.load_seconds_per_entry[tier.name] = _ewma(self.load_seconds_per_entry.get(tier.name),
                                                           seconds / max(1, entries))

    def _release(self, nbytes: int) -> None:
        with self._prefetch_lock:
            self.prefetch_held_bytes -= nbytes

    @staticmethod
    def _wanted(tier: Tier, kv_hit: int, boundary: int, state: int, have_state: int = -1) -> list[tuple[int, str]]:
        """The entries an install of the hit ``boundary`` needs: the page entries of the segments past
        the device's ``kv_hit`` (aligned down), then the state entry at ``state`` (none when ``state``
        is 0, or not past ``have_state``, the device's own restart point)."""
        a = tier.alignment
        segs = range(min(kv_hit, boundary) // a * a + a, boundary + 1, a)
        wanted = [(b, tier.page_group) for b in segs]
        if state > 0 and state > have_state:
            wanted.append((state, tier.state_group))
        return wanted

    # -- admission ----------------------------------------------------------
    def fetch(self, key: Hashable, prompt, match: MatchResult, namespace: bytes | None = None) -> FetchResult:
        """Improve ``match`` from lower tiers.

        Verified loads that this connector's :meth:`prefetch` already did for
        ``key`` are installed when they still serve: the tier's fresh lookup
        names the same best checkpoint, and the device has lost none of the KV
        the prefetch counted on. Otherwise the loads run now.
        """
        st = self._state(key)
        ready_from, st.prefetch = st.prefetch, None
        st.prefetch_tried = False           # not admitted this time: it may prefetch again while it waits
        try:
            return self._fetch(prompt, match, namespace, ready_from)
        finally:
            if ready_from is not None:
                ready_from.cancel()                     # jobs not taken (unreachable tier, an error)

    def _fetch(self, prompt, match: MatchResult, namespace: bytes | None, ready_from: Prefetch | None
               ) -> FetchResult:
        spans: dict[str, list[tuple[int, int]]] = {}
        cap = reuse_cap(len(prompt), self.cache.config.prefix_match_unit)
        missing = None
        for tier in self.tiers:
            rm = self._lookup(tier, match.hashes, cap, match.kv_hit, match.namespace)
            if rm is None:
                continue
            if rm.best_joint <= match.hit < cap // tier.alignment * tier.alignment:
                tier.count_miss("absent")               # the tier has nothing beyond the device hit
            ready = (ready_from.take(tier.name, rm.best_joint, match.kv_hit, tier.purges)
                     if ready_from is not None else None)
            for boundary, state in rm.candidates:             # best first; next-best on a miss
                if boundary <= match.hit:
                    break
                from_prefetch = ready if boundary == rm.best_joint else None
                wanted = self._wanted(tier, match.kv_hit, boundary, state, match.restart)
                entries = len(wanted)
                if from_prefetch is None and not self.worth_loading(tier, entries, boundary - match.hit):
                    tier.stats.loads_declined += 1              # recomputing is predicted faster
                    break
                tier.stats.loads_taken += 1
                t0 = time.perf_counter()
                installed = self._install(tier, match, boundary, wanted, from_prefetch)
                if from_prefetch is None:
                    self._note_load(tier, time.perf_counter() - t0, entries)
                before = match.hit
                # installing may have evicted pages of the hit; the same unit hashes (a simulated
                # replay keys its cache by trace payloads, not by the placeholder prompt's tokens)
                match = self.cache.lookup(prompt, namespace, hashes=match.hashes)
                if installed:
                    if match.hit > before:
                        spans.setdefault(tier.name, []).append((before, match.hit))
                    break
            missing = rm.missing_branching_boundary
        if missing is not None and missing <= match.hit:
            missing = None
        return FetchResult(match, missing, spans)

    def admitted(self, key: Hashable, match: MatchResult, prompt_len: int, gains: dict[str, int]) -> None:
        """A request was admitted with ``match``: credit each tier with the hit tokens it supplied
        (``gains`` from :meth:`fetch`) and start the request's upload state."""
        for tier in self.tiers:
            tier.add_hit_tokens(gains.get(tier.name, 0))
        st = self._state(key)
        st.hashes, st.start, st.prompt_len, st.marks, st.uploads = match.hashes, match.hit, prompt_len, {}, 0

    def _install(self, tier: Tier, match: MatchResult, boundary: int, wanted: list[tuple[int, str]],
                 ready: dict | None = None) -> bool:
        """Install the page entries the device lacks up to ``boundary``, then the state entry
        :meth:`_wanted` names, in order; ``False`` at the first miss. The entries come from ``ready``
        (a prefetch) when it has all of them, else from one batched load (into the tier's staging
        arena for a store tier)."""
        a = tier.alignment
        hashes = match.hashes
        if ready is not None and all(ready.get(w) is not None for w in wanted):
            got = [ready[w] for w in wanted]              # loaded (and timed) by the prefetch
            self.prefetch_used += 1
        else:
            t0 = time.perf_counter()
            got = tier.load_many(hashes, wanted, staging=True, owner=match.namespace) \
                if isinstance(tier, StoreTier) else tier.load_many(hashes, wanted, owner=match.namespace)
            self._timed("load", time.perf_counter() - t0, tier.name)
        moved = [0.0]                                      # seconds in write_pages (the transfer)

        def write(pages, comps) -> None:
            t = time.perf_counter()
            self.backend.write_page_entry(pages, comps)
            moved[0] += time.perf_counter() - t

        t0 = time.perf_counter()
        kv_start = kv_end = state = 0                      # what is installed so far (tokens)
        try:
            for (b, grp), entry in zip(wanted, got):
                if entry is None:
                    return False
                if grp == tier.page_group:
                    if not self.cache.install_kv(hashes, b - a, b, lambda pages, c=entry: write(pages, c),
                                                 match.namespace):
                        return False
                    kv_start, kv_end = (kv_start, b) if kv_end else (b - a, b)   # consecutive segments
                elif not self.cache.install_checkpoint(
                        hashes, self.backend.state_codec.decode(entry, b) if tier.payload else None, b):
                    return False
                else:
                    state = b
            return True
        finally:
            self._timed("transfer", moved[0], tier.name)
            self._timed("install", time.perf_counter() - t0 - moved[0], tier.name)
            if self.on_install is not None and (kv_end or state):
                self.on_install(hashes, kv_start, kv_end, state)

    # -- saving -------------------------------------------------------------
    def upload(self, key: Hashable, alloc: Allocation, computed: int,
               checkpoints: dict[int, object]) -> None:
        """Commit aligned KV segments of ``[0, computed)`` and aligned checkpoints the write-through
        tiers lack, after a prefill step of an admitted request.

        One existence query per tier, then all components go out in one batched
        put and the manifests of the entries whose components landed in a
        second one. Only boundaries past the request's upload mark are queried
        (the mark advances over contiguous visible ``full`` entries), except on
        the last prefill step, which queries every boundary again so segments a
        tier lost meanwhile are uploaded again. On the first step the
        checkpoint the request started from is uploaded too if a tier lacks it
        (e.g. after the store lost its objects).

        Args:
            key: the request's handle (as given to :meth:`admitted`).
            alloc: its allocation.
            computed: prompt tokens computed so far (tokens).
            checkpoints: boundary -> boundary state created in this step (the backend's state
                object, e.g. a KDA checkpoint; ``None``: read it from the device).
        """
        st = self._state(key)
        hashes, final, first = st.hashes, computed >= st.prompt_len, st.uploads == 0
        st.uploads += 1
        checkpoints = dict(checkpoints)
        made = set(checkpoints)
        if first and st.start and st.start not in checkpoints:
            checkpoints[st.start] = None                  # read from the device if a tier lacks it
        for tier in self.tiers:
            if not tier.write_through:
                continue
            a = tier.alignment
            mark = 0 if final else st.marks.get(tier.name, 0)
            page, state = tier.page_group, tier.state_group
            kv = list(range(mark + a, computed // a * a + 1, a)) if tier.writes_through(page) else []
            aligned = (sorted(b for b in checkpoints if b % a == 0 and b <= computed)
                       if tier.writes_through(state) else [])
            present = tier.exists([(tier.chain_hash(hashes, b), page) for b in kv]
                                  + [(tier.chain_hash(hashes, b), state) for b in aligned], alloc.owner)
            if present is None:
                continue
            entries = [tier.entry(hashes, b, page, self.backend.read_page_entry(alloc.block_table, b - a, b)
                                  if tier.payload else None)
                       for b, ok in zip(kv, present) if not ok]
            for b, ok in zip(aligned, present[len(kv):]):
                if ok:
                    continue
                if not tier.payload:             # bytes only: the checkpoint must exist (made now, or published)
                    if b in made or self._published_at(alloc, b):
                        entries.append(tier.entry(hashes, b, state, None))
                    continue
                ckpt = checkpoints[b]
                if ckpt is None:
                    ckpt = self.cache.checkpoint_at(alloc, b)
                if ckpt is not None:
                    entries.append(tier.entry(hashes, b, state, self.backend.state_codec.encode(ckpt)))
            speculative = {tier.chain_hash(hashes, b) for b in aligned if not self._published_at(alloc, b)}
            if isinstance(tier, HostTier):        # the rest are copies of what the device holds now
                saved = tier.save_entries(entries, owner=alloc.owner, speculative=speculative,
                                          on_device={e[0] for e in entries} - speculative)
            else:
                saved = tier.save_entries(entries, owner=alloc.owner, speculative=speculative)  # two batched puts
            visible = iter(saved)
            landed = {b: ok or next(visible) for b, ok in zip(kv, present)}
            for b in kv:                                    # the mark moves over contiguous visible entries
                if not landed[b]:
                    break
                st.marks[tier.name] = b

    def _published_at(self, alloc: Allocation, boundary: int) -> bool:
        """Whether a checkpoint is published at ``boundary`` on the request's own path (tokens)."""
        g = self.cache.config.prefix_match_unit
        if boundary <= 0 or boundary % g or len(alloc.nodes) < boundary // g:
            return False
        node = alloc.nodes[boundary // g - 1]
        return node.parent is not None and node.checkpoint is not None

    def write_back(self, evicted: list[EvictedEntry]) -> None:
        """Save evicted device state into the write-back tiers (page-aligned entries only), batched;
        entries a tier already holds are not saved again (their tensors are not read): a host
        tier hears of them as demoted (:meth:`HostTier.demoted`). The coordinator's ``on_evict``
        callback."""
        for tier in self._back:
            a = tier.alignment
            wanted = [(e, grp) for e in evicted if e.end % a == 0
                      for grp, held in ((tier.page_group, e.page is not None),
                                        (tier.state_group, e.checkpoint is not None))
                      if held and tier.holds(grp)]
            if not wanted:
                continue
            held = []
            for owner, group in _by_owner(wanted).items():       # store keys carry the owner
                found = tier.exists([(e.key, grp) for e, grp in group], owner) or [False] * len(group)
                held.extend(zip(group, found))
            by_owner: dict[bytes | None, list] = {}
            if isinstance(tier, HostTier):
                tier.demoted([(e.key, grp) for (e, grp), ok in held if ok])
            for (e, grp), ok in held:
                if ok:
                    continue
                if not tier.payload:
                    tensors = None                      # bytes only (simulation)
                elif grp == tier.page_group:
                    tensors = self.backend.page_entry(e.page)
                else:
                    tensors = self.backend.state_codec.encode(self.cache.read_checkpoint(e.checkpoint, e.end))
                by_owner.setdefault(e.owner, []).append((e.key, e.parent_key, grp, e.end, tensors))
            for owner, entries in by_owner.items():
                tier.save_entries(entries, owner=owner)


def _by_owner(wanted: list[tuple[EvictedEntry, str]]) -> dict[bytes | None, list[tuple[EvictedEntry, str]]]:
    """``wanted`` split by the entries' owners (order kept within each owner)."""
    out: dict[bytes | None, list[tuple[EvictedEntry, str]]] = {}
    for e, grp in wanted:
        out.setdefault(e.owner, []).append((e, grp))
    return out
