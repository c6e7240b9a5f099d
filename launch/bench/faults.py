"""`meshfl bench faults`: what a bounded mesh does when some of its processes die at
once (by default 2 of 10 hosts: a fifth of the nodes).

It runs `meshfl launch --nodes N --hosts H` (no restarts) in a child process and
waits until every node has recorded round AT - 1, so that all are in round AT; then it
kills `--kill` of the host processes, chosen at random (seeded), with SIGKILL: their
nodes vanish mid-round without a bye, as in a power cut. The launch goes on with the
others. Afterwards it reads what the survivors wrote and prints:

- how many survivors finished the last round (all of them should), and which skipped a
  round after the kill (one held back past its neighbours' round goes on from theirs);
- round by round, how many survivors began the round with a full view of live
  neighbours (`topology.neighbours`; a dead neighbour not yet noticed does not count),
  their mean number of live neighbours then, and how many ended the round (its models
  in, no neighbour dropped yet) with a full view;
- how many rounds after the kill until every survivor's view had been full again (at
  a round's start or end, each in its own round), until every survivor began one
  round with a full view, and ended one so (all in the same round: a node drops
  neighbours after each round and greets candidates in their place while the next
  round runs, so some views are short even when no one died), and how many until the
  survivors' mean at a round's start was back at its level before the kill;
- the survivors' mean test accuracy at their last round, and how often a survivor
  marked another survivor down (a live peer taken for dead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod
from meshfl.node.metrics import RoundRecord

from ..options import add_assignments
from ..run_folder import last_record, node_records
from .flags import add_rounds, bench_parser, positive
from .scale import DOWN_MARK, launch_command

# How often the benchmark looks at the nodes' metrics while it waits for the kill round.
LOOK_EVERY_S = 0.5


@dataclass
class RoundViews:
    """The survivors' views in round `number`: when it began, and when its models were
    in (before the node dropped any neighbour)."""

    number: int
    survivors: int  # that recorded the round
    full_at_start: int  # of those, how many began it with a full view of live neighbours
    mean_at_start: float  # live neighbours when it began, mean over the survivors
    full_at_end: int  # how many ended it with a full view of live neighbours


def main(argv: list[str]) -> int:
    parser = bench_parser("faults", __doc__, preformatted=True)
    parser.add_argument("--nodes", type=positive(int), default=100, help="mesh size")
    parser.add_argument(
        "--hosts", type=positive(int), default=10, help="node host processes (default 10)"
    )
    parser.add_argument(
        "--kill", type=positive(int), default=2, help="host processes to kill (default 2)"
    )
    parser.add_argument(
        "--at", type=positive(int), default=3, help="the round during which they die (default 3)"
    )
    add_rounds(parser, 10, "rounds (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="which hosts die (default 0)")
    add_assignments(parser, "a config change for the run, repeatable")
    parser.add_argument(
        "--keep", metavar="DIR", default=None, help="keep the run's folder in DIR (a new folder)"
    )
    args = parser.parse_args(argv)
    problem = _problem_with(args)
    if problem:
        parser.error(problem)
    with tempfile.TemporaryDirectory(prefix="meshfl-faults-") as scratch:
        out = Path(args.keep or scratch) / "run"
        out.mkdir(parents=True)
        command = launch_command(args.nodes, args.hosts, args.rounds, out, args.assignments)
        clock = time.perf_counter()
        # The launch's (and its hosts') errors go to a file: a pipe nobody reads while
        # the run goes on would fill up and stop them.
        with open(out / "launch.log", "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            rng = random.Random(args.seed)
            dead = kill_hosts_in_round(process, out, args.at, args.kill, rng)
            process.wait()
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait()
        wall = time.perf_counter() - clock
        if not dead:
            tail = (out / "launch.log").read_text(errors="replace")[-800:]
            raise RuntimeError(f"the launch ended before round {args.at}: {tail}")
        report(out, dead, args.rounds, args.at, wall)
    return 0


def _problem_with(args: argparse.Namespace) -> str | None:
    """What makes the flags unable to measure what the benchmark measures, or None."""
    if args.kill >= args.hosts:
        return f"--kill {args.kill}: must leave at least one of the {args.hosts} hosts"
    if not 2 <= args.at < args.rounds:
        return f"--at {args.at}: must be a round after the first and before the last"
    if args.keep and (Path(args.keep) / "run").exists():
        return f"--keep {args.keep}: holds a run already; give a new folder"
    cfg = cfgmod.apply_overrides(cfgmod.MeshConfig(), args.assignments)
    if cfg.topology.views(args.nodes) is None:
        return (
            f"{args.nodes} nodes run as a full mesh here; it measures bounded views "
            "(more than 32 nodes, or --set topology.neighbours=K)"
        )
    return None


def kill_hosts_in_round(
    process: subprocess.Popen[bytes], out: Path, round_no: int, count: int, rng: random.Random
) -> set[str]:
    """Once every node of a live host of the launch `process` (writing to `out`) has
    recorded round `round_no` - 1, SIGKILL `count` of those hosts drawn by `rng`; the
    names of their nodes (none if the launch ended first)."""
    hosts = hosts_in_round(process, out, round_no, least=count + 1)
    return kill_hosts(rng.sample(hosts, count)) if hosts else set()


def hosts_in_round(
    process: subprocess.Popen[bytes], out: Path, round_no: int, least: int = 1
) -> list[dict[str, Any]]:
    """The live node hosts of the launch `process` (writing to `out`), once at least
    `least` are listed and every node of theirs has recorded round `round_no` - 1 (none
    if the launch ended first)."""
    while process.poll() is None:
        hosts = [host for host in _listed_hosts(out, process.pid) if _alive(host["pid"])]
        nodes = [name for host in hosts for name in host["nodes"]]
        if len(hosts) >= least and all(
            rounds_recorded(out / name) >= round_no - 1 for name in nodes
        ):
            return hosts
        time.sleep(LOOK_EVERY_S)
    return []


def kill_hosts(hosts: list[dict[str, Any]]) -> set[str]:
    """SIGKILL the node hosts `hosts`: the names of their nodes."""
    for host in hosts:
        with contextlib.suppress(ProcessLookupError):  # it ended just now
            os.kill(host["pid"], signal.SIGKILL)
    return {name for host in hosts for name in host["nodes"]}


def _listed_hosts(out: Path, launcher: int) -> list[dict[str, Any]]:
    """The node hosts processes.json lists, once the launch `launcher` has written it."""
    try:
        listing = json.loads((out / "processes.json").read_text())
    except (OSError, ValueError):
        return []  # not written yet
    if listing.get("launcher") != launcher:
        return []
    return [host for host in listing["processes"] if len(host["nodes"]) > 1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def rounds_recorded(folder: Path) -> int:
    """The last round a node's metrics file records (0 when none yet)."""
    record = last_record(folder)
    return record.round if record else 0


