"""Loopback Mooncake stores on free ports for the store tests, which skip when Mooncake cannot be imported."""

from __future__ import annotations

import pytest

from hybridkv.store.mooncake.support import MooncakeNotInstalled, load_client_class

MiB = 1 << 20


def require_mooncake(*, allow_module_level: bool = False) -> None:
    """Skip the test (or the whole module) when the Mooncake client cannot be imported."""
    try:
        load_client_class()
    except MooncakeNotInstalled as exc:
        pytest.skip(f"Mooncake not importable: {exc}", allow_module_level=allow_module_level)


def start(tmp_path_factory, segment_mb: int):
    """A store (master + storage process) of ``segment_mb`` MiB on free ports, drawn again if another
    process takes one first; stop it with ``service.stop_store(handle.workdir)``."""
    from hybridkv.store.mooncake import procs, service  # needs mooncake

    work = tmp_path_factory.mktemp("mooncake")
    for attempt in range(3):
        port, metrics_port = procs.find_free_ports(2)
        try:
            return service.start_store(port, metrics_port, segment_mb * MiB, work)
        except procs.StoreServiceError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")
