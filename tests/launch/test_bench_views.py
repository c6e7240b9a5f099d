"""`meshfl bench views` reads how long a round waited for its candidates on trial: the
time their blobs came after the last of the other neighbours' (each round's
transport_fetches). (The benchmark's 100-node runs take minutes; this checks how it
reads a round.)"""

from __future__ import annotations

from meshfl.launch.bench.views import cpu_by_thread, run_order, trial_wait
from meshfl.node.metrics import RoundRecord


def fetched(*came: tuple[str, float]) -> list[dict]:
    return [{"origin": origin, "kind": "model", "seconds": seconds} for origin, seconds in came]


def test_a_round_waited_for_its_candidates_only_past_its_other_neighbours():
    held = RoundRecord(
        round=2, tried=["new"], transport_fetches=fetched(("old", 1.0), ("new", 2.5))
    )
    assert trial_wait(held) == 1.5
    early = RoundRecord(
        round=2, tried=["new"], transport_fetches=fetched(("old", 3.0), ("new", 0.5))
    )
    assert trial_wait(early) == 0.0, "a candidate whose model came first held nothing"
    alone = RoundRecord(round=2, tried=["new"], transport_fetches=fetched(("new", 0.8)))
    assert trial_wait(alone) == 0.8, "with no other neighbour, the whole wait was the candidate's"
    settled = RoundRecord(round=2, tried=[], transport_fetches=fetched(("old", 4.0)))
    assert trial_wait(settled) == 0.0


def test_a_runs_cpu_is_summed_by_thread_over_its_node_rounds():
    rows = [
        RoundRecord(round=1, cpu_seconds={"node": 1.5, "endpoint": 0.25}),
        RoundRecord(round=2, cpu_seconds={"node": 0.5, "endpoint": 0.25}),
        RoundRecord(round=2, cpu_seconds={"node": 1.0}),  # a system without thread counters
        RoundRecord(round=3),  # a record from before the counters
    ]
    assert cpu_by_thread(rows) == {"node": 3.0, "endpoint": 0.5}


def test_neither_selection_always_runs_first():
    orders = [run_order(repeat) for repeat in range(4)]
    assert orders == [("benefit", "random"), ("random", "benefit")] * 2
