"""``--router-args`` of benchmarks/bench_sim_truth.py and bench_router_replicas.py, and
``--hybrid-args`` of bench_peer_router.py (its ``hybridkv-hybrid`` router only): the options reach
every ``hybridkv replay`` / ``hybridkv router`` the script starts, as options that command's own
parser reads (the hybrid router's previous settings restore the figures published with them); a
string that does not split is refused."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from hybridkv.cli import build_parser
from hybridkv.replay.args import hybrid_options

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
OLD = "--own-waiting 1 --waiting-weight 1 --tie-kv-run off"
"""The hybrid router's previous settings."""


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bst, peer, replicas = _load("bench_sim_truth"), _load("bench_peer_router"), _load("bench_router_replicas")


def _old(parsed) -> tuple:
    o = hybrid_options(parsed)
    return o.own_waiting, o.waiting_weight, o.tie_kv_run


def _sim_truth_args(**kw) -> argparse.Namespace:
    base = {"instances": 4, "time_scale": 2.0, "router": "hybrid", "router_args": "", "checkpoint_slots": 512}
    return argparse.Namespace(**{**base, **kw})


def test_sim_truth_router_args_reach_the_replay_options():
    parsed = build_parser().parse_args(["replay", "--timed", *bst.common_options(_sim_truth_args(router_args=OLD))])
    assert parsed.router == "hybrid" and _old(parsed) == (1.0, 1.0, False)
    assert parsed.instances == 4 and parsed.block_tokens == 64 and parsed.max_output_tokens == 4


def test_sim_truth_without_router_args_keeps_the_defaults():
    parsed = build_parser().parse_args(["replay", "--timed", *bst.common_options(_sim_truth_args())])
    assert hybrid_options(parsed) == hybrid_options(argparse.Namespace())


def test_peer_router_hybrid_args_reach_the_hybrid_router_only():
    cmd = peer.hybridkv_router_command(argparse.Namespace(model="tiny", hybrid_args=OLD), "hybrid", 18350,
                                       ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    i = cmd.index("router")
    parsed = build_parser().parse_args(cmd[i:])
    assert parsed.policy == "hybrid" and _old(parsed) == (1.0, 1.0, False) and parsed.port == 18350
    assert parsed.worker == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    rr = peer.hybridkv_router_command(argparse.Namespace(model="tiny", hybrid_args=OLD), "round-robin", 1, [])
    assert not {f for f in OLD.split() if f.startswith("--")} & set(rr)   # refused on round-robin


def test_replicas_router_args_reach_the_router():
    cmd = replicas.router_command(argparse.Namespace(policy="hybrid", router_args=OLD), ["http://127.0.0.1:1"])
    parsed = build_parser().parse_args([*cmd, "--port", "0"])
    assert parsed.policy == "hybrid" and _old(parsed) == (1.0, 1.0, False)


@pytest.mark.parametrize("build", [
    lambda a: bst.common_options(_sim_truth_args(router_args=a)),
    lambda a: peer.hybridkv_router_command(argparse.Namespace(model="tiny", hybrid_args=a), "hybrid", 1, []),
    lambda a: replicas.router_command(argparse.Namespace(policy="hybrid", router_args=a), []),
])
def test_router_args_that_do_not_split_are_refused(build):
    with pytest.raises(ValueError):
        build("--own-waiting '1")
