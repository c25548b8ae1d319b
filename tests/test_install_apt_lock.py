"""``scripts/install.sh`` waits for the apt/dpkg lock another process holds (bounded, saying so)
instead of failing at once with apt's exit 100. Runs the script's own apt helpers against the real
lock (held here with ``fcntl``, as dpkg does); needs root, apt-get and libibverbs1 installed (the
package the script installs first, so apt changes nothing)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = "/var/lib/dpkg/lock-frontend"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("apt-get") is None or not os.path.exists(LOCK)
    or subprocess.run(["dpkg", "-s", "libibverbs1"], capture_output=True).returncode != 0,
    reason="needs root, apt-get and libibverbs1 installed")


def _apt_install_with_lock_held(hold_s: float, wait_s: int) -> subprocess.CompletedProcess:
    """``apt_install libibverbs1`` from install.sh (its helpers sourced as written) while this
    process holds the dpkg frontend lock for ``hold_s`` seconds."""
    script = ("set -euo pipefail; source <(sed -n '/^APT_LOCK_WAIT=/,/^# libibverbs1/p' scripts/install.sh); "
              "apt_install libibverbs1")
    with open(LOCK, "r+") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        release = threading.Timer(hold_s, fcntl.lockf, (lock, fcntl.LOCK_UN))
        release.start()
        try:
            return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                                  env=os.environ | {"HYBRIDKV_APT_LOCK_WAIT": str(wait_s)})
        finally:
            release.cancel()


def test_install_waits_for_the_package_lock_and_says_so():
    """Lock held 1 s, wait up to 20 s: one message naming the lock and its holder, then success
    (before: ``E: Could not get lock``, exit 100 at once)."""
    done = _apt_install_with_lock_held(1.0, 20)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    waiting = [ln for ln in out.splitlines() if ln.startswith("install.sh: waiting for the package lock")]
    assert len(waiting) == 1 and "(up to 20 s" in waiting[0] and LOCK in waiting[0] and f"process {os.getpid()}" in waiting[0]
    assert "Waiting for cache lock" not in out                        # apt's once-a-second lines are folded


def test_install_gives_up_after_the_bound_with_a_clear_message():
    done = _apt_install_with_lock_held(4.0, 2)
    out = done.stdout + done.stderr
    assert done.returncode == 75, out
    assert "install.sh: the package lock is still held after 2 s" in out and "HYBRIDKV_APT_LOCK_WAIT" in out
