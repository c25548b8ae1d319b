"""Processes and ports of the loopback store (:mod:`hybridkv.store.mooncake.service`).

Finding and spawning ``mooncake_master`` and the storage process on
127.0.0.1, waiting for them to come up, finding free ports, and telling
whether a PID still runs and stopping it. Nothing here loads Mooncake or
reads the state file. :mod:`hybridkv.store.mooncake.service` uses these to run the
store; other code imports them from this module.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hybridkv.store.mooncake.loopback import LOOPBACK, listen_addresses, loopback_env
from hybridkv.store.mooncake.support import INSTALL_HINT, MooncakeNotInstalled


class StoreServiceError(RuntimeError):
    """The store service could not be started or stopped; the message says why (and where the log is)."""


# ---------------------------------------------------------------------- spawning


def master_binary() -> str:
    """The ``mooncake_master`` executable shipped inside the mooncake package.

    Raises:
        MooncakeNotInstalled: the package (or its ``mooncake_master``) is missing.
    """
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeNotInstalled(INSTALL_HINT)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "mooncake_master"
        if path.is_file():
            return str(path)
    raise MooncakeNotInstalled(f"{INSTALL_HINT} [no mooncake_master binary in the mooncake package]")


def spawn_master(work: Path, port: int, metrics_port: int) -> subprocess.Popen:
    """Start a bare ``mooncake_master`` on 127.0.0.1 (log: ``work/master.log``); the caller stops it by PID."""
    cmd = [master_binary(), f"--rpc_address={LOOPBACK}", f"--rpc_port={port}", f"--metrics_host={LOOPBACK}",
           f"--metrics_port={metrics_port}", "--enable_http_metadata_server=false"]
    with open(work / "master.log", "ab") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=work,
                                env=loopback_env(cache_dir=work), start_new_session=True)


def spawn_storage(work: Path, port: int, segment_bytes: int) -> subprocess.Popen:
    """Start the storage process (``python -m hybridkv.store.mooncake.service hold``) for the master on ``port``.

    It mounts ``segment_bytes`` bytes and creates ``work/storage.ready`` once
    mounted (removed here first); log: ``work/storage.log``. The caller stops it by PID.
    """
    ready = work / "storage.ready"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "hybridkv.store.mooncake.service", "hold", "--master", f"{LOOPBACK}:{port}",
           "--segment-bytes", str(segment_bytes), "--ready-file", str(ready)]
    with open(work / "storage.log", "ab") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=work,
                                env=loopback_env(cache_dir=work), start_new_session=True)


def wait_for(ready, proc: subprocess.Popen, logfile: Path, timeout_s: float, what: str) -> None:
    """Poll ``ready()`` until true; StoreServiceError (quoting the log) if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise StoreServiceError(f"{what} exited with status {proc.returncode}; log {logfile}:\n{_tail(logfile)}")
        if time.monotonic() > deadline:
            raise StoreServiceError(f"{what} not ready after {timeout_s:g} s; log {logfile}:\n{_tail(logfile)}")
        time.sleep(0.05)


def serves(proc: subprocess.Popen, port: int) -> bool:
    """Whether ``proc`` itself listens on ``port`` (another process holding the port does not count)."""
    return proc.poll() is None and any(p == port for _, p in listen_addresses(proc.pid))


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------- ports


def find_free_ports(n: int, low: int = 20000, high: int = 32000) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1, drawn at random below the kernel's ephemeral range.

    Ports from ``bind(0)`` come from the ephemeral range, where outgoing
    connections may take them again before the master binds them.
    """
    ports: list[int] = []
    for port in random.sample(range(low, high), k=min(high - low, 50 * n)):
        try:
            check_port_free(port)
        except StoreServiceError:
            continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise StoreServiceError(f"no {n} free ports in [{low}, {high}) on {LOOPBACK}")


def check_port_free(port: int) -> None:
    """StoreServiceError unless a server could bind ``port`` on 127.0.0.1 now (``port`` in [1, 65535])."""
    if not 0 < port <= 65535:
        raise StoreServiceError(f"port {port} is not a TCP port (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
        try:
            s.bind((LOOPBACK, port))
        except OSError as exc:
            raise StoreServiceError(f"port {port} on {LOOPBACK} is not free ({exc.strerror})") from None


# ---------------------------------------------------------------------- PIDs


def alive(pid: int) -> bool:
    """Whether ``pid`` runs; a finished zombie counts as gone (and is reaped if it is our child).

    The main thread of a multi-threaded process turns zombie before the other
    threads have finished exiting, and its sockets stay open until they have:
    such a process still counts as running.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state != "Z" or len(os.listdir(f"/proc/{pid}/task")) > 1:
            return True
    except (OSError, IndexError):
        return False
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def terminate(pid: int, timeout_s: float, expect: str | None = None) -> None:
    """SIGTERM ``pid`` (SIGKILL at once when ``timeout_s`` is 0), SIGKILL after ``timeout_s``; wait until gone.

    With ``expect``, a PID whose command line lacks that text is left alone
    (the recorded process is gone and the PID was reused).
    """
    if not alive(pid) or (expect is not None and expect not in _cmdline(pid)):
        return
    os.kill(pid, signal.SIGTERM if timeout_s > 0 else signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)
