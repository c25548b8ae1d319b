#!/usr/bin/env bash
# One-command install on a fresh Debian machine (as root, Python 3.11 as python3).
# Idempotent: safe to run again; it only adds what is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive

# libibverbs1: needed to import the Mooncake transfer engine (docs/DESIGN.md section 11).
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
  if ! apt-get install -y -q libibverbs1; then
    apt-get update -q
    apt-get install -y -q libibverbs1
  fi
fi

# gcc: builds the LD_PRELOAD library that keeps Mooncake's listeners on loopback (docs/mooncake.md).
if ! command -v cc >/dev/null 2>&1; then
  apt-get install -y -q gcc libc6-dev || { apt-get update -q; apt-get install -y -q gcc libc6-dev; }
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi

# torch first and pinned: 2.13.0 is the CPU build for these machines; any
# other spec lets pip pull a CUDA build of several GB.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test,bench,mooncake]'
