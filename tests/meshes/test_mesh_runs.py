"""Real node processes on loopback: FedAvg agreement, crash and resume, a late joiner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.nodes import (
    meshfl,
    records,
    run_nodes,
    start_node,
    stop,
    wait_round,
    wait_until,
    write_config,
)
from tests.spawn import run_to_end

pytestmark = pytest.mark.slow  # real processes over real sockets


def final_model(out, name):
    return torch.load(out / name / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_fedavg_round_over_full_mesh_leaves_every_node_with_the_same_model(tmp_path, compression):
    config = tmp_path / "peers.yaml"
    # The paper's FedAvg: screening (on by default) lets each node keep its own model
    # where the average validates worse, and the models would differ.
    write_config(
        config,
        3,
        rounds=2,
        algorithm={"name": "fedavg", "screen": False},
        compression=compression,
    )
    run_nodes(config, tmp_path, 3, timeout=90)
    last = [records(tmp_path, f"node{i}")[-1] for i in range(3)]
    for record in last:
        assert record["round"] == 2
        assert len(record["received"]) == 2, "every node aggregated the whole mesh"
        assert sum(record["weights"].values()) == pytest.approx(1.0)
        # What the round cost, by thread: the node's own work, its endpoint's beside it
        # (that one counted, test_thread_cpu.py; here, that the round records it).
        assert record["cpu_seconds"]["node"] > 0
        if sys.platform.startswith("linux"):
            assert "endpoint" in record["cpu_seconds"]
    models = [final_model(tmp_path, f"node{i}") for i in range(3)]
    float_bytes = sum(tensor.numel() * 4 for tensor in models[0].values())
    share = 1.0 if compression == "none" else 0.27  # int8: a byte a value, a scale per 128
    assert all(record["published_bytes"] <= share * float_bytes for record in last)
    for model in models[1:]:
        for key, tensor in models[0].items():
            if compression == "none":  # float32 as it is: every node computes the same bits
                assert torch.equal(tensor, model[key]), key
            else:  # each node averages its own model with its peers' as int8 rounded them
                rounding = float(tensor.abs().max()) / 127
                assert torch.allclose(tensor, model[key], rtol=0, atol=rounding), key


def test_a_fresh_mesh_waits_for_a_listed_peer_that_starts_late(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(config, 3, rounds=2, round_timeout=60.0)
    processes = [start_node(config, f"node{i}", tmp_path) for i in range(2)]
    try:
        # node0 and node1 have met and could start round 1 without node2.
        wait_until(lambda: "node1 joined" in log_of(tmp_path, "node0"), 60, "node1 to join")
        processes.append(start_node(config, "node2", tmp_path))
        for process in processes:
            assert process.wait(timeout=90) == 0
    finally:
        stop(processes)
    first = records(tmp_path, "node0")[0]
    assert first["round"] == 1 and first["received"] == ["node1", "node2"]


def log_of(out, name):
    path = out / name / "node.log"
    return path.read_text() if path.exists() else ""


def test_rerunning_a_finished_node_changes_nothing_and_exits_at_once(tmp_path):
    config = tmp_path / "peers.yaml"
    write_config(config, 2, rounds=2, round_timeout=90.0)
    processes = [start_node(config, f"node{i}", tmp_path) for i in range(2)]
    try:
        for process in processes:
            assert process.wait(timeout=90) == 0
        before = records(tmp_path, "node0")
        processes.append(start_node(config, "node0", tmp_path))
        # Well within the round timeout: it does not wait for node1, which is gone.
        assert processes[-1].wait(timeout=60) == 0
    finally:
        stop(processes)
    assert records(tmp_path, "node0") == before
    assert "already finished its 2 rounds" in (tmp_path / "node0" / "node.log").read_text()


def test_a_killed_node_resumes_from_its_checkpoint_while_the_others_finish(tmp_path):
    config = tmp_path / "peers.yaml"
    # The resumed node waits a round timeout for peers that have finished, then trains alone.
    write_config(config, 3, rounds=12, local_epochs=15, round_timeout=3.0)
    processes = [start_node(config, f"node{i}", tmp_path) for i in range(3)]
    try:
        wait_round(tmp_path, "node2", 3, timeout=90)
        os.killpg(processes[2].pid, signal.SIGKILL)
        processes[2].wait(timeout=10)
        killed_at = records(tmp_path, "node2")[-1]["round"]
        for process in processes[:2]:
            assert process.wait(timeout=120) == 0, "the others finish on their deadlines"
        processes[2] = start_node(config, "node2", tmp_path)
        assert processes[2].wait(timeout=90) == 0
    finally:
        stop(processes)
    for name in ("node0", "node1"):
        rounds = records(tmp_path, name)
        assert [r["round"] for r in rounds] == list(range(1, 13))
        assert "node2" not in rounds[-1]["received"]
    resumed = records(tmp_path, "node2")
    assert [r["round"] for r in resumed] == list(range(1, 13)), "no round lost or repeated"
    log = (tmp_path / "node2" / "node.log").read_text()
    # A round's metrics line is written just before its checkpoint: a kill between the two
    # resumes from the round before (and the metrics are rewound to it, as checked above).
    assert any(
        f"resumed from the checkpoint of round {r}" in log for r in (killed_at, killed_at - 1)
    )


def test_a_fifth_node_joining_mid_run_takes_part_in_the_next_rounds(tmp_path):
    # Rounds without end, stopped once the joiner has taken part: on a fast machine a
    # 20-round mesh ended while the joiner was still importing torch.
    config = tmp_path / "peers.yaml"
    cfg = write_config(config, 4, rounds=100_000)
    for peer in cfg["peers"]:  # rounds slow enough to join, without taking the joiner's CPU
        peer["train_delay"] = 0.5
    config.write_text(yaml.safe_dump(cfg))
    others = {"node0", "node1", "node2", "node3"}
    processes = [start_node(config, name, tmp_path) for name in sorted(others)]
    try:
        wait_round(tmp_path, "node0", 2, timeout=90)
        joiner = meshfl(
            "join",
            cfg["peers"][1]["listen"],
            "--config",
            str(config),
            "--name",
            "late",
            "--out",
            str(tmp_path),
            log=tmp_path / "late.log",
        )
        processes.append(joiner)

        def since_joining() -> tuple[list[dict], list[dict]]:
            """The joiner's rounds, and node0's rounds after the joiner's first."""
            joined = records(tmp_path, "late")
            first = joined[0]["round"] if joined else float("inf")
            return joined, [r for r in records(tmp_path, "node0") if r["round"] > first]

        def took_part_in_two_rounds() -> bool:  # on both sides
            joined, later = since_joining()
            full = [r for r in joined if set(r.get("received", [])) == others]
            # Not every later round: on a loaded machine a round may start while node0
            # has the joiner marked down, and goes on without it, as it should.
            learned_from_joiner = [r for r in later if "late" in r.get("received", [])]
            return len(full) >= 2 and len(learned_from_joiner) >= 2

        wait_until(took_part_in_two_rounds, 120, "the joiner and node0 to share two rounds")
        joined, _ = since_joining()
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        stop(processes)
    assert joined[0]["round"] > 1, "the joiner starts at the mesh's round"
    info = json.loads((tmp_path / "late" / "info.json").read_text())
    hint = (
        f"late: joined; the next node can join with: meshfl join "
        f"{info['public_key']}@{info['listen']} --config"
    )
    assert hint in (tmp_path / "late.log").read_text()


