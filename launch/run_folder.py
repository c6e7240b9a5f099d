"""A run folder read back: the one reader that the summary (summary.py), the rules'
scores (measures.py), `meshfl report`, the supervisor and the benches share.

A run folder holds what `meshfl launch`, `meshfl node` and the experiments write: per
node <node>/metrics.jsonl (a record per round) and <node>/info.json (its data facts),
the coordinator's metrics under coordinator/, and the run's config.yaml (`meshfl node`
writes none). Each reader forgives what a crash leaves behind: a missing or cut-short
file reads as nothing recorded, never as an error.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshfl.node import metrics
from meshfl.node.coordinator import COORDINATOR
from meshfl.node.metrics import CoordinatorRecord, Record, RoundRecord

log = logging.getLogger("meshfl.launch")

METRICS, INFO, CONFIG = "metrics.jsonl", "info.json", "config.yaml"

# A node's true cluster as its data facts name it, by partition: (key, word for it).
TRUTH_KEYS = (("true_cluster", "cluster"), ("group", "group"), ("domain", "domain"))

History = dict[str, list[RoundRecord]]  # node -> its metrics records, round by round


def node_records(node_folder: Path) -> list[RoundRecord]:
    """Every complete record of the node whose folder this is, by round ([] when there
    is none yet)."""
    return _by_round(metrics.read_records(node_folder / METRICS, RoundRecord))


def last_record(node_folder: Path) -> RoundRecord | None:
    """The last complete record of the node whose folder this is (None before its
    first), read from the file's end."""
    return metrics.last_record(node_folder / METRICS, RoundRecord)


def coordinator_records(folder: Path) -> list[CoordinatorRecord]:
    path = folder / COORDINATOR / METRICS
    return _by_round(metrics.read_records(path, CoordinatorRecord))


def node_data(folder: Path, node: str) -> dict[str, Any]:
    """A node's data facts (info.json "data"; {} when missing, or cut short by a crash:
    said once)."""
    path = folder / node / INFO
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("%s is unreadable (%s); its data facts are left out", path, error)
        return {}
    data = info.get("data", {}) if isinstance(info, dict) else {}
    return data if isinstance(data, dict) else {}


def run_config(folder: Path) -> dict[str, Any]:
    """The run's config.yaml as written ({} when there is none or it is unreadable)."""
    try:
        config = yaml.safe_load((folder / CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def recorded_nodes(folder: Path) -> list[str]:
    """The learners with a metrics file, node2 before node10."""
    names = (path.parent.name for path in folder.glob(f"*/{METRICS}"))
    return sorted((name for name in names if name != COORDINATOR), key=natural_order)


def natural_order(name: str) -> list[Any]:
    """node2 before node10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _by_round(records: list[Record]) -> list[Record]:
    return sorted(records, key=lambda record: record.round)


@dataclass(frozen=True)
class RunRecords:
    """What a run recorded, as the scores, the summary and the report read it."""

    history: History
    coordinator: list[CoordinatorRecord] = field(default_factory=list)
    # node -> its data facts (info.json "data"), for the nodes that finished a round
    data: dict[str, dict[str, Any]] = field(default_factory=dict)
    attackers: frozenset[str] = frozenset()
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml; {} without one
    folder: Path | None = None  # where it was read from; None for records made in memory

    @property
    def algorithm(self) -> str:
        algorithm = self.config.get("algorithm", "unknown")
        return algorithm.get("name", "unknown") if isinstance(algorithm, dict) else algorithm

    def node_rounds(self) -> Iterator[tuple[str, RoundRecord]]:
        """(node, record) for every complete round of every node."""
        for name, rounds in self.history.items():
            for record in rounds:
                yield name, record

    def fact(self, key: str) -> dict[str, Any]:
        """node -> its data fact `key` (true cluster, group, labels), where recorded."""
        return {name: data[key] for name, data in self.data.items() if key in data}

    def labels(self) -> dict[str, set[int]]:
        """The labels in each node's train split, where the partition recorded them."""
        return {name: set(labels) for name, labels in self.fact("labels").items()}

    def truth(self, node: str) -> tuple[str, Any] | None:
        """(what, value) of the node's true cluster, group or domain, if the data has one."""
        data = self.data.get(node, {})
        for key, word in TRUTH_KEYS:
            if data.get(key) is not None:
                return word, data[key]
        return None


def read_run(
    folder: Path, nodes: Iterable[str] | None = None, attackers: frozenset[str] = frozenset()
) -> RunRecords:
    """The run in `folder`: the records of `nodes` (by default every learner with a
    metrics file; a named node without one has none), the data facts of those that
    finished a round, the coordinator's records and the config."""
    names = list(nodes) if nodes is not None else recorded_nodes(folder)
    history = {name: node_records(folder / name) for name in names}
    return RunRecords(
        history,
        coordinator_records(folder),
        data={name: node_data(folder, name) for name, rounds in history.items() if rounds},
        attackers=attackers,
        config=run_config(folder),
        folder=folder,
    )
