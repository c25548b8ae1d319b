"""Simulate mode's host tier (issue 12 item 1): the real HostTier / connector code paths with byte
accounting only — device evictions demoted to the host, host hits promoted into the device, host
capacity and eviction, and the host-only dense checkpoints of ``host_interval``."""

from __future__ import annotations

import pytest

from hybridkv.cache.config import CacheConfig, ConfigError
from hybridkv.cache.groups import FULL, KDA, FullAttentionSpec, KDASpec, entry_shapes
from hybridkv.engine.build import build_engine, model_config
from hybridkv.replay.runner import ReplayOptions, run_replay
from hybridkv.tiers.host import HostTier

from trace_helpers import whole_block_trace

B = 64                    # tokens per trace hash id and per page in these runs
NS = b"n" * 32


def _replay(trace: str, **kw) -> dict:
    opts = {"trace": trace, "limit": None, "simulate": True, "progress": False, "block_tokens": B,
            "max_num_seqs": 1, "policy": f"tail={B}+branch", **kw}
    return run_replay(ReplayOptions(**opts)).to_dict()


def _shapes():
    cfg = model_config("small")
    return entry_shapes(FullAttentionSpec.for_model(cfg, B), KDASpec.for_model(cfg), B)


def test_payload_free_host_tier_accounts_bytes_evicts_in_order_and_refuses_groups_it_does_not_hold():
    shapes = _shapes()
    ck = KDASpec.for_model(model_config("small")).page_size_bytes
    tier = HostTier(2 * ck, NS, B, B, shapes, payload=False, groups=(KDA,), retention="inclusive")  # a load is a use
    keys = [bytes([i]) * 32 for i in range(3)]
    assert tier.save_entries([(keys[0], None, KDA, B, None), (keys[1], None, KDA, 2 * B, None)]) == [True, True]
    assert tier.used_bytes == 2 * ck and tier.stats.bytes_peak == 2 * ck
    assert tier.save_entries([(keys[2], None, FULL, B, None)]) == [False]         # KV is not held
    tier.load_many([keys[0]], [(B, KDA)])                                        # keys[0] most recent now
    assert tier.save_entries([(keys[2], None, KDA, 3 * B, None)]) == [True]       # evicts keys[1] (lru)
    assert tier.exists([(k, KDA) for k in keys]) == [True, False, True]
    assert tier.stats.evictions == 1 and tier.stats.bytes_evicted == ck and tier.used_bytes == 2 * ck
    assert tier.load_many([keys[2]], [(B, KDA)]) == [dict.fromkeys(shapes[KDA])]   # components, no payload
    with pytest.raises(ValueError, match=r"groups=\('swa',\)"):
        HostTier(ck, NS, B, B, shapes, payload=False, groups=("swa",))


def test_simulate_with_a_host_tier_demotes_device_evictions_and_promotes_host_hits(tmp_path):
    # Request 0's tail checkpoint is evicted by the next three one-off prompts (2 device slots);
    # request 4 continues request 0 and needs it back.
    trace = whole_block_trace(tmp_path, [[1, 2, 3], [10, 11, 12], [20, 21, 22], [30, 31, 32], [1, 2, 3, 4]])
    without = _replay(trace, num_checkpoint_slots=2, host_bytes=0)
    with_host = _replay(trace, num_checkpoint_slots=2, host_bytes=64 << 20, host_groups=(KDA,), host_interval=0)
    assert without["evictions"]["device"]["checkpoints"] > 0
    assert without["reused_tokens"] == 0                         # the checkpoint at 3 blocks is gone
    host = with_host["tiers"]["host"]
    assert host["bytes_saved"] > 0 and host["bytes_peak"] > 0     # demoted on eviction
    assert host["loads_taken"] == 1 and host["hit_tokens"] == 3 * B   # promoted into the device
    assert with_host["reused_tokens"] == 3 * B and with_host["config"]["host_groups"] == KDA


def test_host_capacity_bounds_what_is_demoted(tmp_path):
    trace = whole_block_trace(tmp_path, [[1, 2, 3], [10, 11, 12], [20, 21, 22], [30, 31, 32], [1, 2, 3, 4]])
    ck = KDASpec.for_model(model_config("small")).page_size_bytes
    rep = _replay(trace, num_checkpoint_slots=2, host_bytes=2 * ck, host_groups=(KDA,), host_interval=0)
    assert rep["tiers"]["host"]["bytes_peak"] <= 2 * ck
    assert rep["evictions"]["host"]["entries"] > 0 and rep["reused_tokens"] == 0   # evicted from the host too


