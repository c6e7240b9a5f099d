"""`round_quorum` over real endpoints on loopback: a round waits for that share of its
live peers (rounded up), not for every one; at 1.0 it waits for all (test_round_collect)."""

from __future__ import annotations

import time

import pytest

from tests.node.test_round_collect import DEADLINE, Wanted, collector
from tests.node.test_round_collect import mesh_with_a_silent_peer as mesh_with_a_silent_peer
from tests.protocol.endpoints import make_endpoint as make_endpoint  # the fixture


@pytest.mark.parametrize("quorum", [0.5, 0.3])
def test_a_quorum_below_one_goes_on_without_the_peer_that_never_delivers(
    mesh_with_a_silent_peer, quorum
):
    mesh = mesh_with_a_silent_peer  # two live peers: one publishes, one stays silent
    started = time.monotonic()
    blobs = collector(mesh.puller, Wanted(False)).exchange.collect(
        1, {"model"}, mesh.origins, started + DEADLINE, quorum=quorum
    )
    assert set(blobs["model"]) == {"publisher"}
    assert time.monotonic() - started < DEADLINE / 2, "it waited for the silent peer"


def test_a_quorum_rounds_up(mesh_with_a_silent_peer):
    mesh = mesh_with_a_silent_peer  # 0.51 of two peers is both of them
    started = time.monotonic()
    collector(mesh.puller, Wanted(False)).exchange.collect(
        1, {"model"}, mesh.origins, started + DEADLINE, quorum=0.51
    )
    assert time.monotonic() - started >= DEADLINE - 0.1
