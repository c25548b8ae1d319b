"""Moves entries between the device cache and lower tiers (DESIGN §4, §5).

At admission, :meth:`TierConnector.fetch` asks each tier (in order) for a
per-group result; when a tier's joint boundary beats the device hit, the
verified KV segments and the checkpoint are installed into the device pools as
cached entries, and the device lookup is repeated. The last tier's *missing
branching boundary* (remote KV longer than any remote checkpoint) is returned
so the scheduler computes once up to it, creates the checkpoint and
:meth:`upload` commits it with its pages — a second instance then gets the
full hit (SCENARIOS S9).

A directory hit is not data: the computed-token count moves only through the
repeated device lookup, after transfer, checksum and install.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from hybridkv.cache.coordinator import Allocation, HybridCacheCoordinator, MatchResult
from hybridkv.model.state import KDACheckpoint
from hybridkv.store.base import ObjectStore
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.store_tier import StoreTier
from hybridkv.tiers.base import EntryShapes, Tier, checkpoint_components, checkpoint_from_components

log = logging.getLogger("hybridkv.store")

def entry_shapes(backend, alignment: int) -> EntryShapes:
    """Entry shapes of ``backend``'s model with KV segments of ``alignment`` tokens."""
    cfg = backend.model.config
    zero = backend.model.zero_checkpoint()
    return EntryShapes.for_model(cfg.num_mla_layers, alignment, cfg.kv_latent_dim, tuple(zero.recurrent.shape),
                                 tuple(zero.conv.shape), str(zero.conv.dtype).removeprefix("torch."))


def tier_for(store: ObjectStore, backend, namespace: bytes, unit: int, alignment: int,
             name: str = "store", write_through: bool = True) -> StoreTier:
    """A :class:`StoreTier` shaped for ``backend``'s model (KV segments of ``alignment`` tokens)."""
    return StoreTier(store, namespace, unit, alignment, entry_shapes(backend, alignment),
                     name=name, write_through=write_through)


def host_tier_for(capacity_bytes: int, backend, namespace: bytes, unit: int, block_size: int,
                  write_through: bool = False) -> HostTier:
    """A write-back :class:`HostTier` of ``capacity_bytes`` for ``backend``'s model (one entry per page)."""
    return HostTier(capacity_bytes, namespace, unit, block_size, entry_shapes(backend, block_size),
                    write_through=write_through)


@dataclass(slots=True)
class Prefetch:
    """Background loads for one waiting request (see :meth:`TierConnector.prefetch`).

    Attributes:
        kv_from: the device KV hit (tokens) the loads started from.
        jobs: tier name -> future of ``(boundary, {(b, group): components or None}, reserved bytes)``.
        release: called with each job's reserved bytes once its loads are dropped
            (taken, cancelled or stale), so the connector's prefetch budget is returned.
        owner: the connector that started the jobs; another connector ignores them.
    """

    kv_from: int
    jobs: dict[str, Future]
    release: Callable[[int], None] = lambda nbytes: None
    owner: object = None

    def take(self, tier: str, best_joint: int, kv_hit: int) -> dict | None:
        """The loaded entries of ``tier`` if they are for ``best_joint`` and the device still holds
        the KV they start from (``kv_hit >= kv_from``); waits for the job. ``None`` otherwise."""
        job = self.jobs.pop(tier, None)
        if job is None:
            return None
        boundary, loaded, nbytes = job.result()
        self.release(nbytes)
        if kv_hit < self.kv_from:
            return None
        return loaded if boundary == best_joint and loaded else None

    def cancel(self) -> None:
        """Drop every job: not started yet ones are cancelled, running ones finish and are discarded;
        their reserved bytes are released either way."""
        for job in self.jobs.values():
            if not job.cancel():
                job.add_done_callback(self._release_done)
        self.jobs.clear()

    def _release_done(self, job: Future) -> None:
        if job.cancelled():
            return
        if job.exception() is not None:     # a bug in a job nobody waits for any more: say so
            log.error("prefetch job failed: %r", job.exception())
            return
        self.release(job.result()[2])


