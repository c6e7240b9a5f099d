"""`meshfl bench faults` reads views as a user would: a dead neighbour is no neighbour,
and a view counts as refilled only once every survivor has one again. (The benchmark's
100-node run itself takes minutes; these check how it reads a run.)"""

from __future__ import annotations

from meshfl.launch.bench.faults import DOWN_MARK, first_round_after, view_rounds
from meshfl.node.metrics import RoundRecord


def rounds_of(*neighbours: list[str]) -> list[RoundRecord]:
    return [RoundRecord(round=number, neighbours=each) for number, each in enumerate(neighbours, 1)]


def test_a_dead_neighbour_does_not_count_and_refilling_needs_every_survivor():
    survivors = {
        "a": rounds_of(["b", "c"], ["b", "dead"], ["b", "c"], ["b", "c"]),
        "b": rounds_of(["a", "c"], ["a", "dead"], ["a", "dead"], ["a", "c"]),
    }
    table = view_rounds(survivors, {"dead"}, full=2, rounds=4)
    assert [(each.full, each.mean_live) for each in table] == [
        (2, 2.0),
        (0, 1.0),
        (1, 1.5),
        (2, 2.0),
    ]
    assert first_round_after(table, 2, lambda each: each.full == each.survivors) == "2 (round 4)"
    assert first_round_after(table, 4, lambda each: True) == "never"


def test_a_survivor_that_stopped_recording_is_left_out_of_its_missing_rounds():
    survivors = {"a": rounds_of(["b"], ["b"]), "b": rounds_of(["a"])}
    table = view_rounds(survivors, set(), full=1, rounds=2)
    assert [each.survivors for each in table] == [2, 1]


def test_down_marks_name_the_peer_marked_down():
    line = (
        "2026-11-28 10:11:40,314 meshfl.endpoint node3: peer node7 (tcp://127.0.0.1:7001) is down"
    )
    match = DOWN_MARK.search(line)
    assert match is not None and match.group(1) == "node7"
