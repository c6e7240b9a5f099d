"""A correctly signed peer whose tensors lie, on a live mesh of real processes: every
honest node finishes every round and counts each lie under its refusal reason, whether
the lie is gossiped as a model or uploaded to a coordinator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.nodes import free_ports, meshfl, records, start_node, stop, write_config
from tests.rogue_peer import MUTATIONS, mutation_of

pytestmark = pytest.mark.slow

# Every lie twice: under load a round may close before the rogue's blob arrived, so a
# round may see none; each lie must still be seen and refused at least once.
ROUNDS = 2 * len(MUTATIONS)
ROGUE = "node3"
HONEST = ["node0", "node1", "node2"]


def start_rogue(config: Path, out: Path) -> subprocess.Popen:
    (out / ROGUE).mkdir(parents=True, exist_ok=True)
    log = open(out / ROGUE / "node.log", "ab")
    return subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).parents[1] / "rogue_peer.py"),
            str(config),
            ROGUE,
            str(out),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=Path(__file__).parents[2],
    )


def run(processes: list[subprocess.Popen], honest: list[subprocess.Popen]) -> None:
    try:
        for process in honest:
            assert process.wait(timeout=180) == 0, "an honest node did not finish cleanly"
    finally:
        stop(processes)


DECODER_DROPS = {lie for lie, reason in MUTATIONS.items() if reason == "shape_mismatch"}


def refused_lies(records: list[dict], refused_of) -> set[str]:
    """The lies refused over a run; every record refused the rogue's blob of its round
    under that lie's reason, or saw no blob of it at all (the decoder's drops count as
    rejections: the last record must show them)."""
    seen = set()
    for record in records:
        lie = mutation_of(record["round"])
        if lie in DECODER_DROPS and record.get("rejections", {}).get("shape_mismatch"):
            seen.add(lie)
        if record["refusals"]:
            assert record["refusals"] == {MUTATIONS[lie]: 1}, record
            assert refused_of(record) == [ROGUE], record
            seen.add(lie)
        else:
            assert not refused_of(record), record
    return seen


def test_honest_peers_refuse_every_lie_and_finish_every_round(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(config, 4, rounds=ROUNDS, round_timeout=20.0)
    honest = [start_node(config, name, tmp_path) for name in HONEST]
    rogue = start_rogue(config, tmp_path)
    run([*honest, rogue], honest)
    for name in HONEST:
        lines = records(tmp_path, name)
        assert [r["round"] for r in lines] == list(range(1, ROUNDS + 1)), name
        assert all(ROGUE not in record["weights"] for record in lines)
        assert refused_lies(lines, lambda r: r["refused"].get("model", [])) == set(MUTATIONS)
        assert "Traceback" not in (tmp_path / name / "node.log").read_text()


def test_a_coordinator_refuses_every_lying_upload_and_its_clients_finish(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(
        config,
        4,
        rounds=ROUNDS,
        round_timeout=20.0,
        algorithm={"name": "fedavg_server"},
        coordinator=f"tcp://127.0.0.1:{free_ports(1)[0]}",
    )
    (tmp_path / "coordinator").mkdir()
    coordinator = meshfl(
        "coordinator",
        "--config",
        str(config),
        "--out",
        str(tmp_path),
        log=tmp_path / "coordinator" / "node.log",
    )
    honest = [start_node(config, name, tmp_path) for name in HONEST]
    rogue = start_rogue(config, tmp_path)
    run([coordinator, *honest, rogue], [coordinator, *honest])
    rounds = records(tmp_path, "coordinator")
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert refused_lies(rounds, lambda r: r["refused"]) == set(MUTATIONS)
    assert all(set(HONEST) <= set(record["uploaded"]) for record in rounds)
    # An upload whose frames the decoder dropped is refused at once, not waited for.
    dropped = [r for r in rounds if mutation_of(r["round"]) in DECODER_DROPS]
    assert dropped and all(r["refused"] == [ROGUE] for r in dropped)
    assert all(r["seconds"]["wait"] < 20.0 for r in dropped)
    for name in HONEST:
        assert [r["round"] for r in records(tmp_path, name)] == list(range(1, ROUNDS + 1))
