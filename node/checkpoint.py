"""Everything a killed node needs to resume: written atomically after every round."""

from __future__ import annotations

import json
import os
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


class MetricsLog:
    """One JSON object per round in metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def keep_until(self, last_round: int) -> None:
        """Drop lines of rounds after the checkpoint: a resumed node redoes them."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["round"] <= last_round]
        self.path.write_text("".join(line + "\n" for line in kept))

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")
