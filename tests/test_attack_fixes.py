"""Bad inputs and faults found by probing the CLI, the server and the stores as a user would;
each test fails without its fix."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from hybridkv.serve.run import hand_to_loop


def test_an_event_for_a_closed_server_loop_is_dropped_not_raised():
    """``serve`` stopped (SIGINT) during a long prefill step: the event loop closed before the step
    ended, and the engine thread's final error event raised ``RuntimeError: Event loop is closed``
    (a traceback in the log after "shut down cleanly"). The event now has no reader and is dropped;
    on an open loop it still arrives."""
    loop = asyncio.new_event_loop()
    queue: asyncio.Queue = asyncio.Queue()
    sent: list[bool] = []
    t = threading.Thread(target=lambda: sent.append(hand_to_loop(loop, queue, (0, ("token", 5)))))
    t.start()
    t.join()
    loop.run_until_complete(asyncio.sleep(0))           # runs the put scheduled from the thread
    assert sent == [True] and queue.get_nowait() == (0, ("token", 5))
    loop.close()
    late: list[object] = []

    def engine_thread() -> None:
        try:
            late.append(hand_to_loop(loop, queue, (0, ("error", "the engine stopped"))))
        except RuntimeError as exc:                     # what the engine thread raised before
            late.append(exc)

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert late == [False] and queue.empty()


def test_store_start_refuses_a_segment_larger_than_the_machine(tmp_path, capsys):
    """``store start --segment-mb 999999999999`` started a master, then printed "storage process
    exited with status 1" and the storage process's traceback (Mooncake setup code -600), naming
    neither the option nor the value. It is refused before anything starts."""
    from hybridkv.cli import main

    work = tmp_path / "store"
    rc = main(["store", "start", "--segment-mb", "999999999999", "--workdir", str(work)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: --segment-mb 999999999999: the storage process would hold 976562500.0 GiB but "
                          "this machine has "), err
    assert "\n" not in err and not work.exists()        # nothing started, no workdir made


@pytest.mark.parametrize("field, value, text", [
    ("seconds", float("inf"), "step 0: seconds=inf: must be a finite number of seconds >= 0"),
    ("chunks", "abc", "step 0: chunks='abc': must be a list of [start, tokens] pairs of integers in [0, 2147483647]"),
    ("chunks", [[0, -500]], "step 0: chunks=[[0, -500]]: must be a list of [start, tokens] pairs"),
    ("chunks", [[0, 1e300]], "step 0: chunks=[[0, 1e+300]]: must be a list of [start, tokens] pairs"),
    ("decoders", "x", "step 0: decoders='x': must be an integer in [0, 2147483647]"),
    ("wall_seconds", float("nan"), "step 0: wall_seconds=nan: must be a finite number of seconds >= 0, or null"),
], ids=["seconds-inf", "chunks-str", "chunks-negative", "chunks-float", "decoders-str", "wall-nan"])
def test_calibrate_from_steps_names_a_bad_step_field(tmp_path, capsys, field, value, text):
    """``calibrate --from-steps`` with an edited step log: ``seconds: Infinity`` wrote a NaN cost
    model and exited 0, a string ``decoders`` was a ``TypeError`` traceback, a string ``chunks``
    said ``not enough values to unpack``, a float one ``SVD did not converge``, a negative
    token count was fitted silently. Each is one error line naming the file, step, field and value."""
    from hybridkv.cli import main

    steps = [{"instance": 0, "start": 0.1 * k, "seconds": 0.01 * (k + 1), "chunks": [[0, 64 * (k + 1)]],
              "decoders": k % 2, "decode_context": 100 * (k % 2)} for k in range(6)]
    steps[0][field] = value
    log, out = tmp_path / "steps.json", tmp_path / "cost.json"
    log.write_text(json.dumps({"meta": {}, "steps": steps}))
    rc = main(["calibrate", "--from-steps", str(log), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not out.exists()
    assert err.startswith(f"error: step log {str(log)!r}: {text}"), err
    assert "\n" not in err


@pytest.mark.parametrize("field, value, text", [
    ("overhead_s", float("inf"), "overhead_s=inf must be a number of seconds in [0, 3600]"),
    ("linear_s_per_token", "x", "linear_s_per_token='x' must be a number of seconds in [0, 3600]"),
    ("seq_s", True, "seq_s=True must be a number of seconds in [0, 3600]"),
    ("experts", 1.5, "experts=1.5 must be an integer in [0, 1048576]"),
    ("name", 7, "name=7 must be a string"),
], ids=["inf", "string", "bool", "experts-float", "name-int"])
def test_replay_cost_model_file_names_a_bad_coefficient(tmp_path, capsys, field, value, text):
    """``replay --simulate --timed --cost-model FILE``: ``overhead_s: Infinity`` was an
    ``IndexError`` traceback in the simulator and a string coefficient a ``TypeError`` one;
    ``experts: 1.5`` was blamed on ``experts_per_token``. Each is one error naming the field
    and value."""
    from hybridkv.cli import main

    model = {"name": "m", "overhead_s": 0.001, "linear_s_per_token": 1e-5, "attention_s_per_pair": 1e-9}
    model[field] = value
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(model))
    rc = main(["replay", "--simulate", "--timed", "--cost-model", str(path), "--limit", "5", "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())           # the console wraps long lines
    assert rc == 2
    assert err.endswith(text) and err.startswith("error: cost model "), err
    assert "Traceback" not in err


def test_a_trace_line_is_read_as_utf8(tmp_path):
    """A line starting with bytes 0xff 0xfe was reported as a ``'utf-16-le' codec`` error (the
    bytes were sniffed as UTF-16); trace files are UTF-8, so the error names UTF-8. A UTF-8 byte
    order mark is still accepted."""
    from hybridkv.replay.trace import TraceError, load_trace

    line = b'{"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": [1]}\n'
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(line + b"\xff\xfe\n")
    with pytest.raises(TraceError) as info:
        load_trace(bad)
    text = str(info.value)
    assert f"{bad}:2:" in text and "'utf-8' codec can't decode byte 0xff" in text, text
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + line)
    assert [r.input_length for r in load_trace(bom).requests] == [100]


def test_a_huge_num_hidden_layers_is_refused_at_once(tmp_path, capsys):
    """``config.json`` with ``num_hidden_layers: 1000000000`` and the usual short layer lists hung
    (the check listed every layer in neither list: a billion). It is refused at once naming the
    first such layer and num_hidden_layers."""
    from hybridkv.cli import main
    from hybridkv.model.config import HybridConfig

    d = HybridConfig.preset("tiny").to_hf_dict()
    d["num_hidden_layers"] = 10**9
    (tmp_path / "config.json").write_text(json.dumps(d))
    rc = main(["replay", "--model", str(tmp_path), "--limit", "2", "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2
    assert "layer 5 in neither list (each of the num_hidden_layers=1000000000 layers is KDA or MLA exactly once)" \
        in err, err


def test_weights_larger_than_the_machine_are_refused_before_allocating(tmp_path, capsys):
    """A ``config.json`` within the schema's bounds whose weights cannot fit (``hidden_size``
    2^31 - 1: 49,336 GiB) failed in torch's CPU allocator with a ``RuntimeError`` traceback. It is
    refused before anything is allocated, naming the GiB, the config's sizes and the machine's
    memory."""
    from hybridkv.cli import main
    from hybridkv.model.config import HybridConfig

    d = HybridConfig.preset("tiny").to_hf_dict()
    d["hidden_size"] = 2**31 - 1
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "model.safetensors").write_bytes(b"")
    rc = main(["replay", "--model", str(tmp_path), "--limit", "2", "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2
    assert err.startswith("error: the model's weights need 49336.0 GiB (13243531668039 parameters from "
                          "hidden_size=2147483647, vocab_size=1024,"), err
    assert "GiB of memory" in err and "Traceback" not in err


def _trace_line() -> str:
    return json.dumps({"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": [1]}) + "\n"


def test_an_output_onto_an_input_or_another_output_is_refused(tmp_path, capsys):
    """``replay --json`` onto its own ``--trace`` replaced the trace with the report, and
    ``--json`` with ``--step-log`` onto one file kept only one of them; both exited 0. Each is
    refused before the run naming both options, and the input is left as it was."""
    from hybridkv.cli import main

    trace = tmp_path / "trace.jsonl"
    trace.write_text(_trace_line())
    rc = main(["replay", "--simulate", "--trace", str(trace), "--json", str(trace), "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and trace.read_text() == _trace_line()
    assert err == (f"error: --json {trace} is the same file as --trace {trace}: writing one would overwrite the "
                   "other; choose another path")
    out = tmp_path / "out.json"
    rc = main(["replay", "--simulate", "--timed", "--trace", str(trace), "--json", str(out),
               "--step-log", str(tmp_path / "." / "out.json"), "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and not out.exists()
    assert err.startswith(f"error: --step-log {tmp_path / '.' / 'out.json'} is the same file as --json {out}"), err


def test_calibrate_out_through_a_link_to_its_step_log_is_refused(tmp_path, capsys):
    from hybridkv.cli import main

    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"meta": {}, "steps": []}))
    link = tmp_path / "link.json"
    link.symlink_to(steps)
    rc = main(["calibrate", "--from-steps", str(steps), "--out", str(link)])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and json.loads(steps.read_text()) == {"meta": {}, "steps": []}
    assert err.startswith(f"error: --out {link} is the same file as --from-steps {steps}"), err


@pytest.mark.parametrize("extra", [["--json", "out.json"], ["--rounds", "3"], ["--checks", "10"], ["--seconds", "5"]],
                         ids=["json", "rounds", "checks", "seconds"])
def test_soak_case_refuses_the_options_of_a_new_run(tmp_path, capsys, monkeypatch, extra):
    """``soak --case FILE --json OUT`` wrote no report and ``--rounds``/``--checks``/``--seconds``
    were ignored, silently (exit 0 or 1 on the rerun's result). Each is refused, naming it."""
    from hybridkv.cli import main

    monkeypatch.chdir(tmp_path)
    case = tmp_path / "case.json"
    case.write_text(json.dumps({"config": {}, "shrunk": [{}]}))
    rc = main(["soak", "--case", str(case), *extra])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and not (tmp_path / "out.json").exists()
    assert err == (f"error: {extra[0]} {float(extra[1]) if extra[0] == '--seconds' else extra[1]} has no effect "
                   f"with --case {case}: a rerun of a recorded failure prints its checks and writes no report; "
                   "drop one of them"), err


def _help_texts(parser) -> list[str]:
    """Every help and description text of ``parser`` and its subcommands."""
    import argparse

    texts = [parser.description or ""]
    for action in parser._actions:
        texts.append(action.help or "")
        if isinstance(action, argparse._SubParsersAction):
            texts += [a.help or "" for a in action._choices_actions]
            for sub in action.choices.values():
                texts += _help_texts(sub)
    return texts


def test_every_docs_page_the_cli_help_names_exists():
    """``hybridkv serve --help`` pointed at docs/serve.md and the router, replay and cache purge
    options at docs/routing.md and docs/cache_abi.md, pages that no longer exist."""
    import re
    from pathlib import Path

    from hybridkv.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    named = {m for text in _help_texts(build_parser()) for m in re.findall(r"docs/[\w./-]+\.md", text)}
    assert named, "the help names no page at all: the pattern is stale"
    missing = sorted(p for p in named if not (root / p).is_file())
    assert not missing, missing


@pytest.mark.parametrize("kwargs, exc, text", [
    ({"model": 5}, TypeError, "model=5 must be a preset name or a model directory"),
    ({"seed": -1}, ValueError, r"seed=-1 must be in \[0, 2\*\*63 - 1\]"),
    ({"seed": 2**64}, ValueError, r"seed=18446744073709551616 must be in \[0, 2\*\*63 - 1\]"),
], ids=["model-int", "seed-negative", "seed-2**64"])
def test_llm_names_a_bad_model_or_seed(kwargs, exc, text):
    """``LLM(model=5)`` said ``expected str, bytes or os.PathLike object, not int`` (no argument
    named); ``LLM(seed=-1)`` was accepted though ``--seed`` refuses it. Both fail before loading."""
    from hybridkv import LLM

    with pytest.raises(exc, match=text):
        LLM(**kwargs)


@pytest.mark.parametrize("argv", [["soak", "--seconds", "inf"], ["soak", "--shrink-seconds", "inf"],
                                  ["bench-serve", "--max-seconds", "inf"]])
def test_an_infinite_time_limit_is_refused_naming_the_option(argv, capsys):
    """``soak --seconds inf`` / ``--shrink-seconds inf`` / ``bench-serve --max-seconds inf`` ran with
    no limit at all (exit 0); a limit must be a finite number of seconds."""
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[1] in err and "inf" in err and "finite" in err


def test_a_host_tier_larger_than_the_machine_is_refused_before_the_run(capsys):
    """``replay --host-mib 99999999999`` (about 93 PiB) was accepted: the host tier fills as entries
    are written, so it could only end in an out-of-memory kill. Refused before anything loads."""
    from hybridkv.cli import main

    code = main(["replay", "--model", "tiny", "--limit", "2", "--no-progress", "--host-mib", "99999999999"])
    err = capsys.readouterr().err
    assert code == 2 and "--host-mib 99999999999" in err and "GiB of memory" in err


@pytest.mark.parametrize(("kwargs", "named"), [({"num_kv_pages": 10**12}, "num_kv_pages=1000000000000"),
                                               ({"host_mib": 10**11}, "host_mib=100000000000")])
def test_llm_pools_larger_than_the_machine_are_refused_naming_the_argument(kwargs, named):
    """``LLM(num_kv_pages=10**12)`` was an allocator ``RuntimeError`` (the CLI checked, the Python
    API did not); now the same check, naming the keyword argument rather than a CLI option."""
    from hybridkv import LLM

    with pytest.raises(ValueError, match="GiB of memory") as exc:
        LLM("tiny", **kwargs)
    assert named in str(exc.value) and "--" not in str(exc.value)
