"""The soak harness (hybridkv.replay.soak): a short deterministic run is exact and leak-free, a broken
comparison is caught and shrunk, rounds are reproducible; the fault-injecting store wrapper."""

from __future__ import annotations

import json

import pytest

from hkv_helpers import tamper_resumed_rows
from hybridkv.engine.backend import TorchBackend
from hybridkv.replay import soak, soak_check
from hybridkv.replay.soak_rounds import make_round
from hybridkv.store.base import StoreUnavailable
from hybridkv.store.faults import FaultyStore
from hybridkv.store.memory import MemoryStore


def test_short_soak_is_exact_and_leak_free(tiny_model):
    """24 rounds of seed 0 (about 20 s on 2 cores): every finished request equals a full prefill,
    every drained engine holds nothing, and cancellations, evictions, lower tiers and store faults
    all happened."""
    rep = soak.run_soak(0, rounds=24, model=tiny_model)
    assert rep.ok, "\n".join(f.render(tiny_model.config.vocab_size) for f in rep.failures)
    assert rep.rounds == 24 and rep.checks >= 200
    assert rep.mismatches == 0 and rep.leaks == 0 and rep.exceptions == 0 and rep.rejected == 0
    assert rep.max_abs_logit_diff <= soak_check.TOLERANCE
    assert sum(rep.cancellations.values()) >= 0.15 * rep.requests
    assert sum(n > 0 for n in rep.cancellations.values()) >= 4, rep.cancellations
    assert rep.evicted_pages > 0 and rep.evicted_checkpoints > 0
    assert rep.reused_tokens > 0 and rep.store_hit_tokens > 0 and rep.host_hit_tokens > 0
    assert sum(rep.faults_injected.values()) > 0 and rep.max_store_call_seconds < 5.0
    assert rep.command == "hybridkv soak --seed 0 --first-round 0 --rounds 24"
    json.dumps(rep.to_dict())                       # the report is JSON-ready


def test_rounds_depend_only_on_seed_and_index():
    a = make_round(5, 3, 1024)
    assert a == make_round(5, 3, 1024)
    assert a != make_round(5, 4, 1024) and a != make_round(6, 3, 1024)


def _tamper(monkeypatch):
    """A backend that gets the first logits row of every multi-token chunk resumed at a 64-aligned
    position wrong (a stand-in for a reuse bug); greedy tokens stay right."""
    tamper_resumed_rows(monkeypatch, TorchBackend)


def test_a_wrong_logit_is_reported_with_seed_round_and_shrunk_sequence(tiny_model, monkeypatch, tmp_path, capsys):
    _tamper(monkeypatch)
    monkeypatch.setitem(soak._MODELS, "tiny", tiny_model)      # the CLI below reuses the loaded model
    out = tmp_path / "soak.json"
    rc = soak.main(["--seed", "3", "--rounds", "3", "--shrink-seconds", "15", "--quiet", "--json", str(out)])
    assert rc == 1
    rep = json.loads(out.read_text())
    assert not rep["ok"] and rep["seed"] == 3 and rep["mismatches"] >= 1
    (f,) = rep["failures"]
    assert f["kind"] == "mismatch" and "max abs logit diff" in f["detail"]
    assert 1 <= len(f["shrunk"]) < f["requests"]
    assert f["reproduce"] == f"hybridkv soak --seed 3 --first-round {f['round']} --rounds 1"
    printed = capsys.readouterr().out
    assert f"FAILURE in round {f['round']}: mismatch" in printed and "smallest failing sequence" in printed
    assert "reproduce: hybridkv soak --seed 3" in printed
    # the shrunk sequence alone still fails, and passes once the backend is right again
    assert [x.kind for x in soak.run_case(out, tiny_model).failures][:1] == ["mismatch"]
    monkeypatch.undo()
    assert soak.run_case(out, tiny_model).failures == []


def test_run_soak_needs_a_bound():
    with pytest.raises(ValueError, match="needs a bound"):
        soak.run_soak(0)
    with pytest.raises(ValueError, match="checks=0"):
        soak.run_soak(0, checks=0)


# -- FaultyStore ---------------------------------------------------------------------------------------
def test_faulty_store_injects_each_kind_deterministically():
    def run(seed):
        s = FaultyStore(MemoryStore(), {"lost_manifest": 0.5, "no_space": 0.3, "corrupt": 0.5, "vanish": 0.3},
                        seed=seed)
        ok = s.put([(f"k{i}/manifest", b"m" * 8) for i in range(20)] + [(f"k{i}/c", b"abcdefgh") for i in range(20)])
        got = s.get([f"k{i}/c" for i in range(20)])
        return ok, got, dict(s.injected)

    ok, got, injected = run(1)
    assert (ok, got, injected) == run(1)
    assert all(injected[k] > 0 for k in ("lost_manifest", "no_space", "corrupt", "vanish"))
    assert not all(ok) and any(g is None for g in got)
    assert any(g is not None and g != b"abcdefgh" for g in got)            # one byte flipped in transit


