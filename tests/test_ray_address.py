"""`parse --ray HOST:PORT` checks that the head answers before ray.init, which would retry an
address where nothing listens for minutes (it looked like a hang). Runs without Ray installed:
the check is a plain TCP connect."""
from __future__ import annotations

import socket
import time

import pytest

from fastdeploy_ext.parsing.ray_cluster import check_reachable


def test_a_listening_head_passes_and_a_closed_port_is_a_clear_error_at_once():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        check_reachable(f"127.0.0.1:{port}")
        check_reachable(f"ray://127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"--ray 127.0.0.1:{port}: nothing answers there .*ray start --head"):
        check_reachable(f"127.0.0.1:{port}")                 # closed now: refused at once
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("bad", ["headnode", "10.0.0.5:", ":6379", "10.0.0.5:port"])
def test_an_address_without_host_and_port_is_named(bad):
    with pytest.raises(ValueError, match="not a HOST:PORT address"):
        check_reachable(bad)

