"""The public API (hybridkv.api): ``LLM.generate`` on the real ``tiny`` preset, no mocks.

Reuse must be exact: a prompt that takes its prefix from the cache (device or a
disk store shared by two ``LLM`` instances) generates the tokens and logits of a
no-cache full forward (logits within 1e-4).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridkv.api import LLM, GenerationOutput
from hybridkv.cache.config import CacheConfig, ConfigError
from hybridkv.engine.backend import SimulatedBackend
from hybridkv.engine.build import build_engine
from hybridkv.model.config import HybridConfig

VOCAB = 1024          # the tiny preset's


def ids(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids of the tiny vocabulary."""
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


SHARED = ids(1, 256)                 # four 64-token units
A = SHARED + ids(2, 40)              # T = 296: the tail checkpoint lands at 256
B = SHARED + ids(3, 51)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny") as model:
        yield model


@torch.no_grad()
def assert_matches_full_forward(model, out: GenerationOutput, tol: float = 1e-4) -> None:
    """Greedy tokens and their logits equal a no-cache forward over prompt + generated tokens."""
    seq = torch.tensor(out.prompt_token_ids + out.token_ids[:-1], dtype=torch.long)
    full = model(seq[None])[0]
    t = len(out.prompt_token_ids)
    ref = full[t - 1:]
    assert ref.argmax(-1).tolist() == out.token_ids
    assert out.logits is not None and out.logits.shape == (len(out.token_ids), VOCAB)
    assert float((out.logits - ref).abs().max()) <= tol


def test_shared_prefix_is_reused_exactly(llm):
    first = llm.generate([A], max_tokens=4, return_logits=True)
    second = llm.generate(B, max_tokens=4, return_logits=True)      # one prompt given as a flat list
    assert len(first) == len(second) == 1
    a, b = first[0], second[0]
    assert a.reused_tokens == 0 and a.computed_prompt_tokens == len(A)
    assert b.reused_tokens == 256 and b.kv_hit_tokens >= 256
    assert b.computed_prompt_tokens == len(B) - 256
    assert b.prompt_token_ids == B and len(b.token_ids) == 4 and b.finish_reason == "length"
    assert_matches_full_forward(llm.model, a)
    assert_matches_full_forward(llm.model, b)
    with LLM("tiny", policy="none") as plain:                           # no checkpoints: nothing reused
        ref = plain.generate([A, B], max_tokens=4)
    assert [o.reused_tokens for o in ref] == [0, 0]
    assert [o.token_ids for o in ref] == [a.token_ids, b.token_ids]
    assert llm.stats.reused_tokens >= 256
    tiers = llm.cache_info()["tiers"]
    assert tiers["device"]["hit_tokens"] == llm.stats.reused_tokens
    report_keys = {"hit_tokens", "bytes_loaded", "bytes_saved", "evictions", "bytes_evicted",
                   "loads_taken", "loads_declined"}                    # the replay report's per-tier keys
    assert all(set(t) == set(tiers["device"]) >= report_keys for t in tiers.values()), tiers


def test_batch_keeps_input_order_and_accepts_arrays():
    with LLM("tiny", max_num_seqs=1) as one_at_a_time:
        p = [SHARED + ids(10 + i, 20 + 7 * i) for i in range(3)]
        outs = one_at_a_time.generate(np.array(p[0], dtype=np.int32), max_tokens=2)   # 1-D array: one prompt
        assert outs[0].reused_tokens == 0
        outs = one_at_a_time.generate([torch.tensor(p[1]), np.array(p[2])], max_tokens=3)
        assert [o.prompt_token_ids for o in outs] == p[1:]
        assert [o.reused_tokens for o in outs] == [256, 256]
        assert all(len(o.token_ids) == 3 for o in outs)
        rows = one_at_a_time.generate(np.array([A[:100], B[:100]]), max_tokens=1)    # 2-D: one per row
        assert [o.prompt_token_ids for o in rows] == [A[:100], B[:100]]
        # the first row branches at 64 (KV cached, no checkpoint there yet) and publishes one; the second reuses it
        assert (rows[0].kv_hit_tokens, rows[0].reused_tokens) == (64, 0)
        assert (rows[1].kv_hit_tokens, rows[1].reused_tokens) == (64, 64)