class TierConnector:
    """Fetch from and upload to lower tiers for one engine.

    Args:
        cache: the device coordinator.
        backend: the torch backend (``read_kv`` / ``write_pages``).
        tiers: lower tiers, nearest first (host, then store).
        prefetch_limit_bytes: most bytes that background prefetches may hold
            at once (loaded and not yet installed); a prefetch that would
            exceed it loads nothing and the request loads at admission.
    """

    def __init__(self, cache: HybridCacheCoordinator, backend, tiers: list[Tier],
                 prefetch_limit_bytes: int = 512 << 20) -> None:
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
        if self._back:
            cache.on_evict = self._write_back
        self.prefetch_used = 0          # installs served by a background prefetch
        self.prefetch_skipped = 0       # prefetches not loaded: over the byte budget
        self.prefetch_limit_bytes = prefetch_limit_bytes
        self.prefetch_held_bytes = 0    # loaded (or being loaded) by prefetches not yet taken
        self._prefetch_lock = threading.Lock()

    def prefetch(self, prompt, namespace: bytes | None = None) -> Prefetch | None:
        """Start loading what write-through tiers hold beyond the device hit, in the background.

        Called for requests near the head of the waiting queue, before their
        admission. On each write-through tier's worker thread: a remote lookup
        from the device's current KV hit, then one batched load of the best
        checkpoint's missing KV segments and the checkpoint itself. Nothing is
        installed here; :meth:`fetch` uses the verified results at admission.

        Returns:
            A handle to pass to :meth:`fetch`, or ``None`` when there is nothing
            to prefetch (no write-through tier, or a prompt shorter than one unit).
        """
        remote = [t for t in self.tiers if t.write_through and isinstance(t, StoreTier)]
        g = self.cache.config.prefix_match_unit
        cap = max(len(prompt) - 1, 0) // g * g
        if not remote or cap == 0:
            return None
        match = self.cache.lookup(prompt, namespace, touch=False)
        if match.hit >= cap:
            return None
        jobs = {t.name: t.submit(self._prefetch_job, t, match.hashes, cap, match.kv_hit, match.hit) for t in remote}
        return Prefetch(kv_from=match.kv_hit, jobs=jobs, release=self._release, owner=self)

    def _prefetch_job(self, tier: Tier, hashes, cap: int, local_kv: int, hit: int):
        """Worker side of :meth:`prefetch`: ``(boundary, loaded, reserved bytes)`` with ``loaded[(b, group)]``
        verified. Loads nothing when they would take the bytes held by prefetches past
        ``prefetch_limit_bytes``."""
        rm = tier.lookup(hashes, cap, local_kv)
        if rm is None or rm.best_joint <= hit:
            return 0, {}, 0
        a, boundary = tier.alignment, rm.best_joint
        wanted = [(b, "kv") for b in range(min(local_kv, boundary) // a * a + a, boundary + 1, a)]
        wanted.append((boundary, "kda"))
        need = sum(tier.entry_nbytes(grp) for _, grp in wanted)
        with self._prefetch_lock:
            if self.prefetch_held_bytes + need > self.prefetch_limit_bytes:
                self.prefetch_skipped += 1
                return 0, {}, 0
            self.prefetch_held_bytes += need
        try:
            loaded = tier.load_many(hashes, wanted)
        except BaseException:
            self._release(need)
            raise
        return boundary, dict(zip(wanted, loaded)), need

    def _release(self, nbytes: int) -> None:
        with self._prefetch_lock:
            self.prefetch_held_bytes -= nbytes

    def fetch(self, prompt, match: MatchResult, namespace: bytes | None = None, prefetched: Prefetch | None = None
              ) -> tuple[MatchResult, int | None, dict[str, int]]:
        """Improve ``match`` from lower tiers.

        With ``prefetched`` (from :meth:`prefetch`), verified loads already done
        in the background are installed when they still serve: the tier's
        fresh lookup names the same best checkpoint, and the device has lost
        none of the KV the prefetch counted on. Otherwise the loads run now.

        Returns:
            ``(match, missing_branching_boundary, gains)``; the boundary (tokens)
            is where the last tier has KV but no checkpoint beyond the joint
            hit; ``gains`` maps tier name -> hit tokens it added. Pass
            ``gains`` to :meth:`credit` once the request is admitted.
        """
        gains: dict[str, int] = {}
        g = self.cache.config.prefix_match_unit
        cap = max(len(prompt) - 1, 0) // g * g
        missing = None
        for tier in self.tiers:
            rm = tier.lookup(match.hashes, cap, match.kv_hit)
            if rm is None:
                continue
            if rm.best_joint <= match.hit < cap // tier.alignment * tier.alignment:
                tier.count_miss("absent")               # the tier has nothing beyond the device hit
            ready = None
            if prefetched is not None and prefetched.owner is self:
                ready = prefetched.take(tier.name, rm.best_joint, match.kv_hit)
            for boundary in sorted(rm.checkpoint_boundaries, reverse=True):   # best first; next-best on a miss
                if boundary <= match.hit:
                    break
                installed = self._install(tier, match, boundary, ready if boundary == rm.best_joint else None)
                before = match.hit
                match = self.cache.lookup(prompt, namespace)   # installing may have evicted pages of the hit
                if installed:
                    gains[tier.name] = gains.get(tier.name, 0) + max(match.hit - before, 0)
                    break
            missing = rm.missing_branching_boundary
        if missing is not None and missing <= match.hit:
            missing = None
        return match, missing, gains

    def credit(self, gains: dict[str, int]) -> None:
        """Count the hit tokens a lower tier added to an admitted request."""
        for tier in self.tiers:
            tier.add_hit_tokens(gains.get(tier.name, 0))

    def _install(self, tier: Tier, match: MatchResult, boundary: int, ready: dict | None = None) -> bool:
        """Install the KV segments the device lacks up to ``boundary`` and ``C(P_boundary)``, in order;
        ``False`` at the first miss. The entries come from ``ready`` (a prefetch) when it has all of
        them, else from one batched load into the tier's staging arena."""
        a = tier.alignment
        hashes = match.hashes
        segs = list(range(min(match.kv_hit, boundary) // a * a + a, boundary + 1, a))
        wanted = [(b, "kv") for b in segs] + [(boundary, "kda")]
        if ready is not None and all(ready.get(w) is not None for w in wanted):
            got = [ready[w] for w in wanted]
            self.prefetch_used += 1
        elif isinstance(tier, StoreTier):
            got = tier.load_many(hashes, wanted, staging=True)
        else:
            got = tier.load_many(hashes, wanted)
        for b, entry in zip(segs, got):
            if entry is None or not self.cache.install_kv(
                    hashes, b - a, b, lambda pages, lat=entry["latents"]: self.backend.write_pages(pages, lat)):
                return False
        kda = got[-1]
        return kda is not None and self.cache.install_checkpoint(
            hashes, checkpoint_from_components(kda, boundary), boundary)

    def upload(self, alloc: Allocation, hashes: list[bytes], computed: int,
               checkpoints: dict[int, KDACheckpoint], repair: bool = False,
               marks: dict[str, int] | None = None, final: bool = False) -> None:
        """Commit aligned KV segments of ``[0, computed)`` and aligned checkpoints the tiers lack.

        One existence query per tier, then all components go out in one batched
        put and the manifests of the entries whose components landed in a
        second one. With ``repair``, the checkpoint the request started from
        (its joint hit) is uploaded too if a write-through tier lacks it, e.g.
        after the store lost its objects.

        Args:
            marks: per request, tier name -> tokens of KV known to be in that
                tier (every aligned ``kv`` entry up to it is visible). Only
                boundaries past the mark are queried, and the mark advances as
                entries land, so a long prompt's later steps do not re-query
                its whole prefix. Owned by the caller; ``None``: query all.
            final: the request's last prefill step: every boundary is queried
                again whatever the mark says, so segments the tier lost
                while the request ran (eviction, restart) are uploaded again.
        """
        checkpoints = dict(checkpoints)
        g = self.cache.config.prefix_match_unit
        if repair and alloc.start and alloc.start not in checkpoints and len(alloc.nodes) >= alloc.start // g:
            node = alloc.nodes[alloc.start // g - 1]
            if node.parent is not None and node.checkpoint is not None:
                checkpoints[alloc.start] = None            # read from the device pool if a tier lacks it
        marks = {} if marks is None else marks
        for tier in self.tiers:
            if not tier.write_through:
                continue
            a = tier.alignment
            mark = 0 if final else marks.get(tier.name, 0)
            kv = list(range(mark + a, computed // a * a + 1, a))
            aligned = sorted(b for b in checkpoints if b % a == 0 and b <= computed)
            present = tier.has_many(hashes, [(b, "kv") for b in kv] + [(b, "kda") for b in aligned])
            if present is None:
                continue
            entries = [tier.entry(hashes, b, "kv", {"latents": self.backend.read_kv(alloc.block_table, b - a, b)})
                       for b, ok in zip(kv, present) if not ok]
            for b, ok in zip(aligned, present[len(kv):]):
                if ok:
                    continue
                ckpt = checkpoints[b]
                if ckpt is None:
                    node = alloc.nodes[b // g - 1]
                    if node.checkpoint is None:
                        continue
                    ckpt = self.cache.checkpoints.read(node.checkpoint, b)
                entries.append(tier.entry(hashes, b, "kda", checkpoint_components(ckpt)))
            visible = iter(tier.save_entries(entries))      # two batched puts per step
            landed = {b: ok or next(visible) for b, ok in zip(kv, present)}
            for b in kv:                                    # the mark moves over contiguous visible entries
                if not landed[b]:
                    break
                marks[tier.name] = b

    def _write_back(self, nodes, kv: bool) -> None:
        """Save evicted device state into the write-back tiers (page-aligned entries only), batched;
        entries a tier already holds are skipped before their tensors are read."""
        g = self.cache.config.prefix_match_unit
        for tier in self._back:
            a = tier.alignment
            wanted = []                                     # (node, parent key, group)
            for n in nodes:
                if n.end % a:
                    continue
                parent = n
                for _ in range(a // g):
                    parent = parent.parent
                parent_key = parent.key if parent is not None and parent.end else None
                if kv:
                    wanted.append((n, parent_key, "kv"))
                if n.checkpoint is not None:
                    wanted.append((n, parent_key, "kda"))
            if not wanted:
                continue
            held = tier.has_entries([(n.key, grp) for n, _, grp in wanted]) or [False] * len(wanted)
            entries = []
            for (n, parent_key, grp), ok in zip(wanted, held):
                if ok:
                    continue
                if grp == "kv":
                    tensors = {"latents": self.backend.page_latents(n.page)}
                else:
                    tensors = checkpoint_components(self.cache.checkpoints.read(n.checkpoint, n.end))
                entries.append((n.key, parent_key, grp, n.end, tensors))
            tier.save_entries(entries)
