"""`meshfl bench views`: what choosing neighbours by benefit costs against choosing them
at random, on one mesh, alternately.

Each repeat runs `meshfl launch --nodes N` twice, with `topology.select=benefit` and
`topology.select=random` (benefit first in the first repeat, the order swapped every
other repeat), the rest of the config alike (`--set` changes both), and
reads what the nodes wrote: the wall time of the run, its mean test accuracy, and the
median over node-rounds of where a round's time went (metrics.jsonl `seconds`):
training, the wait for the view to fill its free places (`view_wait`), the wait for
the models (`communicate` less the view wait), aggregation and evaluation; beside them
the CPU seconds the whole run took (every process of it, the launcher's included), and
of them what the nodes' rounds spent on their own threads (`node`: training,
screening, aggregation) and on their endpoints' worker and transport threads
(`endpoint`: signatures, decoding, heartbeats), each round's `cpu_seconds` summed
(Linux). Not in either: ZeroMQ's threads (encryption, TCP), start-up, checkpoints and
the launcher. Then the neighbours new to a node in a round (`tried`: candidates on
trial), and the models and bytes a node took in a round. On one machine that holds the
whole mesh, wall time follows the CPU the mesh spends, and a node that took in more of
its peers' models spent more of it. It prints each run, then the medians and benefit's
ratios to random:

    meshfl bench views --nodes 60 --rounds 12 --repeats 3 \\
        --set data.dataset=mnist --set data.root=DIR --set data.partition=clusters:5
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

from meshfl.node.metrics import RoundRecord

from ..options import add_assignments
from ..run_folder import node_records
from .flags import add_rounds, bench_parser, positive
from .scale import run_size

SELECTIONS = ("benefit", "random")
PHASES = ("train", "view_wait", "model_wait", "aggregate", "evaluate")


def run_records(out: Path) -> list[RoundRecord]:
    """Every round record of the run in `out`, read once."""
    return [
        record
        for metrics in sorted(out.glob("*/metrics.jsonl"))
        for record in node_records(metrics.parent)
    ]


def phase_medians(rows: list[RoundRecord]) -> dict[str, float]:
    """The median seconds of each phase over the run's node-rounds."""
    seconds: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for record in rows:
        spent = dict(record.seconds)
        view = spent.get("view_wait", 0.0)
        if "communicate" in spent:
            spent["model_wait"] = spent["communicate"] - view
        spent["view_wait"] = view
        for phase in PHASES:
            if phase in spent:
                seconds[phase].append(spent[phase])
    return {phase: statistics.median(values) for phase, values in seconds.items() if values}


def trial_wait(record: RoundRecord) -> float:
    """How long the round's wait for models went on for its candidates on trial (the
    neighbours new to it, `tried`) after the last of its other neighbours' blobs came:
    what trying candidates added to the round (`seconds` of transport_fetches)."""
    tried = set(record.tried or ())
    came = [
        (fetch["origin"] in tried, fetch["seconds"]) for fetch in record.transport_fetches or ()
    ]
    trials = [seconds for on_trial, seconds in came if on_trial]
    others = [seconds for on_trial, seconds in came if not on_trial]
    return max(0.0, max(trials, default=0.0) - max(others, default=0.0))


def intake(rows: list[RoundRecord]) -> dict[str, float]:
    """Per node-round after the first (where every neighbour is new), means: the
    neighbours new to the node (`tried`), the models it fetched, the MB it took in, and
    the seconds its candidates on trial added to its wait (`trial_wait`)."""
    later = [record for record in rows if record.round > 1]
    if not later:
        return {}
    return {
        "tried": statistics.mean(len(record.tried or ()) for record in later),
        "models_in": statistics.mean(
            len((record.fetched or {}).get("model", ())) for record in later
        ),
        "mb_in": statistics.mean(record.bytes_in or 0 for record in later) / 1e6,
        "trial_wait": statistics.mean(trial_wait(record) for record in later),
    }


