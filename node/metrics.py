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


def is_record(line: Any) -> bool:
    """Whether a decoded metrics line holds a record of any role: an object with an
    integer round (without one a line cannot be placed, and reads as damaged)."""
    return isinstance(line, dict) and isinstance(line.get("round"), int)


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
    # The tensors' bytes of the blobs the role published this round, as they travelled.
    published_bytes: int | None = None
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
        if not is_record(line):
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
    device: str | None = None  # where the node trains (node/devices.py)
    # The peak a GPU allocated to the node's process (shared by the nodes of a host that
    # share the GPU); None on a CPU.
    device_memory_mb: float | None = None
    weights: dict[str, float] = field(default_factory=dict)  # peer -> aggregation weight
    # A gossip peer's only: a coordinated client gets its model from the coordinator.
    received: list[str] | None = None  # peers whose whole model was aggregated
    peers_alive: int | None = None  # when the round started
    fetched: dict[str, list[str]] | None = None  # blob kind -> peers it came from
    refused: dict[str, list[str]] | None = None  # blob kind -> peers whose blob was unusable
    transport_fetches: list[dict[str, Any]] | None = None  # every blob pulled in the round
    attacker: bool | None = None  # the node ran an attack this round
    bytes_sent_by_kind: dict[str, int] | None = None  # message kind -> bytes, since start
    compression: str | None = None  # the codec of the blobs the node published
    # A bounded mesh's only (WIRE.md 7.7): the neighbours when the round began and when
    # it ended (before any was dropped: places freed after a round are filled while the
    # next one runs), the ones new since the last round began, those whose models it
    # passed over (a view past its places), and the ones the node dropped after it, and
    # its anchors then (node/neighbours.py).
    neighbours: list[str] | None = None
    neighbours_at_end: list[str] | None = None
    tried: list[str] | None = None
    past_places: list[str] | None = None
    dropped: list[str] | None = None
    anchors: list[str] | None = None
    connections: int | None = None  # the node dialled, open when the round ended
    # CPU seconds the round took on the node's own thread (`node`: training, screening,
    # aggregation, evaluation) and on its endpoint's threads (`endpoint`; Linux only):
    # node/thread_cpu.py, which says what neither counts (ZeroMQ's and torch's threads).
    cpu_seconds: dict[str, float] | None = None


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


def read_lines(path: Path) -> list[str]:
    """A text file's lines ([] when it cannot be read, or is not there yet)."""
    try:
        return path.read_text().splitlines()
    except OSError:  # not written yet, or gone
        return []


def read_records(path: Path, kind: type[Record]) -> list[Record]:
    """Every complete `kind` record of a metrics file (RoundRecord for a learner's,
    CoordinatorRecord for the coordinator's), in file order ([] when there is none)."""
    return list(parse_records(read_lines(path), kind))


# How much of a metrics file's end `last_record` reads first: a line of a 100-node mesh
# is about 10 kB, and launch asks for every node's last line twice a second.
TAIL_BYTES = 64 << 10


def last_record(path: Path, kind: type[Record]) -> Record | None:
    """The last complete record of a metrics file (None when there is none), read from
    the file's end: a long run's file is not read whole each time."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, 2)
            file.seek(max(0, size - TAIL_BYTES))
            tail = file.read().decode(errors="replace").splitlines()
    except OSError:  # not written yet, or gone
        return None
    if size > TAIL_BYTES:
        tail = tail[1:]  # the first line read may be the end of a longer one
    found = next(parse_records(reversed(tail), kind), None)
    if found is None and size > TAIL_BYTES:
        return next(parse_records(reversed(read_lines(path)), kind), None)  # lines over 64 kB
    return found
