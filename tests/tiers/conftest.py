"""The byte stores the store-tier and connector tests run over: memory and disk (Mooncake has its own module)."""

from __future__ import annotations

import pytest

from hybridkv.store.disk import DiskStore
from hybridkv.store.memory import MemoryStore


@pytest.fixture(params=["memory", "disk"])
def store(request, tmp_path):
    if request.param == "memory":
        yield MemoryStore()
    else:
        s = DiskStore(tmp_path / "store")
        yield s
        s.close()
