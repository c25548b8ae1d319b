"""Bad store inputs end in one clear error naming the offending value (and lose nothing stored):
store URL parameters and ports, read-only disk stores, truncated disk objects, ``memory://``
across instances, ``hybridkv store start`` workdirs and ports, and the per-user default directory."""

from __future__ import annotations

import pytest

from hybridkv.store.url import open_store

# -- store URLs: one validation layer, every error names the parameter and its value -----------------


@pytest.mark.parametrize(("query", "named"), [
    ("timeout_s=abc", "timeout_s='abc' is not a number of seconds > 0"),        # before: could not convert string
    ("timeout_s=-1", "timeout_s='-1' is not a number of seconds > 0"),          # before: a list of four rules
    ("timeout_s=nan", "timeout_s='nan' is not a number of seconds > 0"),        # before: accepted, then unreachable
    ("timeout_s=inf", "timeout_s='inf' is not a number of seconds > 0"),
    ("retry_interval_s=-0.5", "retry_interval_s='-0.5' is not a number of seconds >= 0"),
    ("setup_retries=0", "setup_retries='0' is not a count >= 1"),
    ("setup_retries=2.5", "setup_retries='2.5' is not a count >= 1"),
    ("segment_bytes=1.5", "segment_bytes='1.5' is not a byte count >= 0"),     # before: invalid literal for int()
    ("local_buffer_bytes=-1", "local_buffer_bytes='-1' is not a byte count >= 0"),
])
def test_a_bad_mooncake_parameter_is_named_with_its_value(query, named):
    """Refused before any connection (port 1: no master there)."""
    url = f"mooncake://127.0.0.1:1?{query}"
    with pytest.raises(ValueError) as info:
        open_store(url)
    assert str(info.value) == f"store URL {url!r}: {named}"


@pytest.mark.parametrize("port", ["99999", "0", "65536", "abc"])
def test_a_port_outside_1_to_65535_is_named(port):
    """Before: ``Port out of range 0-65535`` (no URL, no port) or ``needs host:port`` for 0."""
    url = f"mooncake://127.0.0.1:{port}"
    with pytest.raises(ValueError) as info:
        open_store(url)
    assert str(info.value) == f"store URL {url!r}: port {port!r} is not a TCP port (1-65535)"


@pytest.mark.parametrize(("query", "named"), [("eviction=fifo", "eviction='fifo' is not one of lru, value"),
                                              ("capacity=-5", "capacity='-5' is not a byte count >= 0"),
                                              ("capacity=1e9", "capacity='1e9' is not a byte count >= 0")])
def test_a_bad_disk_parameter_is_named_and_nothing_is_created(tmp_path, query, named):
    url = f"disk://{tmp_path}/s?{query}"
    with pytest.raises(ValueError, match=f"{named}$"):
        open_store(url)
    assert not (tmp_path / "s").exists()


def test_a_direct_mooncake_store_names_its_bad_argument():
    from hybridkv.store.mooncake.client import MooncakeStore

    with pytest.raises(ValueError, match=r"^MooncakeStore timeout_s=-1.0 must be > 0 and finite$"):
        MooncakeStore("127.0.0.1:1", timeout_s=-1)
    with pytest.raises(ValueError, match=r"^MooncakeStore setup_retries=0 must be >= 1$"):
        MooncakeStore("127.0.0.1:1", setup_retries=0)


# -- a disk store on a read-only file system: new, empty or populated, one clear StoreUnavailable ----


@pytest.fixture
def read_only_fs(tmp_path):
    """``remount(ro)``: a 1 MiB tmpfs mounted for the test, switched read-only / writable again by
    the kernel (real EROFS, which root cannot bypass as it does chmod; skipped where mounting is not
    permitted)."""
    import subprocess

    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=False, capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")

    def remount(ro: bool) -> None:
        subprocess.run(["mount", "-o", f"remount,{'ro' if ro else 'rw'}", str(mnt)], check=True, capture_output=True)

    remount.path = mnt
    try:
        yield remount
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


