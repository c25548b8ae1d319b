"""``hybridkv --version`` and ``hybridkv.__version__`` report the installed distribution's version."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import hybridkv
from hybridkv.cli import main

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _pyproject_version() -> str:
    return tomllib.loads(PYPROJECT.read_text())["project"]["version"]


def test_dunder_version_is_the_distribution_metadata():
    assert re.fullmatch(r"\d+\.\d+\.\d+", hybridkv.__version__), hybridkv.__version__
    assert hybridkv.__version__ == importlib.metadata.version("hybridkv") == _pyproject_version()


def test_cli_version_flag_prints_and_exits_zero(capsys):
    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    else:
        raise AssertionError("hybridkv --version did not exit")
    assert capsys.readouterr().out.strip() == f"hybridkv {_pyproject_version()}"


def test_cli_version_in_a_fresh_process():
    """The installed command's process prints exactly one line: ``hybridkv X.Y.Z``."""
    done = subprocess.run([sys.executable, "-m", "hybridkv.cli", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"hybridkv {_pyproject_version()}\n"
