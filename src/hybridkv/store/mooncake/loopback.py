"""Keep Mooncake's listeners on loopback (docs/how-to/mooncake.md, "Loopback only").

Mooncake clients open their handshake and data listeners on the wildcard
address whatever ``MC_TCP_BIND_ADDRESS`` says. A 25-line ``LD_PRELOAD``
library, built here with the system C compiler, rewrites wildcard ``bind()``
calls to 127.0.0.1 / ::ffff:127.0.0.1. It only works from process start, so
processes that load Mooncake are started (or re-exec themselves) under
:func:`loopback_env`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

from hybridkv.store.mooncake.support import LOOPBACK_SHIM_NAME
from hybridkv.store.userdirs import user_cache_dir

log = logging.getLogger("hybridkv.store")

LOOPBACK = "127.0.0.1"


def _default_cache_dir() -> Path:
    """This user's :func:`~hybridkv.store.userdirs.user_cache_dir` (``~/.cache/hybridkv``): where
    the shim is built (never a directory another user could put a library in)."""
    return user_cache_dir(create=True)


_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
/* Rewrite wildcard binds (0.0.0.0, ::) to loopback (127.0.0.1, ::ffff:127.0.0.1). */
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn next_bind;
    if (!next_bind) next_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a4 = *(const struct sockaddr_in *)addr;
        if (a4.sin_addr.s_addr == htonl(INADDR_ANY)) a4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        return next_bind(fd, (const struct sockaddr *)&a4, sizeof a4);
    }
    if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a6 = *(const struct sockaddr_in6 *)addr;
        if (IN6_IS_ADDR_UNSPECIFIED(&a6.sin6_addr)) {
            static const unsigned char mapped[16] = {0,0,0,0, 0,0,0,0, 0,0,0xff,0xff, 127,0,0,1};
            memcpy(&a6.sin6_addr, mapped, sizeof mapped);
        }
        return next_bind(fd, (const struct sockaddr *)&a6, sizeof a6);
    }
    return next_bind(fd, addr, len);
}
"""

_shim_lock = threading.Lock()


def loopback_shim(cache_dir: str | os.PathLike | None = None) -> str | None:
    """Path of the bind-to-loopback ``LD_PRELOAD`` library, built on first use; None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: Mooncake processes will listen on all interfaces, not only loopback")
        return None
    digest = hashlib.sha256(_SHIM_SOURCE.encode()).hexdigest()[:12]
    out = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    lib = out / f"{LOOPBACK_SHIM_NAME}-{digest}.so"
    with _shim_lock:
        if not lib.exists():
            src = out / f"{LOOPBACK_SHIM_NAME}-{digest}.c"
            src.write_text(_SHIM_SOURCE)
            tmp = out / f".{lib.name}.{os.getpid()}"
            done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src), "-ldl"],
                                  check=False, capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("building %s failed: %s", lib, done.stderr.strip()[-500:])
                return None
            os.replace(tmp, lib)
    return str(lib)


def loopback_env(base: dict | None = None, cache_dir: str | os.PathLike | None = None) -> dict:
    """Environment for a process that loads Mooncake: loopback bind address, fast setup failure, shim preloaded."""
    env = dict(os.environ if base is None else base)
    env["MC_TCP_BIND_ADDRESS"] = LOOPBACK
    env.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    shim = loopback_shim(cache_dir)
    if shim is not None and shim not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(x for x in (shim, env.get("LD_PRELOAD", "")) if x)
    return env


def reexec_under_loopback(argv: list[str]) -> None:
    """Replace this process with ``argv`` under :func:`loopback_env`, unless already there.

    Mooncake clients open wildcard listeners whatever ``MC_TCP_BIND_ADDRESS``
    says; the preloaded shim rebinds them to 127.0.0.1, and it only takes
    effect from process start. Returns without doing anything when the shim is
    already loaded or cannot be built (then one warning was logged).
    """
    if LOOPBACK_SHIM_NAME in os.environ.get("LD_PRELOAD", ""):
        return
    env = loopback_env()
    if LOOPBACK_SHIM_NAME not in env.get("LD_PRELOAD", ""):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def listen_addresses(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket ``pid`` listens on, read from /proc."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = cols[1].split(":")
            raw = bytes.fromhex(addr_hex)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # 32-bit words, host order
            found.append((socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw),
                          int(port_hex, 16)))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 or an IPv4-mapped loopback address."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


