"""`meshfl bench views`: what choosing neighbours by benefit costs against choosing them
at random, on one mesh, alternately.

Each repeat runs `meshfl launch --nodes N` twice, with `topology.select=benefit` and
`topology.select=random`, the rest of the config alike (`--set` changes both), and
reads what the nodes wrote: the wall time of the run, its mean test accuracy, and the
median over node-rounds of where a round's time went (metrics.jsonl `seconds`):
training, the wait for the view to fill its free places (`view_wait`), the wait for
the models (`communicate` less the view wait), aggregation and evaluation. It prints
each run, then the medians and benefit's ratio to random:

    meshfl bench views --nodes 60 --rounds 12 --repeats 3 \\
        --set data.dataset=mnist --set data.root=DIR --set data.partition=clusters:5
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from ..options import add_assignments
from ..summary import records
from .flags import add_rounds, bench_parser, positive
from .scale import run_size

SELECTIONS = ("benefit", "random")
PHASES = ("train", "view_wait", "model_wait", "aggregate", "evaluate")


def phase_medians(out: Path) -> dict[str, float]:
    """The median seconds of each phase over the run's node-rounds."""
    seconds: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for metrics in sorted(out.glob("*/metrics.jsonl")):
        for record in records(metrics):
            spent = dict(record.seconds)
            view = spent.get("view_wait", 0.0)
            if "communicate" in spent:
                spent["model_wait"] = spent["communicate"] - view
            spent["view_wait"] = view
            for phase in PHASES:
                if phase in spent:
                    seconds[phase].append(spent[phase])
    return {phase: statistics.median(values) for phase, values in seconds.items() if values}


def describe(selection: str, wall: float, accuracy: float, phases: dict[str, float]) -> str:
    split = " ".join(f"{phase}={seconds:.2f}" for phase, seconds in phases.items())
    return f"{selection}: wall_s={wall:.1f} mean_test_acc={accuracy:.4f} median s/round: {split}"


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
    walls: dict[str, list[float]] = {selection: [] for selection in SELECTIONS}
    accuracies: dict[str, list[float]] = {selection: [] for selection in SELECTIONS}
    with tempfile.TemporaryDirectory(prefix="meshfl-views-") as scratch:
        runs = args.keep or Path(scratch)
        for repeat in range(args.repeats):
            for selection in SELECTIONS:
                out = runs / f"{selection}{repeat}"
                settings = [*args.assignments, f"topology.select={selection}"]
                run = run_size(args.nodes, None, args.rounds, out, settings)
                summary = json.loads((out / "summary.json").read_text())
                walls[selection].append(run.wall_s)
                accuracies[selection].append(summary["mean_test_acc"])
                line = describe(
                    selection, run.wall_s, accuracies[selection][-1], phase_medians(out)
                )
                print(f"repeat {repeat + 1} {line}", flush=True)
    medians = {selection: statistics.median(walls[selection]) for selection in SELECTIONS}
    print(
        f"medians: benefit wall_s={medians['benefit']:.1f} "
        f"mean_test_acc={statistics.median(accuracies['benefit']):.4f}; random "
        f"wall_s={medians['random']:.1f} "
        f"mean_test_acc={statistics.median(accuracies['random']):.4f}; "
        f"benefit/random wall={medians['benefit'] / medians['random']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
