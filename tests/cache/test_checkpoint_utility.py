"""The device checkpoint pool by expected saving (``CacheConfig.checkpoint_eviction="utility"``,
:class:`UtilityOrder`): a checkpoint's uses (its hits, or its placing term's learned use share)
times the tokens it saves over the checkpoint below it, aged GreedyDual-style; the coordinator
measures that saving at publication; the order's bookkeeping stays exact."""

from __future__ import annotations

import numpy as np
import pytest
from small_checkpoint_cache import BLOCK, UNIT, serve_once, small_cache

from hybridkv.cache.config import CacheConfig, ConfigError
from hybridkv.cache.pools import UtilityOrder

TOL = 1e-9          # priorities are sums of a few products of small integers and shares


def _put(o: UtilityOrder, item, label: str, saving: float) -> None:
    o.mark(item, label, saving)
    o.describe(item, cost=saving)
    o.add(item)


def test_lowest_expected_saving_goes_first_and_the_floor_rises():
    o = UtilityOrder()
    _put(o, 1, "tail", 512)            # uses 1/3 (none of 1 tail used yet): 170.7
    _put(o, 2, "interval", 64)         # 1/3 * 64 = 21.3
    _put(o, 3, "interval", 128)        # 1/4 * 128 = 32 (its label's share is 1/4 now)
    assert abs(o.priority(3) - 32.0) < TOL and o.use_share("interval") == pytest.approx(0.25, abs=TOL)
    assert o.victim() == 2
    o.evicted(2)
    o.discard(2)
    assert abs(o.floor - 64 / 3) < TOL            # the victim's priority
    assert o.victim() == 3 and list(o) == [3, 1] and len(o) == 2 and 1 in o and 2 not in o


def test_hits_count_and_teach_the_label_share():
    o = UtilityOrder()
    _put(o, 1, "branch", 100)
    _put(o, 2, "branch", 100)
    _put(o, 3, "tail", 150)
    # priorities are taken when an item is added or hit: branch 2 at 1/4 * 100, branch 1 at
    # 1/3 * 100 (one branch placed then), the tail at 1/3 * 150
    assert o.victim() == 2 and list(o) == [2, 1, 3]
    o.hit(1)                                       # its first use: 1 use of 2 branches
    assert o.use_share("branch") == pytest.approx(2 / 4, abs=TOL)
    assert abs(o.priority(1) - 100.0) < TOL and list(o) == [2, 3, 1]
    o.hit(1, count=False)                          # the same use again (a waiting request): no count
    assert abs(o.priority(1) - 100.0) < TOL and o.used["branch"] == 1
    o.hit(1)
    assert abs(o.priority(1) - 200.0) < TOL


def test_a_held_item_is_no_member_and_comes_back_refreshed():
    o = UtilityOrder()
    _put(o, 1, "tail", 64)
    _put(o, 2, "tail", 640)
    o.discard(1)                                   # a request holds it
    assert o.victim() == 2
    o.hit(1)                                       # used while held
    o.floor = 1000.0                               # meanwhile others were evicted
    o.add(1)                                       # released: priority taken now
    assert abs(o.priority(1) - (1000.0 + 64)) < TOL and o.victim() == 2


def test_forget_drops_the_description_and_a_new_content_starts_afresh():
    o = UtilityOrder()
    _put(o, 1, "tail", 64)
    o.hit(1)
    o.forget(1)
    assert 1 not in o and len(o) == 0 and o.victim() is None
    o.describe(1, cost=300)                        # unmarked: label "" with the described cost
    o.add(1)
    assert o.info[1].hits == 0 and abs(o.priority(1) - 300 / 3) < TOL


def test_victim_by_owner_and_stale_heap_entries():
    o = UtilityOrder()
    for i in range(5):
        o.mark(i, "tail", 64 * (i + 1))
        o.describe(i, owner=b"a" if i % 2 else b"b")
        o.add(i)
    for _ in range(3000):                          # many refreshes: the heap is rebuilt, order kept
        o.hit(4, count=False)
    assert len(o._heap) <= 4 * len(o) + 1024 + 1
    assert o.victim(b"a") == 1 and o.victim(b"b") == 0 and o.victim() == 0
    assert o.owner_bytes == {b"a": 2, b"b": 3}


@pytest.mark.parametrize("kw, match", [({"checkpoint_eviction": "lfu"}, "checkpoint_eviction='lfu'"),
                                       ({"checkpoint_eviction": "utility", "checkpoint_probation": 0.0},
                                        "exclude each other")])
def test_config_refuses(kw, match):
    with pytest.raises(ConfigError, match=match):
        CacheConfig(block_size=BLOCK, prefix_match_unit=UNIT, **kw)


def _tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


