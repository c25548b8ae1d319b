"""Port checks of the loopback store service (no Mooncake needed)."""

from __future__ import annotations

import pytest

from hybridkv.store.mooncake.procs import StoreServiceError, check_port_free


@pytest.mark.parametrize("port", [0, -1, 65536, 99999])
def test_a_port_outside_1_65535_is_named_not_an_overflow(port):
    with pytest.raises(StoreServiceError, match=f"port {port} is not a TCP port"):
        check_port_free(port)
