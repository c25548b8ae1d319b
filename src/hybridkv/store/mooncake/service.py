"""A loopback Mooncake Store for one machine: ``hybridkv store start|stop|status``.

Two processes, both bound to 127.0.0.1 and stopped by PID:

* ``mooncake_master`` (metadata, leases, eviction);
* a storage process (``python -m hybridkv.store.mooncake.service hold``) that mounts
  the memory segment holding the object bytes, so objects outlive the engines
  that wrote them (engine clients mount no memory).

Their PIDs, ports and sizes are kept in ``<workdir>/store.json``; logs go to
``<workdir>/master.log`` and ``storage.log``. Killing the master forgets every
object; :func:`restart_master` does that on purpose for fault tests, and the
storage process remounts its (now empty) segment on the new master.

Mooncake's transfer engine listens on all interfaces whatever
``MC_TCP_BIND_ADDRESS`` says (0.3.13.post1: the handshake port binds 0.0.0.0,
the data port [::]). The storage process is therefore started with a tiny
``LD_PRELOAD`` library (built with the system C compiler by
:mod:`hybridkv.store.mooncake.loopback`) that rewrites wildcard binds to loopback;
:func:`loopback_env` gives that environment to any other process that loads
Mooncake. Spawning the processes, ports and PIDs: :mod:`hybridkv.store.mooncake.procs`.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridkv.store.base import StoreUnavailable
from hybridkv.store.mooncake.client import MooncakeStore
from hybridkv.store.mooncake.loopback import (
    LOOPBACK,
    loopback_env,
)
from hybridkv.store.mooncake.procs import (
    StoreServiceError,
    alive,
    check_port_free,
    find_free_ports,
    serves,
    spawn_master,
    spawn_storage,
    terminate,
    wait_for,
)
from hybridkv.store.mooncake.support import MooncakeNotInstalled, master_reachable
from hybridkv.store.userdirs import user_cache_dir

log = logging.getLogger(__name__)

STATE_FILE = "store.json"
DEFAULT_SEGMENT_MB = 1024

@dataclass(frozen=True, slots=True)
class StoreHandle:
    """A running loopback store, as recorded in ``<workdir>/store.json``."""

    workdir: str
    port: int
    metrics_port: int
    segment_bytes: int
    master_pid: int
    storage_pid: int

    @property
    def master(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        """The store URL engines take (``--store``)."""
        return f"mooncake://{self.master}"


def default_workdir(create: bool = False) -> Path:
    """``store`` under this user's cache directory (:func:`~hybridkv.store.userdirs.user_cache_dir`:
    ``$XDG_CACHE_HOME/hybridkv/store``, ``~/.cache/hybridkv/store``, or ``<tmp>/hybridkv-<uid>/store``
    without a home of one's own): one per user, never shared between users. ``create``: make the
    temporary-directory fallback private (see ``user_cache_dir``)."""
    return user_cache_dir(create=create) / "store"


def _check_port_numbers(port: int, metrics_port: int) -> None:
    """Both ports TCP ports (1-65535) and different.

    Raises:
        StoreServiceError: naming the option(s) and port(s).
    """
    for option, p in (("--port", port), ("--metrics-port", metrics_port)):
        if isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 65536:
            raise StoreServiceError(f"{option} {p!r} is not a TCP port (1-65535)")
    if port == metrics_port:
        raise StoreServiceError(f"--port and --metrics-port are both {port}: the master listens on each "
                                "(RPC and metrics), so they need two different ports")


def _check_ports_free(port: int, metrics_port: int) -> None:
    """Both ports free on 127.0.0.1 now.

    Raises:
        StoreServiceError: naming the option and the port, and how to choose another (a port
            free now is suggested).
    """
    for option, p in (("--port", port), ("--metrics-port", metrics_port)):
        try:
            check_port_free(p)
        except StoreServiceError as exc:
            try:
                hint = f" (e.g. {option} {find_free_ports(1)[0]}, free now)"
            except StoreServiceError:
                hint = ""
            raise StoreServiceError(f"{option} {p}: {exc}: another store or program listens there; "
                                    f"stop it or choose another port with {option} N{hint}") from None


def _check_workdir(work: Path) -> None:
    """Create ``work`` (with parents) and check this process can write its state and logs there.

    Raises:
        StoreServiceError: it is (or lies under) a file, or cannot be created or written (a
            read-only file system, permissions); the message names the path and ``--workdir``.
    """
    why = None
    try:
        work.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        why = "exists and is not a directory" if work.exists() else "lies under a file, not a directory"
    except OSError as exc:
        why = f"cannot be created ({'read-only file system' if exc.errno == errno.EROFS else exc.strerror})"
    if why is None:
        try:
            read_only = bool(os.statvfs(work).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        if read_only:
            why = "is on a read-only file system"
        elif not os.access(work, os.W_OK | os.X_OK):
            why = "is not writable by this user"
    if why is not None:
        raise StoreServiceError(f"store workdir {str(work)!r} {why}: it holds the store's state and logs; "
                                "choose another with --workdir DIR")


# ---------------------------------------------------------------------- start / stop


def start_store(port: int = 50051, metrics_port: int = 9003, segment_bytes: int = DEFAULT_SEGMENT_MB << 20,
                workdir: str | os.PathLike | None = None, timeout_s: float = 30.0) -> StoreHandle:
    """Start master and storage process on 127.0.0.1; return once a probe put/get succeeds.

    Raises:
        StoreServiceError: ``workdir`` cannot be created or written (a file, a read-only file
            system, permissions), a store is already running in ``workdir`` (its master
            answers; what is left of one whose master died is stopped first),
            a port is invalid, taken, or both ports are the same (the message names the
            option and the port), or a process failed to come up (the message quotes its log).
        MooncakeNotInstalled: the mooncake package is missing.
    """
    _check_port_numbers(port, metrics_port)
    try:
        work = Path(workdir) if workdir is not None else default_workdir(create=True)
    except OSError as exc:
        raise StoreServiceError(f"no store workdir of this user: {exc}") from None
    _check_workdir(work)
    old = read_state(work)
    if old is not None and alive(old.master_pid) and master_reachable(old.master, 0.5):
        raise StoreServiceError(f"a store is already running from {work} (master pid {old.master_pid}, "
                                f"storage pid {old.storage_pid}); stop it first")
    if old is not None and (alive(old.master_pid) or alive(old.storage_pid)):
        # Half a store (the master died: its objects are gone) is what `status` calls not running:
        # stop what is left of it and start afresh.
        log.warning("store in %s is not running (master pid %d %s); stopping what is left of it",
                    work, old.master_pid, "alive but not answering" if alive(old.master_pid) else "gone")
        stop_store(work, timeout_s=timeout_s)
    _check_ports_free(port, metrics_port)
    master = spawn_master(work, port, metrics_port)
    storage = None
    try:
        wait_for(lambda: serves(master, port), master, work / "master.log", timeout_s, "mooncake_master")
        storage = spawn_storage(work, port, segment_bytes)
        ready = work / "storage.ready"
        wait_for(ready.exists, storage, work / "storage.log", timeout_s, "storage process")
        handle = StoreHandle(str(work), port, metrics_port, segment_bytes, master.pid, storage.pid)
        _probe_in_subprocess(handle.master, work, timeout_s)
    except BaseException:
        for proc in (storage, master):
            if proc is not None:
                terminate(proc.pid, timeout_s=5.0)
        raise
    _write_state(work, handle)
    log.info("store running at %s (master pid %d, storage pid %d)", handle.url, master.pid, storage.pid)
    return handle


def stop_store(workdir: str | os.PathLike | None = None, timeout_s: float = 10.0) -> bool:
    """Stop the storage process, then the master (SIGTERM, SIGKILL after ``timeout_s``).

    Returns False if no store was recorded in ``workdir``.
    """
    work = Path(workdir) if workdir is not None else default_workdir()
    handle = read_state(work)
    if handle is None:
        return False
    terminate(handle.storage_pid, timeout_s, expect="hybridkv.store.mooncake.service")
    terminate(handle.master_pid, timeout_s, expect="mooncake_master")
    (work / STATE_FILE).unlink(missing_ok=True)
    (work / "storage.ready").unlink(missing_ok=True)
    return True


def kill_master(workdir: str | os.PathLike) -> StoreHandle:
    """SIGKILL the master (a crash: every object is forgotten); the storage process keeps running."""
    handle = _require_state(Path(workdir))
    if alive(handle.master_pid):
        terminate(handle.master_pid, timeout_s=0.0, expect="mooncake_master")
    return handle


def restart_master(workdir: str | os.PathLike, timeout_s: float = 30.0) -> StoreHandle:
    """Kill the master if it is running and start a new one on the same ports.

    The storage process remounts its segment on the new master by itself
    (within about a second); objects stored before are gone.
    """
    work = Path(workdir)
    handle = kill_master(work)
    deadline = time.monotonic() + timeout_s
    while True:  # the old master's ports may linger briefly
        try:
            check_port_free(handle.port)
            check_port_free(handle.metrics_port)
            break
        except StoreServiceError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    master = spawn_master(work, handle.port, handle.metrics_port)
    wait_for(lambda: serves(master, handle.port), master, work / "master.log", timeout_s, "mooncake_master")
    handle = StoreHandle(str(work), handle.port, handle.metrics_port, handle.segment_bytes, master.pid,
                         handle.storage_pid)
    _write_state(work, handle)
    return handle


def probe(master: str, timeout_s: float = 10.0) -> None:
    """Put, read back and remove one object through a fresh client; StoreUnavailable if that fails.

    Retries until ``timeout_s`` (a freshly mounted segment takes a moment to be usable).
    """
    key = f"hybridkv/probe/{os.getpid()}/{time.monotonic_ns()}"
    payload = key.encode() * 4
    deadline = time.monotonic() + timeout_s
    with MooncakeStore(master, retry_interval_s=0.0) as store:
        while True:
            try:
                if store.put([(key, payload)]) == [True] and store.get([key]) == [payload]:
                    store.remove([key])
                    return
                reason = "probe object was refused or not read back"
            except StoreUnavailable as exc:
                reason = str(exc)
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"store at {master} failed its probe: {reason}")
            time.sleep(0.2)


def _probe_in_subprocess(master: str, work: Path, timeout_s: float) -> None:
    """:func:`probe` in a child process under :func:`loopback_env` (this process never loads Mooncake)."""
    cmd = [sys.executable, "-m", "hybridkv.store.mooncake.service", "probe", "--master", master]
    try:
        done = subprocess.run(cmd, env=loopback_env(cache_dir=work), capture_output=True, text=True,
                              timeout=timeout_s + 10, check=False)
    except subprocess.TimeoutExpired:
        raise StoreServiceError(f"probe of {master} did not finish within {timeout_s + 10:g} s") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln[:1] not in "IWE" or not ln[1:5].isdigit()]
        raise StoreServiceError(f"probe of {master} failed:\n" + "\n".join(lines[-10:]))


def status(workdir: str | os.PathLike | None = None) -> dict:
    """What is recorded in ``workdir`` and whether it is alive (no Mooncake client is created)."""
    work = Path(workdir) if workdir is not None else default_workdir()
    handle = read_state(work)
    if handle is None:
        return {"running": False, "workdir": str(work)}
    info = asdict(handle) | {
        "url": handle.url,
        "master_alive": alive(handle.master_pid),
        "storage_alive": alive(handle.storage_pid),
        "master_reachable": master_reachable(handle.master, 0.5),
    }
    info["running"] = info["master_alive"] and info["storage_alive"] and info["master_reachable"]
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{handle.metrics_port}/metrics/summary", timeout=1.0) as r:
            text = r.read(8192).decode(errors="replace")
        info["summary"] = [part.strip().split("{")[-1] for part in text.split("|")
                           if any(word in part for word in ("Mem Storage", "Keys:", "Clients:"))]
    except OSError:
        info["summary"] = None
    return info


# ---------------------------------------------------------------------- state file


def read_state(work: Path) -> StoreHandle | None:
    """The handle recorded in ``work``, or None."""
    try:
        return StoreHandle(**json.loads((Path(work) / STATE_FILE).read_text()))
    except FileNotFoundError:
        return None


def _write_state(work: Path, handle: StoreHandle) -> None:
    tmp = work / f".{STATE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(handle), indent=1))
    os.replace(tmp, work / STATE_FILE)


def _require_state(work: Path) -> StoreHandle:
    handle = read_state(work)
    if handle is None:
        raise StoreServiceError(f"no store recorded in {work}")
    return handle


# ---------------------------------------------------------------------- storage process


def hold(master: str, segment_bytes: int, ready_file: str | None) -> int:
    """Mount ``segment_bytes`` on ``master`` and keep it until SIGTERM/SIGINT (the storage process)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    store = MooncakeStore(master, segment_bytes=segment_bytes, timeout_s=10.0)
    print(f"storage process {os.getpid()}: {segment_bytes} bytes mounted on {master}", flush=True)
    if ready_file:
        Path(ready_file).write_text(str(os.getpid()))
    while not stop.wait(1.0):
        pass
    store.close()  # unmounts cleanly while the master is up; never blocks on a dead one
    print(f"storage process {os.getpid()}: stopped", flush=True)
    return 0


