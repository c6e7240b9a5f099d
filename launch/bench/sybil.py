"""`meshfl bench sybil`: an open mesh against many cheap identities (WIRE.md 7.7).

Runs one bounded mesh of H honest nodes twice, alternately per repeat: alone, and with
S Sybil identities beside them that sit on `--addresses` addresses, several identities
to an address on ports of their own. Every node listens on the loopback, on an address
that stands for a machine of its own network: honest node i on 127.(1 + i // 256).
(i % 256).1, a /24 of its own, the Sybils' addresses on 127.200.j.1 and on; with
`topology.group_by=network` a node groups them as it would a mesh spread over the
internet. The Sybils run `attack.kind=relay:<noise>`: each publishes an honest model it
received the round before with a little noise added, the most helpful-looking thing an
identity that does no work can publish, and otherwise runs the protocol as any node
does (it greets, shuffles and answers). The loopback's 127.x.y.z addresses bind as they
do on Linux.

Per round of the run with Sybils it prints, over the honest nodes' neighbours at the
round's end: the Sybils' share of all their places, the honest node with the smallest
share of honest neighbours, and the Sybils' share of the honest nodes' aggregation
weight. Then,
from `--from-round` on: the worst node and round, the largest share, and the honest
nodes' mean test accuracy with and without the Sybils.

With `--restart-at R` each run has a node host per 10 nodes and restarts a host that
dies (`--restarts 1`); once the nodes of node0's host (honest ones) have recorded
round R - 1, that host is killed (SIGKILL) and comes back from its nodes' checkpoints
while the Sybils stay. For each of its nodes the bench then prints how many of its
anchors (those its last checkpoint named) it began its first round back with, and the
first round it then ended with a full view of honest neighbours. The command of the
measurements (docs/defences.md):

    meshfl bench sybil --honest 100 --sybils 100 --addresses 1 --rounds 15 \\
        --set data.dataset=mnist --set data.root=DIR --set data.samples_per_node=200
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from meshfl.node import config as cfgmod
from meshfl.node.metrics import RoundRecord
from meshfl.protocol.ports import free_ports

from ..options import ConfigSource, add_assignments, resolve_config
from ..run_folder import RunRecords, read_run
from .faults import hosts_in_round, kill_hosts, rounds_recorded
from .flags import add_rounds, bench_parser, positive

SYBIL_NETWORKS_FROM = 200  # 127.200.0.1 and on: the Sybils' addresses; honest ones below
BENCH_SETTINGS = ("topology.neighbours=8", "topology.select=benefit", "topology.group_by=network")
RESTARTED_HOST_NODES = 10  # nodes per host where a host is killed and restarted


def non_negative(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a finite number >= 0")
    return value


def honest_address(index: int) -> str:
    return f"127.{1 + index // 256}.{index % 256}.1"


def sybil_address(index: int) -> str:
    return f"127.{SYBIL_NETWORKS_FROM + index // 256}.{index % 256}.1"


def sybil_mesh(
    settings: list[str], honest: int, sybils: int, addresses: int, noise: float
) -> cfgmod.MeshConfig:
    """The mesh of `honest` nodes node0.. and `sybils` identities sybil0.. spread over
    `addresses` addresses (the rest of the config from `settings`)."""
    cfg = resolve_config(ConfigSource(overrides=(*BENCH_SETTINGS, *settings)), check=False)
    peers = [
        cfgmod.PeerConfig(name=f"node{i}", listen=f"tcp://{ip}:{free_ports(1, ip)[0]}")
        for i, ip in enumerate(honest_address(i) for i in range(honest))
    ]
    sybil_peers: list[cfgmod.PeerConfig] = []
    for place in range(min(addresses, sybils)):
        ip = sybil_address(place)
        here = range(place, sybils, addresses)  # identity k on address k mod `addresses`
        for k, port in zip(here, free_ports(len(here), ip), strict=True):
            sybil_peers.append(cfgmod.PeerConfig(name=f"sybil{k}", listen=f"tcp://{ip}:{port}"))
    attack = cfgmod.AttackConfig(
        nodes=[peer.name for peer in sybil_peers], kind=f"relay:{noise}" if sybils else ""
    )
    return replace(cfg, peers=peers + sybil_peers, attack=attack)


def run_mesh_once(cfg: cfgmod.MeshConfig, out: Path, restart_at: int | None = None) -> MeshRun:
    """`meshfl launch` of `cfg` (written under `out`) to its end, killing and restarting
    node0's host once its nodes recorded round `restart_at` - 1 where one is given: its
    wall seconds, and the rounds the killed nodes had recorded by then."""
    out.mkdir(parents=True)
    config = out.parent / f"{out.name}.yaml"
    cfgmod.save_config(cfg, config)
    command = [sys.executable, "-m", "meshfl.launch.cli", "launch", "--config", str(config)]
    command += ["--out", str(out), "--quiet"]
    if restart_at is not None:
        hosts = math.ceil(len(cfg.peers) / RESTARTED_HOST_NODES)
        command += ["--hosts", str(hosts), "--restarts", "1"]
    clock = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "wb") as log:  # a pipe unread would fill
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    killed: dict[str, int] = {}
    try:
        if restart_at is not None:
            hosts_now = hosts_in_round(process, out, restart_at, least=2)
            first = [host for host in hosts_now if cfg.peers[0].name in host["nodes"]]
            kill_hosts(first)
            killed = {name: rounds_recorded(out / name) for host in first for name in host["nodes"]}
            if not killed:
                print(f"  the run ended before round {restart_at}: nothing was killed")
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode not in (0, 3):
        tail = (out.parent / f"{out.name}.log").read_text(errors="replace")[-800:]
        raise RuntimeError(f"meshfl launch failed: {tail}")
    return MeshRun(time.perf_counter() - clock, killed)


@dataclass(frozen=True)
class MeshRun:
    """A run's wall seconds, and the nodes killed mid-run with the last round each had
    recorded then (none where no host was killed)."""

    wall: float
    killed: dict[str, int]


def _view_size(cfg: cfgmod.MeshConfig) -> int:
    views = cfg.topology.views(len(cfg.peers))
    return views.neighbours if views is not None else len(cfg.peers) - 1


def comebacks(run: RunRecords, killed: dict[str, int], neighbours: int) -> list[str]:
    """One line per node that was killed: its anchors at its last checkpoint, how many
    of them its first round back began with (a resumed node may skip to its
    neighbours' round), and the first round it then ended with `neighbours`
    neighbours, all honest."""
    lines = []
    for name, last in sorted(killed.items()):
        history = run.history.get(name, [])
        before = next((record for record in history if record.round == last), None)
        anchors = set(before.anchors or []) if before else set()
        back = [record for record in history if record.round > last]
        text = f"{name} (died in round {last + 1}): "
        if not back:
            lines.append(text + "no round recorded after")
            continue
        greeted = len(anchors & set(back[0].neighbours or []))
        full = [
            record.round
            for record in back
            if len(_view_at_end(record)) >= neighbours
            and not set(_view_at_end(record)) & run.attackers
        ]
        text += (
            f"{greeted} of its {len(anchors)} anchors among the neighbours it began round "
            f"{back[0].round} with; "
        )
        lines.append(
            text
            + (
                f"first full honest view at the end of round {full[0]}"
                if full
                else "no full honest view again"
            )
        )
    return lines


@dataclass(frozen=True)
class RoundTake:
    """Over the honest nodes' views at one round's end: the Sybils' share of their
    places, the node with the smallest share of honest neighbours (how many of how
    many), and the Sybils' mean share of their aggregation weight."""

    round: int
    sybil_places: float
    worst_node: str
    worst_honest: int
    worst_of: int
    sybil_weight: float


def round_takes(run: RunRecords) -> list[RoundTake]:
    """One RoundTake per round any honest node recorded, in order."""
    by_round: dict[int, list[tuple[str, RoundRecord]]] = {}
    for name, record in run.node_rounds():
        if name not in run.attackers:
            by_round.setdefault(record.round, []).append((name, record))
    return [_take(number, rows, run.attackers) for number, rows in sorted(by_round.items())]


def _take(number: int, rows: list[tuple[str, RoundRecord]], sybils: frozenset[str]) -> RoundTake:
    views = {name: _view_at_end(record) for name, record in rows}
    places = sum(len(view) for view in views.values())
    taken = sum(peer in sybils for view in views.values() for peer in view)
    honest = {name: sum(peer not in sybils for peer in view) for name, view in views.items()}
    worst = min(views, key=lambda name: (_share(honest[name], len(views[name])), honest[name]))
    weights = [sum(w for peer, w in record.weights.items() if peer in sybils) for _, record in rows]
    return RoundTake(
        number,
        taken / places if places else 0.0,
        worst,
        honest[worst],
        len(views[worst]),
        statistics.fmean(weights),
    )


def _share(honest: int, of: int) -> float:
    """The share of honest neighbours in a view of `of` (an empty view has none): what
    the worst node is chosen by."""
    return honest / of if of else 0.0


def _view_at_end(record: RoundRecord) -> list[str]:
    """The neighbours a round ended with (those it began with, for a record that lacks
    them)."""
    view = record.neighbours if record.neighbours_at_end is None else record.neighbours_at_end
    return view or []


def honest_accuracy(run: RunRecords) -> float:
    """The honest nodes' mean test accuracy in their last round (nan without any)."""
    last = [
        rounds[-1].test_acc
        for name, rounds in run.history.items()
        if name not in run.attackers and rounds
    ]
    scores = [accuracy for accuracy in last if accuracy is not None]
    return statistics.fmean(scores) if scores else math.nan


def describe(takes: list[RoundTake], from_round: int) -> str:
    later = [take for take in takes if take.round >= from_round] or takes
    if not later:
        return "no honest node recorded a round"
    worst = min(later, key=lambda take: (_share(take.worst_honest, take.worst_of), take.round))
    return (
        f"from round {from_round}: worst node {worst.worst_node} with "
        f"{worst.worst_honest} of {worst.worst_of} neighbours honest (round {worst.round}); "
        f"Sybils' share of honest places at most {max(t.sybil_places for t in later):.3f} "
        f"(mean {statistics.fmean(t.sybil_places for t in later):.3f}), of their weight "
        f"at most {max(t.sybil_weight for t in later):.3f}"
    )


def main(argv: list[str]) -> int:
    parser = bench_parser("sybil", __doc__, preformatted=True)
    parser.add_argument("--honest", type=positive(int), default=100, help="honest nodes")
    parser.add_argument("--sybils", type=positive(int), default=100, help="Sybil identities")
    parser.add_argument(
        "--addresses", type=positive(int), default=1, help="addresses the Sybils share"
    )
    parser.add_argument(
        "--noise",
        type=non_negative,
        default=1e-3,
        help="the relayed models' noise, in each tensor's scale (relay:<s>; default 0.001)",
    )
    add_rounds(parser, 15, "rounds (default: 15)")
    parser.add_argument("--repeats", type=positive(int), default=1, help="runs of each")
    parser.add_argument(
        "--from-round", type=positive(int), default=5, help="first round of the summary"
    )
    add_assignments(parser, "a config change for both runs, repeatable")
    parser.add_argument(
        "--restart-at",
        type=positive(int),
        metavar="ROUND",
        help="kill node0's host in this round and restart it (see above)",
    )
    parser.add_argument("--keep", metavar="DIR", type=Path, help="keep the runs under DIR")
    args = parser.parse_args(argv)
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep}: not empty; the runs go into a folder of their own")
    if args.restart_at is not None and not 2 <= args.restart_at < args.rounds:
        parser.error(f"--restart-at {args.restart_at}: must be after round 1 and before the last")
    if args.restart_at is not None and args.honest < RESTARTED_HOST_NODES:
        parser.error(
            f"--restart-at: needs --honest {RESTARTED_HOST_NODES} or more (the host it kills "
            "must hold honest nodes only)"
        )
    settings = [*args.assignments, f"rounds={args.rounds}"]
    accuracy: dict[int, list[float]] = {0: [], args.sybils: []}
    with tempfile.TemporaryDirectory(prefix="meshfl-sybil-") as scratch:
        runs = args.keep or Path(scratch)
        for repeat in range(args.repeats):
            for sybils in (0, args.sybils):
                cfg = sybil_mesh(settings, args.honest, sybils, args.addresses, args.noise)
                out = runs / f"sybils{sybils}-{repeat}"
                done = run_mesh_once(cfg, out, args.restart_at)
                run = read_run(out, attackers=frozenset(cfg.attack.nodes))
                accuracy[sybils].append(honest_accuracy(run))
                print(
                    f"repeat {repeat + 1}, {sybils} Sybils on {args.addresses} addresses: "
                    f"wall_s={done.wall:.1f} honest mean_test_acc={accuracy[sybils][-1]:.4f}",
                    flush=True,
                )
                for line in comebacks(run, done.killed, _view_size(cfg)):
                    print("  " + line, flush=True)
                if sybils:
                    takes = round_takes(run)
                    for take in takes:
                        print(
                            f"  round {take.round}: Sybil places {take.sybil_places:.3f}, "
                            f"worst {take.worst_node} {take.worst_honest}/{take.worst_of} "
                            f"honest, Sybil weight {take.sybil_weight:.3f}"
                        )
                    print("  " + describe(takes, args.from_round), flush=True)
    print(
        f"honest mean test accuracy, medians: {statistics.median(accuracy[args.sybils]):.4f} "
        f"with {args.sybils} Sybils, {statistics.median(accuracy[0]):.4f} without"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
