"""Session setup: the tiny real model, and a loopback-only process for the Mooncake tests."""

import importlib.util
import os
import sys

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run: CI results are reproducible.
settings.register_profile("hybridkv", derandomize=True)
settings.load_profile("hybridkv")

from hybridkv.model.model import HybridModel


def pytest_configure(config):
    """Restart pytest under the bind-to-loopback shim when Mooncake is installed.

    Mooncake clients (the tests create some in this process) open wildcard
    listeners; the preloaded shim keeps every one of them on 127.0.0.1 and only
    works from process start (docs/how-to/mooncake.md).
    """
    # Mooncake's native log stays on stderr (pytest captures it per test); the CLI's default of a
    # log file would point this process's descriptor 2 elsewhere (tests/store/test_mooncake.py
    # checks that default in a subprocess).
    os.environ.setdefault("HYBRIDKV_MOONCAKE_LOG", "")
    if importlib.util.find_spec("mooncake") is None:
        return
    from hybridkv.store.mooncake.loopback import reexec_under_loopback
    reexec_under_loopback(list(sys.orig_argv))


torch.set_num_threads(1)   # tiny shapes gain nothing from more; several threads collapse on a busy machine


@pytest.fixture(scope="session")
def tiny_model():
    """The ``tiny`` preset, seed 0, fp32 on CPU."""
    torch.manual_seed(0)
    return HybridModel.from_preset("tiny", seed=0).eval()
