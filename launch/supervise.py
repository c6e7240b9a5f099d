"""`meshfl launch`: a mesh of local nodes in a few processes, supervised until all exit.

The peers run in node hosts (`meshfl host`, node/host.py), about one per core, each
host a process holding a share of the peers; `--hosts N` gives every peer a process of
its own (`meshfl node`). A coordinator runs alone (`meshfl coordinator`). Every
process has its own session and writes under the run folder; launch shows their
progress, restarts a failed process's unfinished nodes from their checkpoints when
asked to, stops them all on Ctrl-C or a stop signal, and ends with the run's summary
(summary.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
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
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod
from meshfl.node.checkpoint import StorageError
from meshfl.node.coordinator import COORDINATOR, needs_coordinator
from meshfl.node.host import (
    files_per_node,
    forget_restarts,
    raise_open_files_limit,
    record_restarts,
    restarts_so_far,
)
from meshfl.node.metrics import read_lines
from meshfl.node.splits import load_node_data
from meshfl.node.trainer import set_torch_threads
from meshfl.protocol.transport import free_ports

from .contacts import key_path, own_contact
from .errors import EXIT_NODE_FAILED, STOP_SIGNALS, UserError, raise_stopped
from .forked import ForkedProcess, can_fork, fork_command
from .lifeline import Lifeline
from .options import resolve_config
from .summary import (
    FAILED,
    FINISHED,
    failed_nodes,
    last_record,
    print_table,
    ran_every_round,
    write_summary,
)


def launch_local(args: argparse.Namespace) -> int:
    """`meshfl launch`: run the mesh, print its table; EXIT_NODE_FAILED when a node failed."""
    cfg = resolve_config(args, check=False)  # run_mesh checks it with its local addresses
    if args.nodes is not None or args.config is None:
        count = args.nodes if args.nodes is not None else len(cfg.peers)
        cfg = with_local_peers(cfg, count)
    if args.restarts < 0:
        raise UserError(f"--restarts: got {args.restarts}; allowed: 0 or more")
    if args.hosts is not None and not 1 <= args.hosts <= len(cfg.peers):
        raise UserError(
            f"--hosts: got {args.hosts}; allowed: 1 to the number of nodes "
            f"({len(cfg.peers)}), which gives every node a process of its own"
        )
    out = Path(args.out or _default_run_dir(cfg))
    if args.ray is not None:
        from .ray_hosts import run_mesh_on_ray  # the only module that imports Ray

        with _stop_signals_as_interrupts():  # its hosts stop as on Ctrl-C
            summary = run_mesh_on_ray(
                cfg, out, args.ray, quiet=args.quiet, restarts=args.restarts, hosts=args.hosts
            )
    else:
        summary = run_mesh(cfg, out, quiet=args.quiet, restarts=args.restarts, hosts=args.hosts)
    print_table(summary)
    failed = failed_nodes(summary)
    if failed:
        print(
            f"meshfl: {len(failed)} of {len(summary['nodes'])} nodes failed: "
            f"{', '.join(failed)} (see {out / 'summary.json'})",
            file=sys.stderr,
        )
        return EXIT_NODE_FAILED
    return 0


def with_local_peers(cfg: cfgmod.MeshConfig, count: int) -> cfgmod.MeshConfig:
    """`cfg` with `count` peers (and a coordinator) on free loopback ports."""
    if count < 1:
        raise UserError(f"--nodes: got {count}; allowed: 1 or more")
    *ports, coordinator_port = free_ports(count + 1)
    peers = [
        replace(peer, listen=f"tcp://127.0.0.1:{port}")
        for peer, port in zip(cfgmod.local_peers(count), ports, strict=True)
    ]
    coordinator = f"tcp://127.0.0.1:{coordinator_port}"
    return replace(
        cfg, peers=peers, coordinator=coordinator if needs_coordinator(cfg.algorithm.name) else None
    )


def default_hosts(peers: int) -> int:
    """About one node host per core, so each host's torch has a core of its own; more
    where the nodes' connections would not fit one process's open-files limit (a node
    of a full mesh holds a few per peer), with a fifth of the limit to spare."""
    per_core = min(peers, os.cpu_count() or 1)
    by_files = math.ceil(peers * files_per_node(peers) / (0.8 * raise_open_files_limit()))
    return max(1, per_core, min(peers, by_files))


def run_mesh(
    cfg: cfgmod.MeshConfig,
    out: Path,
    quiet: bool = False,
    restarts: int = 0,
    hosts: int | None = None,
) -> dict[str, Any]:
    """Run every peer of `cfg` on this machine in `hosts` processes (default: about one
    per core; as many as peers: one each) until all have exited; write and return the
    summary. A process that fails does not stop the others: its unfinished nodes are
    restarted up to `restarts` times, then listed as failed. SIGTERM and SIGHUP stop
    the mesh as Ctrl-C does (KeyboardInterrupt), and the nodes stop on their own if this
    process dies (launch/lifeline.py)."""
    cfgmod.validate(cfg)
    _check_data(cfg)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    # Fitted rule parameters written out: a joiner with other `rounds` still agrees.
    cfgmod.save_config(cfgmod.with_explicit_params(cfg), config_path)
    first = cfg.peers[0]
    # Made before the node that loads it starts, so that the join line can carry its key.
    joinable = own_contact(cfg, first.listen, key_path(out, first.name, first.key))
    for peer in cfg.peers:  # a launch counts its own restarts, not an earlier one's
        forget_restarts(out / peer.name)
    groups = host_groups(
        [peer.name for peer in cfg.peers],
        hosts if hosts is not None else default_hosts(len(cfg.peers)),
    )
    if cfg.coordinator is not None:
        groups.append([COORDINATOR])
    labels = [host_label(index, names) for index, names in enumerate(groups)]
    with (
        _stop_signals_as_interrupts(),
        node_processes(config_path, out, groups, labels, len(groups), restarts=restarts) as (
            supervised,
            start,
        ),
    ):
        write_processes(out, supervised)
        if not quiet:
            print(
                f"meshfl: {len(cfg.peers)} nodes in {len(groups)} processes, "
                f"{cfg.algorithm.name} on {cfg.data.dataset} ({cfg.data.partition}), "
                f"{cfg.rounds} rounds -> {out}"
            )
            print(f"meshfl: join this mesh with: meshfl join {joinable} --config {config_path}")
        supervise(
            supervised,
            start,
            restarts,
            out,
            cfg.rounds,
            quiet=quiet,
            on_restart=partial(write_processes, out, supervised),
        )
    outcomes = {
        name: each.outcome(name, out, cfg.rounds) for each in supervised for name in each.names
    }
    return write_summary(cfg, out, outcomes)


def host_label(index: int, names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"host{index}"


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
) -> Iterator[tuple[list[SupervisedProcess], Start]]:
    """A process for each group of names (`_spawn`), each with the lifeline that stops
    it if this process dies; every one of them stopped when the block ends, however it
    ends. Yields the processes and how to start one again. Torch threads: the machine's
    cores among `local_nodes`. `restarted`: how often each node was restarted before;
    `held`: descriptors every process holds open until it exits; `restarts`: how often
    a host may start each of its nodes again itself."""
    lifeline = Lifeline()
    start = partial(
        _spawn,
        config_path,
        out=out,
        local_nodes=local_nodes,
        lifeline=lifeline,
        held=held,
        restarts=restarts,
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


def write_processes(out: Path, supervised: list[SupervisedProcess]) -> None:
    """<out>/processes.json: which process runs which nodes, for whoever looks at a live
    run (a forked process keeps the launcher's command line, so `ps` cannot tell)."""
    listing = {
        "launcher": os.getpid(),
        "processes": [
            {"label": each.label, "pid": each.process.pid, "nodes": each.running}
            for each in supervised
        ],
    }
    (out / "processes.json").write_text(json.dumps(listing, indent=2) + "\n")


def host_groups(names: list[str], hosts: int) -> list[list[str]]:
    """`names` in `hosts` runs of consecutive names, as even in size as can be."""
    size, extra = divmod(len(names), hosts)
    groups, start = [], 0
    for index in range(hosts):
        end = start + size + (index < extra)
        groups.append(names[start:end])
        start = end
    return groups


@contextmanager
def _stop_signals_as_interrupts() -> Iterator[None]:
    """SIGTERM (timeout, CI runners, systemd, container stops) and SIGHUP (a closed
    terminal) raise `Stopped`, a KeyboardInterrupt: the mesh stops as on Ctrl-C."""
    previous = {signum: signal.signal(signum, raise_stopped) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _default_run_dir(cfg: cfgmod.MeshConfig) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{cfg.algorithm.name}-{cfg.data.dataset}")


def _check_data(cfg: cfgmod.MeshConfig) -> None:
    """Load the first node's data here, so a wrong path fails once, before any process.
    On one torch thread: an OpenMP thread pool made here would not survive the forks
    of the processes (forked.py), and a child that found it half there could hang."""
    set_torch_threads(os.cpu_count() or 1)  # one thread: all cores among that many
    data = cfgmod.data_for(cfg, cfg.peers[0])
    load_node_data(
        data.dataset,
        data.root,
        data.partition,
        len(cfg.peers),
        0,
        cfg.seed,
        data.samples_per_node,
        tuple(data.split),
    )


def _spawn(
    config_path: Path,
    names: list[str],
    out: Path,
    local_nodes: int,
    lifeline: Lifeline,
    held: tuple[int, ...] = (),
    restarts: int = 0,
) -> subprocess.Popen | ForkedProcess:
    """Start the process that runs `names`: the coordinator, one node, or a host. It is
    forked from this one where the system allows (forked.py: the processes share one
    torch), else a fresh interpreter."""
    for name in names:
        (out / name).mkdir(parents=True, exist_ok=True)
    if names == [COORDINATOR]:
        role = ["coordinator"]
    elif len(names) == 1:
        role = ["node", "--name", names[0]]
    else:  # a host restarts a node that fails itself, at once
        role = ["host", "--names", ",".join(names), "--restarts", str(restarts)]
    argv = [
        *role,
        *("--config", str(config_path), "--out", str(out)),
        *("--local-nodes", str(local_nodes), "--launcher-fd", str(lifeline.node_fd)),
    ]
    # Its own session, so that a Ctrl-C in the terminal reaches launch alone, which then
    # stops every process in order; the lifeline covers a launcher that cannot. A host
    # writes each node's log itself; what it prints goes to the host's own log.
    log_path = process_log(out, names)
    if can_fork():
        from .cli import main  # the command line's own entry: cli imports this module

        return fork_command(main, argv, log_path, close_fds=[lifeline.launcher_end])
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "meshfl.launch.cli", *argv],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(lifeline.node_fd, *held),
        )


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


def node_finished(out: Path, name: str, rounds: int) -> bool:
    """Whether node `name` of the run in `out` recorded its last round."""
    return ran_every_round(last_record(out / name / "metrics.jsonl"), rounds)


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
        last = {name: last_record(out / name / "metrics.jsonl") for name in unfinished}
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

    def show(self, names: list[str]) -> None:
        records = {name: last_record(self.out / name / "metrics.jsonl") for name in names}
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
