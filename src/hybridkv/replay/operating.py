"""The operating figures of a timed replay's report (:mod:`hybridkv.fleet.operating`), gathered
from the run's requests, instances and per-instance results."""

from __future__ import annotations

from hybridkv.fleet.operating import device_memory, goodput, phases, queue_skew, tier_capacity


def timed_operating_figures(setup, cfg, requests, instances, results, store_view) -> dict:
    """The report keys ``goodput`` (only with ``setup.slo``), ``queue_skew``, ``tier_capacity``,
    ``device_memory`` and ``phases`` of a timed run.

    Args:
        setup: the :class:`~hybridkv.replay.timed.TimedSetup` (instances, host bytes, SLO).
        cfg: the instances' cache config (pool sizes, ``block_size``, ``prefix_match_unit``).
        requests: every :class:`~hybridkv.fleet.instance.FleetRequest` of the run.
        instances: the fleet's instances.
        results: per-instance :class:`~hybridkv.replay.instance.InstanceResult` (current engines
            first, one per instance, then engines retired by restarts or crashes).
        store_view: the simulated store's :class:`~hybridkv.fleet.store.StoreView`, or ``None``.

    Byte sizes are the cache's own (``kv_bytes_per_token`` and ``checkpoint_bytes`` of the
    results). The device tier's peak is the sum of each engine's peak (an upper bound of what the
    fleet held at once); the host tier's likewise.
    """
    out: dict = {}
    if setup.slo:
        out["goodput"] = goodput(requests, setup.slo)
    out["queue_skew"] = queue_skew(requests, len(instances))
    if not results:
        return out
    page_bytes = results[0].kv_bytes_per_token * cfg.block_size
    ck = results[0].checkpoint_bytes
    n = len(instances)
    ends = [fr.finished for fr in requests if fr.finished is not None]
    span = (max(ends) - min(fr.arrival for fr in requests)) if ends else 0.0
    tiers = {"device": {"capacity_bytes": n * (cfg.num_kv_pages * page_bytes + cfg.num_checkpoint_slots * ck),
                        "bytes_peak": sum(r.kv_bytes_peak + r.checkpoint_bytes_peak for r in results),
                        "evicted_bytes": sum(r.evicted_pages * page_bytes + r.evicted_checkpoints * ck
                                             for r in results)}}
    host_peak = sum(r.tiers.get("host", {}).get("bytes_peak", 0) for r in results)
    if setup.host_bytes and (host_peak or any(r.tiers.get("host", {}).get("bytes_saved", 0) for r in results)):
        tiers["host"] = {"capacity_bytes": n * setup.host_bytes, "bytes_peak": host_peak,
                         "evicted_bytes": sum(r.tiers.get("host", {}).get("bytes_evicted", 0) for r in results)}
    if store_view is not None and setup.simulate:
        tiers["store"] = {"capacity_bytes": store_view.capacity_bytes, "bytes_peak": store_view.bytes_peak,
                          "evicted_bytes": store_view.evicted_bytes}
    out["tier_capacity"] = tier_capacity(span, tiers)
    out["device_memory"] = device_memory(requests, cfg.num_kv_pages, page_bytes, cfg.num_checkpoint_slots, ck)
    out["phases"] = phases(requests, cfg.block_size, cfg.prefix_match_unit)
    return out
