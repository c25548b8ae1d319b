"""The host tier's protected segment from the configuration and the command line
(``CacheConfig.host_protected_share``, ``hybridkv replay --host-protected-share``): checkpoints loaded
from the host before outlast a flood of one-off demotions."""

from __future__ import annotations

import json

import pytest

from hybridkv.cache.config import CacheConfig, ConfigError
from hybridkv.cache.groups import KDA, KDASpec
from hybridkv.engine.build import model_config
from hybridkv.replay.runner import ReplayOptions, run_replay

from trace_helpers import whole_block_trace

B = 64                    # tokens per trace hash id and per page in these runs


def _replay(trace: str, **kw) -> dict:
    opts = {"trace": trace, "limit": None, "simulate": True, "progress": False, "block_tokens": B,
            "max_num_seqs": 1, "policy": f"tail={B}+branch", "num_checkpoint_slots": 1,
            "host_groups": (KDA,), "host_interval": 0, **kw}
    return run_replay(ReplayOptions(**opts)).to_dict()


def test_a_checkpoint_loaded_from_the_host_before_outlasts_a_flood_of_one_off_demotions(tmp_path):
    """A 1-slot device demotes every tail to a host of 3 checkpoints. The tail ``[1, 2]`` is loaded
    from the host once (request 2), then four one-off conversations demote four tails. In one
    recency order they push it out and the last request, which resumes from it, reuses nothing;
    with a protected share of a third (one checkpoint), it stays and the last request reuses its
    2 blocks from the host."""
    trace = whole_block_trace(tmp_path, [[1, 2], [10, 11], [1, 2, 3], [20, 21], [30, 31], [40, 41], [50, 51], [1, 2, 9]])
    ck = KDASpec.for_model(model_config("small")).page_size_bytes
    plain = _replay(trace, host_bytes=3 * ck)
    kept = _replay(trace, host_bytes=3 * ck, host_protected_share=0.34)
    assert plain["config"]["host_protected_share"] is None and kept["config"]["host_protected_share"] == 0.34
    assert plain["reused_tokens"] == 2 * B                   # request 2 only
    assert kept["reused_tokens"] == 4 * B and kept["tiers"]["host"]["hit_tokens"] == 4 * B
    assert kept["tiers"]["host"]["bytes_peak"] <= 3 * ck


def test_a_tiny_protected_share_demotes_its_overflow_instead_of_evicting_it_first(tmp_path):
    """A protected segment past its share hands its oldest entries back to the main order as its
    most recent ones (segmented LRU), so even a share too small to hold one checkpoint never makes
    a checkpoint loaded before go first: with a host of 3 checkpoints, the tail ``[1, 2]`` loaded
    by request 3 outlasts one more demotion and the last request resumes from it, as in one
    recency order (a share of ``1e-300`` used to evict it first, reusing 2 blocks, not 4)."""
    trace = whole_block_trace(tmp_path, [[1, 2], [10, 11], [1, 2, 3], [20, 21], [1, 2, 9]])
    ck = KDASpec.for_model(model_config("small")).page_size_bytes
    plain = _replay(trace, host_bytes=3 * ck)
    tiny = _replay(trace, host_bytes=3 * ck, host_protected_share=1e-300)
    assert plain["reused_tokens"] == 4 * B
    assert tiny["reused_tokens"] == 4 * B and tiny["tiers"]["host"]["hit_tokens"] == 4 * B


@pytest.mark.parametrize("kw, match", [
    ({"host_protected_share": 0.0}, r"host_protected_share=0.0 must be a fraction in \(0, 1\]"),
    ({"host_protected_share": 1.5}, r"host_protected_share=1.5 must be a fraction"),
    ({"host_protected_share": True}, r"host_protected_share=True must be a fraction"),
    ({"host_protected_share": 0.3, "host_eviction": "value"}, r"host_protected_share=0.3 works with host_eviction='lru'"),
])
def test_config_refuses_a_bad_protected_share(kw, match):
    with pytest.raises(ConfigError, match=match):
        CacheConfig(**kw)


@pytest.mark.parametrize("args, message", [
    (["--host-protected-share", "0"], "argument --host-protected-share: '0' must be a fraction in (0, 1]"),
    (["--host-protected-share", "1.2"], "argument --host-protected-share: '1.2' must be a fraction in (0, 1]"),
    (["--host-protected-share", "half"], "argument --host-protected-share: 'half' is not a number"),
    (["--host-protected-share", "0.3", "--host-mib", "0"], "--host-protected-share 0.3 needs a host tier: --host-mib is 0"),
    (["--host-protected-share", "0.3", "--host-eviction", "value"],
     "--host-protected-share 0.3 works with --host-eviction lru, not value"),
    (["--model", "v4-tiny", "--host-protected-share", "0.3"],
     "--host-protected-share 0.3 needs a host tier: --host-mib is 0 for a DeepSeek-V4 model unless given"),
    (["--timed", "--instances", "64", "--host-mib", "8192", "--host-protected-share", "0.3"],
     "--host-protected-share 0.3 needs a host tier: a simulated timed fleet builds none"),
])
def test_replay_cli_refuses_a_bad_protected_share_in_one_line(capsys, args, message):
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err


def test_replay_cli_passes_the_protected_share_to_the_host_tier(tmp_path, capsys):
    from hybridkv.cli import main

    trace = whole_block_trace(tmp_path, [[1, 2], [1, 2, 3]])
    out = tmp_path / "r.json"
    assert main(["replay", "--simulate", "--trace", trace, "--block-tokens", str(B), "--no-progress",
                 "--host-protected-share", "0.3", "--host-probation", "0", "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["host_protected_share"] == 0.3 and config["host_probation"] == 0.0


def _bench_frontier():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_frontier", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_frontier.py")
    bf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bf)
    return bf


def test_bench_frontier_utility_protected_and_its_plot_from_json(tmp_path, capsys):
    """bench_frontier's ``utility_protected`` variant sets the device order and both host options
    (recorded in its rows); ``--from-json`` with ``default utility_protected`` gives the new variant
    the device-only rows of ``utility`` (the same device setting, skipped by a run that has both)
    and draws the plot."""
    import sys

    from rich.console import Console

    bf = _bench_frontier()
    trace = whole_block_trace(tmp_path, [[1, 2], [10, 11], [1, 2, 3], [20, 21], [1, 2, 9]])
    console = Console(stderr=True, quiet=True)
    rows = [bf.cell(trace, None, 512, 64 << 20, 1 << 20, v, d, h, None, console)
            for v in ("default", "utility", "utility_protected") for d, h in ((0.5, 0.0), (0.5, 0.5))
            if not (v == "utility_protected" and h == 0)]
    prot = [r for r in rows if r["variant"] == "utility_protected"][0]
    assert prot["checkpoint_eviction"] == "utility" and prot["host_probation"] == 0.0
    assert prot["host_protected_share"] == 0.3
    data = tmp_path / "rows.json"
    data.write_text(json.dumps({"baseline": {"reused_tokens": 4 * 512, "checkpoint_bytes_peak": 64 << 20},
                                "rows": rows}))
    png = tmp_path / "f.png"
    argv = sys.argv
    sys.argv = ["bench_frontier.py", "--from-json", str(data), "--variants", "default", "utility_protected",
                "--png", str(png)]
    try:
        bf.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| utility_protected")]
    assert len(table) == 2                                 # its own host row and utility's device-only row
    assert not any(line.startswith("| utility ") for line in out.splitlines())
    assert png.stat().st_size > 0