def test_meshfl_launch_with_the_same_seed_gives_the_same_accuracies(tmp_path):
    def launch(out: Path, hash_seed: str) -> tuple[list[float], float]:
        flags = ["--nodes", "3", "--rounds", "2", "--samples-per-node", "150", "--seed", "7"]
        ran = run_to_end(
            ["launch", *flags, "--quiet", "--out", str(out)], timeout=180, hash_seed=hash_seed
        )
        assert ran.returncode == 0, ran.stderr
        summary = json.loads((out / "summary.json").read_text())
        return [node["test_acc"] for node in summary["nodes"]], summary["mean_test_acc"]

    # Under different string-hashing seeds, as two fresh interpreters would mostly be.
    assert launch(tmp_path / "first", "1") == launch(tmp_path / "second", "2")


def launch_quietly(*flags: str) -> subprocess.CompletedProcess:
    return run_to_end(["launch", "--quiet", *flags], timeout=180)


def test_launch_with_only_the_run_folder_resumes_the_run_with_its_own_config(tmp_path):
    """And refuses a flag that changes what the run's checkpoints hold."""
    run = tmp_path / "run"
    first = launch_quietly(
        *("--nodes", "2", "--rounds", "2", "--samples-per-node", "150", "--seed", "3"),
        *("--set", "lr=0.1", "--out", str(run)),
    )
    assert first.returncode == 0, first.stderr
    before = yaml.safe_load((run / "config.yaml").read_text())

    more = launch_quietly("--out", str(run), "--rounds", "3")
    assert more.returncode == 0, more.stderr
    assert f"meshfl: resuming {run} with its config.yaml" in more.stdout
    after = yaml.safe_load((run / "config.yaml").read_text())
    assert after == {**before, "rounds": 3}  # same peers, ports, seed, lr: only rounds changed
    for name in ("node0", "node1"):
        assert [record["round"] for record in records(run, name)] == [1, 2, 3]
        assert "resumed from the checkpoint of round 2" in log_of(run, name)

    other_count = launch_quietly("--out", str(run), "--nodes", "3")
    assert other_count.returncode == 2
    assert "--nodes: got 3; the run in" in other_count.stderr

    # Another rule, or other data, would meet checkpoints made by this one: refused in
    # one line, before the run's config or summary is touched.
    kept = {name: (run / name).read_bytes() for name in ("config.yaml", "summary.json")}
    for flags, line in [
        (("--algorithm", "pfedsv"), "algorithm.name: got 'pfedsv'; the run in"),
        (("--dataset", "mnist"), "data.dataset: got 'mnist'; the run in"),
        (("--set", "seed=4"), "seed: got 4; the run in"),
    ]:
        changed = launch_quietly("--out", str(run), *flags)
        assert changed.returncode == 2, flags
        assert line in changed.stderr
    # A config of its own for the folder is the user's choice, but its nodes still
    # resume from what they saved.
    edited = tmp_path / "edited.yaml"
    edited.write_text((run / "config.yaml").read_text().replace("name: mlp", "name: cnn"))
    another_model = launch_quietly("--config", str(edited), "--out", str(run))
    assert another_model.returncode == 2
    assert "model.name: got 'cnn'; the run in" in another_model.stderr
    assert {name: (run / name).read_bytes() for name in kept} == kept


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_launch_says_how_to_resume_it(tmp_path, signum, code):
    run = tmp_path / "run"
    log = tmp_path / "launch.log"
    # A background job (tests run by a script with `&`) starts with SIGINT ignored, and
    # an ignored signal stays ignored in its children: the launch gets Python's default.
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch = meshfl("launch", "--nodes", "2", "--rounds", "500", "--out", str(run), log=log)
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        wait_round(run, "node0", 1, timeout=120)
        os.killpg(launch.pid, signum)  # the nodes have sessions of their own: launch alone
        assert launch.wait(timeout=60) == code
    finally:
        stop([launch])
    last = log.read_text().strip().splitlines()[-1]
    assert last == f"meshfl: stopped; resume with: meshfl launch --out {run}"
