"""The bounded options of ``hybridkv serve`` and ``hybridkv router`` (``--snapshot-readers``,
``--purge-timeout``, ``--follow-wait``): each bound itself is accepted, a value just past it is refused
in one line naming the option and the value."""

from __future__ import annotations

import pytest

from hybridkv.cli import build_parser, main

ROUTER = ["router", "--worker", "http://127.0.0.1:9"]


@pytest.mark.parametrize(("argv", "dest", "value"), [
    (["serve", "--snapshot-readers", "1"], "snapshot_readers", 1),
    (["serve", "--snapshot-readers", "1024"], "snapshot_readers", 1024),
    ([*ROUTER, "--purge-timeout", "0.1"], "purge_timeout", 0.1),
    ([*ROUTER, "--purge-timeout", "600"], "purge_timeout", 600.0),
    ([*ROUTER, "--follow-wait", "0"], "follow_wait", 0.0),
    ([*ROUTER, "--follow-wait", "30"], "follow_wait", 30.0),
])
def test_each_bound_is_accepted(argv, dest, value):
    assert getattr(build_parser().parse_args(argv), dest) == value


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--snapshot-readers", "1025"], "argument --snapshot-readers: 1025 exceeds 1024 snapshots held at once"),
    ([*ROUTER, "--purge-timeout", "600.5"], "argument --purge-timeout: '600.5' exceeds 600 seconds"),
    ([*ROUTER, "--purge-timeout", "0.099"],
     "argument --purge-timeout: '0.099' is under 0.1 s, too short for any worker to answer a purge"),
    ([*ROUTER, "--follow-wait", "30.5"],
     "argument --follow-wait: --follow-wait 30.5 exceeds a worker's longest long poll, 30.0 s"),
    ([*ROUTER, "--follow-wait", "-1"], "argument --follow-wait: -1.0 must be 0 or more"),
])
def test_a_value_past_a_bound_is_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err
