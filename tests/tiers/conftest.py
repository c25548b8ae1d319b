"""The byte stores the store-tier, connector and purge tests run over: memory, disk and a real
Mooncake master on 127.0.0.1 (started once per session, only when a ``mooncake`` case is collected;
those cases skip where the Mooncake client is not importable)."""

from __future__ import annotations

import uuid

import pytest
from tier_helpers import PrefixedStore

from hybridkv.store.disk import DiskStore
from hybridkv.store.memory import MemoryStore


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory):
    """``(handle, client)``: a mooncake_master with 256 MiB of segment, its client; stopped by PID at the end.

    Raises:
        pytest.skip.Exception: the Mooncake client cannot be imported here.
    """
    from hybridkv.store.mooncake.support import MooncakeNotInstalled, load_client_class

    try:
        load_client_class()
    except MooncakeNotInstalled as exc:
        pytest.skip(f"Mooncake not importable: {exc}")
    from hybridkv.store.mooncake import procs, service
    from hybridkv.store.mooncake.client import MooncakeStore

    work = tmp_path_factory.mktemp("mc-tiers")
    port, metrics = procs.find_free_ports(2)
    handle = service.start_store(port, metrics, 256 << 20, work)
    client = MooncakeStore(handle.master)
    yield handle, client
    client.close()
    service.stop_store(handle.workdir)


@pytest.fixture(params=["memory", "disk", "mooncake"])
def store(request, tmp_path):
    """A fresh byte store of each backend; the Mooncake one is the shared master under a key prefix
    of its own (``PrefixedStore``), so tests never see each other's objects."""
    if request.param == "memory":
        yield MemoryStore()
    elif request.param == "disk":
        s = DiskStore(tmp_path / "store")
        yield s
        s.close()
    else:
        _, client = request.getfixturevalue("mooncake")
        yield PrefixedStore(client, f"t{uuid.uuid4().hex[:8]}/")
