"""How `meshfl launch` decides what to restart and how each node ended, with stand-in
processes (the real ones are in test_mesh_faults.py): restarts run only the nodes of a
failed process that had not finished, a process that fails last is still restarted,
and a node that ran every round finished whatever became of its process."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from meshfl.launch import supervise as supervise_module
from meshfl.launch.run_folder import last_record
from meshfl.launch.supervise import Progress, SupervisedProcess, supervise
from meshfl.node.host import record_restarts, restarts_so_far

ROUNDS = 5


class Stopped:
    """A process that has already exited with `code`."""

    def __init__(self, code: int, pid: int = 1) -> None:
        self.code, self.pid = code, pid

    def poll(self) -> int:
        return self.code


def ran_rounds(out: Path, name: str, rounds: int) -> None:
    (out / name).mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"round": r, "node": name}) for r in range(1, rounds + 1)]
    (out / name / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def test_a_failed_host_restarts_only_its_unfinished_nodes_and_counts_them(tmp_path):
    ran_rounds(tmp_path, "a", ROUNDS)  # finished before its host died
    ran_rounds(tmp_path, "b", 2)
    host = SupervisedProcess("host0", ["a", "b"], Stopped(-9))
    started: list[list[str]] = []

    def start(names: list[str]) -> Stopped:
        started.append(names)
        return Stopped(0)

    supervise([host], start, restarts=1, out=tmp_path, rounds=ROUNDS, quiet=True)
    assert started == [["b"]]
    assert host.node_restarts == {"b": 1} and host.restarts == 1
    assert host.outcome("a", tmp_path, ROUNDS) == {"status": "finished", "restarts": 0}
    assert host.outcome("b", tmp_path, ROUNDS) == {"status": "finished", "restarts": 1}


def test_a_process_that_fails_after_all_others_exited_is_still_restarted(tmp_path):
    ran_rounds(tmp_path, "a", ROUNDS)
    ran_rounds(tmp_path, "b", 1)
    done = SupervisedProcess("a", ["a"], Stopped(0))
    last = SupervisedProcess("b", ["b"], Stopped(1))  # everything has exited already
    started: list[list[str]] = []

    def start(names: list[str]) -> Stopped:
        started.append(names)
        return Stopped(0)

    supervise([done, last], start, restarts=2, out=tmp_path, rounds=ROUNDS, quiet=True)
    assert started == [["b"]]


def test_a_node_that_ran_every_round_finished_even_if_its_process_was_killed_after(tmp_path):
    ran_rounds(tmp_path, "a", ROUNDS)
    ran_rounds(tmp_path, "b", 3)
    alone = SupervisedProcess("a", ["a"], Stopped(-9))
    cut_short = SupervisedProcess("b", ["b"], Stopped(-9))
    assert alone.outcome("a", tmp_path, ROUNDS)["status"] == "finished"
    failed = cut_short.outcome("b", tmp_path, ROUNDS)
    assert failed["status"] == "failed" and failed["ended"] == "SIGKILL"


def test_a_process_whose_nodes_all_finished_is_not_restarted_again_and_again(tmp_path):
    ran_rounds(tmp_path, "a", ROUNDS)
    host = SupervisedProcess("host0", ["a"], Stopped(-9))
    started: list[list[str]] = []
    supervise([host], started.append, restarts=3, out=tmp_path, rounds=ROUNDS, quiet=True)
    assert started == [] and host.running == []
    assert host.outcome("a", tmp_path, ROUNDS) == {"status": "finished", "restarts": 0}


def test_a_stop_ends_supervision_at_once_and_restarts_nothing(tmp_path):
    """A Ray machine's actor stops its hosts this way (ray_hosts.RayMachine.stop)."""
    ran_rounds(tmp_path, "a", 2)
    host = SupervisedProcess("host0", ["a"], Stopped(-15))  # ended by the stop's SIGTERM
    started: list[list[str]] = []
    stopping = threading.Event()
    stopping.set()
    supervise([host], started.append, 3, tmp_path, ROUNDS, quiet=True, stopping=stopping)
    assert started == [] and host.restarts == 0


def test_restarts_a_host_made_itself_count_against_the_budget_and_in_the_summary(tmp_path):
    ran_rounds(tmp_path, "a", ROUNDS)
    ran_rounds(tmp_path, "b", 2)
    record_restarts(tmp_path / "a", 1)  # its host restarted it once, then it finished
    record_restarts(tmp_path / "b", 1)  # and b once, which failed again for good
    host = SupervisedProcess("host0", ["a", "b"], Stopped(3))
    started: list[list[str]] = []
    supervise([host], started.append, restarts=1, out=tmp_path, rounds=ROUNDS, quiet=True)
    assert started == [], "b had its one restart, in its host"
    assert host.outcome("a", tmp_path, ROUNDS) == {"status": "finished", "restarts": 1}
    assert host.outcome("b", tmp_path, ROUNDS)["restarts"] == 1


def test_a_restart_by_launch_is_counted_where_the_host_counts_on_from(tmp_path):
    ran_rounds(tmp_path, "b", 2)
    host = SupervisedProcess("host0", ["b"], Stopped(-9))
    supervise([host], lambda names: Stopped(0), restarts=2, out=tmp_path, rounds=ROUNDS, quiet=True)
    assert restarts_so_far(tmp_path / "b") == 1


def reads_counted(monkeypatch) -> list[str]:
    """The node folders whose last record the progress line parses, in order."""
    reads: list[str] = []

    def counted(folder: Path):
        reads.append(folder.name)
        return last_record(folder)

    monkeypatch.setattr(supervise_module, "last_record", counted)
    return reads


def test_progress_says_the_round_every_node_finished_reading_only_files_that_grew(
    tmp_path, capsys, monkeypatch
):
    reads = reads_counted(monkeypatch)
    ran_rounds(tmp_path, "a", 2)
    ran_rounds(tmp_path, "b", 1)
    progress = Progress(tmp_path, ROUNDS, quiet=False)
    progress.show(["a", "b", "not-started"])
    assert capsys.readouterr().out == ""  # a node that wrote nothing yet holds it at 0
    progress.show(["a", "b"])
    assert capsys.readouterr().out == f"  round 1/{ROUNDS} done by every running node\n"
    assert reads == ["a", "b"]  # each parsed once: neither file grew since
    ran_rounds(tmp_path, "b", 3)
    progress.show(["a", "b"])
    assert capsys.readouterr().out == f"  round 2/{ROUNDS} done by every running node\n"
    assert reads == ["a", "b", "b"]


def test_a_quiet_launch_reads_no_record_for_progress(tmp_path, capsys, monkeypatch):
    reads = reads_counted(monkeypatch)
    ran_rounds(tmp_path, "a", 2)
    Progress(tmp_path, ROUNDS, quiet=True).show(["a"])
    assert capsys.readouterr().out == "" and reads == []
