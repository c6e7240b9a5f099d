"""Everything a killed node needs to resume: written atomically after every round."""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file and rename it over the old one: a crash mid-write
    leaves the previous checkpoint whole."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as out:
        torch.save(state, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The last checkpoint, or None when there is none. Our own file, so weights_only."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


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
        """Drop lines of rounds after the checkpoint: a resumed node redoes them."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["round"] <= last_round]
        self.path.write_text("".join(line + "\n" for line in kept))
        for line in kept[-(self._recent.maxlen or 0):]:
            self._remember(json.loads(line))

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")
        self._remember(record)
