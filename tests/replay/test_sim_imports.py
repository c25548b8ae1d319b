"""A simulated replay imports no torch: its
engines, tiers and pools keep bookkeeping only, and importing torch cost each run about a
CPU second of start-up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHILD = """
import json, sys
from hybridkv.cli import main
sys.argv = ["hybridkv", "replay", "--simulate", "--no-progress", "--limit", "40", "--json", sys.argv[1]] + sys.argv[2:]
try:
    main()
except SystemExit as exc:
    if exc.code:
        raise
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


@pytest.mark.parametrize("extra", [[], ["--timed", "--instances", "4", "--router", "hybrid"],
                                   ["--model", "deepseek-v4-flash", "--swa-recovery", "recompute", "--timed",
                                    "--instances", "2"]],
                         ids=["untimed", "timed4", "v4-timed2"])
def test_simulated_replay_imports_no_torch(tmp_path, extra):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-c", _CHILD, str(out), *extra], capture_output=True, text=True,
                         check=True)
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
    assert json.loads(out.read_text())["requests"] == 40      # the replay itself ran
