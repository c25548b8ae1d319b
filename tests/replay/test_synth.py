"""``hybridkv trace synth`` / ``trace scale`` (hybridkv.replay.synth): determinism, the format the
trace loader reads, the structure of each workload, and scaling that keeps sharing within a copy
and none across copies."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hybridkv.cli import main
from hybridkv.replay.synth import KINDS, SynthParams, plan_scale, scale_trace, synth_requests, write_lines
from hybridkv.replay.trace import TRACE_BLOCK_TOKENS, load_trace

B = TRACE_BLOCK_TOKENS


def _write(tmp_path, kind, n=300, seed=0, **kw):
    out = tmp_path / f"{kind}_{seed}.jsonl"
    write_lines(synth_requests(kind, n, seed, **kw), out)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_file_other_seed_other(tmp_path, kind):
    a = _write(tmp_path, kind, seed=3)
    b = tmp_path / "again.jsonl"
    assert main(["trace", "synth", "--kind", kind, "--requests", "300", "--seed", "3", "--out", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    c = _write(tmp_path, kind, seed=4)
    assert a.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("kind", KINDS)
def test_loader_reads_every_line(tmp_path, kind):
    path = _write(tmp_path, kind, n=400, rate=10.0)
    reqs = load_trace(path).requests          # raises on any malformed line
    assert len(reqs) == 400
    ts = [r.timestamp_ms for r in reqs]
    assert ts == sorted(ts)
    # ~40 s at 10 requests/s (Poisson): well inside 20..80 s
    assert 20_000 < ts[-1] < 80_000
    for r in reqs:
        assert len(r.hash_ids) == -(-r.input_length // B)


def _first_blocks(reqs, n):
    return Counter(tuple(r.hash_ids[:n]) for r in reqs if len(r.hash_ids) >= n)


def _prefix_consistent(reqs):
    """Prefix-chained ids: an id at position i always follows the same id at position i - 1."""
    parent = {}
    for r in reqs:
        for i, h in enumerate(r.hash_ids):
            prev = r.hash_ids[i - 1] if i else None
            assert parent.setdefault(h, prev) == prev


@pytest.mark.parametrize("kind", KINDS)
def test_ids_are_prefix_chained(tmp_path, kind):
    _prefix_consistent(load_trace(_write(tmp_path, kind, n=500)).requests)


def test_tenants_share_a_system_prompt_per_tenant(tmp_path):
    p = SynthParams()
    reqs = load_trace(_write(tmp_path, "tenants", n=2000)).requests
    first = Counter(r.hash_ids[0] for r in reqs)
    assert 20 <= len(first) <= p.tenants           # many tenants, none beyond the count
    # a tenant's system prompt is at least 8 whole blocks shared by its requests
    top = first.most_common(1)[0][0]
    mine = [r for r in reqs if r.hash_ids[0] == top]
    common = min(len(r.hash_ids) for r in mine)
    shared = next((i for i in range(common) if len({r.hash_ids[i] for r in mine}) > 1), common)
    assert shared >= p.system_blocks[0]
    # follow-ups: some prompts extend an earlier prompt's whole blocks
    seen = {tuple(r.hash_ids[:-1]) for r in reqs}
    assert any(tuple(r.hash_ids[:k]) in seen for r in reqs for k in range(shared + 2, len(r.hash_ids)))


def test_agentic_turns_extend_the_previous_turn(tmp_path):
    reqs = load_trace(_write(tmp_path, "agentic", n=1500)).requests
    whole = {tuple(r.hash_ids[:-1]): r for r in reqs}
    extended = sum(1 for r in reqs for k in range(len(r.hash_ids) - 1, 0, -1)
                   if tuple(r.hash_ids[:k]) in whole and whole[tuple(r.hash_ids[:k])].index < r.index
                   and k > SynthParams().agent_blocks[0])
    assert extended > len(reqs) // 2                 # most requests are later turns of a session
    assert len(Counter(r.hash_ids[0] for r in reqs)) <= SynthParams().agent_types


def test_documents_shared_across_users_behind_one_preamble(tmp_path):
    p = SynthParams()
    reqs = load_trace(_write(tmp_path, "documents", n=2000)).requests
    assert len({tuple(r.hash_ids[:p.preamble_blocks]) for r in reqs}) == 1
    docs = _first_blocks(reqs, p.preamble_blocks + p.document_blocks[0])
    assert docs.most_common(1)[0][1] >= 20           # the most popular document, read by many


def test_hotset_shifts(tmp_path):
    p = SynthParams()
    reqs = load_trace(_write(tmp_path, "hotset", n=4000)).requests
    early = Counter(r.hash_ids[0] for r in reqs[:p.shift_every])
    late = Counter(r.hash_ids[0] for r in reqs[-p.shift_every:])
    hot_early = {h for h, _ in early.most_common(p.hot_set)}
    hot_late = {h for h, _ in late.most_common(p.hot_set)}
    assert sum(early[h] for h in hot_early) > 0.6 * p.shift_every    # hot_share 0.7 of the traffic
    assert len(hot_early & hot_late) < p.hot_set                      # the hot set moved


def test_scale_keeps_sharing_within_a_copy_and_none_across(tmp_path):
    src = load_trace(_write(tmp_path, "tenants", n=200, rate=5.0)).requests
    plan = plan_scale(src, 3, rate=50.0)
    out = tmp_path / "scaled.jsonl"
    assert write_lines(scale_trace(src, plan), out) == 600
    got = load_trace(out).requests
    ts = [r.timestamp_ms for r in got]
    assert ts == sorted(ts)
    assert 600 / (ts[-1] / 1000) == pytest.approx(50.0, rel=0.05)
    copies = [[r for r in got if (r.hash_ids[0] // plan.namespace) == c] for c in range(3)]
    assert [len(c) for c in copies] == [200, 200, 200]
    for c, reqs in enumerate(copies):
        # the same requests in the same order, ids shifted by the copy's namespace
        assert [[h - c * plan.namespace for h in r.hash_ids] for r in reqs] == [list(r.hash_ids) for r in src]
        assert [r.input_length for r in reqs] == [r.input_length for r in src]
    ids = [{h for r in reqs for h in r.hash_ids} for reqs in copies]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2]) and not (ids[0] & ids[2])


def test_scale_shared_prefix(tmp_path):
    src = load_trace(_write(tmp_path, "documents", n=50)).requests
    plan = plan_scale(src, 2, shared_prefix_blocks=4)
    got = list(scale_trace(src, plan))
    assert all(line["hash_ids"][:4] == [0, 1, 2, 3] for line in got)
    assert Counter(line["input_length"] for line in got) == Counter(r.input_length + 4 * B for r in src for _ in range(2))
    after = [{h for line in got[c::1] for h in line["hash_ids"][4:] if (h - 4) // plan.namespace == c} for c in (0, 1)]
    assert after[0] and after[1] and not after[0] & after[1]


def test_scale_streams_in_bounded_memory(tmp_path):
    """Lines are written as they are made: the most allocated at once stays under a quarter of the
    file's size (holding the lines as objects would take several times it), so a million-line
    output needs no more memory than this one."""
    import tracemalloc

    src = load_trace(_write(tmp_path, "hotset", n=500, rate=100.0)).requests
    plan = plan_scale(src, 20, rate=1e3)
    out = tmp_path / "big.jsonl"
    tracemalloc.start()
    try:
        assert write_lines(scale_trace(src, plan), out) == 10_000
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < out.stat().st_size / 4


@pytest.mark.parametrize("argv, needle", [
    (["synth", "--kind", "chat", "--requests", "5"], "invalid choice: 'chat'"),
    (["synth", "--kind", "tenants", "--requests", "0"], "0 must be >= 1 (requests)"),
    (["synth", "--kind", "tenants", "--requests", "5", "--rate", "nan"], "'nan' is not a number"),
    (["synth", "--kind", "tenants", "--requests", "5", "--sessions", "4"],
     "--sessions 4 applies to --kind agentic, not --kind tenants"),
    (["synth", "--kind", "hotset", "--requests", "5", "--hot-set", "5000"], "hot_set (5000) must not exceed pool"),
    (["scale", "--copies", "0"], "0 must be >= 1 (copies)"),
])
def test_bad_options_one_line(tmp_path, capsys, argv, needle):
    out = tmp_path / "x.jsonl"
    try:
        code = main(["trace", *argv, "--out", str(out)])
    except SystemExit as exc:                 # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not out.exists()


def test_scale_refuses_to_overwrite_its_source(tmp_path, capsys):
    src = _write(tmp_path, "tenants", n=20)
    before = src.read_bytes()
    assert main(["trace", "scale", "--trace", str(src), "--copies", "2", "--out", str(src)]) == 2
    assert "same file as --trace" in capsys.readouterr().err
    assert src.read_bytes() == before


def test_scale_cli_bundled_prefix_too_long(tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    assert main(["trace", "scale", "--copies", "1", "--shared-prefix-blocks", "2000", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--shared-prefix-blocks 2000" in err and "at most 1,048,576" in err
    assert not out.exists()


def test_synth_lines_are_json_objects(tmp_path):
    path = _write(tmp_path, "agentic", n=5)
    for raw in path.read_text().splitlines():
        obj = json.loads(raw)
        assert set(obj) == {"timestamp", "input_length", "output_length", "hash_ids"}
