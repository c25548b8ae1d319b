"""cache.groups: the reuse cap, each group's hit rule, the joint hit and the group specs' byte sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache.groups import (
    BOUNDARY,
    FULL,
    GROUP_NAMES,
    KDA,
    KIMI_LINEAR,
    PREFIX,
    BoundaryList,
    EntryPresence,
    Family,
    FullAttentionSpec,
    GroupSpec,
    HeldBoundaries,
    KDASpec,
    RecomputeCone,
    SavedAtHit,
    SavedEvery,
    entry_shapes,
    joint_hit,
    joint_hits,
    kimi_linear,
    nbytes,
    reuse_cap,
)
from hybridkv.cache.pools import CheckpointPool
from hybridkv.model.config import HybridConfig

UNIT = 64


def path(*flags: str, unit: int = UNIT) -> list[EntryPresence]:
    """Consecutive boundaries from ``unit`` on; each flag is ``"k"`` (KV), ``"c"`` (checkpoint),
    ``"kc"`` (both) or ``""`` (neither)."""
    return [EntryPresence((i + 1) * unit, "k" in f, "c" in f) for i, f in enumerate(flags)]


# -- reuse_cap -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,unit,cap", [
    (0, 64, 0), (1, 64, 0), (2, 64, 0), (64, 64, 0), (65, 64, 64), (66, 64, 64), (128, 64, 64),
    (129, 64, 128), (1000, 64, 960), (1024, 1024, 0), (1025, 1024, 1024), (4097, 1024, 4096),
])
def test_reuse_cap_is_t_minus_one_rounded_down_to_the_unit(num_tokens, unit, cap):
    assert reuse_cap(num_tokens, unit) == cap


@given(st.integers(0, 10_000), st.sampled_from([64, 128, 256, 1024]))
def test_reuse_cap_always_leaves_the_last_position_to_compute(num_tokens, unit):
    cap = reuse_cap(num_tokens, unit)
    assert cap % unit == 0 and 0 <= cap <= max(num_tokens - 1, 0)
    assert cap + unit > num_tokens - 1                                       # the largest such multiple


# -- the Kimi Linear family over explicit boundaries ------------------------------------------------


def kimi(boundaries, limit):
    return joint_hit(KIMI_LINEAR, BoundaryList(boundaries), limit)


def test_group_names():
    assert KIMI_LINEAR.names == (FULL, KDA) == GROUP_NAMES
    assert KIMI_LINEAR.prefix_names == (FULL,) and KIMI_LINEAR.boundary == ((KDA, SavedAtHit()),)


def test_full_attention_hit_is_the_kv_run_from_token_zero():
    def run(b, limit):
        return BoundaryList(b).prefix_run(FULL, limit)
    assert run([], 1000) == 0
    assert run(path("k", "k", "k"), 1000) == 192
    assert run(path("k", "", "kc", "k"), 1000) == 64                         # contiguity break at 128
    assert run(path("", "k", "k"), 1000) == 0                                # never skips a hole
    assert run(path("k", "k", "k"), 150) == 128                              # limit between boundaries
    assert run(path("k", "k", "k"), 128) == 128                              # limit on a boundary
    assert run(path("k", "k", "k"), 63) == 0


def test_kda_hit_is_the_deepest_checkpoint_at_or_below_the_limit():
    def deepest(b, limit):
        return BoundaryList(b).deepest_state(KDA, limit)
    assert deepest([], 1000) == 0
    assert deepest(path("k", "kc", "k", "kc"), 1000) == 256
    assert deepest(path("k", "kc", "k", "kc"), 255) == 128
    assert deepest(path("k", "kc", "k", "kc"), 127) == 0                     # zero state
    assert deepest(path("c", "", "", "c"), 1000) == 256                      # sparse: ignores KV


def test_joint_hit_is_the_deepest_checkpoint_inside_the_kv_run():
    j = kimi(path("k", "kc", "k", "kc", "k"), 1000)
    assert (j.hit, j.kv_hit, j.restart, j.per_group) == (256, 320, 256, {FULL: 320, KDA: 256})
    assert j.branching_boundary == 320


def test_joint_hit_stops_at_the_limit():
    j = kimi(path("k", "kc", "k", "kc", "k"), 200)
    assert (j.hit, j.kv_hit, j.per_group[KDA], j.branching_boundary) == (128, 192, 128, 192)


def test_a_checkpoint_beyond_the_kv_run_is_not_used():
    j = kimi(path("kc", "k", "", "kc"), 1000)                                # KV breaks at 192
    assert (j.hit, j.kv_hit, j.per_group[KDA]) == (64, 128, 64)
    assert j.branching_boundary == 128
    j = kimi(path("k", "k", "", "kc"), 1000)                                 # no checkpoint inside it
    assert (j.hit, j.kv_hit, j.branching_boundary) == (0, 128, 128)


def test_no_branching_boundary_when_the_checkpoint_is_at_the_end_of_the_kv_run():
    j = kimi(path("k", "kc"), 1000)
    assert (j.hit, j.kv_hit, j.branching_boundary) == (128, 128, None)
    empty = kimi([], 1000)
    assert (empty.hit, empty.kv_hit, empty.branching_boundary) == (0, 0, None)


def reference_joint_hit(flags: list[tuple[bool, bool]], limit: int, unit: int) -> int:
    """The deepest boundary ``b <= limit`` such that every boundary up to ``b`` has KV and ``b`` has a checkpoint."""
    best = 0
    for i, (has_kv, has_ckpt) in enumerate(flags):
        end = (i + 1) * unit
        if end > limit or not all(kv for kv, _ in flags[: i + 1]):
            break
        if has_ckpt:
            best = end
    return best


@given(flags=st.lists(st.tuples(st.booleans(), st.booleans()), max_size=24),
       limit=st.integers(0, 26 * UNIT))
def test_joint_hit_matches_a_brute_force_reference(flags, limit):
    boundaries = [EntryPresence((i + 1) * UNIT, kv, ck) for i, (kv, ck) in enumerate(flags)]
    j = kimi(boundaries, limit)
    assert j.hit == reference_joint_hit(flags, limit, UNIT) == j.restart
    kv_run = next((i for i, (kv, _) in enumerate(flags) if not kv), len(flags))
    assert j.kv_hit == min(kv_run * UNIT, limit // UNIT * UNIT)
    assert j.per_group == {FULL: j.kv_hit, KDA: j.hit}
    assert j.hit <= j.kv_hit and j.hit <= limit
    assert j.branching_boundary == (j.kv_hit if j.kv_hit > j.hit else None)
    held = {FULL: [b.end for b in boundaries if b.has_kv], KDA: [b.end for b in boundaries if b.has_checkpoint]}
    assert joint_hit(KIMI_LINEAR, HeldBoundaries(UNIT, held), limit) == j      # another adapter, one rule


# -- group specs, families, restore strategies (a DeepSeek-V4-shaped family) ----------------------

SWA = "swa"
V4_GROUPS = (GroupSpec(FULL, PREFIX, 1, (("kv", "bfloat16", (3, 1, 8)),)),
             GroupSpec("csa", PREFIX, 4, (("entries", "bfloat16", (2, 1, 8)), ("indexer", "bfloat16", (2, 1, 4)))),
             GroupSpec("hca", PREFIX, 128, (("entries", "bfloat16", (1, 1, 8)),)),
             GroupSpec(SWA, BOUNDARY, 64, (("window", "bfloat16", (3, 127, 8)), ("tails", "float32", (3, 128, 8)))))


def v4(restore) -> Family:
    return Family("deepseek-v4", V4_GROUPS, {SWA: restore})


def test_group_spec_bytes_and_entry_shapes():
    full, csa, hca, swa = V4_GROUPS
    assert full.bytes_per_entry == 3 * 8 * 2 and csa.bytes_per_entry == 2 * 8 * 2 + 2 * 4 * 2
    assert csa.entry_shape(256) == {"entries": ("bfloat16", (2, 64, 8)), "indexer": ("bfloat16", (2, 64, 4))}
    assert hca.entry_shape(256) == {"entries": ("bfloat16", (1, 2, 8))}
    assert swa.entry_shape() == {"window": ("bfloat16", (3, 127, 8)), "tails": ("float32", (3, 128, 8))}
    assert swa.bytes_per_entry == 3 * 127 * 8 * 2 + 3 * 128 * 8 * 4
    with pytest.raises(ValueError, match="tokens=100 is not a positive multiple of its granularity 128"):
        hca.entry_shape(100)


@pytest.mark.parametrize("kwargs,message", [
    (dict(direction="sideways"), "direction='sideways'"),
    (dict(direction=PREFIX, granularity=0), "granularity=0"),
    (dict(direction=PREFIX, components=(("x", "int8", (1,)),)), "dtype 'int8'"),
])
def test_a_bad_group_spec_is_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupSpec("g", **kwargs)


def test_a_bad_family_is_refused_naming_the_group():
    full, kda = GroupSpec(FULL, PREFIX), GroupSpec(KDA, BOUNDARY)
    with pytest.raises(ValueError, match="boundary group 'kda' has no restore strategy"):
        Family("f", (full, kda))
    with pytest.raises(ValueError, match="no prefix-closed group"):
        Family("f", (kda,), {KDA: SavedAtHit()})
    with pytest.raises(ValueError, match="duplicate group names"):
        Family("f", (full, full))
    with pytest.raises(ValueError, match="restore strategy for 'swa'"):
        Family("f", (full, kda), {KDA: SavedAtHit(), SWA: SavedAtHit()})
    with pytest.raises(ValueError, match="period=0"):
        SavedEvery(0)
    with pytest.raises(ValueError, match="cone tokens=-1"):
        RecomputeCone(-1)


def test_kimi_linear_with_shapes_has_the_specs_entry_shapes():
    full = FullAttentionSpec(block_size=128, num_layers=2, latent_dim=8)
    kda = KDASpec(num_layers=3, num_heads=2, head_dim=4, conv_dim=24, conv_width=3)
    fam = kimi_linear(full, kda)
    assert fam.names == KIMI_LINEAR.names and fam.boundary == KIMI_LINEAR.boundary
    assert fam.spec(FULL).bytes_per_entry == full.bytes_per_token
    assert fam.spec(KDA).bytes_per_entry == kda.page_size_bytes
    with pytest.raises(KeyError, match="no group 'swa'"):
        fam.spec(SWA)


def v4_presence(kv_to: int, csa_to: int, hca_to: int, swa_at=()) -> HeldBoundaries:
    return HeldBoundaries(UNIT, {FULL: range(UNIT, kv_to + 1, UNIT), "csa": range(UNIT, csa_to + 1, UNIT),
                                 "hca": range(UNIT, hca_to + 1, UNIT), SWA: swa_at})


def test_the_prefix_hit_is_the_shortest_prefix_group_run():
    j = joint_hit(v4(RecomputeCone(0)), v4_presence(640, 512, 576), 1000)
    assert (j.kv_hit, j.hit, j.restart) == (512, 512, 512)
    assert j.per_group == {FULL: 640, "csa": 512, "hca": 576, SWA: 512}


def test_saved_window_moves_the_hit_to_the_deepest_saved_state():
    j = joint_hit(v4(SavedAtHit()), v4_presence(640, 640, 640, swa_at=[128, 384, 704]), 1000)
    assert (j.kv_hit, j.hit, j.restart, j.branching_boundary) == (640, 384, 384, 640)


def test_periodic_keeps_the_hit_and_restarts_at_the_nearest_saved_state():
    j = joint_hit(v4(SavedEvery(256)), v4_presence(640, 640, 640, swa_at=[256, 512, 768]), 1000)
    assert (j.kv_hit, j.hit, j.restart, j.branching_boundary) == (640, 640, 512, None)
    j = joint_hit(v4(SavedEvery(256)), v4_presence(640, 640, 640), 1000)     # nothing saved: from 0
    assert (j.hit, j.restart) == (640, 0)


def test_recompute_restarts_one_cone_before_the_hit():
    j = joint_hit(v4(RecomputeCone(300)), v4_presence(640, 640, 640), 1000)
    assert (j.hit, j.restart) == (640, 340)
    j = joint_hit(v4(RecomputeCone(300)), v4_presence(192, 640, 640), 1000)
    assert (j.hit, j.restart) == (192, 0)


def test_two_saved_boundary_groups_loop_to_agreement():
    fam = Family("two", (GroupSpec(FULL, PREFIX), GroupSpec(KDA, BOUNDARY), GroupSpec(SWA, BOUNDARY)),
                 {KDA: SavedAtHit(), SWA: SavedAtHit()})
    pres = HeldBoundaries(UNIT, {FULL: range(UNIT, 1000, UNIT), KDA: [128, 320, 512], SWA: [192, 320, 448]})
    j = joint_hit(fam, pres, 600)
    assert (j.hit, j.restart) == (320, 320) and j.per_group[KDA] == j.per_group[SWA] == 320
    fam = Family("mixed", fam.groups, {KDA: SavedAtHit(), SWA: RecomputeCone(100)})
    j = joint_hit(fam, pres, 600)
    assert (j.hit, j.restart) == (512, 412)


# -- specs -----------------------------------------------------------------------------------------


def test_full_attention_spec_sizes_match_its_entry_shape():
    spec = FullAttentionSpec(block_size=128, num_layers=2, latent_dim=8)
    assert spec.bytes_per_token == 2 * 8 * 4
    assert spec.page_size_bytes == 128 * 2 * 8 * 4
    assert spec.entry_shape(128) == {"latents": ("float32", (2, 128, 8))}
    dtype, shape = spec.entry_shape(128)["latents"]
    assert nbytes(dtype, shape) == spec.page_size_bytes
    assert nbytes(*spec.entry_shape(512)["latents"]) == 512 * spec.bytes_per_token   # any segment length


def test_a_half_precision_pool_halves_the_page_but_entries_stay_float32():
    spec = FullAttentionSpec(block_size=128, num_layers=2, latent_dim=8, dtype_bytes=2)
    assert spec.page_size_bytes == 128 * 2 * 8 * 2
    assert spec.entry_shape(128)["latents"][0] == "float32"


@pytest.mark.parametrize("conv_dtype,conv_bytes", [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_kda_spec_checkpoint_bytes_match_its_entry_shape(conv_dtype, conv_bytes):
    spec = KDASpec(num_layers=3, num_heads=2, head_dim=4, conv_dim=24, conv_width=3, conv_dtype=conv_dtype)
    shape = spec.entry_shape()
    assert shape == {"recurrent": ("float32", (3, 2, 4, 4)), "conv.q": (conv_dtype, (3, 8, 3)),
                     "conv.k": (conv_dtype, (3, 8, 3)), "conv.v": (conv_dtype, (3, 8, 3))}
    assert spec.page_size_bytes == 3 * 2 * 4 * 4 * 4 + 3 * 24 * 3 * conv_bytes
    assert spec.page_size_bytes == sum(nbytes(d, s) for d, s in shape.values())


def test_kda_spec_bytes_equal_a_tensor_backed_checkpoint_slot():
    spec = KDASpec(num_layers=3, num_heads=2, head_dim=4, conv_dim=24, conv_width=3, conv_dtype="bfloat16")
    pool = CheckpointPool(1, spec=spec.group_spec())
    assert pool.slot_bytes == spec.page_size_bytes
    slot = pool.take_free()
    pool.write(slot, {c: torch.zeros(shape, dtype=getattr(torch, dt)) for c, (dt, shape) in spec.entry_shape().items()})
    held = pool.held(slot)
    assert held["conv.q"].dtype == torch.bfloat16 and held["recurrent"].shape == (3, 2, 4, 4)
    assert sum(t.numel() * t.element_size() for t in held.values()) == pool.slot_bytes


def test_specs_for_a_model_config_match_its_byte_counts():
    config = HybridConfig.preset("tiny")
    full = FullAttentionSpec.for_model(config, block_size=256)
    kda = KDASpec.for_model(config)
    assert (full.num_layers, full.latent_dim, full.block_size) == (config.num_mla_layers, config.kv_latent_dim, 256)
    assert full.bytes_per_token == config.kv_bytes_per_token
    assert kda.page_size_bytes == config.checkpoint_bytes
    assert kda.entry_shape()["recurrent"][1] == config.recurrent_state_shape
    third = (config.num_kda_layers, config.conv_dim // 3, config.conv_kernel_size - 1)
    assert all(kda.entry_shape()[c] == ("float32", third) for c in ("conv.q", "conv.k", "conv.v"))


def test_entry_shapes_name_both_groups():
    full = FullAttentionSpec(block_size=128, num_layers=2, latent_dim=8)
    kda = KDASpec(num_layers=3, num_heads=2, head_dim=4, conv_dim=24, conv_width=3)
    assert entry_shapes(full, kda, 256) == {FULL: full.entry_shape(256), KDA: kda.entry_shape()}


def test_nbytes_refuses_an_unknown_dtype():
    assert nbytes("float16", (3, 5)) == 30 and nbytes("float32", ()) == 4
    with pytest.raises(KeyError):
        nbytes("int8", (4,))


# -- joint_hits: the rule for several holders at once ----------------------------------------------


class EachPresence:
    """A :class:`~hybridkv.cache.groups.Presences` asking each holder's own presence in turn."""

    def __init__(self, presences):
        self.presences = presences

    def prefix_runs(self, group, limit):
        return [p.prefix_run(group, limit) for p in self.presences]

    def deepest_states(self, group, at_most):
        return [p.deepest_state(group, a) for p, a in zip(self.presences, at_most)]


