"""Supervision: start a mesh's processes, watch them, restart their unfinished nodes.

A mesh runner (local_mesh.py on this machine, ray_hosts.py on each machine of a Ray cluster)
decides which nodes each process runs; here each process is started with its entry
(entry.py, hosts.py: the coordinator, one node, or a node host), forked from this
process where the system allows (forked.py), each in a session of its own and writing
under the run folder. `supervise` shows their progress and restarts a failed process's
unfinished nodes from their checkpoints when asked to; `node_processes` stops them all
however its block ends; `SupervisedProcess.outcome` says how each node ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from meshfl.node.checkpoint import StorageError, write_atomically
from meshfl.node.coordinator import COORDINATOR
from meshfl.node.host import record_restarts, restarts_so_far
from meshfl.node.metrics import RoundRecord, read_lines

from .entry import run_coordinator, run_forked, run_named_node
from .forked import ForkedProcess, can_fork, fork_call
from .hosts import run_host
from .lifeline import Lifeline
from .options import ConfigSource, ProcessOptions
from .run_folder import METRICS, last_record
from .summary import FAILED, FINISHED, ran_every_round


@contextmanager
def node_processes(
    config_path: Path,
    out: Path,
    groups: list[list[str]],
    labels: list[str],
    local_nodes: int,
    restarted: Counter[str] | None = None,
    held: tuple[int, ...] = (),
    restarts: int = 0,
    join_with: int = 0,
) -> Iterator[tuple[list[SupervisedProcess], Start]]:
    """A process for each group of names (`_spawn`), each with the lifeline that stops
    it if this process dies; every one of them stopped when the block ends, however it
    ends. Yields the processes and how to start one again. Torch threads: the machine's
    cores among `local_nodes`. `restarted`: how often each node was restarted before;
    `held`: descriptors every process holds open until it exits; `restarts`: how often
    a host may start each of its nodes again itself; `join_with`: the hosts among the
    processes, which join the mesh together once all have built their nodes
    (node/joining.py; 0: each host joins as soon as its own nodes are built)."""
    lifeline = Lifeline()
    start = partial(
        _spawn,
        config_path,
        out=out,
        local_nodes=local_nodes,
        lifeline=lifeline,
        held=held,
        restarts=restarts,
        join_with=join_with,
    )
    supervised: list[SupervisedProcess] = []
    try:
        for label, names in zip(labels, groups, strict=True):
            before = Counter({name: (restarted or Counter())[name] for name in names})
            supervised.append(SupervisedProcess(label, names, start(names), node_restarts=before))
        yield supervised, start
    finally:
        _stop([each.process for each in supervised])
        lifeline.close()


def _spawn(
    config_path: Path,
    names: list[str],
    out: Path,
    local_nodes: int,
    lifeline: Lifeline,
    held: tuple[int, ...] = (),
    restarts: int = 0,
    join_with: int = 0,
) -> subprocess.Popen | ForkedProcess:
    """Start the process that runs `names`: the coordinator, one node, or a host. It is
    forked from this one where the system allows (forked.py: the processes share one
    torch) and calls its entry directly, else it is a fresh interpreter given the same
    options as flags."""
    for name in names:
        (out / name).mkdir(parents=True, exist_ok=True)
    options = ProcessOptions(ConfigSource(str(config_path)), out, local_nodes, lifeline.node_fd)
    entry, role = _entry(names, options, restarts, join_with)
    argv = [*role, *options.argv()]
    # Its own session, so that a Ctrl-C in the terminal reaches launch alone, which then
    # stops every process in order; the lifeline covers a launcher that cannot. A host
    # writes each node's log itself; what it prints goes to the host's own log.
    log_path = process_log(out, names)
    if can_fork():
        return fork_call(
            partial(run_forked, entry), argv, log_path, close_fds=[lifeline.launcher_end]
        )
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "meshfl.launch.cli", *argv],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(lifeline.node_fd, *held),
        )


def _entry(
    names: list[str], options: ProcessOptions, restarts: int, join_with: int = 0
) -> tuple[Callable[[], int], list[str]]:
    """The entry of the process that runs `names`, and its command on a command line. A
    host restarts a node that fails itself, at once, up to `restarts` times, and joins
    the mesh together with `join_with` hosts in all."""
    if names == [COORDINATOR]:
        return partial(run_coordinator, options), ["coordinator"]
    if len(names) == 1:
        return partial(run_named_node, options, names[0]), ["node", "--name", names[0]]
    command = ["host", "--names", ",".join(names), "--restarts", str(restarts)]
    command += ["--join-with", str(join_with)] if join_with else []
    return partial(run_host, options, names, restarts, join_with), command


def process_log(out: Path, names: list[str]) -> Path:
    """Where the process of `names` writes what it prints: a lone node's node.log, or
    its host's own log."""
    if len(names) == 1:
        return out / names[0] / "node.log"
    return out / f"host-{names[0]}-{names[-1]}.log"


