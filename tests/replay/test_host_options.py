"""``hybridkv replay``'s host tier options (``--host-eviction``, ``--host-probation``,
``--host-protected-share``, ``--host-interval``, ``--host-groups``, ``--host-write-through``) given where the replay builds no host tier: a one-line error naming the
option and why, exit 2, no traceback; left out, their defaults hold as before."""

from __future__ import annotations

import json

import pytest

from hybridkv.cache.config import HOST_PROBATION

from trace_helpers import whole_block_trace

B = 64                    # tokens per trace hash id in these runs


@pytest.mark.parametrize("args, message", [
    (["--host-mib", "0", "--host-eviction", "value"], "--host-eviction value needs a host tier: --host-mib is 0"),
    (["--host-mib", "0", "--host-eviction", "lru"], "--host-eviction lru needs a host tier: --host-mib is 0"),
    (["--host-mib", "0", "--host-probation", "0.5"], "--host-probation 0.5 needs a host tier: --host-mib is 0"),
    (["--model", "v4-tiny", "--host-probation", "0"],
     "--host-probation 0 needs a host tier: --host-mib is 0 for a DeepSeek-V4 model unless given"),
    (["--model", "v4-tiny", "--host-eviction", "value"],
     "--host-eviction value needs a host tier: --host-mib is 0 for a DeepSeek-V4 model unless given"),
    (["--timed", "--instances", "2", "--host-probation", "0.1"],
     "--host-probation 0.1 needs a host tier: a simulated timed fleet builds none"),
    (["--timed", "--instances", "2", "--host-mib", "64", "--host-eviction", "value"],
     "--host-eviction value needs a host tier: a simulated timed fleet builds none"),
    (["--model", "v4-tiny", "--host-interval", "4"],
     "--host-interval 4 needs a host tier: --host-mib is 0 for a DeepSeek-V4 model unless given"),
    (["--timed", "--instances", "2", "--host-groups", "kda"],
     "--host-groups kda needs a host tier: a simulated timed fleet builds none"),
    (["--timed", "--instances", "2", "--host-write-through"],
     "--host-write-through needs a host tier: a simulated timed fleet builds none"),
])
def test_replay_refuses_a_host_option_without_a_host_tier_in_one_line(capsys, args, message):
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--no-progress", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
    assert f"hybridkv replay: error: {message}" in err          # the command's parser names it


def _config(tmp_path, *args: str) -> dict:
    from hybridkv.cli import main

    trace = whole_block_trace(tmp_path, [[1, 2], [1, 2, 3]])
    out = tmp_path / "r.json"
    assert main(["replay", "--simulate", "--trace", trace, "--block-tokens", str(B), "--no-progress",
                 *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())["config"]


def test_left_out_the_host_options_keep_their_defaults_with_or_without_a_host_tier(tmp_path):
    for host in ([], ["--host-mib", "0"]):
        config = _config(tmp_path, *host)
        assert config["host_eviction"] == "lru" and config["host_probation"] == HOST_PROBATION


def test_given_with_a_host_tier_the_host_options_reach_it(tmp_path):
    config = _config(tmp_path, "--host-mib", "8", "--host-eviction", "value", "--host-probation", "0.5")
    assert config["host_eviction"] == "value" and config["host_probation"] == 0.5