def test_invalid_input_names_the_value(llm):
    with pytest.raises(ValueError, match=r"prompt 1: token id 1024 is outside the vocabulary \[0, 1024\)"):
        llm.generate([A, [5, 1024, 7]])
    with pytest.raises(ValueError, match=r"prompt 0: token id -3"):
        llm.generate([[1, -3]])
    with pytest.raises(ValueError, match=r"prompt 1 is empty \(0 token ids\)"):
        llm.generate([[1, 2], []])
    with pytest.raises(ValueError, match=r"max_tokens=0 must be an integer >= 1"):
        llm.generate([A], max_tokens=0)
    with pytest.raises(ValueError, match=r"max_tokens=2.5"):
        llm.generate([A], max_tokens=2.5)
    with pytest.raises(ValueError, match=r"prompt 0: element 0 is 1.0 \(float\), not an integer token id"):
        llm.generate([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"prompt 0: element 1 is True \(bool\)"):
        llm.generate([[1, True, 3]])                                   # numpy would have made it id 1
    with pytest.raises(ValueError, match=r"prompt 0: token ids must be integers, got dtype float64"):
        llm.generate(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"prompts is empty"):
        llm.generate([])
    with pytest.raises(TypeError, match=r"no tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match=r"num_kv_pages=1024"):
        llm.generate([[1] * 65536], max_tokens=2)          # 1025 pages of 64 tokens
    assert not llm.engine.has_work                          # nothing was queued by a failed call
    assert llm.generate([A[:70]], max_tokens=1)[0].token_ids


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_size": 100}, r"prefix_match_unit=64 must divide block_size=100"),
    ({"prefix_match_unit": 32}, r"prefix_match_unit=32 must be a multiple"),
    ({"policy": "branch+often"}, r"policy term 'often'"),
    ({"mechanism": "fast"}, r"mechanism='fast'"),
    ({"max_num_seqs": 0}, r"max_num_seqs=0"),
    ({"store_alignment": 96}, r"store_alignment=96"),
])
def test_invalid_settings_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM("tiny", **kwargs)


def test_invalid_model_and_tier_settings():
    with pytest.raises(ValueError, match=r"unknown preset 'huge'"):
        LLM("huge")
    with pytest.raises(ValueError, match=r"host_mib=-1"):
        LLM("tiny", host_mib=-1)
    with pytest.raises(ValueError, match=r"threads=0"):
        LLM("tiny", threads=0)
    with pytest.raises(ValueError, match=r"scheme 'ftp'"):
        LLM("tiny", store="ftp://x")


def test_disk_store_is_shared_by_two_instances(tmp_path):
    url = f"disk://{tmp_path / 'store'}"
    with LLM("tiny", store=url) as writer:
        first = writer.generate([A], max_tokens=3, return_logits=True)[0]
        assert writer.cache_info()["tiers"]["store"]["bytes_saved"] > 0
    with LLM("tiny", store=url) as reader:                  # a fresh process-local cache: only the store has A
        again, other = reader.generate([A, B], max_tokens=3, return_logits=True)
        info = reader.cache_info()
    assert info["store_connected"] and info["tiers"]["store"]["hit_tokens"] > 0
    assert again.reused_tokens == 256 and other.reused_tokens == 256
    assert again.token_ids == first.token_ids
    assert_matches_full_forward(reader.model, again)
    assert_matches_full_forward(reader.model, other)


def test_close_is_idempotent(tmp_path):
    llm = LLM("tiny", store=f"disk://{tmp_path}", host_mib=1)
    llm.generate([A[:128]], max_tokens=1)
    llm.close()
    llm.close()
    assert llm.closed and llm.stats.requests == 1            # counters stay readable
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([A[:128]])
    with LLM("tiny") as other:
        pass
    other.close()
    assert "tiny" in repr(other)


def test_unreachable_store_at_startup_runs_without_it(caplog):
    with socket.socket() as s:                              # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="hybridkv.engine.build"):
        llm = LLM("tiny", store=f"mooncake://127.0.0.1:{port}?setup_retries=1&timeout_s=1")
    with llm:
        assert "unreachable at startup" in caplog.text
        assert not llm.cache_info()["store_connected"]
        assert len(llm.generate([A[:80]], max_tokens=1)[0].token_ids) == 1


def test_build_engine_simulated_has_no_store_and_a_payload_free_host():
    cfg = CacheConfig(block_size=64, num_kv_pages=16, num_checkpoint_slots=4)
    with build_engine(HybridConfig.preset("tiny"), cfg, model_name="tiny") as built:
        assert isinstance(built.backend, SimulatedBackend) and built.model is None
        assert built.host_tier is None and built.store_tier is None and len(built.namespace) == 32
    with pytest.raises(ValueError, match=r"simulation has no tensors for a store"):
        build_engine(HybridConfig.preset("tiny"), cfg, model_name="tiny", store_url="memory://")
    with build_engine(HybridConfig.preset("tiny"), cfg, model_name="tiny", host_bytes=1 << 20) as built:
        assert built.host_tier is not None and not built.host_tier.payload     # byte accounting only
    with pytest.raises(ValueError, match=r"host_write_through=True needs a host tier"):
        build_engine(HybridConfig.preset("tiny"), cfg, model_name="tiny", host_write_through=True)


def test_top_package_imports_the_api_lazily():
    # in a subprocess: a fresh interpreter, and tests/test_layers.py wants imports from the defining module
    code = ("import sys, hybridkv.store.base; assert 'torch' not in sys.modules, 'torch imported'; "
            "from hybridkv import LLM, GenerationOutput; assert LLM.__module__ == 'hybridkv.api'")
    subprocess.run([sys.executable, "-c", code], check=True)
