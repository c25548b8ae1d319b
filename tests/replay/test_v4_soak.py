"""``hybridkv soak --model v4-tiny``: short soaks on DeepSeek-V4 under each SWA recovery strategy
are exact against full prefills and leak-free, with the drawn host tier, stores, two engines
sharing a store and injected store faults."""

from __future__ import annotations

import json

import pytest

from hybridkv.cache.config import ConfigError
from hybridkv.replay import soak, soak_check
from hybridkv.replay.soak_rounds import make_round

V4_SEED, V4_FIRST, V4_ROUNDS = 2, 2, 1
"""Soak seed and rounds per strategy (a few seconds each on one core): round 2 of seed 2 draws a
host tier and a memory store shared by two engines, with injected store faults."""


@pytest.fixture(scope="module")
def v4_model():
    return soak.soak_model("v4-tiny")


@pytest.mark.parametrize("recovery", ["window", "periodic=128", "recompute"])
def test_a_short_v4_soak_is_exact_and_leak_free(v4_model, recovery):
    rep = soak.run_soak(V4_SEED, rounds=V4_ROUNDS, first_round=V4_FIRST, model=v4_model, model_name="v4-tiny",
                        swa_recovery=recovery)
    assert rep.ok, "\n".join(f.render(v4_model.config.vocab_size) for f in rep.failures)
    assert rep.rounds == V4_ROUNDS and rep.checks >= 10
    assert rep.mismatches == 0 and rep.leaks == 0 and rep.exceptions == 0 and rep.rejected == 0
    assert rep.max_abs_logit_diff <= soak_check.TOLERANCE
    assert rep.reused_tokens > 0
    assert rep.store_hit_tokens > 0 and rep.host_hit_tokens > 0 and sum(rep.faults_injected.values()) > 0
    if recovery == "recompute":
        assert rep.evicted_checkpoints == 0                   # nothing saved, so nothing to evict
    assert rep.command == (f"hybridkv soak --seed {V4_SEED} --first-round {V4_FIRST} --rounds {V4_ROUNDS} "
                           f"--model v4-tiny --swa-recovery {recovery}")


def test_v4_rounds_keep_the_tiers_and_fit_the_period():
    """Every drawn round keeps its settings, host tier, store, second engine and faults included;
    a drawn 128-token unit that does not divide periodic=192 becomes 64."""
    seen_unit_fix = False
    for i in range(40):
        rc, _ = make_round(0, i, 1024)
        v4 = soak.for_model(rc, "v4-tiny", "periodic=192")
        assert (v4.host_bytes, v4.store, v4.instances, v4.faults) == (rc.host_bytes, rc.store, rc.instances, rc.faults)
        assert (v4.block_size, v4.num_kv_pages, v4.policy) == (rc.block_size, rc.num_kv_pages, rc.policy)
        assert v4.model == "v4-tiny" and v4.swa_recovery == "periodic=192" and 192 % v4.prefix_match_unit == 0
        seen_unit_fix |= rc.prefix_match_unit == 128
        assert soak.for_model(rc, "tiny", None) == rc                  # Kimi rounds unchanged
    assert seen_unit_fix


def test_soak_options_for_v4(capsys):
    assert soak.main(["--model", "tiny", "--swa-recovery", "window", "--rounds", "1"]) == 2
    assert "error: --swa-recovery window: applies to DeepSeek-V4 models" in capsys.readouterr().err
    assert soak.main(["--model", "v4-tiny", "--swa-recovery", "periodic=96", "--rounds", "1"]) == 2
    assert "error: --swa-recovery periodic=96: " in capsys.readouterr().err
    with pytest.raises(ValueError, match="swa_recovery='recompute' applies to DeepSeek-V4 models"):
        soak.run_soak(0, rounds=1, swa_recovery="recompute")
    with pytest.raises(ConfigError, match="periodic=96"):
        soak.run_soak(0, rounds=1, model_name="v4-tiny", swa_recovery="periodic=96")


def test_a_wrong_v4_logit_is_caught_and_its_case_reruns_on_v4(v4_model, monkeypatch, tmp_path, capsys):
    """A V4 backend that gets the first row of each chunk resumed at a 64-aligned position wrong
    (a stand-in for a restore bug) fails the soak; the recorded case names its model and reruns on it."""
    from hybridkv.engine.v4backend import V4Backend
    from hkv_helpers import tamper_resumed_rows
    run = V4Backend.run
    tamper_resumed_rows(monkeypatch, V4Backend)
    monkeypatch.setitem(soak._MODELS, "v4-tiny", v4_model)
    out = tmp_path / "soak.json"
    assert soak.main(["--model", "v4-tiny", "--swa-recovery", "recompute", "--seed", "1", "--rounds", "1",
                      "--shrink-seconds", "3", "--quiet", "--json", str(out)]) == 1
    (f,) = json.loads(out.read_text())["failures"]
    assert f["kind"] == "mismatch" and f["config"]["model"] == "v4-tiny"
    assert f["reproduce"].endswith("--model v4-tiny --swa-recovery recompute")
    assert [x.kind for x in soak.run_case(out).failures][:1] == ["mismatch"]
    monkeypatch.setattr(V4Backend, "run", run)
    assert soak.run_case(out).failures == []


def test_v4_small_rounds_take_whole_hca_entries_per_block():
    """v4-small's HCA rate is 128: a drawn 64-token block (and store alignment) becomes 128, and the
    round's engine builds."""
    from hybridkv.engine.build import model_config
    rate = model_config("v4-small").hca_rate
    rounds = [make_round(0, i, 1024)[0] for i in range(40)]
    assert any(rc.block_size % rate for rc in rounds)
    for rc in rounds:
        v4 = soak.for_model(rc, "v4-small", None)
        assert v4.block_size % rate == 0 and rc.block_size <= v4.block_size < rc.block_size + rate
        assert v4.store_alignment is None or v4.store_alignment % rate == 0
        v4.cache_config()                                       # still a valid cache config
