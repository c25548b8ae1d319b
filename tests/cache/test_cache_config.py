"""cache.config: Mechanism (parsed from its name; where a prefill chunk ends, which states it captures
and where each checkpoint comes from) and CacheConfig's store alignment."""

from __future__ import annotations

import pytest

from hybridkv.cache.config import CacheConfig, ConfigError, Mechanism

# -- Mechanism -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,mechanism", [("extract", Mechanism.EXTRACT), ("split", Mechanism.SPLIT)])
def test_mechanism_parses_from_its_name_and_from_itself(name, mechanism):
    assert Mechanism.parse(name) is mechanism
    assert Mechanism.parse(mechanism) is mechanism
    assert CacheConfig(mechanism=name).mechanism is mechanism


@pytest.mark.parametrize("bad", ["splat", "EXTRACT", "", 3])
def test_unknown_mechanism_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match=f"mechanism={bad!r} must be one of") as exc:
        Mechanism.parse(bad)
    assert "extract" in str(exc.value) and "split" in str(exc.value)
    assert isinstance(exc.value, ValueError)
    with pytest.raises(ConfigError, match=f"mechanism={bad!r}"):
        CacheConfig(mechanism=bad)


def test_split_ends_a_chunk_at_its_first_planned_boundary():
    assert Mechanism.SPLIT.chunk(0, 1024, [256, 512]) == (256, [256])
    assert Mechanism.SPLIT.chunk(256, 1024, [512, 1024]) == (512, [512])
    assert Mechanism.SPLIT.chunk(0, 1024, [1024]) == (1024, [1024])
    assert Mechanism.SPLIT.chunk(0, 1024, []) == (1024, [])                 # nothing planned: the whole chunk


def test_extract_runs_the_whole_chunk_and_captures_every_boundary_inside():
    assert Mechanism.EXTRACT.chunk(0, 1024, [256, 512]) == (1024, [256, 512])
    assert Mechanism.EXTRACT.chunk(0, 1024, []) == (1024, [])


def test_only_extract_asks_the_backend_for_intermediate_states():
    captures = [256, 512]
    got = Mechanism.EXTRACT.backend_captures(captures)
    assert got == [256, 512] and got is not captures
    assert Mechanism.SPLIT.backend_captures(captures) == []


def test_checkpoint_is_the_end_state_under_split_and_the_intermediate_state_under_extract():
    end_state, intermediate = object(), {256: object(), 512: object()}
    assert Mechanism.SPLIT.checkpoint(512, 512, end_state, intermediate) is end_state
    assert Mechanism.SPLIT.checkpoint(256, 512, end_state, intermediate) is intermediate[256]
    assert Mechanism.EXTRACT.checkpoint(512, 512, end_state, intermediate) is intermediate[512]
    assert Mechanism.EXTRACT.checkpoint(256, 512, end_state, intermediate) is intermediate[256]


# -- CacheConfig -----------------------------------------------------------------------------------


def test_store_alignment_validation():
    with pytest.raises(ConfigError, match="store_alignment=1536 must be a positive multiple of block_size=1024"):
        CacheConfig(block_size=1024, store_alignment=1536)
    assert CacheConfig(block_size=1024).store_boundary == 1024
    assert CacheConfig(block_size=1024, store_alignment=4096).store_boundary == 4096