@dataclass
class SupervisedProcess:
    """A process of `meshfl launch` for the nodes `names`, and how often it was
    restarted; a restart runs only the nodes that had not finished (`running`)."""

    label: str
    names: list[str]
    process: subprocess.Popen | ForkedProcess
    running: list[str] = field(default_factory=list)
    node_restarts: Counter[str] = field(default_factory=Counter)  # name -> times re-run

    def __post_init__(self) -> None:
        self.running = self.running or list(self.names)

    @property
    def restarts(self) -> int:
        """How often this process was started again: its nodes that ran every time."""
        return max(self.node_restarts.values(), default=0)

    def count_host_restarts(self, out: Path) -> None:
        """Take in the restarts its host made of its nodes itself (node/host.py), which
        each node's folder counts."""
        for name in self.names:
            if (recorded := restarts_so_far(out / name)) > self.node_restarts[name]:
                self.node_restarts[name] = recorded

    def failed(self) -> bool:
        return self.process.poll() not in (None, 0)

    def listed(self) -> dict[str, Any]:
        """Its row of processes.json."""
        return {"label": self.label, "pid": self.process.pid, "nodes": self.running}

    def outcome(self, name: str, out: Path, rounds: int) -> dict[str, Any]:
        """How node `name` ended, for the summary: finished, or failed with how its
        process ended and the last error line of its log (else of its host's log). A
        node of a failed host that had finished its rounds finished."""
        code = self.process.poll()
        self.count_host_restarts(out)
        restarts = self.node_restarts[name]
        if code == 0 or name not in self.running or node_finished(out, name, rounds):
            return {"status": FINISHED, "restarts": restarts}
        error = last_error_line(out / name / "node.log") or last_error_line(
            process_log(out, self.running)
        )
        return {
            "status": FAILED,
            "restarts": restarts,
            "ended": how_it_ended(code),
            "last_error": error,
        }


def write_processes(out: Path, processes: list[dict[str, Any]], **about: Any) -> None:
    """<out>/processes.json: which process runs which nodes (each a row: its label, pid
    and nodes, and where a Ray launch put it), for whoever looks at a live run: a
    forked process keeps the launcher's command line, so `ps` cannot tell. `about`: what
    the launcher adds of the run (a Ray launch: its cluster and scratch folders)."""
    listing = {"launcher": os.getpid(), **about, "processes": processes}
    write_atomically(out / "processes.json", (json.dumps(listing, indent=2) + "\n").encode())


def node_finished(out: Path, name: str, rounds: int) -> bool:
    """Whether node `name` of the run in `out` recorded its last round."""
    return ran_every_round(last_record(out / name), rounds)


