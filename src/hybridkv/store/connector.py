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

from hybridkv.cache.coordinator import Allocation, HybridCacheCoordinator, MatchResult
from hybridkv.model.state import KDACheckpoint
from hybridkv.store.base import ObjectStore
from hybridkv.store.host import HostTier
from hybridkv.store.tier import EntryShapes, StoreTier, Tier, checkpoint_components, checkpoint_from_components


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


class TierConnector:
    """Fetch from and upload to lower tiers for one engine.

    Args:
        cache: the device coordinator.
        backend: the torch backend (``read_kv`` / ``write_pages``).
        tiers: lower tiers, nearest first (host, then store).
    """

    def __init__(self, cache: HybridCacheCoordinator, backend, tiers: list[Tier]) -> None:
        self.cache = cache
        self.backend = backend
        self.tiers = tiers
        self._back = [t for t in tiers if not t.write_through]
        for t in self._back:
            if t.alignment != cache.config.block_size:
                raise ValueError(f"write-back tier {t.name}: alignment {t.alignment} must equal "
                                 f"block_size={cache.config.block_size}")
        if self._back:
            cache.on_evict = self._write_back

    def fetch(self, prompt, match: MatchResult, namespace: bytes | None = None
              ) -> tuple[MatchResult, int | None, dict[str, int]]:
        """Improve ``match`` from lower tiers.

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
                tier.stats.misses["absent"] += 1        # the tier has nothing beyond the device hit
            for boundary in sorted(rm.checkpoint_boundaries, reverse=True):   # best first; next-best on a miss
                if boundary <= match.hit:
                    break
                if self._install(tier, match, boundary):
                    before = match.hit
                    match = self.cache.lookup(prompt, namespace)
                    gains[tier.name] = gains.get(tier.name, 0) + max(match.hit - before, 0)
                    break
            missing = rm.missing_branching_boundary
        if missing is not None and missing <= match.hit:
            missing = None
        return match, missing, gains

    def credit(self, gains: dict[str, int]) -> None:
        """Count the hit tokens a lower tier added to an admitted request."""
        for tier in self.tiers:
            tier.stats.hit_tokens += gains.get(tier.name, 0)

    def _install(self, tier: Tier, match: MatchResult, boundary: int) -> bool:
        """Load the KV segments the device lacks up to ``boundary`` and ``C(P_boundary)`` (two
        batched gets), verify, then install them in order; ``False`` at the first miss."""
        a = tier.alignment
        hashes = match.hashes
        segs = list(range(min(match.kv_hit, boundary) // a * a + a, boundary + 1, a))
        got = tier.load_many(hashes, [(b, "kv") for b in segs] + [(boundary, "kda")])
        for b, entry in zip(segs, got):
            if entry is None or not self.cache.install_kv(
                    hashes, b - a, b, lambda pages, lat=entry["latents"]: self.backend.write_pages(pages, lat)):
                return False
        kda = got[-1]
        return kda is not None and self.cache.install_checkpoint(
            hashes, checkpoint_from_components(kda, boundary), boundary)

    def upload(self, alloc: Allocation, hashes: list[bytes], computed: int,
               checkpoints: dict[int, KDACheckpoint], repair: bool = False) -> None:
        """Commit aligned KV segments of ``[0, computed)`` and aligned checkpoints the tiers lack.

        All components go out in one batched put, then the manifests of the
        entries whose components landed in a second one. With ``repair``, the
        checkpoint the request started from (its joint hit) is uploaded too if
        a write-through tier lacks it, e.g. after the store lost its objects.
        """
        checkpoints = dict(checkpoints)
        g = self.cache.config.prefix_match_unit
        if repair and alloc.start and alloc.start not in checkpoints and len(alloc.nodes) >= alloc.start // g:
            node = alloc.nodes[alloc.start // g - 1]
            if node.parent is not None and node.checkpoint is not None:
                checkpoints[alloc.start] = None            # read from the device pool if a tier lacks it
        for tier in self.tiers:
            if not tier.write_through:
                continue
            a = tier.alignment
            bounds = list(range(a, computed // a * a + 1, a))
            present = tier.has(hashes, bounds, "kv")
            if present is None:
                continue
            entries = [tier.entry(hashes, b, "kv", {"latents": self.backend.read_kv(alloc.block_table, b - a, b)})
                       for b, ok in zip(bounds, present) if not ok]
            aligned = sorted(b for b in checkpoints if b % a == 0 and b <= computed)
            have = tier.has(hashes, aligned, "kda") or [True] * len(aligned)
            for b, ok in zip(aligned, have):
                if ok:
                    continue
                ckpt = checkpoints[b]
                if ckpt is None:
                    node = alloc.nodes[b // g - 1]
                    if node.checkpoint is None:
                        continue
                    ckpt = self.cache.checkpoints.read(node.checkpoint, b)
                entries.append(tier.entry(hashes, b, "kda", checkpoint_components(ckpt)))
            tier.save_entries(entries)                      # two batched puts per step

    def _write_back(self, nodes, kv: bool) -> None:
        """Save evicted device state into the write-back tiers (page-aligned entries only), batched."""
        g = self.cache.config.prefix_match_unit
        for tier in self._back:
            a = tier.alignment
            entries = []
            for n in nodes:
                if n.end % a:
                    continue
                parent = n
                for _ in range(a // g):
                    parent = parent.parent
                parent_key = parent.key if parent is not None and parent.end else None
                if kv:
                    entries.append((n.key, parent_key, "kv", n.end, {"latents": self.backend.page_latents(n.page)}))
                if n.checkpoint is not None:
                    ckpt = self.cache.checkpoints.read(n.checkpoint, n.end)
                    entries.append((n.key, parent_key, "kda", n.end, checkpoint_components(ckpt)))
            tier.save_entries(entries)
