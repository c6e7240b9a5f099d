"""`meshfl bench faults` reads views as a user would: a dead neighbour is no neighbour,
and a view counts as refilled only once every survivor has one again. (The benchmark's
100-node run itself takes minutes; these check how it reads a run.)"""

from __future__ import annotations

import argparse
import json
import os

from meshfl.launch.bench.faults import (
    DOWN_MARK,
    _listed_hosts,
    _problem_with,
    each_refilled,
    first_round_after,
    skipped_after,
    view_rounds,
)
from meshfl.node.metrics import RoundRecord


def rounds_of(*views: tuple[list[str], list[str]]) -> list[RoundRecord]:
    """A node's records, from each round's neighbours when it began and ended."""
    return [
        RoundRecord(round=number, neighbours=start, neighbours_at_end=end)
        for number, (start, end) in enumerate(views, 1)
    ]


def test_a_dead_neighbour_does_not_count_and_refilling_needs_every_survivor():
    survivors = {
        "a": rounds_of((["b", "c"],) * 2, (["b", "dead"], ["b", "c"]), (["c"], ["b", "c"])),
        "b": rounds_of((["a", "c"],) * 2, (["a", "dead"],) * 2, (["a"], ["a", "c"])),
    }
    table = view_rounds(survivors, {"dead"}, full=2, rounds=3)
    assert [(e.full_at_start, e.mean_at_start, e.full_at_end) for e in table] == [
        (2, 2.0, 2),
        (0, 1.0, 1),
        (0, 1.0, 2),
    ]
    assert first_round_after(table, 1, lambda e: e.full_at_end == e.survivors) == "2 (round 3)"
    assert first_round_after(table, 3, lambda each: True) == "never"
    # a's view was full again at the end of round 2, b's at the end of round 3.
    assert each_refilled(survivors, {"dead"}, full=2, killed_in=1) == "2 (round 3)"


def test_each_survivor_counts_as_refilled_in_its_own_round():
    # a is full again at the end of round 2, b at the start of round 3, never together.
    survivors = {
        "a": rounds_of((["b", "c"],) * 2, (["b"], ["b", "c"]), (["b"], ["b"])),
        "b": rounds_of((["a", "c"],) * 2, (["a"], ["a"]), (["a", "c"], ["a"])),
    }
    assert each_refilled(survivors, set(), full=2, killed_in=1) == "2 (round 3)"
    table = view_rounds(survivors, set(), full=2, rounds=3)
    assert first_round_after(table, 1, lambda e: e.full_at_end == e.survivors) == "never"
    assert first_round_after(table, 1, lambda e: e.full_at_start == e.survivors) == "never"
    assert each_refilled(survivors, set(), full=3, killed_in=1) == "never"


def test_a_survivor_that_stopped_recording_is_left_out_of_its_missing_rounds():
    survivors = {"a": rounds_of((["b"], ["b"]), (["b"], ["b"])), "b": rounds_of((["a"], ["a"]))}
    table = view_rounds(survivors, set(), full=1, rounds=2)
    assert [each.survivors for each in table] == [2, 1]


def test_a_survivor_that_skipped_a_round_after_the_kill_is_named():
    # Killed in round 3: c skipped round 4 and d the kill's own; a skipped round 1 (the
    # start's), b stopped recording and e recorded nothing, which is no skip.
    kept = {"a": (2, 3, 4, 5), "b": (1, 2, 3), "c": (1, 2, 3, 5), "d": (1, 2, 4, 5), "e": ()}
    survivors = {name: [RoundRecord(round=r) for r in rounds] for name, rounds in kept.items()}
    assert skipped_after(survivors, killed_in=3) == ["c", "d"]


def test_down_marks_name_the_peer_marked_down():
    line = (
        "2026-11-28 10:11:40,314 meshfl.endpoint node3: peer node7 (tcp://127.0.0.1:7001) is down"
    )
    match = DOWN_MARK.search(line)
    assert match is not None and match.group(1) == "node7"


def flags(**given):
    defaults = dict(nodes=100, hosts=10, kill=2, at=3, rounds=10, assignments=[], keep=None)
    return argparse.Namespace(**{**defaults, **given})


def test_flags_that_cannot_measure_a_fault_of_bounded_views_are_refused(tmp_path):
    assert _problem_with(flags()) is None
    assert "--at 1" in _problem_with(flags(at=1)), "the kill would come before round 1 began"
    assert "--at 10" in _problem_with(flags(at=10))
    assert "--kill 10" in _problem_with(flags(kill=10))
    assert "full mesh" in _problem_with(flags(nodes=20))
    assert _problem_with(flags(nodes=20, assignments=["topology.neighbours=4"])) is None
    (tmp_path / "run").mkdir()
    assert "holds a run" in _problem_with(flags(keep=str(tmp_path))), "its old pids are no targets"


def test_only_the_hosts_listed_by_this_launch_are_targets(tmp_path):
    hosts = [
        {"label": "host0", "pid": 11, "nodes": ["node0", "node1"]},
        {"label": "coordinator", "pid": 12, "nodes": ["coordinator"]},
    ]
    listing = tmp_path / "processes.json"
    listing.write_text(json.dumps({"launcher": os.getpid(), "processes": hosts}))
    assert [host["label"] for host in _listed_hosts(tmp_path, os.getpid())] == ["host0"]
    assert _listed_hosts(tmp_path, os.getpid() + 1) == [], "an earlier launch's listing"
    listing.unlink()
    assert _listed_hosts(tmp_path, os.getpid()) == [], "not written yet"
