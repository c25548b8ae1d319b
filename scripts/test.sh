#!/usr/bin/env bash
# The test suite: installs everything if needed (scripts/install.sh), then runs pytest
# from the repository root. Extra arguments go to pytest (paths relative to the root),
# e.g. `bash scripts/test.sh -q tests/replay/test_report.py`; default: `-q`, all tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
if [ "$#" -eq 0 ]; then
  set -- -q
fi
exec .venv/bin/python -m pytest "$@"