def test_host_interval_puts_dense_checkpoints_on_the_host_only(tmp_path):
    # Request 2 branches from request 0 after 3 blocks: only a checkpoint there serves it; the device
    # policy (tail) never placed one, the host-only captures every block did.
    trace = whole_block_trace(tmp_path, [[1, 2, 3, 4, 5, 6], [10, 11, 12], [1, 2, 3, 9, 9]])
    plain = _replay(trace, host_bytes=64 << 20, host_groups=(KDA,), host_interval=0)
    dense = _replay(trace, host_bytes=64 << 20, host_groups=(KDA,), host_interval=B)
    assert plain["reused_tokens"] == 0
    assert dense["reused_tokens"] == 3 * B and dense["tiers"]["host"]["hit_tokens"] == 3 * B
    assert dense["config"]["host_interval"] == B
    assert plain["checkpoints_created"]["branch"] == 1 and dense["checkpoints_created"]["branch"] == 0
    assert dense["tiers"]["host"]["bytes_saved"] > plain["tiers"]["host"]["bytes_saved"]


def test_host_interval_plumbing_is_checked():
    with pytest.raises(ConfigError, match=r"host_interval=96"):
        CacheConfig(block_size=64, host_interval=96)
    cfg = CacheConfig(block_size=64, num_kv_pages=16, num_checkpoint_slots=4, host_interval=64)
    with pytest.raises(ValueError, match=r"host_interval=64 .* host tier"):
        build_engine(model_config("tiny"), cfg, model_name="tiny")
    with build_engine(model_config("tiny"), cfg, model_name="tiny", host_bytes=1 << 20) as built:
        host = built.host_tier                  # checkpoints written through, KV pages only written back
        assert host.writes_through(KDA) and not host.writes_through(FULL) and host.write_back and not host.payload
    plain = CacheConfig(block_size=64, num_kv_pages=16, num_checkpoint_slots=4)
    with build_engine(model_config("tiny"), plain, model_name="tiny", host_bytes=1 << 20) as built:
        assert not built.host_tier.write_through


def test_replay_default_host_interval_follows_the_host_tier(tmp_path):
    trace = whole_block_trace(tmp_path, [[1, 2, 3, 4, 5]])
    assert _replay(trace, host_bytes=1 << 20)["config"]["host_interval"] == 4 * B
    assert _replay(trace, host_bytes=0)["config"]["host_interval"] is None
    assert _replay(trace, host_bytes=1 << 20, host_interval=0)["config"]["host_interval"] is None
    assert _replay(trace, host_bytes=1 << 20, host_groups=(FULL,))["config"]["host_interval"] is None


def test_replay_cli_host_interval_needs_a_host_tier(capsys):
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--host-mib", "0", "--host-interval", "512"])
    assert exc.value.code == 2 and "--host-interval 512 needs a host tier" in capsys.readouterr().err


def test_replay_cli_host_groups_needs_a_host_tier(capsys):
    """``--host-groups kda`` without a host tier was silently ignored; now it is refused, named."""
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--host-mib", "0", "--host-groups", "kda"])
    assert exc.value.code == 2 and "--host-groups kda needs a host tier" in capsys.readouterr().err


def test_host_only_checkpoints_of_one_off_prompts_do_not_push_out_a_demoted_tail(tmp_path):
    """Two long one-off prompts write 14 host-only checkpoints (every block) through to a host tier
    of 6; request 0's tail at 3 blocks, demoted from the 2-slot device, must survive for request 3.
    On probation (default share) the flood evicts its own oldest; with speculative entries ranked
    above the rest (share 1) the tail is pushed out."""
    trace = whole_block_trace(tmp_path, [[1, 2, 3], list(range(10, 18)), list(range(20, 28)), [1, 2, 3, 4]])
    ck = KDASpec.for_model(model_config("small")).page_size_bytes
    kw = {"num_checkpoint_slots": 2, "host_bytes": 6 * ck, "host_groups": (KDA,), "host_interval": B}
    kept = _replay(trace, **kw)
    flooded = _replay(trace, **kw, host_probation=1.0)
    assert kept["config"]["host_probation"] == 0.25 and flooded["config"]["host_probation"] == 1.0
    assert kept["reused_tokens"] == 3 * B and kept["tiers"]["host"]["hit_tokens"] == 3 * B
    assert flooded["reused_tokens"] == 0
    assert kept["tiers"]["host"]["bytes_peak"] <= 6 * ck and flooded["tiers"]["host"]["bytes_peak"] <= 6 * ck
    with pytest.raises(ConfigError, match=r"host_probation=1.5"):
        CacheConfig(host_probation=1.5)
