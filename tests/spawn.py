"""`meshfl` processes for tests, forked from one that has imported torch already.

Importing torch costs a fresh interpreter 2 to 3.5 s of CPU, and the multi-process tests
start a few hundred `meshfl node`, `join`, `coordinator` and `launch` processes. So a
pytest worker keeps one spawner, a process that imports meshfl and torch once, and each
command is a fork of it, as `meshfl launch` forks its hosts (launch/forked.py): a
process of its own, in a session of its own, running the command's code over real
sockets. A command run under a string-hashing seed of its own (PYTHONHASHSEED) is forked
from a spawner started with that seed. Commands that need a fresh interpreter (a
variable read when torch loads, the console script) start one with subprocess instead.

The command's process is the test's own child, as a `subprocess.Popen` one would be, so
that the test can wait for it and read its exit status: the spawner forks it through an
intermediate that exits at once, while the test's process is, for that moment only, a
child subreaper (Linux), which takes the orphan in.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from meshfl.launch.cli import main
from meshfl.launch.forked import ForkedProcess, run_and_exit

PR_SET_CHILD_SUBREAPER = 36


def spawn(
    args: list[str],
    log: Path | None,
    errors: Path | None = None,
    cwd: Path | None = None,
    hash_seed: str | None = None,
) -> subprocess.Popen | Spawned:
    """Start `meshfl ARGS` in `cwd` (else this process's), in a session of its own, its
    output appended to `log` (else dropped), its errors to `errors` (else with the
    output): forked from this worker's spawner where the system allows. With
    `hash_seed`, its interpreter's string hashing is seeded so (PYTHONHASHSEED), as a
    fresh one's would be: it is forked from a spawner started with that seed."""
    if not sys.platform.startswith("linux"):
        output = open(log, "ab") if log else subprocess.DEVNULL
        return subprocess.Popen(
            [sys.executable, "-m", "meshfl.launch.cli", *args],
            stdout=output,
            stderr=open(errors, "ab") if errors else subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
            env=_environment(hash_seed),
        )
    return _spawner(hash_seed).start(args, log, errors, cwd)


def _environment(hash_seed: str | None) -> dict[str, str]:
    """This process's environment, with string hashing seeded by `hash_seed` if given."""
    return {**os.environ, **({} if hash_seed is None else {"PYTHONHASHSEED": hash_seed})}


def run_to_end(
    args: list[str], timeout: float, cwd: Path | None = None, hash_seed: str | None = None
) -> subprocess.CompletedProcess:
    """Run `meshfl ARGS` to its end, as `subprocess.run(..., capture_output=True,
    text=True)` would: its exit status, output and errors (killed past `timeout`)."""
    with tempfile.TemporaryDirectory() as folder:
        log, errors = Path(folder) / "out", Path(folder) / "err"
        log.touch()
        errors.touch()
        process = spawn(args, log, errors, cwd, hash_seed)
        try:
            code = process.wait(timeout=timeout)
        finally:
            stop([process])
        return subprocess.CompletedProcess(args, code, log.read_text(), errors.read_text())


def _spawner(hash_seed: str | None) -> _Spawner:
    with _starting:
        running = _running.get(hash_seed)
        if running is None or running.process.poll() is not None:
            running = _running[hash_seed] = _Spawner(hash_seed)
        return running


_running: dict[str | None, _Spawner] = {}  # by hash seed
_starting = threading.Lock()


class Spawned(ForkedProcess):
    """A command forked by the spawner and taken in by this process, with the part of
    `subprocess.Popen` that the tests use."""

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def stop(processes: list[subprocess.Popen] | list[Spawned]) -> None:
    """Kill what is left of each process's group and wait for it."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


class _Spawner:
    def __init__(self, hash_seed: str | None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_environment(hash_seed),
        )
        self.lock = threading.Lock()

    def start(
        self, args: list[str], log: Path | None, errors: Path | None, cwd: Path | None
    ) -> Spawned:
        request = {"args": args, "cwd": str(cwd or os.getcwd()), "env": dict(os.environ)}
        # What a fresh process would inherit from this one: a background job's ignore.
        request["ignore_sigint"] = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        request |= {"log": str(log) if log else None, "errors": str(errors) if errors else None}
        assert self.process.stdin is not None and self.process.stdout is not None
        with self.lock, _taking_in_orphans():
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the spawner exited ({self.process.poll()}) before {args}")
        return Spawned(json.loads(reply)["pid"], args)


class _taking_in_orphans:
    """While the block runs, this process is a child subreaper: a descendant whose
    parent exits becomes its child (prctl(2))."""

    def __enter__(self) -> None:
        _set_subreaper(1)

    def __exit__(self, *exc: object) -> None:
        _set_subreaper(0)


def _set_subreaper(on: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


# --- the spawner's side -------------------------------------------------------------


def serve() -> None:
    """Import what a command needs, then fork one command per request line on stdin,
    answering each with its pid."""
    # The imports every command's fork shares, and what the tests' tasks bring in:
    # scikit-learn's datasets, and torch._dynamo, which a torch.optim optimizer imports
    # the first time one is made (2 to 3 s a process).
    import sklearn.datasets  # noqa: F401
    import torch._dynamo  # noqa: F401

    import meshfl.launch.entry  # noqa: F401
    import meshfl.launch.mesh  # noqa: F401
    import meshfl.node.host  # noqa: F401

    for line in sys.stdin.buffer:
        pid = _fork_command(json.loads(line))
        os.write(sys.stdout.fileno(), json.dumps({"pid": pid}).encode() + b"\n")


def _fork_command(request: dict[str, Any]) -> int:
    gc.freeze()  # as launch/forked.py does: no child copies pages to collect them
    read_end, write_end = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(read_end)
            command = os.fork()
            if command == 0:
                os.close(write_end)
                run_and_exit(lambda: _run_command(request))
            os.write(write_end, str(command).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pid:
        command_pid = int(pid.read())
    os.waitpid(intermediate, 0)  # the command is an orphan now, taken in by the test
    return command_pid


def _run_command(request: dict[str, Any]) -> int:
    """In the forked command: become the process the test asked for, then run it."""
    os.setsid()
    _move(os.open(os.devnull, os.O_RDONLY), 0)  # off the spawner's own pipes
    _move(_appending(request["log"] or os.devnull), 1)
    if request["errors"] is None:
        os.dup2(1, 2)
    else:
        _move(_appending(request["errors"]), 2)
    ignore_sigint = request["ignore_sigint"]
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    return main(request["args"])


def _move(fd: int, to: int) -> None:
    os.dup2(fd, to)
    os.close(fd)


def _appending(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


if __name__ == "__main__":
    serve()
