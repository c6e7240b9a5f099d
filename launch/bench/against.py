"""`meshfl bench against`: a mesh of N local nodes beside another program doing the
same job, run alternately, so that a noisy machine treats both alike.

Each repeat runs `meshfl launch --nodes N` (as `meshfl bench scale` does: the real
thing, its PSS sampled each second over its whole process tree), then the other
command, whose process tree is sampled the same way (a Ray daemon it starts is in that
tree). It prints each run, with meshfl's mean test accuracy and the last line the other
command printed (where it says what it reached), then the medians and meshfl's ratios
to the other. Flower's job as a task, so that the accuracies compare too:

    meshfl bench against --nodes 100 --rounds 5 --repeats 3 \\
        --set task=examples/flower_digits_task.py --set algorithm.name=fedavg \\
        -- python flower_fedavg_digits.py --nodes 100 --rounds 5
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..options import add_assignments
from .flags import add_rounds, bench_parser, positive
from .scale import PeakPss, run_size


def measure(command: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak PSS (MB) and the last line printed of `command`, which must
    exit 0."""
    clock = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pss = PeakPss([process.pid])
    stdout, stderr = process.communicate()
    wall = time.perf_counter() - clock
    peak = pss.stop()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {stderr.decode()[-800:]}")
    lines = stdout.decode(errors="replace").strip().splitlines()
    return wall, peak, lines[-1] if lines else ""


def mean_test_accuracy(out: Path) -> float:
    """The mean final test accuracy of a launch's nodes (summary.json)."""
    return float(json.loads((out / "summary.json").read_text())["mean_test_acc"])


def main(argv: list[str]) -> int:
    parser = bench_parser(
        "against",
        "Wall time and peak PSS of `meshfl launch --nodes N` and of another command "
        "doing the same job, run alternately; medians and meshfl's ratios.",
    )
    parser.add_argument("--nodes", type=positive(int), default=100, help="nodes (default: 100)")
    add_rounds(parser, 5, "rounds (default: 5)")
    parser.add_argument(
        "--repeats", type=positive(int), default=3, help="runs of each (default: 3)"
    )
    add_assignments(parser, "a config change for the meshfl runs, repeatable")
    parser.add_argument("other", nargs="+", help="the other command, after --")
    args = parser.parse_args(argv)
    mine: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    accuracies: list[float] = []
    with tempfile.TemporaryDirectory(prefix="meshfl-against-") as scratch:
        for repeat in range(args.repeats):
            out = Path(scratch) / f"run{repeat}"
            run = run_size(args.nodes, None, args.rounds, out, args.assignments)
            mine.append((run.wall_s, run.pss_mb))
            accuracies.append(mean_test_accuracy(out))
            wall, pss, said = measure(args.other)
            theirs.append((wall, pss))
            print(
                f"repeat {repeat + 1}: meshfl wall_s={run.wall_s:.1f} pss_mb={run.pss_mb:.0f}"
                f" mean_test_acc={accuracies[-1]:.4f} | other wall_s={wall:.1f}"
                f" pss_mb={pss:.0f} said: {said}",
                flush=True,
            )
    my_wall, other_wall = (statistics.median(w for w, _ in runs) for runs in (mine, theirs))
    my_pss, other_pss = (statistics.median(p for _, p in runs) for runs in (mine, theirs))
    print(
        f"medians: meshfl wall_s={my_wall:.1f} pss_mb={my_pss:.0f}; "
        f"other wall_s={other_wall:.1f} pss_mb={other_pss:.0f}; "
        f"meshfl/other: wall={my_wall / other_wall:.2f}x pss={my_pss / other_pss:.2f}x; "
        f"meshfl mean_test_acc median={statistics.median(accuracies):.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