@pytest.mark.parametrize("utility, kept", [(False, False), (True, True)])
def test_interval_checkpoints_do_not_push_out_a_deep_tail(utility, kept):
    """A conversation's tail 4 units deep, then a one-off prompt whose prefill places 4 interval
    checkpoints (one unit apart) in a 4-slot pool: under lru they push the tail out; by expected
    saving each saves one unit over the one below it, the tail four, so they evict each other."""
    cache = small_cache(checkpoint_eviction="utility" if utility else None)
    conv = _tokens(1, 4 * UNIT + 1)
    serve_once(cache, conv, {4 * UNIT: "tail"})
    serve_once(cache, _tokens(2, 5 * UNIT), {b * UNIT: "interval" for b in range(1, 5)})
    turn = np.concatenate([conv[:4 * UNIT], _tokens(3, 2 * UNIT)])
    hit, _ = serve_once(cache, turn, {})
    assert (hit == 4 * UNIT) is kept


@pytest.mark.parametrize("policy, saving", [("tail+supersede", 6 * UNIT), ("tail", 2 * UNIT)])
def test_saving_is_counted_from_the_checkpoint_left_below(policy, saving):
    """A conversation's next turn resumes from its tail at 4 units and places a tail at 6: the new
    tail saves 2 units over the old one, or, when ``supersede`` retires the old one, 6 units over
    nothing (no checkpoint is left below it)."""
    cache = small_cache(policy, checkpoint_eviction="utility")
    conv = _tokens(1, 4 * UNIT + 1)
    serve_once(cache, conv, {4 * UNIT: "tail"})
    turn = np.concatenate([conv[:4 * UNIT], _tokens(3, 2 * UNIT + 1)])
    hit, alloc = serve_once(cache, turn, {6 * UNIT: "tail"})
    assert hit == 4 * UNIT
    slot = cache.index.walk(cache.hash_prompt(turn)[:6])[-1].checkpoint
    order = cache.checkpoints.order
    assert isinstance(order, UtilityOrder) and order._what[slot] == ("tail", float(saving))
    retired = cache.index.walk(cache.hash_prompt(conv)[:4])[-1].checkpoint is None
    assert retired is policy.endswith("supersede")


@pytest.mark.parametrize("branched, lower", [(False, False), (True, False), (False, True)])
def test_a_checkpoint_every_request_went_past_hands_its_uses_up(branched, lower):
    """A request resumes from an ``interval`` checkpoint at 2 units and places one at 5: with no
    branch between them (every request so far that reached 2 units went on), the one at 2 ranks as
    unused again (label ``shadowed``, hits back to 0) and the one at 5 saves 5 units (its own 3
    plus the 2 the one below saved). After another request branched at 2 units, both keep what
    they had, and so they do when a lower tier holds the cache's checkpoints (``lower_tiers``)."""
    cache = small_cache("tail", checkpoint_eviction="utility")
    cache.lower_tiers = lower
    prompt = _tokens(7, 6 * UNIT + 1)
    serve_once(cache, prompt[: 3 * UNIT + 1], {2 * UNIT: "interval"})
    if branched:
        other = np.concatenate([prompt[: 2 * UNIT], _tokens(8, 2 * UNIT + 1)])
        assert serve_once(cache, other, {})[0] == 2 * UNIT
    hit, _ = serve_once(cache, prompt, {5 * UNIT: "branch"})
    assert hit == 2 * UNIT
    hashes = cache.hash_prompt(prompt)
    low, high = (cache.index.walk(hashes[:k])[-1].checkpoint for k in (2, 5))
    order = cache.checkpoints.order
    if branched or lower:
        assert order._what[low] == ("interval", float(2 * UNIT)) and order.info[low].hits == (2 if branched else 1)
        assert order._what[high] == ("branch", float(3 * UNIT)) and cache.labels[low] == "interval"
    else:
        assert order._what[low] == ("shadowed", float(2 * UNIT)) and order.info[low].hits == 0
        assert order._what[high] == ("branch", float(5 * UNIT)) and cache.labels[low] == "shadowed"
        assert order.placed["shadowed"] == 1 and order.priority(low) < order.priority(high)


def test_an_installed_checkpoint_saves_over_the_deepest_one_below():
    """A checkpoint installed from a lower tier (a promotion) at 5 units, on a path with a tail at
    2 units: labelled ``installed``, it saves 3 units."""
    cache = small_cache("tail", checkpoint_eviction="utility")
    prompt = _tokens(4, 6 * UNIT + 1)
    serve_once(cache, prompt[: 2 * UNIT + 1], {2 * UNIT: "tail"})
    serve_once(cache, prompt, {})                      # publishes the KV of all 6 units
    hashes = cache.hash_prompt(prompt)
    assert cache.install_checkpoint(hashes, None, 5 * UNIT)
    cache.check_invariants()
    slot = cache.index.walk(hashes[:5])[-1].checkpoint
    assert cache.checkpoints.order._what[slot] == ("installed", float(3 * UNIT))


