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


# -- hybridkv store start: workdir and ports ------------------------------------------------------


def _store_start(capsys, *args):
    """``hybridkv store start ARGS``: (exit code, the whole output on one line)."""
    from hybridkv.cli import main

    code = main(["store", "start", *args])
    out = capsys.readouterr()
    return code, " ".join((out.out + out.err).split())


@pytest.fixture
def ports():
    from hybridkv.store.mooncake.procs import find_free_ports

    return [str(p) for p in find_free_ports(2)]


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_store_start_with_a_file_as_workdir_is_one_clear_error(tmp_path, capsys, ports, where):
    """Before: ``FileExistsError`` / ``NotADirectoryError`` tracebacks (``--workdir /etc/passwd``)."""
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0\n")
    work = f if where == "file" else f / "x"
    code, text = _store_start(capsys, "--workdir", str(work), "--port", ports[0], "--metrics-port", ports[1])
    why = "exists and is not a directory" if where == "file" else "lies under a file"
    assert code == 2 and "Traceback" not in text
    assert f"error: store workdir {str(work)!r} {why}" in text and "--workdir DIR" in text
    assert f.read_text() == "root:x:0:0\n"                            # nothing lost


@pytest.mark.parametrize("exists", [False, True])
def test_store_start_with_a_read_only_workdir_is_one_clear_error(read_only_fs, capsys, ports, exists):
    """Before: ``OSError: [Errno 30] Read-only file system`` traceback."""
    work = read_only_fs.path if exists else read_only_fs.path / "wd"
    read_only_fs(ro=True)
    code, text = _store_start(capsys, "--workdir", str(work), "--port", ports[0], "--metrics-port", ports[1])
    assert code == 2 and "Traceback" not in text
    assert f"store workdir {str(work)!r}" in text and "read-only file system" in text


def test_store_start_with_equal_ports_names_both_options(tmp_path, capsys, ports):
    """Before: the master was started and its exit blamed (``mooncake_master exited with status 1``)."""
    code, text = _store_start(capsys, "--workdir", str(tmp_path / "w"), "--port", ports[0], "--metrics-port", ports[0])
    assert code == 2 and text == (f"error: --port and --metrics-port are both {ports[0]}: the master listens on each "
                                  "(RPC and metrics), so they need two different ports")
    assert not (tmp_path / "w").exists()                              # refused before anything is made


@pytest.mark.parametrize("option", ["--port", "--metrics-port"])
def test_store_start_on_a_taken_port_names_it_and_how_to_choose_another(tmp_path, capsys, ports, option):
    import re
    import socket

    taken = ports[0] if option == "--port" else ports[1]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", int(taken)))
        holder.listen()
        code, text = _store_start(capsys, "--workdir", str(tmp_path / "w"), "--port", ports[0],
                                  "--metrics-port", ports[1])
    assert code == 2 and text.startswith(f"error: {option} {taken}: port {taken} on 127.0.0.1 is not free")
    assert re.search(rf"choose another port with {option} N \(e\.g\. {option} \d+, free now\)$", text), text


def test_store_start_with_a_port_out_of_range_names_it(tmp_path, capsys, ports):
    code, text = _store_start(capsys, "--workdir", str(tmp_path / "w"), "--port", "99999", "--metrics-port", ports[1])
    assert code == 2 and text == "error: --port 99999 is not a TCP port (1-65535)"


# -- per-user default directories -----------------------------------------------------------------


def test_the_default_store_workdir_is_per_user(tmp_path, monkeypatch):
    """``$XDG_CACHE_HOME`` when set; ``~/.cache`` when the home is this user's own; else a private
    ``<tmp>/hybridkv-<uid>`` (before: ``~/.cache/hybridkv/store`` whoever the home belonged to)."""
    import os
    import stat
    import tempfile

    from hybridkv.store.mooncake.service import default_workdir
    from hybridkv.store.userdirs import private_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_workdir() == tmp_path / "xdg" / "hybridkv" / "store"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")             # not absolute: ignored (XDG rule)
    own = tmp_path / "home"
    own.mkdir()
    monkeypatch.setenv("HOME", str(own))
    assert default_workdir() == own / ".cache" / "hybridkv" / "store"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))   # the system temp dir, here
    (tmp_path / "tmp").mkdir()
    shared = "/" if os.getuid() != 0 else str(tmp_path / "shared")    # a home that is not this user's
    if os.getuid() == 0:
        os.mkdir(shared)
        os.chown(shared, 12345, 12345)
    monkeypatch.setenv("HOME", shared)
    fallback = tmp_path / "tmp" / f"hybridkv-{os.getuid()}"
    assert default_workdir() == fallback / "store" and not fallback.exists()   # naming it makes nothing
    assert default_workdir(create=True) == fallback / "store"
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700 and fallback.stat().st_uid == os.getuid()
    if os.getuid() == 0:                                              # another user's directory is refused
        os.chown(fallback, 12345, 12345)
        with pytest.raises(PermissionError, match=f"{fallback} is not a directory of this user"):
            private_dir(fallback)


# -- memory:// is private to one engine: refused where instances are meant to share the store ------


@pytest.mark.parametrize("timed", [False, True])
def test_memory_store_with_several_instances_is_refused_naming_the_alternatives(capsys, timed):
    """Before: exit 0, each instance a private empty store (store hit_tokens 0), no warning."""
    from hybridkv.cli import main

    code = main(["replay", "--no-progress", "--model", "tiny", "--limit", "4", "--instances", "2",
                 "--store", "memory://", *(["--timed"] if timed else [])])
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert code == 2 and "Traceback" not in text
    assert "store 'memory://' with instances=2: memory:// is private to one engine" in text
    assert "disk:///PATH" in text and "mooncake://HOST:PORT" in text


@pytest.mark.parametrize("command", ["replay", "serve"])
def test_a_bad_mooncake_url_on_the_command_line_is_one_line_before_anything_starts(capsys, command):
    """Before: a "Mooncake's own log: …" line (and a log file) came first, then the raw error."""
    from hybridkv.cli import main

    url = "mooncake://127.0.0.1:50051?timeout_s=-1"
    code = main([command, "--model", "tiny", "--store", url, *(["--no-progress"] if command == "replay" else [])])
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert code == 2 and text == f"error: store URL {url!r}: timeout_s='-1' is not a number of seconds > 0"