def test_faulty_store_unavailable_and_slow_are_bounded():
    s = FaultyStore(MemoryStore(), {"unavailable": 1.0, "slow": 1.0}, slow_seconds=0.01)
    with pytest.raises(StoreUnavailable, match="injected"):
        s.exists(["a"])
    assert s.injected["unavailable"] == 1 and s.injected["slow"] == 1
    assert 0.01 <= s.max_call_seconds < 1.0
    with pytest.raises(ValueError, match="fault kind"):
        FaultyStore(MemoryStore(), {"fire": 0.1})


def test_store_faults_never_change_outputs(tiny_model):
    """Rounds whose store injects every fault kind: outputs exact, misses counted, nothing leaks.

    Fault decisions are drawn from the store keys, which carry the model namespace (a digest of
    the random weights, which differ between CPUs' kernels), so which round first injects a kind
    differs from machine to machine: rounds run until every kind was injected (at least
    ``MIN_ROUNDS``, at most ``MAX_ROUNDS``), each checked exact.
    """
    import dataclasses

    min_rounds, max_rounds = 6, 24
    kinds = {"unavailable", "slow", "lost_manifest", "corrupt", "vanish", "no_space", "two_writers"}
    vocab = tiny_model.config.vocab_size
    ref = soak_check.Reference(tiny_model)
    injected, misses, checks = {}, {}, 0

    def enough() -> bool:
        return (checks > 30 and set(injected) >= kinds and misses.get("unreachable", 0) > 0
                and misses.get("checksum", 0) + misses.get("incomplete", 0) > 0)

    for i in range(max_rounds):
        if i >= min_rounds and enough():
            break
        rc, specs = make_round(11, i, vocab)
        rc = dataclasses.replace(rc, store="memory" if i % 2 else "disk", faults=0.15, instances=2)
        res = soak.run_sequence(tiny_model, rc, specs, ref)
        assert res.failures == [], (i, res.failures)
        checks += res.checks
        for k, n in res.faults_injected.items():
            injected[k] = injected.get(k, 0) + n
        for k, n in res.store_misses.items():
            misses[k] = misses.get(k, 0) + n
        assert res.max_store_call_seconds < 5.0
    assert checks > 30
    assert set(injected) >= kinds, f"after {max_rounds} rounds, never injected: {sorted(kinds - set(injected))}"
    assert misses["unreachable"] > 0 and misses["checksum"] + misses["incomplete"] > 0, misses


def test_cli_registers_soak_and_needs_a_bound(capsys):
    import argparse

    p = argparse.ArgumentParser(prog="hybridkv")
    soak.register_cli(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["soak", "--seed", "4", "--seconds", "30", "--json", "r.json"])
    assert (args.command, args.seed, args.seconds, args.json_path) == ("soak", 4, 30.0, "r.json")
    assert args.soak_func is soak.cmd_soak
    assert soak.main([]) == 2 and "give --checks N, --seconds S or --rounds N" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--seed", "--first-round"])
def test_a_negative_seed_or_round_is_a_usage_error_naming_it(option, capsys):
    with pytest.raises(SystemExit) as exc:
        soak.main([option, "-1", "--rounds", "1", "--quiet"])
    assert exc.value.code == 2
    why = "-1 is outside [0, 2**63 - 1]" if option == "--seed" else "-1 must be 0 or more"
    assert f"argument {option}: {why}" in capsys.readouterr().err


def test_value_eviction_rounds_are_exact_and_leak_free(tiny_model):
    """The soak's --eviction value: the same rounds with the device pools and host tier evicting by
    value (issue 12) stay exact and leak-free; an unknown order is refused before any round."""
    rep = soak.run_soak(0, rounds=8, model=tiny_model, eviction="value")
    assert rep.ok, "\n".join(f.render(tiny_model.config.vocab_size) for f in rep.failures)
    assert rep.checks >= 60 and rep.evicted_pages > 0 and rep.coverage["eviction"] == {"value": 8}
    assert rep.command.endswith("--eviction value")
    with pytest.raises(ValueError, match="eviction='fifo'"):
        soak.run_soak(0, rounds=1, model=tiny_model, eviction="fifo")
