"""The `meshfl` command: launch a local mesh, run one node, join a mesh, make keys.

The command line parses here. The flags of `launch` and of the node processes (`node`,
`host`, `coordinator`, `join`) become typed options (mesh.py, options.py) for their
entries (mesh.launch, entry.py, hosts.py), which `meshfl launch` calls directly in the
processes it forks.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from meshfl.node.logs import configure as configure_logging

from .bench import BENCHMARKS, run_benchmark
from .errors import UserError, command_status, end_process
from .options import (
    ProcessOptions,
    add_assignments,
    config_source,
    joiner_out,
    process_options,
    resolve_config,
)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    # options.py turns the named flags into config overrides: a new one goes there too.
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="peers.yaml with the mesh settings and peers (default: built-in demo settings)",
    )
    parser.add_argument(
        "--algorithm",
        help="who learns from whom: local, fedavg (the default), fedc2i, pfedsv, pfedlia, "
        "the robust rules, and with a coordinator fedinfluence and fedrema; an unknown "
        "name is answered with them all. Every rule that takes peers' models runs behind "
        "validation screening (--set algorithm.screen=false for the paper's rule)",
    )
    parser.add_argument(
        "--task",
        metavar="FILE|MODULE",
        help="your own model and data: a task file (task.py) or module defining model() "
        "and data(node) (see docs/tasks.md); default: the built-in model and dataset",
    )
    parser.add_argument(
        "--dataset",
        help="digits (embedded), mnist, fmnist, usps, cifar10, "
        "mnistm, femnist, office, synthetic, digit5, npz:PATH",
    )
    parser.add_argument(
        "--data-root", metavar="DIR", help="folder holding the dataset in its standard layout"
    )
    parser.add_argument(
        "--partition",
        help="iid, dirichlet:<alpha>, pathological:<labels>, "
        "groups:<s>, clusters:<k>[:noisy], domains",
    )
    parser.add_argument(
        "--samples-per-node", type=int, metavar="N", help="cap on each node's shard"
    )
    parser.add_argument("--rounds", type=int, help="number of rounds")
    parser.add_argument("--seed", type=int, help="seed of every random choice")
    add_assignments(
        parser, "set any config field, e.g. --set lr=0.1 --set algorithm.gamma=2 (repeatable)"
    )


def _add_local_nodes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--local-nodes", type=int, default=1, help="node processes sharing this machine's cores"
    )


def _add_launcher_fd(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher-fd",
        type=int,
        metavar="FD",
        # Set by `meshfl launch`: stop (as on Ctrl-C) when this pipe descriptor reads
        # end-of-file, i.e. when the launcher is gone. Not a user's flag.
        help=argparse.SUPPRESS,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshfl",
        description="A peer-to-peer network for personalized federated learning. Every node "
        "is its own process with its own data; nodes gossip signed models over "
        "ZeroMQ and each decides whom to learn from.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    launch = commands.add_parser(
        "launch",
        help="start N local nodes and show their progress",
        description="Start N nodes on this machine, in about one process per core (see "
        "--hosts), show their progress, print a result table and write per-node "
        "metrics and summary.json to --out.",
    )
    _add_config_flags(launch)
    launch.add_argument(
        "--nodes", type=int, help="number of local nodes (default 4, or the peers of --config)"
    )
    launch.add_argument(
        "--out",
        metavar="DIR",
        help="run folder (default runs/<time>-<rule>-<dataset>). A folder of an earlier run "
        "(it holds config.yaml) without --config resumes that run with its config: its "
        "nodes go on from their checkpoints, the flags given change it (--rounds 40 "
        "extends it), and --nodes may only repeat its number of nodes",
    )
    launch.add_argument(
        "--hosts",
        type=int,
        metavar="H",
        help="processes the nodes share (default: one per core, at most one "
        "per node). Each is a node host: torch loads once per host and "
        "its nodes take turns at the CPU, each still a full peer on the "
        "wire. --hosts equal to --nodes gives every node its own process",
    )
    launch.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the node hosts on the Ray cluster at ADDRESS (HEAD:6379, or auto for "
        "the cluster this machine belongs to), spread over its machines by their CPUs; "
        "nodes still talk over meshfl's own wire, and the run folder is gathered here. "
        "Needs the ray extra: pip install 'meshfl[ray]'",
    )
    launch.add_argument("--quiet", action="store_true", help="no live progress line")
    launch.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart a node that fails up to N times; it resumes from its "
        "checkpoint (default 0). Exit code 3 when a node failed for "
        "good, 128+signal when launch itself is stopped by one",
    )

    node = commands.add_parser(
        "node",
        help="run one node of a peers.yaml mesh (one per LAN machine)",
        description="Run the peer NAME of --config; it binds its listen address and dials "
        "the other peers listed there.",
    )
    _add_config_flags(node)
    node.add_argument("--name", required=True, help="this node's name in the config's peers")
    node.add_argument(
        "--out",
        metavar="DIR",
        default="runs/node",
        help="folder for <name>/metrics.jsonl and the checkpoint",
    )
    node.add_argument(
        "--key",
        metavar="PEM",
        help="private key (default: the peer's `key`, "
        "else <out>/keys/<name>.pem, created on first start)",
    )
    _add_local_nodes(node)
    _add_launcher_fd(node)

    coordinator = commands.add_parser(
        "coordinator",
        help="run the coordinator node of a server-centric mesh",
        description="Run the coordinator of --config (its `coordinator:` address) for the "
        "server-centric rules; clients upload to it and it answers each with its "
        "personalized model. Restarted, it resumes from its checkpoint.",
    )
    _add_config_flags(coordinator)
    coordinator.add_argument(
        "--out",
        metavar="DIR",
        default="runs/node",
        help="folder for coordinator/metrics.jsonl and the checkpoint",
    )
    coordinator.add_argument(
        "--key",
        metavar="PEM",
        help="private key (default: <out>/keys/coordinator.pem, created on first start)",
    )
    _add_local_nodes(coordinator)
    _add_launcher_fd(coordinator)

    host = commands.add_parser(
        "host",
        help="run several peers of a peers.yaml mesh in one process",
        description="Run the peers NAMES of --config in this one process, each a full peer "
        "with its own key, port, metrics and checkpoint, talking to the others "
        "only over the wire. torch loads once; the peers take turns at the CPU. "
        "`meshfl launch` starts about one host per core.",
    )
    _add_config_flags(host)
    host.add_argument(
        "--names",
        required=True,
        metavar="NAME,NAME,...",
        help="the peers of --config this host runs",
    )
    host.add_argument(
        "--out",
        metavar="DIR",
        default="runs/node",
        help="folder for each <name>/metrics.jsonl, checkpoint and node.log",
    )
    host.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="start a peer that fails again at once, from its checkpoint, while the "
        "others go on; up to N restarts each, counted in <name>/restarts (default 0)",
    )
    host.add_argument(
        "--join-with",
        type=int,
        default=0,
        metavar="N",
        # Set by `meshfl launch`: once its peers are built, wait until N hosts sharing
        # this --out (this one included) have built theirs, so that no peer greets one
        # still being built; each notes it in <out>/.joining, and the wait ends 60 s
        # after the last one did (default 0: no wait). Not a user's flag.
        help=argparse.SUPPRESS,
    )
    _add_local_nodes(host)
    _add_launcher_fd(host)

    join = commands.add_parser(
        "join",
        help="join a running mesh through any one of its addresses",
        description="Join the mesh at ADDR (tcp://HOST:PORT of any member). The mesh settings "
        "come from --config (the run folder's config.yaml for a `meshfl launch` "
        "mesh) and must match the mesh's, or its members ignore this node.",
    )
    join.add_argument(
        "address",
        metavar="ADDR",
        help="KEY@tcp://HOST:PORT of any mesh "
        "member (as printed by `meshfl launch` and logged by every node); a "
        "bare tcp://HOST:PORT when --config lists that member's public_key",
    )
    _add_config_flags(join)
    join.add_argument("--name", help="this node's name (default joiner-<port>)")
    join.add_argument(
        "--listen",
        metavar="ADDR",
        help="where to bind (default: this host's address towards ADDR, on a free port)",
    )
    join.add_argument(
        "--out",
        metavar="DIR",
        help="output folder, as for `meshfl node` (default runs/join-NAME with --name, "
        "which a rejoin under that name resumes; else a new runs/join-<time>-<pid>): "
        "two joiners on one machine never share keys or checkpoints",
    )
    join.add_argument(
        "--key",
        metavar="PEM",
        help="private key (default: the listed peer's "
        "`key` when --name is in --config, else <out>/keys/<name>.pem; created "
        "if missing)",
    )
    _add_local_nodes(join)

    keygen = commands.add_parser(
        "keygen",
        help="write a new Ed25519 node key",
        description="Write a new Ed25519 private key as PEM (mode 0600) and print the node id "
        "and public key; never overwrites an existing file.",
    )
    keygen.add_argument("path", metavar="PATH", help="the PEM file to write (e.g. keys/me.pem)")

    new = commands.add_parser(
        "new",
        help="write a task file and a peers.yaml to start your own from",
        description="Write DIR/task.py (a model and each node's data, running as it is on "
        "the embedded digits: replace its model() and data(node) with yours) and "
        "DIR/peers.yaml (four nodes on this machine learning it). Then: meshfl launch "
        "--task DIR/task.py, or meshfl launch --config DIR/peers.yaml. Never overwrites "
        "a file.",
    )
    new.add_argument("directory", metavar="DIR", help="the folder to write (made if missing)")

    experiment = commands.add_parser(
        "experiment",
        help="run a named experiment and print its results table",
        description="Run every variant of a named experiment for each seed as a local mesh "
        "and print the per-node test accuracy table (also OUT/table.md). "
        "Finished runs are kept and skipped on a rerun; one made with other "
        "settings stops the command with what differs.",
    )
    experiment.add_argument("name", nargs="?", metavar="NAME", help="experiment name")
    experiment.add_argument("--list", action="store_true", help="list the experiments")
    experiment.add_argument("--data-root", metavar="DIR", help="dataset folder")
    experiment.add_argument("--seeds", metavar="S1,S2", help="override the seeds")
    experiment.add_argument(
        "--only",
        action="append",
        metavar="COLUMN",
        help="run only this column of the table (a variant, or a rule of an attack grid, "
        "as the table heads it); repeat for more",
    )
    experiment.add_argument(
        "--out", metavar="DIR", help="output folder (default runs/experiments/NAME)"
    )
    add_assignments(experiment, "override any config field of every run")

    report = commands.add_parser(
        "report",
        help="draw a finished run's figures and write a markdown summary",
        description="Read RUN_DIR (the --out folder of `meshfl launch` or `meshfl node`) and "
        "write accuracy.png, who-learns-from-whom heatmaps and report.md. Needs "
        "matplotlib: pip install 'meshfl[report]'.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    report.add_argument("--out", metavar="DIR", help="where to write (default RUN_DIR/report)")

    status = commands.add_parser(
        "status",
        help="ask a live node for its round, peers, accuracies and rejections",
        description="Send a signed status request to the node at ADDR and print its answer. "
        "Joins nothing; signs with a throwaway key unless --key is given (a "
        "closed mesh answers only keys it lists). The connection is encrypted "
        "when ADDR names the node's key.",
    )
    status.add_argument(
        "address",
        metavar="ADDR",
        help="KEY@tcp://HOST:PORT of the node "
        "(KEY: its public key, which it logs at start); tcp://HOST:PORT for "
        "a node with encryption off",
    )
    status.add_argument("--key", metavar="PEM", help="sign with this private key")
    status.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the answer (default 5)",
    )
    status.add_argument("--json", action="store_true", help="print the answer as JSON")

    config = commands.add_parser(
        "config",
        help="write the JSON Schema of peers.yaml for editors",
        description="Write the JSON Schema of peers.yaml, so that an editor checks and "
        "completes a config as it is typed.",
    )
    config.add_argument("what", choices=["schema"], help="schema: the JSON Schema of peers.yaml")
    config.add_argument("--out", metavar="FILE", help="write it to FILE (default: stdout)")

    bench = commands.add_parser(
        "bench", help="measure the wire protocol's throughput or an algorithm's overhead"
    )
    bench.add_argument(
        "what",
        choices=list(BENCHMARKS),
        help="; ".join(f"{name}: {what}" for name, what in BENCHMARKS.items()),
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")
    return parser


NODE_COMMANDS = ("node", "host", "join", "coordinator")
# Commands whose process ends at once when it is the command's own (`end_process`): they
# hold torch, and they close their files and sockets and stop their Ray session themselves.
ENDS_AT_ONCE = (*NODE_COMMANDS, "launch")


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """Run the `meshfl` command `argv` (the process's own arguments by default) and
    return its exit status. `own_process`: this process is the command's alone (the
    console script, `python -m`), so a command of ENDS_AT_ONCE ends it (`end_process`)."""
    args = build_parser().parse_args(argv)
    _trace_crashes()
    quiet_command = args.command not in NODE_COMMANDS
    configure_logging(logging.WARNING if quiet_command and not args.verbose else logging.INFO)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "launch": _launch,
        "node": _node,
        "host": _host,
        "coordinator": _coordinator,
        "join": _join,
        "keygen": _keygen,
        "new": _new,
        "bench": _bench,
        "experiment": _experiment,
        "report": _report,
        "status": _status,
        "config": _config,
    }
    status = command_status(partial(handlers[args.command], args))
    if own_process and args.command in ENDS_AT_ONCE:
        end_process(status)
    return status


def _trace_crashes() -> None:
    """A crash in native code (torch, zmq) prints every thread's Python stack to stderr,
    which is a node's log; the processes launch forks inherit it. Not where stderr is no
    file (a notebook, or a caller capturing it)."""
    try:
        faulthandler.enable(all_threads=True)
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
        pass


# Each command imports its module when run: most load torch, which --help, keygen and
# status do without, and which a node process loads only once its config reads well.


def _launch(args: argparse.Namespace) -> int:
    from .mesh import LaunchOptions, launch

    options = LaunchOptions(
        config_source(args),
        nodes=args.nodes,
        out=Path(args.out) if args.out else None,
        hosts=args.hosts,
        ray=args.ray,
        quiet=args.quiet,
        restarts=args.restarts,
    )
    return launch(options)


def _read_process_options(args: argparse.Namespace) -> ProcessOptions:
    """A node process's options, its config read and its fields checked here (the
    entry checks it whole again): a mistake in it answers before torch loads."""
    options = process_options(args)
    resolve_config(options.config, check=False)
    return options


def _node(args: argparse.Namespace) -> int:
    options = _read_process_options(args)
    from .entry import run_named_node

    return run_named_node(options, args.name, args.key)


def _host(args: argparse.Namespace) -> int:
    options = _read_process_options(args)
    from .hosts import hosted_names, run_host

    return run_host(options, hosted_names(args.names), args.restarts, args.join_with)


def _coordinator(args: argparse.Namespace) -> int:
    options = _read_process_options(args)
    from .entry import run_coordinator

    return run_coordinator(options, args.key)


def _join(args: argparse.Namespace) -> int:
    if args.out is None:
        args.out = str(joiner_out(args.name))
    options = _read_process_options(args)
    from .entry import run_joiner

    return run_joiner(options, args.address, args.name, args.listen, args.key)


def _keygen(args: argparse.Namespace) -> int:
    from meshfl.protocol.identity import Identity

    if Path(args.path).exists():  # name its public key, which a closed mesh's peers.yaml needs
        existing = Identity.load(args.path).public_key.hex()
        raise UserError(
            f"{args.path} already exists; refusing to overwrite a key (its public key: {existing})"
        )
    identity = Identity.generate()
    identity.save(args.path)
    print(f"wrote {Path(args.path)} (mode 0600)")
    print(f"node id:    {identity.id}")
    print(f"public key: {identity.public_key.hex()}")
    return 0


def _new(args: argparse.Namespace) -> int:
    from importlib.resources import files

    folder = Path(args.directory)
    names = ("task.py", "peers.yaml")
    taken = [str(folder / name) for name in names if (folder / name).exists()]
    if taken:
        raise UserError(f"{', '.join(taken)} already exist(s); refusing to overwrite")
    folder.mkdir(parents=True, exist_ok=True)
    templates = files("meshfl.launch") / "templates"
    for name in names:
        (folder / name).write_text((templates / name).read_text(encoding="utf-8"))
    print(f"wrote {folder / 'task.py'} and {folder / 'peers.yaml'}; run them with")
    print(f"    meshfl launch --task {folder / 'task.py'}")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from .experiment_runs import run_experiment

    return run_experiment(args)


def _report(args: argparse.Namespace) -> int:
    from .report import run_report

    return run_report(args.run_dir, args.out)


def _status(args: argparse.Namespace) -> int:
    from .status import run_status

    return run_status(args)


def _config(args: argparse.Namespace) -> int:
    from meshfl.node.config import write_schema

    write_schema(args.out)
    return 0


def _bench(args: argparse.Namespace) -> int:
    return run_benchmark(args.what, args.rest)


if __name__ == "__main__":
    sys.exit(main(own_process=True))
