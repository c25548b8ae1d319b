"""The replay report's memory additions: the reused-length histogram and per-tier evictions."""

from __future__ import annotations

from hybridkv.replay.report import REUSE_BUCKET_EDGES, reuse_histogram
from hybridkv.replay.runner import ReplayOptions, run_replay


def test_reuse_histogram_buckets_every_length_once_with_every_bucket_present():
    lengths = [0, 0, 1, 1023, 1024, 2047, 65535, 65536, 10**6]
    h = reuse_histogram(lengths)
    assert list(h) == ["0", "1-1023", "1024-2047", "2048-4095", "4096-8191", "8192-16383", "16384-32767",
                       "32768-65535", "65536+"]
    assert len(h) == len(REUSE_BUCKET_EDGES) + 1
    assert h == {"0": 2, "1-1023": 2, "1024-2047": 2, "2048-4095": 0, "4096-8191": 0, "8192-16383": 0,
                 "16384-32767": 0, "32768-65535": 1, "65536+": 2}


def test_simulated_replay_reports_evictions_and_the_histogram_under_both_orders():
    for eviction in ("lru", "value"):
        rep = run_replay(ReplayOptions(limit=60, simulate=True, progress=False, num_checkpoint_slots=8,
                                       eviction=eviction, host_bytes=0)).to_dict()
        assert rep["config"]["eviction"] == eviction
        assert sum(rep["reused_histogram"].values()) == rep["requests"]
        dev = rep["evictions"]["device"]
        slot_bytes = rep["checkpoint_bytes_peak"] // 8          # evictions happened, so all 8 slots were full
        assert dev["checkpoints"] > 0 and dev["checkpoint_bytes"] == dev["checkpoints"] * slot_bytes
        assert rep["evictions"]["host"] == {"entries": 0, "bytes": 0}     # host_bytes=0: no host tier


def test_replay_cli_refuses_an_unknown_eviction_order(capsys):
    import pytest

    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--eviction", "mru"])
    assert exc.value.code == 2 and "'mru'" in capsys.readouterr().err
