"""The launcher's port picking (services/launcher/servers.free_port): every service starts
at once, binding port 0 where it needs no fixed port, so a port the launcher hands a
sibling must not be one the kernel may give a port-0 bind meanwhile ("Address already in
use" at start-up, seen under bench/route.py)."""

from __future__ import annotations

import socket

from rtp_serve.services.launcher import servers
from rtp_serve.services.launcher.servers import free_port


def test_picked_ports_lie_below_the_ephemeral_range_that_port_0_binds_draw_from():
    low, high = servers._ephemeral_range()
    picked = {free_port() for _ in range(50)}
    assert all(10000 <= p < low for p in picked), sorted(picked)
    held = []
    try:
        for _ in range(200):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
            assert low <= s.getsockname()[1] <= high
            assert s.getsockname()[1] not in picked
    finally:
        for s in held:
            s.close()


def test_a_picked_port_can_be_bound():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
