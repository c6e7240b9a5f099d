"""One node process: `meshfl node`, `meshfl coordinator` and `meshfl join`.

Each is a function of its typed options (options.py), called by the command line
(cli.py) and, in a process forked by `meshfl launch`, directly (supervise.py). Each
builds the node's NodeOptions (one builder, `node_options`: which seat of the mesh it
takes, its key, whom it dials) and runs the node until it ends, taking SIGTERM and
SIGHUP as Ctrl-C.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from meshfl.node import config as cfgmod
from meshfl.node.coordinator import COORDINATOR, make_node, needs_coordinator
from meshfl.node.host import raise_open_files_limit
from meshfl.node.logs import configure as configure_logging
from meshfl.node.runtime import NodeOptions
from meshfl.protocol.ports import free_ports
from meshfl.protocol.transport import host_towards, split_contact

from .contacts import join_contact, key_path, listed_contacts, own_contact
from .errors import STOP_SIGNALS, UserError, command_status, raise_stopped
from .lifeline import watch_launcher
from .options import ProcessOptions, resolve_config
from .run_folder import METRICS, last_record


def node_options(
    cfg: cfgmod.MeshConfig,
    name: str,
    listen: str,
    out: Path,
    key: Path,
    shard: tuple[int, int],
    local_nodes: int = 1,
    dial: list[str] | None = None,
) -> NodeOptions:
    """How node `name` takes part: it listens on `listen`, writes under `out`/`name`,
    signs with the key at `key` (made here if missing), trains on data shard `shard`
    (index, count) and dials `dial` (default: every node `cfg` lists but itself)."""
    own_contact(cfg, listen, key)  # our key first, then the others': contacts.py
    index, count = shard
    return NodeOptions(
        config=cfg,
        name=name,
        listen=listen,
        out_dir=out / name,
        key_path=key,
        node_index=index,
        num_nodes=count,
        local_nodes=local_nodes,
        bootstrap=listed_contacts(cfg, out, but=name) if dial is None else dial,
    )


def named_node_options(
    cfg: cfgmod.MeshConfig, name: str, out: Path, key: str | None = None, local_nodes: int = 1
) -> NodeOptions:
    """How peer `name` of `cfg` takes part, writing under `out`: its listed address and
    shard, its key (made here if it has none), and the others' contacts to dial."""
    peer = cfgmod.peer_by_name(cfg, name)
    own_key = key_path(out, peer.name, key or peer.key)
    return node_options(
        cfg,
        peer.name,
        peer.listen,
        out,
        own_key,
        (cfg.peers.index(peer), len(cfg.peers)),
        local_nodes,
    )


def run_named_node(process: ProcessOptions, name: str, key: str | None = None) -> int:
    """`meshfl node`: run peer `name` of the config, signing with `key` (default: the
    peer's own, else one made under the run folder)."""
    options = named_node_options(
        resolve_config(process.config), name, process.out, key, process.local_nodes
    )
    return _run(options, launcher_fd=process.launcher_fd)


def run_coordinator(process: ProcessOptions, key: str | None = None) -> int:
    """`meshfl coordinator`: run the coordinator of a server-centric config."""
    cfg = resolve_config(process.config)
    if cfg.coordinator is None or not needs_coordinator(cfg.algorithm.name):
        raise UserError(
            f"algorithm {cfg.algorithm.name} runs without a coordinator; a "
            "coordinator needs a server-centric algorithm and `coordinator: ADDR`"
        )
    out = process.out
    # The coordinator's own data is a held-out shard (node N of N+1), for the rules that
    # evaluate on the coordinator.
    options = node_options(
        cfg,
        COORDINATOR,
        cfg.coordinator,
        out,
        key_path(out, COORDINATOR, key),
        (len(cfg.peers), len(cfg.peers) + 1),
        process.local_nodes,
    )
    return _run(options, role=COORDINATOR, launcher_fd=process.launcher_fd)


def run_joiner(
    process: ProcessOptions,
    address: str,
    name: str | None = None,
    listen: str | None = None,
    key: str | None = None,
) -> int:
    """`meshfl join`: join the mesh through the member at `address` as `name` (default
    joiner-<port>), listening on `listen` (default: a free port towards `address`)."""
    cfg = resolve_config(process.config)
    # A late member listed in peers.yaml (the only way into a closed mesh) joins with
    # its listed address, key and shard; anyone else is node N of N+1 on a free port.
    listed = next((peer for peer in cfg.peers if peer.name == name), None)
    out = process.out
    through = join_contact(cfg, out, address)
    if listed is None:
        host = host_towards(split_contact(through)[0])
        listen = listen or f"tcp://{host}:{free_ports(1, host)[0]}"
        listed_key, shard = None, (len(cfg.peers), len(cfg.peers) + 1)
    else:
        listen, listed_key = listen or listed.listen, listed.key
        shard = (cfg.peers.index(listed), len(cfg.peers))
    name = name or f"joiner-{listen.rsplit(':', 1)[1]}"
    own_key = key_path(out, name, key or listed_key)
    # It dials the coordinator, if any, and the member it joins through; the mesh's
    # peer lists name the rest.
    coordinator = listed_contacts(replace(cfg, peers=[]), out, but=name)
    options = node_options(
        cfg, name, listen, out, own_key, shard, process.local_nodes, dial=[*coordinator, through]
    )
    config = process.config.path
    hint = (
        f"meshfl join {own_contact(cfg, listen, own_key)}"
        + (f" --config {config}" if config else "")
        + " --name NAME"
    )
    print(f"meshfl: {name} joining through {address}, writing to {out / name}", flush=True)
    return _run(replace(options, joining=True, join_hint=hint))


def run_forked(entry: Callable[[], int]) -> int:
    """In a process forked by `meshfl launch`: run a node process's `entry` as its
    `meshfl` command runs it, logging at INFO; a mistake the user can fix as one line
    and its exit status."""
    configure_logging(logging.INFO)
    return command_status(entry)


def _run(options: NodeOptions, role: str = "peer", launcher_fd: int | None = None) -> int:
    # SIGTERM (from `meshfl launch` or a service manager) and SIGHUP end the node like
    # Ctrl-C: it says bye; the last finished round is already checkpointed.
    for signum in STOP_SIGNALS:
        signal.signal(signum, raise_stopped)
    if launcher_fd is not None:
        watch_launcher(launcher_fd, options.name)
    raise_open_files_limit()  # a node of a big mesh holds a few files per peer
    make_node(options, role).run()
    say_finished(options)
    return 0


def say_finished(options: NodeOptions) -> None:
    """One closing line, so whoever started the node sees how it ended without
    reading the metrics."""
    metrics = options.out_dir / METRICS
    record = last_record(options.out_dir)
    if record is None:
        print(f"meshfl: {options.name} ran no round (rounds: {options.config.rounds})", flush=True)
    elif record.test_acc is not None:
        print(
            f"meshfl: {options.name} finished round {record.round}/"
            f"{options.config.rounds}, test accuracy {record.test_acc:.3f} ({metrics})",
            flush=True,
        )