def report(out: Path, dead: set[str], rounds: int, killed_in: int, wall: float) -> None:
    """Print what the survivors of the run in `out` wrote (see the module's docstring)."""
    cfg = cfgmod.load_config(out / "config.yaml")
    views = cfg.topology.views(len(cfg.peers))
    assert views is not None, "a full mesh is refused before the run (_problem_with)"
    survivors = {peer.name: node_records(out / peer.name) for peer in cfg.peers}
    survivors = {name: lines for name, lines in survivors.items() if name not in dead}
    finished = sum(1 for lines in survivors.values() if lines and lines[-1].round >= rounds)
    skipped = skipped_after(survivors, killed_in)
    print(
        f"nodes={len(cfg.peers)} killed={len(dead)} in round {killed_in} "
        f"survivors={len(survivors)} finished_the_last_round={finished} "
        f"skipped_a_round_after_the_kill={len(skipped)} wall_s={wall:.1f}"
    )
    if skipped:
        print(f"survivors that skipped a round after the kill: {', '.join(skipped)}")
    table = view_rounds(survivors, dead, views.neighbours, rounds)
    full = f"full view ({views.neighbours} live neighbours)"
    print(f"round  survivors  {full} at start  mean live at start  {full} at end")
    for each in table:
        print(
            f"{each.number:>5}  {each.survivors:>9}  {each.full_at_start:>{len(full) + 9}}"
            f"  {each.mean_at_start:>18.1f}  {each.full_at_end:>{len(full) + 7}}"
        )
    # A node drops neighbours after each round and greets candidates in their place while
    # the next one runs, so some views begin a round short even with no one dead: a view
    # is refilled when it ends a round full, and the level of views at a round's start
    # before the kill (rounds 2 to the kill's) is the mark to get back to.
    before = statistics.fmean(each.mean_at_start for each in table[1:killed_in])
    began = first_round_after(table, killed_in, lambda each: each.full_at_start == each.survivors)
    ended = first_round_after(table, killed_in, lambda each: each.full_at_end == each.survivors)
    level = first_round_after(table, killed_in, lambda each: each.mean_at_start >= before)
    refilled = each_refilled(survivors, dead, views.neighbours, killed_in)
    print(
        f"rounds after the kill until every survivor's view had been full again: {refilled}; "
        f"until every survivor began a round with a full view: {began}, ended one so: "
        f"{ended}; until the mean at a round's start was back at its level before the kill "
        f"({before:.1f}): {level}"
    )
    accuracies = [
        lines[-1].test_acc
        for lines in survivors.values()
        if lines and lines[-1].test_acc is not None
    ]
    print(
        f"survivors' mean test accuracy {statistics.fmean(accuracies or [0.0]):.3f}; "
        f"survivors marked down by survivors: {live_marked_down(out, survivors)}"
    )