boundary_sets = st.lists(st.integers(1, 16).map(lambda i: i * UNIT), max_size=10)


@settings(max_examples=60, deadline=None)
@given(holders=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 16), boundary_sets, boundary_sets),
                        min_size=1, max_size=5),
       limit=st.integers(0, 17 * UNIT),
       restore=st.sampled_from([SavedAtHit(), SavedEvery(256), RecomputeCone(150)]))
def test_joint_hits_equals_joint_hit_per_holder(holders, limit, restore):
    fam = Family("t", (GroupSpec(FULL, PREFIX), GroupSpec("csa", PREFIX, 4), GroupSpec(KDA, BOUNDARY),
                       GroupSpec(SWA, BOUNDARY)), {KDA: SavedAtHit(), SWA: restore})
    for family in (fam, KIMI_LINEAR):
        pres = [HeldBoundaries(UNIT, {FULL: range(UNIT, a * UNIT + 1, UNIT), "csa": range(UNIT, b * UNIT + 1, UNIT),
                                      KDA: k, SWA: w}) for a, b, k, w in holders]
        kvs, hits, restarts = joint_hits(family, EachPresence(pres), limit)
        one = [joint_hit(family, p, limit) for p in pres]
        assert (kvs, hits, restarts) == ([j.kv_hit for j in one], [j.hit for j in one], [j.restart for j in one])
        assert all(r <= h <= kv <= limit for kv, h, r in zip(kvs, hits, restarts))


def test_the_cache_package_imports_no_model_module():
    """The cache knows state only by group specs (a checkpoint pool is built from one, with the
    backend's codec): importing every cache module loads nothing of ``hybridkv.model``."""
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib, hybridkv.cache as c\n"
            "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('hybridkv.cache.' + m.name)\n"
            "print(sorted(m for m in sys.modules if m.startswith('hybridkv.model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
