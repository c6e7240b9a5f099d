"""The ports a launcher picks for its nodes (protocol/ports.py): free, below the range
the OS lends outgoing connections, and not handed out twice while a node may still be
about to bind one, by this launcher or another on the machine."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from meshfl.protocol import ports
from meshfl.protocol.errors import UserError
from meshfl.protocol.ports import ephemeral_ports_start, free_ports

pytestmark = pytest.mark.sockets  # real ports, bound and probed


def test_picked_ports_differ_lie_below_the_ephemeral_range_and_are_free():
    # Below the range the OS lends outgoing connections, so the dialling of a mesh's
    # first nodes cannot take a port a later node is about to bind; never handed twice,
    # so two meshes started one after the other cannot share one.
    first, second = free_ports(50), free_ports(50)
    picked = first + second
    assert len(set(picked)) == len(picked)
    assert all(port < ephemeral_ports_start() for port in picked)
    for port in picked:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))


def test_two_launchers_at_once_are_never_handed_one_port(tmp_path, monkeypatch):
    # A port stays free to a probe until its node binds it, so only the claims keep two
    # launchers started together (processes: neither's memory knows the other's) off
    # each other's ports. Without them, two draws of 3,000 from 12,768 share about 700.
    asks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from pathlib import Path; from meshfl.protocol import ports;"
                f" ports.CLAIMS_DIR = Path({str(tmp_path)!r}); print(*ports.free_ports(3000))",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    first, second = ({int(port) for port in ask.communicate(timeout=60)[0].split()} for ask in asks)
    assert len(first) == len(second) == 3000
    assert not first & second


def only_1000_ports(monkeypatch, claims):
    """Ports picked from 1,000 only, no claim made yet, here or in `claims`."""
    lowest = ports.LOWEST_PICKED_PORT + 5000
    monkeypatch.setattr(ports, "CLAIMS_DIR", claims)
    monkeypatch.setattr(ports, "_claimed_here", {})
    monkeypatch.setattr(ports, "LOWEST_PICKED_PORT", lowest)
    monkeypatch.setattr(ports, "ephemeral_ports_start", lambda: lowest + 1000)


def test_a_launcher_that_cannot_have_enough_ports_claims_none(tmp_path, monkeypatch):
    only_1000_ports(monkeypatch, tmp_path)
    with pytest.raises(UserError, match="listening ports are free"):
        free_ports(2000)
    assert len(free_ports(900)) == 900, "the failed ask left its ports to others"


def test_a_port_is_handed_out_again_only_once_its_node_had_time_to_bind_it(tmp_path, monkeypatch):
    # 1,000 ports to pick from, each handed out at most once within HANDED_OUT_S: a
    # second mesh of 900 does not fit, until the first mesh's ports are old enough.
    only_1000_ports(monkeypatch, tmp_path)
    first = free_ports(900)
    with pytest.raises(UserError, match="listening ports are free"):
        free_ports(900)
    monkeypatch.setattr(ports, "HANDED_OUT_S", 0.0)
    assert set(free_ports(900)) & set(first)
