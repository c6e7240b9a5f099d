"""The metrics record: the line a node appends to <node>/metrics.jsonl per round.

`RoundRecord` is a learner's round (a gossip peer's, or a coordinated client's, which
leaves the peer-only fields unset); `CoordinatorRecord` is the coordinator's round.
A writer builds one with keyword arguments and appends `to_json()`; a reader gets them
back with `read_records`. Lines outlive versions, so both directions are lenient:

* a field left unset (None) is left out of the line, so a line holds what its role
  records, and a line written before a field existed reads back with its default;
* a key this version does not know (written by a newer one) is kept in `extra` and
  written back, not dropped.

Only the round is required: without it a line cannot be placed and reads as damaged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

Record = TypeVar("Record", bound="_Round")


@dataclass
class _Round:
    """What every role records of a round."""

    round: int
    diagnostics: dict[str, Any] = field(default_factory=dict)  # the rule's own (ALGORITHMS.md)
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds it took
    bytes_in: int | None = None  # received during the round
    bytes_out: int | None = None  # sent during the round
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> messages, since start
    refusals: dict[str, int] = field(default_factory=dict)  # reason -> blobs refused this round
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object: every field that is set, then the unknown keys."""
        known = {
            item.name: getattr(self, item.name) for item in fields(self) if item.name != "extra"
        }
        return {**{key: value for key, value in known.items() if value is not None}, **self.extra}

    @classmethod
    def from_json(cls: type[Record], line: Any) -> Record:
        """The record a decoded line holds; ValueError when it holds none (not an object,
        or no integer round)."""
        if not isinstance(line, dict) or not isinstance(line.get("round"), int):
            raise ValueError("a metrics line is a JSON object with an integer round")
        names = {item.name for item in fields(cls)} - {"extra"}
        return cls(
            **{key: value for key, value in line.items() if key in names},
            extra={key: value for key, value in line.items() if key not in names},
        )


@dataclass
class RoundRecord(_Round):
    """A learner's round: its scores, what it aggregated, and what the round cost."""

    node: str | None = None
    train_loss: float | None = None  # None: the node did not train (an attack that skips it)
    val_loss: float | None = None
    val_acc: float | None = None
    test_loss: float | None = None
    test_acc: float | None = None
    n_train: int | None = None
    weights: dict[str, float] = field(default_factory=dict)  # peer -> aggregation weight
    # A gossip peer's only: a coordinated client gets its model from the coordinator.
    received: list[str] | None = None  # peers whose whole model was aggregated
    peers_alive: int | None = None  # when the round started
    fetched: dict[str, list[str]] | None = None  # blob kind -> peers it came from
    refused: dict[str, list[str]] | None = None  # blob kind -> peers whose blob was unusable
    transport_fetches: list[dict[str, Any]] | None = None  # every blob pulled in the round
    attacker: bool | None = None  # the node ran an attack this round
    bytes_sent_by_kind: dict[str, int] | None = None  # message kind -> bytes, since start


@dataclass
class CoordinatorRecord(_Round):
    """The coordinator's round: whom it chose and whose uploads it aggregated."""

    clients: list[str] = field(default_factory=list)  # chosen to train this round
    uploaded: list[str] = field(default_factory=list)  # whose upload came in time
    refused: list[str] = field(default_factory=list)  # whose upload was unusable


def parse_records(lines: Iterable[str], kind: type[Record]) -> Iterator[Record]:
    """The records of `lines`, skipping any that holds none: a line cut short by a crash,
    or one being written right now."""
    for line in lines:
        try:
            yield kind.from_json(json.loads(line))
        except ValueError:  # json.JSONDecodeError is one
            continue


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:  # not written yet, or gone
        return []


def read_records(path: Path, kind: type[Record]) -> list[Record]:
    """Every complete `kind` record of a metrics file (RoundRecord for a learner's,
    CoordinatorRecord for the coordinator's), in file order ([] when there is none)."""
    return list(parse_records(_lines(path), kind))


def last_record(path: Path, kind: type[Record]) -> Record | None:
    """The last complete record of a metrics file (None when there is none)."""
    return next(parse_records(reversed(_lines(path)), kind), None)
