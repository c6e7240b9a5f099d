"""A run's summary.json and the table `meshfl launch` ends with.

`write_summary` turns what the nodes wrote (read by run_folder.py) into the
run's summary: each node's last scores and how it ended, the mean over finished honest
nodes, and, where the rule and the partition record them, scores of what the rule
decided (grouping, peer ranking, Shapley values, influence: launch/measures.py has which
rule reports which) and what a round cost.
`print_table` shows it as the table `meshfl launch` ends with.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Collection
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod
from meshfl.node.coordinator import COORDINATOR
from meshfl.node.metrics import RoundRecord

from . import measures, run_folder

log = logging.getLogger("meshfl.launch")

FINISHED, FAILED = "finished", "failed"  # a node's status in summary.json


def failed_nodes(summary: dict[str, Any]) -> list[str]:
    """The names of the nodes the summary lists as not finished."""
    return [node["name"] for node in summary["nodes"] if node["status"] != FINISHED]


def honest_accuracies(nodes: list[dict[str, Any]], attackers: Collection[str]) -> list[float]:
    """Test accuracies of the finished nodes outside `attackers`. Failed nodes stopped
    early: their accuracies are of another round. An attacker's own scores say nothing
    of what the rule does for honest nodes."""
    return [
        node["test_acc"]
        for node in nodes
        if node["status"] == FINISHED
        and node["test_acc"] is not None
        and node["name"] not in attackers
    ]


def write_summary(
    cfg: cfgmod.MeshConfig, out: Path, outcomes: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Summarize the run in `out` and write summary.json. `outcomes` says how each node
    ended (supervise.py: SupervisedProcess.outcome); without it (a summary made again
    later) it is what the previous summary.json said, else judged by the rounds each
    node finished."""
    outcomes = outcomes or _recorded_outcomes(out)
    attackers = frozenset(cfg.attack.nodes)
    run = run_folder.read_run(out, [peer.name for peer in cfg.peers], attackers)
    history, coordinator = run.history, run.coordinator
    nodes = []
    for peer in cfg.peers:
        record = history[peer.name][-1] if history[peer.name] else None
        outcome = outcomes.get(peer.name) or _judged_by_rounds(record, cfg.rounds)
        data = run.data.get(peer.name) if record else run_folder.node_data(out, peer.name)
        nodes.append(_node_entry(peer.name, record, outcome, data or {}))
    decisions = measures.node_decisions(cfg.algorithm.name, history, coordinator)
    for node in nodes:
        if node["name"] in decisions:
            node["decision"] = decisions[node["name"]]
    if COORDINATOR in outcomes and outcomes[COORDINATOR]["status"] != FINISHED:
        nodes.append(
            {
                "name": COORDINATOR,
                "round": coordinator[-1].round if coordinator else 0,
                "test_acc": None,
                "val_acc": None,
                "n_train": None,
                "data": {},
                **outcomes[COORDINATOR],
            }
        )
    for node in nodes:
        if node["name"] in attackers:
            node["attacker"] = True
    accuracies = honest_accuracies(nodes, attackers)
    summary = {
        "algorithm": cfg.algorithm.name,
        "task": cfg.task,  # None: the built-in model and dataset
        # A task's data are its own: the config's dataset and partition go unread then.
        "dataset": None if cfg.task else cfg.data.dataset,
        "partition": None if cfg.task else cfg.data.partition,
        "rounds": cfg.rounds,
        "seed": cfg.seed,
        "nodes": nodes,
        "mean_test_acc": statistics.fmean(accuracies) if accuracies else None,
        "std_test_acc": statistics.pstdev(accuracies) if accuracies else None,
        "mean_over": f"{len(accuracies)} finished nodes of {len(nodes)}"
        + (f" ({len(attackers)} attackers left out)" if attackers else ""),
        "worst_test_acc": min(accuracies) if accuracies else None,
        **measures.rule_scores(cfg.algorithm.name, run),
        "cost": measures.ROUND_COSTS.compute(run),
    }
    _write_summary_file(out / "summary.json", summary)
    return summary


def _node_entry(
    name: str, record: RoundRecord | None, outcome: dict[str, Any], data: dict[str, Any]
) -> dict[str, Any]:
    """A node's line of the summary: its last round's scores (None before its first
    round) and how it ended."""
    last = record or RoundRecord(round=0)
    return {
        "name": name,
        "test_acc": last.test_acc,
        "val_acc": last.val_acc,
        "n_train": last.n_train,
        "round": last.round,
        "data": data,
        **outcome,
    }


def ran_every_round(record: RoundRecord | None, rounds: int) -> bool:
    """Whether a node whose last record is `record` finished a run of `rounds`: what
    counts, whatever became of its process afterwards."""
    return record is not None and record.round >= rounds


def _judged_by_rounds(record: RoundRecord | None, rounds: int) -> dict[str, Any]:
    return {"status": FINISHED if ran_every_round(record, rounds) else FAILED}


def _recorded_outcomes(out: Path) -> dict[str, dict[str, Any]]:
    """How each node ended, as a previous summary.json of `out` says ({} without one)."""
    try:
        nodes = json.loads((out / "summary.json").read_text())["nodes"]
        keys = ("status", "restarts", "ended", "last_error")
        return {
            node["name"]: {key: node[key] for key in keys if key in node}
            for node in nodes
            if "status" in node
        }
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _write_summary_file(path: Path, summary: dict[str, Any]) -> None:
    """Write summary.json whole or not at all; a full disk is one line, not a crash (the
    table still shows what it holds)."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.write_text(json.dumps(_as_json(summary), indent=2, allow_nan=False) + "\n")
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        log.warning("cannot write %s: %s", path, (error.strerror or str(error)).lower())


def _as_json(value: Any) -> Any:
    """`value` with every float that is not finite (the val loss of a model that
    diverged) as null: JSON has no NaN, and other readers of the file refuse one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json(item) for item in value]
    return value


def print_table(summary: dict[str, Any]) -> None:
    # The rule's decision per node (launch/decisions.py); no column for the baselines.
    decided = max((len(node.get("decision", "")) for node in summary["nodes"]), default=0)
    decision = f"  {'decision':<{decided}}" if decided else ""
    print(
        f"\n{'node':<12}{'rounds':>7}{'n_train':>9}{'val_acc':>9}{'test_acc':>10}{decision}  status"
    )
    for node in summary["nodes"]:
        decision = f"  {node.get('decision', '-'):<{decided}}" if decided else ""
        print(
            f"{node['name']:<12}{node['round']:>7}{_cell(node['n_train'], 9, 'd')}"
            f"{_cell(node['val_acc'], 9, '.3f')}{_cell(node['test_acc'], 10, '.3f')}"
            f"{decision}  {_status_cell(node)}"
        )
    if summary["mean_test_acc"] is not None:
        print(
            f"{'mean (std)':<37}{summary['mean_test_acc']:>7.3f} "
            f"({summary['std_test_acc']:.3f})  over {summary['mean_over']}"
        )
    else:
        print("mean: no node finished")
    for node in summary["nodes"]:
        if node.get("last_error"):
            print(f"{node['name']}: {node['last_error']}")


def _cell(value: float | int | None, width: int, form: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{form}}"


def _status_cell(node: dict[str, Any]) -> str:
    """ "finished", or "failed (SIGKILL)", with the restarts when there were any."""
    status = node["status"] + (f" ({node['ended']})" if node.get("ended") else "")
    restarts = node.get("restarts", 0)
    return status + (f", restarted {restarts}x" if restarts else "")
