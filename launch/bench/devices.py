"""`meshfl bench devices`: one mesh trained on the CPU and on this machine's GPU, alternately.

Each repeat runs `meshfl launch --nodes N` once per device (`--set device=cpu`, then
`--set device=cuda`, or the devices `--devices` names), one node per host process so
that a process's GPU memory is one node's, the rest of the config alike. It prints each
run's wall time, total PSS, the median over node-rounds of the training and evaluation
seconds, the bytes a node took in per round, its mean test accuracy and, on a GPU, the
most memory one node allocated there; then the medians and the ratios of each device to
the CPU, and how many such nodes one GPU's memory would hold. The default job is the
README's: ResNet-18 on CIFAR-10 from an ImageFolder root, 4 nodes x 3 rounds:

    meshfl bench devices --task examples/resnet18_cifar10_task.py --set data.root=DIR

A machine without a GPU runs the CPU alone and says so.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..options import add_assignments
from .flags import add_rounds, bench_parser, positive
from .scale import run_size
from .views import run_records

PHASES = ("train", "evaluate")


@dataclass
class DeviceRun:
    device: str
    wall_s: float
    pss_mb: float
    accuracy: float
    phases: dict[str, float]  # median seconds per node-round
    mb_in: float  # taken in per node-round
    device_mb: float | None  # the most one node allocated on its GPU

    def line(self) -> str:
        phases = " ".join(f"{phase}_s={seconds:.2f}" for phase, seconds in self.phases.items())
        memory = f" gpu_mb_per_node={self.device_mb:.0f}" if self.device_mb is not None else ""
        return (
            f"device={self.device} wall_s={self.wall_s:.1f} pss_mb={self.pss_mb:.0f} "
            f"{phases} mb_in_per_node_round={self.mb_in:.1f} "
            f"mean_test_acc={self.accuracy:.4f}{memory}"
        )


def run_on(device: str, nodes: int, rounds: int, out: Path, settings: list[str]) -> DeviceRun:
    run = run_size(nodes, nodes, rounds, out, [*settings, f"device={device}"])
    rows = run_records(out)
    phases = {
        phase: statistics.median(row.seconds[phase] for row in rows if phase in row.seconds)
        for phase in PHASES
        if any(phase in row.seconds for row in rows)
    }
    memory = [row.device_memory_mb for row in rows if row.device_memory_mb is not None]
    return DeviceRun(
        device,
        run.wall_s,
        run.pss_mb,
        json.loads((out / "summary.json").read_text())["mean_test_acc"],
        phases,
        statistics.mean(row.bytes_in or 0 for row in rows) / 1e6 if rows else 0.0,
        max(memory) if memory else None,
    )


def cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_memory_mb() -> float:
    """The first CUDA GPU's memory. Asked after the runs: asking makes a CUDA context in
    this process, which would hold GPU memory beside the nodes'."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**20


def main(argv: list[str]) -> int:
    parser = bench_parser("devices", __doc__, preformatted=True)
    parser.add_argument("--nodes", type=positive(int), default=4, help="nodes (default: 4)")
    add_rounds(parser, 3, "rounds (default: 3)")
    parser.add_argument("--repeats", type=positive(int), default=1, help="runs of each device")
    parser.add_argument(
        "--task",
        default="examples/resnet18_cifar10_task.py",
        help="the task file (default: examples/resnet18_cifar10_task.py)",
    )
    parser.add_argument(
        "--devices",
        default="cpu,cuda",
        help="the devices to compare, comma-separated, the first the reference "
        "(default: cpu,cuda; cuda is skipped where torch sees no GPU)",
    )
    add_assignments(parser, "a config change for every run, repeatable")
    args = parser.parse_args(argv)
    named = [device for device in args.devices.split(",") if device]
    gpus = cuda_gpus()
    devices = [device for device in named if gpus or not device.startswith("cuda")]
    if len(devices) < len(named):
        print("torch sees no CUDA GPU on this machine: its runs are skipped", flush=True)
    if not devices:
        parser.error(f"--devices {args.devices}: nothing this machine can run")
    settings = [f"task={args.task}", *args.assignments]
    runs: dict[str, list[DeviceRun]] = {device: [] for device in devices}
    with tempfile.TemporaryDirectory(prefix="meshfl-devices-") as scratch:
        for repeat in range(args.repeats):
            for device in devices:
                out = Path(scratch) / f"{device.replace(':', '')}{repeat}"
                run = run_on(device, args.nodes, args.rounds, out, settings)
                runs[device].append(run)
                print(f"repeat {repeat + 1} {run.line()}", flush=True)
    reference = devices[0]
    wall = {device: statistics.median(r.wall_s for r in runs[device]) for device in devices}
    train = {
        device: statistics.median(r.phases.get("train", float("nan")) for r in runs[device])
        for device in devices
    }
    for device in devices[1:]:
        print(
            f"{reference}/{device}: wall={wall[reference] / wall[device]:.2f}x "
            f"train={train[reference] / train[device]:.2f}x",
            flush=True,
        )
        peaks = [r.device_mb for r in runs[device] if r.device_mb]
        if peaks:
            total = gpu_memory_mb()
            print(
                f"  one GPU of {total / 1024:.0f} GiB holds about "
                f"{int(total // max(peaks))} such nodes (their peak allocation)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
