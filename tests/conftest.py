"""Shared fixtures: real dataset files, materialized once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq


def _shared_dir() -> Path:
    """The project's shared folder: $MESHFL_SHARED, else the sibling of the checkout."""
    override = os.environ.get("MESHFL_SHARED")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --data-root holding every dataset of shared/data in its standard layout."""
    script = _shared_dir() / "data" / "materialize.py"
    if not script.is_file():
        pytest.skip(
            f"real datasets unavailable: {script} not found (set MESHFL_SHARED to the "
            "folder holding data/materialize.py)"
        )
    root = tmp_path_factory.mktemp("data_root")
    done = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        pytest.fail(f"{script} failed: {done.stderr.strip() or done.stdout.strip()}")
    return root


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A ZeroMQ context for a test's own sockets, destroyed after it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
