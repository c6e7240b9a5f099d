"""A mesh on this machine: its peers in node hosts forked from this process.

`run_mesh` runs a checked config's peers in about one process per core (placement.py),
started, watched and restarted by supervise.py, and ends with the run's summary; it is
`meshfl launch`'s runner without --ray (mesh.py) and every run's of `meshfl experiment`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod
from meshfl.node.coordinator import COORDINATOR, needs_coordinator
from meshfl.node.host import forget_restarts
from meshfl.node.joining import JOINING_DIR
from meshfl.node.task import node_info, task_of
from meshfl.node.trainer import set_torch_threads
from meshfl.protocol.ports import free_ports

from .contacts import key_path, own_contact
from .errors import stop_signals_as_interrupts
from .placement import default_hosts, host_groups, host_label
from .summary import write_summary
from .supervise import SupervisedProcess, node_processes, supervise, write_processes


def with_local_peers(cfg: cfgmod.MeshConfig, count: int) -> cfgmod.MeshConfig:
    """`cfg` with `count` peers (and a coordinator) on free loopback ports."""
    *ports, coordinator_port = free_ports(count + 1)
    peers = [
        replace(peer, listen=f"tcp://127.0.0.1:{port}")
        for peer, port in zip(cfgmod.local_peers(count), ports, strict=True)
    ]
    coordinator = f"tcp://127.0.0.1:{coordinator_port}"
    return replace(
        cfg, peers=peers, coordinator=coordinator if needs_coordinator(cfg.algorithm.name) else None
    )


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
    # Every key is made before any node starts, so that the join line carries the first
    # one and each node knows its contacts' keys: it greets them at once, instead of
    # waiting for each to say hello first.
    contacts = [
        own_contact(cfg, peer.listen, key_path(out, peer.name, peer.key)) for peer in cfg.peers
    ]
    joinable = contacts[0]
    for peer in cfg.peers:  # a launch counts its own restarts, not an earlier one's
        forget_restarts(out / peer.name)
    groups = host_groups(
        [peer.name for peer in cfg.peers],
        hosts
        if hosts is not None
        else default_hosts(len(cfg.peers), cfg.topology.connections(len(cfg.peers))),
    )
    if cfg.coordinator is not None:
        groups.append([COORDINATOR])
    labels = [host_label(index, names) for index, names in enumerate(groups)]
    # The hosts join together once all have built their nodes (node/joining.py); an
    # earlier launch's notes in this folder say nothing about this one's.
    shutil.rmtree(out / JOINING_DIR, ignore_errors=True)
    hosts_joining = sum(len(names) > 1 for names in groups)
    with (
        stop_signals_as_interrupts(),
        node_processes(
            config_path,
            out,
            groups,
            labels,
            len(groups),
            restarts=restarts,
            join_with=hosts_joining,
        ) as (supervised, start),
    ):
        list_processes = partial(_list_processes, out, supervised)
        list_processes()
        if not quiet:
            print(
                f"meshfl: {cfgmod.counted(len(cfg.peers), 'node')} in "
                f"{cfgmod.counted(len(groups), 'process', 'processes')}, "
                f"{cfgmod.what_runs(cfg)} -> {out}"
            )
            print(f"meshfl: join this mesh with: meshfl join {joinable} --config {config_path}")
        supervise(
            supervised, start, restarts, out, cfg.rounds, quiet=quiet, on_restart=list_processes
        )
    outcomes = {
        name: each.outcome(name, out, cfg.rounds) for each in supervised for name in each.names
    }
    return write_summary(cfg, out, outcomes)


def _list_processes(out: Path, supervised: list[SupervisedProcess]) -> None:
    write_processes(out, [each.listed() for each in supervised])


def _check_data(cfg: cfgmod.MeshConfig) -> None:
    """Load the first node's data and build its model here, so a wrong path or a task
    that does not fit its data fails once, before any process.
    On one torch thread: an OpenMP thread pool made here would not survive the forks
    of the processes (forked.py), and a child that found it half there could hang."""
    set_torch_threads(os.cpu_count() or 1)  # one thread: all cores among that many
    task = task_of(cfg)
    first = cfg.peers[0].name
    data = task.node_data(node_info(cfg, first, 0, len(cfg.peers)))
    task.check_rule(cfg.algorithm, task.model_maker(data)(), data)
