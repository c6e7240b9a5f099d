"""Shared fixtures: real dataset files, materialized once per test session."""

from __future__ import annotations

import fcntl
import os
import shutil
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
    """A --data-root holding every dataset of shared/data in its standard layout, written
    once for the session: under pytest -n, the first worker to need it writes it into
    the folder the workers' own temporary folders share, and the others wait for it."""
    script = _shared_dir() / "data" / "materialize.py"
    if not script.is_file():
        pytest.skip(
            f"real datasets unavailable: {script} not found (set MESHFL_SHARED to the "
            "folder holding data/materialize.py)"
        )
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root, written = shared / "data_root", shared / "data_root.written"
    with open(shared / "data_root.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not written.exists():
            shutil.rmtree(root, ignore_errors=True)  # what a worker that failed left
            _materialize(script, root)
            written.touch()
    return root


def _materialize(script: Path, root: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        pytest.fail(f"{script} failed: {done.stderr.strip() or done.stdout.strip()}")


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A ZeroMQ context for a test's own sockets, destroyed after it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