def how_it_ended(code: int | None) -> str:
    """A process's end in words: "exit code 2", "SIGKILL", or "still running"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


Start = Callable[[list[str]], "subprocess.Popen | ForkedProcess"]


def supervise(
    supervised: list[SupervisedProcess],
    start: Start,
    restarts: int,
    out: Path,
    rounds: int,
    quiet: bool,
    stopping: threading.Event | None = None,
    on_restart: Callable[[], None] | None = None,
) -> None:
    """Show progress and restart failed processes (up to `restarts` times each: a
    process's count is its most restarted node's) until every process has exited, or
    until `stopping` is set; `on_restart` after each restart."""
    progress = Progress(out, rounds, quiet)
    while stopping is None or not stopping.is_set():
        for each in supervised:
            if each.failed():
                each.count_host_restarts(out)
            if each.failed() and each.restarts < restarts:
                if _restart(each, start, restarts, out, rounds, quiet) and on_restart:
                    on_restart()
        # Checked after the restarts: a process that failed last is still restarted.
        if all(each.process.poll() is not None for each in supervised):
            break
        time.sleep(0.5)
        progress.show([name for each in supervised if not each.failed() for name in each.running])
    progress.end()


def _restart(
    failed: SupervisedProcess, start: Start, restarts: int, out: Path, rounds: int, quiet: bool
) -> bool:
    """Start the unfinished nodes of `failed` again; False when none is left to run."""
    unfinished = [name for name in failed.running if not node_finished(out, name, rounds)]
    failed.running = unfinished
    if not unfinished:
        return False  # it failed after every node of it finished: nothing to run again
    failed.node_restarts.update(unfinished)
    for name in unfinished:  # where its host counts on from; a full disk fails it anyway
        with contextlib.suppress(StorageError):
            record_restarts(out / name, failed.node_restarts[name])
    if not quiet:
        last = {name: last_record(out / name) for name in unfinished}
        after = ", ".join(
            f"{name} after round {record.round if record else 0}" for name, record in last.items()
        )
        print(
            f"\nmeshfl: {failed.label} failed ({how_it_ended(failed.process.returncode)}): "
            f"{after}; restarting from the checkpoints ({failed.restarts} of {restarts})",
            flush=True,
        )
    failed.process = start(unfinished)
    return True


class Progress:
    """The live line on a terminal, else a line each time every running node finished
    another round."""

    def __init__(self, out: Path, rounds: int, quiet: bool) -> None:
        self.out, self.rounds, self.quiet = out, rounds, quiet
        self.live = sys.stdout.isatty() and not quiet
        self.shown_round = 0
        self._read: dict[str, tuple[int, RoundRecord | None]] = {}  # size read at, record

    def show(self, names: list[str]) -> None:
        if self.quiet:
            return
        records = {name: self._last_record(name) for name in names}
        done = min((r.round if r else 0 for r in records.values()), default=0)
        if self.live:
            accuracies = " ".join(
                f"{name}:{r.test_acc:.2f}"
                for name, r in records.items()
                if r and r.test_acc is not None
            )
            print(f"\r  round {done}/{self.rounds}  {accuracies}   ", end="", flush=True)
        elif not self.quiet and done > self.shown_round:
            self.shown_round = done
            print(f"  round {done}/{self.rounds} done by every running node", flush=True)

    def end(self) -> None:
        if self.live:
            print()

    def _last_record(self, name: str) -> RoundRecord | None:
        """A node's last record, read again only once its metrics file has changed size:
        a node appends one record a round, and parsing every node's last record twice a
        second took 31 ms a time for 100 FedC2I nodes, 6% of a core (1.7 ms now)."""
        try:
            size = (self.out / name / METRICS).stat().st_size
        except OSError:  # not written yet
            return None
        read = self._read.get(name)
        if read is None or read[0] != size:
            read = self._read[name] = (size, last_record(self.out / name))
        return read[1]


# What counts as an error in a node's log: our one-line errors, a traceback's last line
# (an exception name and its message), and the warnings a node logs when it gives up.
_ERROR_LINE = re.compile(
    r"(meshfl: error: .*|Traceback \(most recent call last\):"
    r"|[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: .*)?)"
)


def last_error_line(log_path: Path) -> str | None:
    """The last error or traceback line of a node's log, or None when it has none (a
    SIGKILL leaves no word)."""
    errors = [line.strip() for line in read_lines(log_path) if _ERROR_LINE.fullmatch(line.strip())]
    return errors[-1] if errors else None


def _stop(processes: list[subprocess.Popen | ForkedProcess]) -> None:
    for process in processes:
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()


def _signal_group(pid: int, signum: int) -> None:
    """Signal the session a process leads, or the process alone if it has not made its
    session yet (a fork that has just been born)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