# ---------------------------------------------------------------------- CLI


def register_cli(subparsers) -> None:
    """Add ``store start|stop|status`` to the ``hybridkv`` command's subparsers."""
    store = subparsers.add_parser("store", help="run a loopback Mooncake Store (master + storage process)",
                                  description="Start, stop or inspect a Mooncake Store bound to 127.0.0.1.")
    sub = store.add_subparsers(dest="store_command", required=True)
    for name, fn, text in (("start", cmd_start, "start master and storage process"),
                           ("stop", cmd_stop, "stop them by PID"),
                           ("status", cmd_status, "show PIDs, ports and liveness")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--port", type=int, default=50051, help="master RPC port (default 50051)")
        p.add_argument("--metrics-port", type=int, default=9003, help="master metrics port (default 9003)")
        p.add_argument("--segment-mb", type=int, default=DEFAULT_SEGMENT_MB,
                       help=f"memory of the storage process in MiB (default {DEFAULT_SEGMENT_MB}; at least 16, at most "
                            "the machine's memory)")
        p.add_argument("--workdir", default=None, help=f"state and logs (default {default_workdir()})")
        p.set_defaults(store_func=fn)


def cmd_start(args: argparse.Namespace) -> int:
    """``hybridkv store start``: exit 0 and print the store URL, or 2 with one ``error:`` line."""
    if args.segment_mb < 16:
        print(f"error: --segment-mb {args.segment_mb}: Mooncake needs at least 16", file=sys.stderr)
        return 2
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")     # bytes of this machine's memory
    if args.segment_mb << 20 > have:
        print(f"error: --segment-mb {args.segment_mb}: the storage process would hold "
              f"{args.segment_mb / 1024:.1f} GiB but this machine has {have / 2**30:.1f} GiB of memory",
              file=sys.stderr)
        return 2
    try:
        handle = start_store(args.port, args.metrics_port, args.segment_mb << 20, args.workdir)
    except (StoreServiceError, StoreUnavailable, MooncakeNotInstalled) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:      # e.g. the workdir turned unwritable while starting
        print(f"error: store start: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"store running: {handle.url}  (master pid {handle.master_pid}, storage pid {handle.storage_pid}, "
          f"{args.segment_mb} MiB, workdir {handle.workdir})")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """``hybridkv store stop``: exit 0 (also when nothing was running)."""
    work = args.workdir if args.workdir is not None else default_workdir()
    print("store stopped" if stop_store(work) else f"no store recorded in {work}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``hybridkv store status``: exit 0 when running, 1 otherwise."""
    info = status(args.workdir)
    if not info["running"] and "port" not in info:
        print(f"not running (nothing recorded in {info['workdir']})")
        return 1
    state = "running" if info["running"] else "NOT running"
    print(f"{state}: {info['url']}  master pid {info['master_pid']} alive={info['master_alive']} "
          f"reachable={info['master_reachable']}, storage pid {info['storage_pid']} alive={info['storage_alive']}, "
          f"segment {info['segment_bytes'] >> 20} MiB, workdir {info['workdir']}")
    if info["summary"]:
        print("  " + " | ".join(s.strip() for s in info["summary"]))
    return 0 if info["running"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridkv.store.mooncake.service``: ``hold`` (the storage process), ``probe``, or ``store …``."""
    parser = argparse.ArgumentParser(prog="python -m hybridkv.store.mooncake.service")
    sub = parser.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hold", help="be the storage process (used by start_store)")
    h.add_argument("--master", required=True)
    h.add_argument("--segment-bytes", type=int, required=True)
    h.add_argument("--ready-file", default=None)
    pr = sub.add_parser("probe", help="put, read back and remove one object (used by start_store)")
    pr.add_argument("--master", required=True)
    register_cli(sub)
    args = parser.parse_args(argv)
    if args.command == "hold":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return hold(args.master, args.segment_bytes, args.ready_file)
    if args.command == "probe":
        probe(args.master)
        return 0
    return args.store_func(args)


if __name__ == "__main__":
    sys.exit(main())