def skipped_after(survivors: dict[str, list[RoundRecord]], killed_in: int) -> list[str]:
    """The survivors that skipped a round from the kill's (`killed_in`) on: a node held
    back past its neighbours' round (waiting for a dead one's model until it was marked
    down) goes on from theirs (node/runtime.py, `_keep_up`), without that round's
    training. Every node had recorded the round before the kill's when it came."""
    return sorted(
        name
        for name, lines in survivors.items()
        if has_a_gap([record.round for record in lines if record.round >= killed_in - 1])
    )


def has_a_gap(rounds: list[int]) -> bool:
    """Whether the rising round numbers `rounds` miss one between their first and last."""
    return bool(rounds) and rounds != list(range(rounds[0], rounds[-1] + 1))


def first_round_after(
    table: list[RoundViews], killed_in: int, holds: Callable[[RoundViews], bool]
) -> str:
    """How many rounds after round `killed_in` the first round of `table` that `holds`
    came, in words."""
    found = next((each.number for each in table if each.number > killed_in and holds(each)), None)
    return "never" if found is None else f"{found - killed_in} (round {found})"


def each_refilled(
    survivors: dict[str, list[RoundRecord]], dead: set[str], full: int, killed_in: int
) -> str:
    """How many rounds after round `killed_in` every survivor had had a full view again,
    at the start or the end of a round of its own, in words."""
    latest = killed_in
    for lines in survivors.values():
        refilled = next(
            (
                record.round
                for record in lines
                if record.round > killed_in
                and max(
                    len(set(record.neighbours or ()) - dead),
                    len(set(record.neighbours_at_end or ()) - dead),
                )
                >= full
            ),
            None,
        )
        if refilled is None:
            return "never"
        latest = max(latest, refilled)
    return f"{latest - killed_in} (round {latest})"


def view_rounds(
    survivors: dict[str, list[RoundRecord]], dead: set[str], full: int, rounds: int
) -> list[RoundViews]:
    """For each round, the survivors' live neighbours when it began and ended."""
    table = []
    for number in range(1, rounds + 1):
        recorded = [
            record for lines in survivors.values() for record in lines if record.round == number
        ]
        at_start = [len(set(record.neighbours or ()) - dead) for record in recorded]
        at_end = [len(set(record.neighbours_at_end or ()) - dead) for record in recorded]
        table.append(
            RoundViews(
                number,
                len(recorded),
                sum(n >= full for n in at_start),
                statistics.fmean(at_start or [0]),
                sum(n >= full for n in at_end),
            )
        )
    return table


def live_marked_down(out: Path, survivors: dict[str, list[RoundRecord]]) -> int:
    """How many times a survivor's log marked another survivor down."""
    return sum(
        1
        for name in survivors
        for match in DOWN_MARK.finditer((out / name / "node.log").read_text(errors="replace"))
        if match.group(1) in survivors
    )