def test_replay_option_reaches_the_cache_and_keeps_more_reuse():
    """``ReplayOptions.checkpoint_eviction`` (``replay --checkpoint-eviction utility``) reaches the
    device checkpoint pool: on the bundled trace's first 1,000 requests with 60 checkpoint slots it
    reuses more tokens than one lru order."""
    from rich.console import Console

    from hybridkv.replay.runner import ReplayOptions, run_replay

    def run(order):
        return run_replay(ReplayOptions(limit=1000, simulate=True, progress=False, block_tokens=512,
                                        num_checkpoint_slots=60, host_bytes=0, checkpoint_eviction=order),
                          Console(stderr=True, quiet=True))

    utility, lru = run("utility"), run(None)
    assert utility.config["checkpoint_eviction"] == "utility"
    assert utility.reused_tokens > lru.reused_tokens


def test_soak_rounds_with_utility_are_exact_and_leak_free(tiny_model):
    """``hybridkv soak --eviction utility``: the soak's rounds with the device checkpoint pool by
    expected saving stay exact (every request against a full prefill) and leak-free."""
    from hybridkv.replay import soak

    rep = soak.run_soak(0, rounds=3, model=tiny_model, eviction="utility")
    assert rep.ok, "\n".join(f.render(tiny_model.config.vocab_size) for f in rep.failures)
    assert rep.checks >= 20
    assert rep.command.endswith("--eviction utility")


def test_cli_refuses_utility_with_probation(capsys):
    from hybridkv.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--checkpoint-eviction", "utility", "--checkpoint-probation", "0"])
    assert exc.value.code == 2
    assert "--checkpoint-eviction utility and --checkpoint-probation 0 exclude each other" in capsys.readouterr().err


def test_bench_frontier_utility7_places_interval_checkpoints_every_7_blocks(tmp_path):
    """bench_frontier's ``utility7`` variant: ``utility`` with the policy's interval term at 7
    blocks. A prompt of 16 blocks, then (after three one-block fillers) one branching after 10:
    with interval checkpoints every 14 blocks only the first request's lead checkpoint (one block
    in) lies below the branch; every 7, the second request resumes from 7 blocks."""
    import importlib.util
    import json
    from pathlib import Path

    from rich.console import Console
    spec = importlib.util.spec_from_file_location(
        "bench_frontier", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_frontier.py")
    bf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bf)
    prompts = [list(range(1, 17)), [90_001], [90_002], [90_003], list(range(1, 11)) + [99]]
    trace = tmp_path / "t.jsonl"
    with open(trace, "w") as f:
        for k, ids in enumerate(prompts):
            f.write(json.dumps({"timestamp": 10_000 * k, "input_length": 512 * len(ids), "output_length": 1,
                                "hash_ids": ids}) + "\n")
    console = Console(stderr=True, quiet=True)
    rows = {v: bf.cell(str(trace), None, 512, 64 << 20, 1 << 20, v, 1.0, 0.0, None, console)
            for v in ("utility", "utility7")}
    assert "interval=3584" in rows["utility7"]["policy"] and "interval=7168" in rows["utility"]["policy"]
    assert rows["utility7"]["checkpoint_eviction"] == rows["utility"]["checkpoint_eviction"] == "utility"
    assert rows["utility"]["reused_tokens"] == 512 and rows["utility7"]["reused_tokens"] == 7 * 512


def test_cli_checkpoint_eviction_lru_names_the_default(tmp_path, capsys):
    """``--checkpoint-eviction lru`` is the default order (``checkpoint_eviction`` None): the same
    run as without it, allowed with ``--checkpoint-probation``, refused with ``--eviction value``."""
    import json

    from hybridkv.cli import main

    runs = {}
    for name, extra in (("plain", []), ("lru", ["--checkpoint-eviction", "lru"]),
                        ("lru_probation", ["--checkpoint-eviction", "lru", "--checkpoint-probation", "0"])):
        out = tmp_path / f"{name}.json"
        assert main(["replay", "--no-progress", "--simulate", "--limit", "30", "--checkpoint-slots", "40",
                     *extra, "--json", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["lru"]["config"]["checkpoint_eviction"] is None
    assert runs["lru"]["reused_tokens"] == runs["plain"]["reused_tokens"]
    assert runs["lru_probation"]["config"]["checkpoint_eviction"] is None
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--simulate", "--limit", "5", "--checkpoint-eviction", "lru", "--eviction", "value"])
    assert exc.value.code == 2
    assert "--checkpoint-eviction lru with --eviction value" in capsys.readouterr().err
