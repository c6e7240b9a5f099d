"""Everything a killed node needs to resume: written atomically after every round."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import pickle
from collections import deque
from pathlib import Path
from typing import Any

import torch

from meshfl.protocol.errors import UserError

from .metrics import is_record

log = logging.getLogger("meshfl.node")


class CheckpointError(UserError):
    """A checkpoint that does not read: one line naming the file and what to do."""


class StorageError(UserError):
    """A node file that cannot be written (a full disk, most often): one line naming it."""

    def __init__(self, path: Path, error: OSError, kept: str = "") -> None:
        reason = (
            "no space left on device"
            if error.errno == errno.ENOSPC
            else (error.strerror or str(error)).lower()
        )
        super().__init__(f"cannot write {path}: {reason}{kept}")


def write_atomically(path: Path, data: bytes, kept: str = "") -> None:
    """Write to a temporary file and rename it over the old one: a crash or a full disk
    mid-write leaves the previous file whole, and no temporary behind. StorageError
    (ending in `kept`, what the user still has) when the write fails."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException as error:  # a full disk, or a stop signal (KeyboardInterrupt)
        with contextlib.suppress(OSError):  # it may never have been made
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise StorageError(path, error, kept) from None
        raise


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Serialized in memory first, so that a full disk fails in our own write (a clear
    OSError) and not inside torch's zip writer (an opaque RuntimeError)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    kept = (
        "; the previous checkpoint is kept whole (free some space and restart the "
        "node: it resumes from there)"
        if path.exists()
        else ""
    )
    write_atomically(path, buffer.getvalue(), kept)


# What torch.load raises on a file cut short or garbled, depending on where the cut is.
_UNREADABLE = (RuntimeError, EOFError, ValueError, pickle.UnpicklingError, KeyError, OSError)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The last checkpoint, or None when there is none. Our own file, so weights_only.
    CheckpointError when it does not read."""
    remove_leftover(path.with_name(path.name + ".tmp"))
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except _UNREADABLE as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"checkpoint {path} does not read: cut short or damaged ({detail}); restore it "
            "from a backup, or move it aside to start this node over from round 1"
        ) from None


def remove_leftover(temporary: Path) -> None:
    """A temporary file of a write that was cut short: the file it was to replace is
    the last whole one, so the temporary goes."""
    if temporary.exists():
        temporary.unlink()
        log.warning(
            "removed %s, left by a write that was cut short; %s is the last whole one",
            temporary,
            temporary.name.removesuffix(".tmp"),
        )


SCORES = ("round", "test_acc", "val_acc")  # what `recent_scores` keeps of a record


class MetricsLog:
    """One JSON object per round in metrics.jsonl; the last few scores also in memory,
    for a live node's status answer."""

    def __init__(self, path: Path, keep_recent: int = 5) -> None:
        self.path = path
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep_recent)

    def recent_scores(self) -> list[dict[str, Any]]:
        """The scores of the last rounds that were evaluated, newest last; any thread."""
        return list(self._recent)

    def _remember(self, record: dict[str, Any]) -> None:
        if "test_acc" in record:
            self._recent.append({key: record[key] for key in SCORES if key in record})

    def keep_until(self, last_round: int) -> None:
        """Drop lines of rounds after the checkpoint: a resumed node redoes them. A line
        cut short or garbled (a crash mid-append) is dropped too, said in one line."""
        remove_leftover(self.path.with_name(self.path.name + ".tmp"))
        if not self.path.exists():
            return
        records, unreadable = _parsed_lines(self.path.read_text(errors="replace"))
        if unreadable:
            log.warning(
                "%s: dropped %d line(s) cut short or garbled (line %s), as from a crash mid-write",
                self.path,
                len(unreadable),
                ", ".join(map(str, unreadable)),
            )
        kept = [record for record in records if record["round"] <= last_round]
        text = "".join(json.dumps(record) + "\n" for record in kept)
        write_atomically(self.path, text.encode())
        for record in kept[-(self._recent.maxlen or 0) :]:
            self._remember(record)

    def append(self, record: dict[str, Any]) -> None:
        try:
            with open(self.path, "a") as out:
                out.write(json.dumps(record) + "\n")
        except OSError as error:
            raise StorageError(self.path, error) from None
        self._remember(record)


def _parsed_lines(text: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a metrics file, and the numbers of the lines that are none."""
    records, unreadable = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if is_record(record):
            records.append(record)
        else:
            unreadable.append(number)
    return records, unreadable
