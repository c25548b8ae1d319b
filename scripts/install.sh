#!/usr/bin/env bash
# One-command install on a fresh Debian machine (as root, Python 3.11 as python3).
# Idempotent: safe to run again; it only adds what is missing. Shared first step of
# scripts/replay.sh and scripts/test.sh.
#
# Fast path: when a previous run completed with the same pyproject.toml and this
# script, and the system packages, .venv and every pinned/required distribution are
# still in place, it exits at once (well under a second). HYBRIDKV_FORCE_INSTALL=1
# skips the fast path and runs every step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive
STAMP=.venv/.hybridkv-install-stamp
want_stamp=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)

# Exit 0 when .venv already holds an editable hybridkv of this checkout, torch 2.13.0
# and every requirement of hybridkv[test,bench,mooncake,serve,docs] at a satisfying version.
venv_complete() {
  .venv/bin/python - "$PWD" <<'EOF' 2>/dev/null
import importlib.metadata as md, json, sys
from pathlib import Path
from pip._vendor.packaging.requirements import Requirement

root = Path(sys.argv[1]).resolve()
dist = md.distribution("hybridkv")
url = json.loads(dist.read_text("direct_url.json") or "{}")
if not url.get("dir_info", {}).get("editable") or url.get("url") != root.as_uri():
    sys.exit(1)
if md.version("torch").split("+")[0] != "2.13.0":
    sys.exit(1)
for spec in dist.requires or []:
    req = Requirement(spec)
    if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ("", "test", "bench", "mooncake", "serve", "docs")):
        continue
    if not req.specifier.contains(md.version(req.name), prereleases=True):
        sys.exit(1)
EOF
}

if [ -z "${HYBRIDKV_FORCE_INSTALL:-}" ] \
  && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] \
  && dpkg -s libibverbs1 >/dev/null 2>&1 && command -v cc >/dev/null 2>&1 \
  && [ -x .venv/bin/python ] && venv_complete; then
  exit 0
fi

# apt-get that waits for the package lock another process holds (unattended-upgrades, another
# install) instead of failing at once (exit 100): at most HYBRIDKV_APT_LOCK_WAIT seconds (default
# 300) over the whole script, saying so every 15 s (apt itself says it every second). Status 75
# when the lock was still held at the end.
APT_LOCK_WAIT=${HYBRIDKV_APT_LOCK_WAIT:-300}
apt_lock_deadline=
apt_get() {
  [ -n "$apt_lock_deadline" ] || apt_lock_deadline=$((SECONDS + APT_LOCK_WAIT))
  local left=$((apt_lock_deadline - SECONDS)) start=$SECONDS
  [ "$left" -gt 0 ] || left=1
  apt-get -o DPkg::Lock::Timeout="$left" "$@" 2>&1 | {
    said=-15 locked=0
    while IFS= read -r line; do
      case $line in
        "Waiting for cache lock"*)
          if [ $((SECONDS - said)) -ge 15 ]; then
            said=$SECONDS
            line=${line#Waiting for cache lock: }
            echo "install.sh: waiting for the package lock (up to ${left} s, $((SECONDS - start)) s so far): ${line%...}"
          fi ;;
        "E: Could not get lock"* | "E: Unable to acquire the dpkg frontend lock"* | "E: Unable to lock"*)
          printf '%s\n' "$line"
          [ "$locked" = 1 ] || echo "install.sh: the package lock is still held after ${left} s; run again once" \
                                    "that process is done (or wait longer: HYBRIDKV_APT_LOCK_WAIT=SECONDS)"
          locked=1 ;;
        *) printf '%s\n' "$line" ;;
      esac
    done
    [ "$locked" = 0 ] || exit 75
  }
}

apt_install() {
  local rc=0
  apt_get install -y -q "$@" || rc=$?
  [ "$rc" = 0 ] && return 0
  [ "$rc" = 75 ] && return 75       # the lock, not stale package lists: updating would not help
  apt_get update -q && apt_get install -y -q "$@"
}

# libibverbs1: needed to import the Mooncake transfer engine (docs/design/design.md section 11).
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
  apt_install libibverbs1
fi

# gcc: builds the LD_PRELOAD library that keeps Mooncake's listeners on loopback (docs/how-to/mooncake.md).
if ! command -v cc >/dev/null 2>&1; then
  apt_install gcc libc6-dev
fi

if [ ! -x .venv/bin/python ]; then
  # Debian's python3 needs python3-venv (ensurepip) to create a venv with pip.
  if ! "$PYTHON" -m venv .venv; then
    rm -rf .venv
    apt_install python3-venv
    "$PYTHON" -m venv .venv
  fi
fi

# torch first and pinned: 2.13.0 is the CPU build for these machines; any
# other spec lets pip pull a CUDA build of several GB.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test,bench,mooncake,serve,docs]'

venv_complete || { echo "install.sh: .venv is still missing requirements of hybridkv" >&2; exit 1; }
echo "$want_stamp" > "$STAMP"
