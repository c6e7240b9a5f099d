"""What a node may dial and tell others to dial (protocol/addresses.py): ZeroMQ TCP
endpoints only, one spelling per socket, IP addresses only on the wire, and the groups
a bounded view limits."""

from __future__ import annotations

import socket

import pytest

from meshfl.protocol.addresses import is_wire_endpoint, network_group, resolved, tcp_endpoint


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("tcp://127.0.0.1:7700", ("127.0.0.1", 7700)),
        ("tcp://localhost:7700", ("127.0.0.1", 7700)),  # the loopback's name: one socket
        ("tcp://LAB-Machine.local:80", ("lab-machine.local", 80)),
        ("tcp://[0:0:0:0:0:0:0:1]:9", ("[::1]", 9)),  # one spelling of an IPv6 address
        ("tcp://127.0.0.1:0", None),
        ("tcp://127.0.0.1:65536", None),
        ("ipc:///tmp/socket", None),  # ZeroMQ would take it; a node dials TCP only
        ("inproc://x", None),
        ("tcp://*:7700", None),
        ("tcp://-bad-.example:1", None),
        ("tcp://300.1.1.1:1", None),
        ("tcp://127.0.0.1", None),
        (7700, None),
        ("tcp://" + "a" * 300 + ":1", None),
    ],
)
def test_a_node_dials_tcp_endpoints_only_each_in_one_spelling(address, endpoint):
    assert tcp_endpoint(address) == endpoint


def test_messages_may_name_ip_addresses_only():
    assert is_wire_endpoint("tcp://10.0.0.7:7700")
    assert is_wire_endpoint("tcp://[2001:db8::1]:7700")
    # A hostname would be resolved on ZeroMQ's one I/O thread, stalling every socket.
    assert not is_wire_endpoint("tcp://example.org:7700")
    assert not is_wire_endpoint(b"tcp://10.0.0.7:7700")


def test_a_node_tells_others_an_ip_address_and_leaves_what_does_not_resolve(monkeypatch):
    answers = {
        "node-a.lan": (socket.AF_INET, ("10.1.2.3", 7700)),
        "node-b.lan": (socket.AF_INET6, ("fd00::7", 7700, 0, 0)),
    }

    def getaddrinfo(host, port, type=0):  # a resolver that knows two LAN names
        if host not in answers:
            raise socket.gaierror(host)
        family, sockaddr = answers[host]
        return [(family, type, 6, "", sockaddr)]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert resolved("tcp://node-a.lan:7700") == "tcp://10.1.2.3:7700"
    assert resolved("tcp://node-b.lan:7700") == "tcp://[fd00::7]:7700"
    assert resolved("tcp://10.0.0.7:7700") == "tcp://10.0.0.7:7700"
    # A node listening on localhost tells its peers an address they will dial.
    assert resolved("tcp://localhost:7700") == "tcp://127.0.0.1:7700"
    assert resolved("tcp://no-such-host.lan:7700") == "tcp://no-such-host.lan:7700"


@pytest.mark.parametrize(
    ("address", "auto", "network"),
    [
        ("tcp://8.8.4.7:5000", "8.8.4.0/24", "8.8.4.0/24"),
        ("tcp://192.168.1.7:5000", "tcp://192.168.1.7:5000", "192.168.1.0/24"),  # a LAN
        ("tcp://[::ffff:8.8.4.7]:5000", "8.8.4.0/24", "8.8.4.0/24"),  # IPv4 as IPv6
        ("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5000", "127.0.0.0/24"),  # one machine
        ("tcp://[2a00:1450:4001::5]:7", "2a00:1450:4001::/48", "2a00:1450:4001::/48"),
        ("tcp://[::1]:7", "tcp://[::1]:7", "::/48"),
    ],
)
def test_addresses_group_by_network_on_the_internet_and_not_on_a_lan(address, auto, network):
    assert network_group(address) == auto
    assert network_group(address, "network") == network
    assert network_group(address, "port") == address
