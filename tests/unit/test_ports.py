"""The test suite's ``MASTER_PORT`` helper (``tests/conftest.py``), which lets two pytest-xdist
workers run distributed tests side by side."""

from __future__ import annotations

import socket

from tests.conftest import _ephemeral_start, free_port, port_slice


def test_ports_come_from_this_workers_slice_below_the_ephemeral_range_and_are_free() -> None:
    """Negative control (run): the former ``bind(0)`` helper returns ports of the ephemeral
    range (32768 and up here), which the outgoing gloo connections of the other worker's
    tests draw from too -> the range assertion fails."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50, "a port came back within 50 draws"
    assert all(p < _ephemeral_start() for p in ports), ports
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_each_worker_has_a_slice_of_its_own() -> None:
    """Negative control (run): one slice for every worker (the index ignored) -> the
    disjointness assertion fails."""
    slices = [set(port_slice(f"gw{i}")) for i in range(8)]
    for i in range(8):
        for j in range(i + 1, 8):
            assert not slices[i] & slices[j], (i, j)
    assert all(max(s) < _ephemeral_start() for s in slices)
    assert port_slice("master") == port_slice("gw0")