@pytest.mark.parametrize("case", ["new", "empty", "populated"])
def test_a_read_only_disk_store_is_unavailable_naming_its_path(read_only_fs, case):
    """Before: a new or empty directory raised a raw ``OSError: [Errno 30]`` while a populated one
    was StoreUnavailable ("not readable and writable"); now every case is StoreUnavailable naming
    the path and the read-only file system, and a populated store loses nothing."""
    from hybridkv.store.base import StoreUnavailable
    from hybridkv.store.disk import DiskStore

    root = read_only_fs.path / "store"
    if case == "empty":
        root.mkdir()
    if case == "populated":
        with DiskStore(root) as s:
            assert s.put([("kept", b"bytes stored before")]) == [True]
    read_only_fs(ro=True)
    with pytest.raises(StoreUnavailable) as info:
        open_store(f"disk://{root}")
    assert repr(str(root)) in str(info.value) and "read-only file system" in str(info.value)
    read_only_fs(ro=False)
    if case == "populated":
        with DiskStore(root) as s:
            assert s.get(["kept"]) == [b"bytes stored before"]


def test_an_llm_on_a_read_only_store_warns_and_runs_without_it(read_only_fs, caplog):
    """``LLM(store=…)`` on a read-only file system (new directory): a warning naming the path, the
    LLM runs without a store tier (before: ``OSError: [Errno 30]`` out of the constructor)."""
    from hybridkv.api import LLM

    read_only_fs(ro=True)
    root = read_only_fs.path / "new"
    with caplog.at_level("WARNING"):
        llm = LLM("tiny", store=f"disk://{root}")
    try:
        assert llm._handle.store_tier is None
        assert any(str(root) in r.getMessage() and "read-only file system" in r.getMessage() for r in caplog.records)
    finally:
        llm.close()


# -- a truncated disk object is a damaged miss, not an eviction --------------------------------------


def _engine(model, store):
    """A fresh engine (empty device cache) whose only lower tier is ``store`` (entries every 1,024 tokens)."""
    from hybridkv.cache.config import CacheConfig, CheckpointPolicy
    from hybridkv.cache.namespace import CacheIdentity
    from hybridkv.engine.backend import TorchBackend
    from hybridkv.engine.engine import Engine
    from hybridkv.tiers.connector import tier_for

    cfg = CacheConfig(block_size=1024, prefix_match_unit=64, max_num_batched_tokens=8192, num_kv_pages=32,
                      num_checkpoint_slots=8, policy=CheckpointPolicy.parse("tail=1024"), store_alignment=1024)
    backend = TorchBackend(model, cfg.num_kv_pages, cfg.block_size)
    ns = CacheIdentity(model_repo="tiny", weight_digest=model.weight_digest()).digest()
    tier = tier_for(store, backend, ns, 64, cfg.store_boundary)
    return Engine(cfg, backend, ns, tiers=[tier]), tier


@pytest.mark.parametrize(("component", "reason"), [("conv.k", "checksum"), ("manifest", "incomplete")])
def test_a_truncated_disk_object_is_counted_as_damaged_not_evicted(tiny_model, tmp_path, component, reason):
    """A component file cut short on disk is a ``checksum`` miss (its size does not match the
    manifest), a cut manifest an ``incomplete`` one (unreadable); before, both read as absent and
    the component counted ``evicted`` (as if the store had removed it), the manifest ``absent``.
    The reader drops the entry and its own upload commits it again: the next reader reuses it."""
    import os

    import numpy as np
    from hkv_helpers import assert_exact, run_one, tokens

    from hybridkv.store.disk import DiskStore
    from hybridkv.store.disk_files import object_digest, object_path

    v = tiny_model.config.vocab_size
    P = tokens(37, 1024, v)
    a, tier_a = _engine(tiny_model, DiskStore(tmp_path / "store"))
    run_one(a, np.concatenate([P, tokens(38, 300, v)]))
    key = tier_a._key(a.cache.hash_prompt(P), 1024, "kda", component)
    path = object_path(str(tmp_path / "store"), object_digest(key.encode()))
    os.truncate(path, os.path.getsize(path) - 7)                       # a real short file on disk
    b, tier_b = _engine(tiny_model, DiskStore(tmp_path / "store"))
    r = run_one(b, np.concatenate([P, tokens(39, 200, v)]))
    assert r.reused == 0 and tier_b.stats.misses[reason] == 1
    assert tier_b.stats.misses["evicted"] == 0
    assert [r.split(" (")[0] for r in tier_b.store.bad_reasons.elements()] == ["truncated payload"]
    assert_exact(tiny_model, r)
    c, tier_c = _engine(tiny_model, DiskStore(tmp_path / "store"))
    assert run_one(c, np.concatenate([P, tokens(40, 200, v)])).reused == 1024
