"""`meshfl bench sybil`: the mesh it builds and what it reads from a run's records."""

from __future__ import annotations

from meshfl.launch.bench.sybil import comebacks, round_takes, sybil_mesh
from meshfl.launch.run_folder import RunRecords
from meshfl.node.metrics import RoundRecord
from meshfl.protocol.addresses import network_group


def test_honest_nodes_get_a_network_each_and_sybils_share_few_addresses():
    cfg = sybil_mesh([], honest=3, sybils=5, addresses=2, noise=0.01)
    honest = [peer for peer in cfg.peers if peer.name.startswith("node")]
    sybils = [peer for peer in cfg.peers if peer.name.startswith("sybil")]
    assert len(honest) == 3 and len(sybils) == 5
    assert len({network_group(peer.listen, "network") for peer in honest}) == 3
    assert len({network_group(peer.listen, "ip") for peer in sybils}) == 2
    assert {network_group(p.listen, "network") for p in sybils}.isdisjoint(
        network_group(p.listen, "network") for p in honest
    )
    assert len({peer.listen for peer in cfg.peers}) == 8, "every node a port of its own"
    assert cfg.attack.kind == "relay:0.01" and cfg.attack.nodes == [p.name for p in sybils]
    assert cfg.topology.group_by == "network" and cfg.topology.select == "benefit"
    alone = sybil_mesh([], honest=3, sybils=0, addresses=2, noise=0.01)
    assert len(alone.peers) == 3 and alone.attack.kind == "" and not alone.attack.nodes


def test_a_rounds_take_counts_sybil_places_the_worst_node_and_sybil_weight():
    def record(node, view, weights):
        return RoundRecord(round=2, node=node, neighbours_at_end=view, weights=weights)

    sybils = [f"s{index}" for index in range(1, 7)]
    run = RunRecords(
        history={
            "a": [record("a", ["b", "s1", "s2", "c"], {"a": 0.5, "s1": 0.5})],
            "b": [record("b", ["a", "c", "d", "e"], {"b": 1.0})],
            # More honest neighbours than a, a smaller share of them: the worst node.
            "c": [record("c", ["a", "b", "d", *sybils], {"c": 1.0})],
            "s1": [record("s1", ["a"], {})],
        },
        attackers=frozenset(sybils),
    )
    (take,) = round_takes(run)
    assert take.sybil_places == 8 / 17
    assert (take.worst_node, take.worst_honest, take.worst_of) == ("c", 3, 9)
    assert take.sybil_weight == 0.5 / 3


def test_a_restarted_nodes_comeback_counts_its_anchors_and_rounds_to_a_full_honest_view():
    def record(number, began, ended, anchors=None):
        return RoundRecord(round=number, neighbours=began, neighbours_at_end=ended, anchors=anchors)

    history = [
        record(3, ["b", "c"], ["b", "c"], anchors=["b", "c"]),  # its last checkpoint
        record(4, ["b", "s1"], ["b", "s1"]),  # back with one anchor, and a Sybil
        record(5, ["b", "s1"], ["b", "d"]),  # ends full (2 places here) and honest
        record(6, ["b", "d"], ["b", "d"]),
    ]
    run = RunRecords(history={"a": history}, attackers=frozenset({"s1"}))
    (line,) = comebacks(run, {"a": 3}, neighbours=2)
    assert line == (
        "a (died in round 4): 1 of its 2 anchors among the neighbours it began round 4 "
        "with; first full honest view at the end of round 5"
    )
    (never,) = comebacks(run, {"a": 5}, neighbours=3)
    assert never.endswith("no full honest view again")
    skipped = RunRecords(history={"a": [history[0], *history[2:]]}, attackers=frozenset({"s1"}))
    (late,) = comebacks(skipped, {"a": 3}, neighbours=2)
    assert "1 of its 2 anchors among the neighbours it began round 5 with" in late