def cpu_by_thread(rows: list[RoundRecord]) -> dict[str, float]:
    """The CPU seconds the run's node-rounds spent, by thread (`cpu_seconds`), summed."""
    spent: Counter[str] = Counter()
    for record in rows:
        spent.update(record.cpu_seconds or {})
    return dict(spent)


def children_cpu_s() -> float:
    """CPU seconds of every process this one has waited for (a launch's, its forks')."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def describe(selection: str, wall: float, cpu: float, accuracy: float, out: Path) -> str:
    rows = run_records(out)
    phases = " ".join(f"{phase}={seconds:.2f}" for phase, seconds in phase_medians(rows).items())
    taken = " ".join(f"{what}={value:.2f}" for what, value in intake(rows).items())
    threads = " ".join(f"{thread}={seconds:.1f}" for thread, seconds in cpu_by_thread(rows).items())
    of_which = f" ({threads})" if threads else ""
    return (
        f"{selection}: wall_s={wall:.1f} cpu_s={cpu:.1f}{of_which} "
        f"mean_test_acc={accuracy:.4f} median s/round: {phases}; per node-round: {taken}"
    )


def run_order(repeat: int) -> tuple[str, ...]:
    """The selections in the order repeat `repeat` (from 0) runs them: swapped every
    other repeat, so that neither always runs first or after the other (on a busy
    machine a run can be slower for the one before it)."""
    return SELECTIONS if repeat % 2 == 0 else SELECTIONS[::-1]


def main(argv: list[str]) -> int:
    parser = bench_parser("views", __doc__, preformatted=True)
    parser.add_argument("--nodes", type=positive(int), default=60, help="nodes (default: 60)")
    add_rounds(parser, 12, "rounds (default: 12)")
    parser.add_argument(
        "--repeats", type=positive(int), default=3, help="runs of each (default: 3)"
    )
    add_assignments(parser, "a config change for both selections, repeatable")
    parser.add_argument(
        "--keep",
        metavar="DIR",
        type=Path,
        help="keep each run's folder under DIR (to read with meshfl report); default: none kept",
    )
    args = parser.parse_args(argv)
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep}: not empty; the runs go into a folder of their own")
    walls: dict[str, list[float]] = {selection: [] for selection in SELECTIONS}
    cpus: dict[str, list[float]] = {selection: [] for selection in SELECTIONS}
    accuracies: dict[str, list[float]] = {selection: [] for selection in SELECTIONS}
    with tempfile.TemporaryDirectory(prefix="meshfl-views-") as scratch:
        runs = args.keep or Path(scratch)
        for repeat in range(args.repeats):
            for selection in run_order(repeat):
                out = runs / f"{selection}{repeat}"
                settings = [*args.assignments, f"topology.select={selection}"]
                cpu_before = children_cpu_s()
                run = run_size(args.nodes, None, args.rounds, out, settings)
                cpus[selection].append(children_cpu_s() - cpu_before)
                summary = json.loads((out / "summary.json").read_text())
                walls[selection].append(run.wall_s)
                accuracies[selection].append(summary["mean_test_acc"])
                line = describe(
                    selection, run.wall_s, cpus[selection][-1], accuracies[selection][-1], out
                )
                print(f"repeat {repeat + 1} {line}", flush=True)
    wall = {selection: statistics.median(walls[selection]) for selection in SELECTIONS}
    cpu = {selection: statistics.median(cpus[selection]) for selection in SELECTIONS}
    print(
        "medians: "
        + "; ".join(
            f"{selection} wall_s={wall[selection]:.1f} cpu_s={cpu[selection]:.1f} "
            f"mean_test_acc={statistics.median(accuracies[selection]):.4f}"
            for selection in SELECTIONS
        )
        + f"; benefit/random wall={wall['benefit'] / wall['random']:.2f}x "
        f"cpu={cpu['benefit'] / cpu['random']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
