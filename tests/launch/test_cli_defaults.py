"""Defaults of the command line that a user meets without reading --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from meshfl.launch.cli import build_parser
from meshfl.launch.options import joiner_out

PRINT_JOINER_OUT = "from meshfl.launch.options import joiner_out; print(joiner_out(None))"


def test_a_named_joiner_writes_to_a_folder_of_its_name():
    args = build_parser().parse_args(["join", "tcp://127.0.0.1:7700", "--name", "delta"])
    assert args.out is None  # the command picks it: runs/node would be shared
    assert joiner_out("delta") == Path("runs", "join-delta")
    assert joiner_out("delta") != joiner_out("echo")


def test_two_unnamed_joiners_started_together_get_folders_of_their_own(tmp_path):
    started = [
        subprocess.Popen(
            [sys.executable, "-c", PRINT_JOINER_OUT], cwd=tmp_path, stdout=subprocess.PIPE
        )
        for _ in range(2)
    ]
    folders = [process.communicate(timeout=60)[0].decode().strip() for process in started]
    assert all(folder.startswith("runs/join-") for folder in folders)
    assert folders[0] != folders[1]
