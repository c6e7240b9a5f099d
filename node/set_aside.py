"""States a rule reads again in a later round, held in files of the node's folder.

Screening judges each round's outcome against the model the round started from, so
until then a node would hold that model twice: as its own, which local training then
changes, and as the copy screening reads at the round's end. Held in a file instead
(the tensors' raw bytes: nothing is pickled), the copy costs the node no memory while
it trains and waits for its peers, and is read back once, at the aggregate: a model
less per node, and on a GPU node a model less in the device's memory.

Each state gets a file of its own, removed once nothing holds the function that reads
it: a rule's step that is undone and replayed (algorithms/base.py `Rewind`) reads the
state it read the first time. Where a file cannot be written the state is kept in
memory, as a node without a folder would (algorithms/base.py `kept`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import shutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshfl.algorithms.base import State, kept

log = logging.getLogger(__name__)

# One count for the process, so that no two nodes a host ran in the folder, one after
# the other (a restarted node), name a file alike: the first one's readers, when they
# go, remove only their own files.
_numbers = itertools.count()


def set_aside_folder(out_dir: Path) -> Path:
    return out_dir / "set-aside"


def remove_set_aside(out_dir: Path) -> None:
    """Remove what a node set aside: at its end, nothing reads it any more."""
    shutil.rmtree(set_aside_folder(out_dir), ignore_errors=True)


# Where each tensor's bytes start in a file: a multiple of this, so every dtype's view
# of them is aligned.
ALIGN = 64


@dataclass(frozen=True)
class Placed:
    """Where one tensor of a set-aside state lies in its file, and what it was."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SetAside:
    """`Context.set_aside` for the node whose folder is `out_dir` (emptied at start:
    what a run that stopped left there is nobody's any more)."""

    def __init__(self, out_dir: Path) -> None:
        remove_set_aside(out_dir)
        self.folder = set_aside_folder(out_dir)

    def __call__(self, state: State) -> Callable[[], State]:
        path = self.folder / f"{next(_numbers)}.bin"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            placed = write_state(path, state)
        except OSError as error:
            log.warning("keeping a state in memory: cannot write %s: %s", path, error)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return kept(state)
        reader = StateFile(path, placed)
        weakref.finalize(reader, path.unlink, missing_ok=True)
        return reader


def write_state(path: Path, state: State) -> tuple[Placed, ...]:
    """The tensors' raw bytes, one after the other, into `path`; where each lies."""
    placed, offset = [], 0
    with open(path, "wb") as file:
        for key, value in state.items():
            raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            padding = -offset % ALIGN
            file.write(bytes(padding))
            offset += padding
            file.write(raw.data)
            placed.append(Placed(key, value.dtype, tuple(value.shape), value.device, offset))
            offset += raw.nbytes
    return tuple(placed)


class StateFile:
    """Reads a state written by `write_state` back, each tensor on its device."""

    def __init__(self, path: Path, placed: tuple[Placed, ...]) -> None:
        self.path = path
        self.placed = placed

    def __call__(self) -> State:
        data = torch.from_numpy(np.fromfile(self.path, dtype=np.uint8))
        return {
            spot.key: data[spot.offset : spot.offset + spot.size]
            .view(spot.dtype)
            .reshape(spot.shape)
            .to(spot.device)
            for spot in self.placed
        }
