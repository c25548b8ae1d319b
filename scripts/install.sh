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

apt_install() {
  apt-get install -y -q "$@" || { apt-get update -q; apt-get install -y -q "$@"; }
}

# libibverbs1: needed to import the Mooncake transfer engine (docs/DESIGN.md section 11).
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
  apt_install libibverbs1
fi

# gcc: builds the LD_PRELOAD library that keeps Mooncake's listeners on loopback (docs/mooncake.md).
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
