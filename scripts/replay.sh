#!/usr/bin/env bash
# The main job: installs everything if needed (scripts/install.sh), then runs
# `hybridkv replay` on the bundled trace. Extra arguments go to `hybridkv replay`,
# e.g. `bash scripts/replay.sh --limit 5`; relative paths in them (--trace, --json)
# are taken from the directory you run it from.
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
bash scripts/install.sh
cd "$CALLER_DIR"
exec "$ROOT/.venv/bin/hybridkv" replay "$@"
