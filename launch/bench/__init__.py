"""`meshfl bench WHAT`: the measurements, one module each, named as its WHAT.

Each module's `main` takes the benchmark's own flags (flags.py has the shapes they
share) and its docstring says exactly what is measured. A module is imported only when
its benchmark runs: most load torch, which `meshfl --help` does without.
"""

from __future__ import annotations

import importlib

# What each benchmark measures, for `meshfl bench --help`.
BENCHMARKS = {
    "wire": "signed and encrypted blob MB/s against raw ZeroMQ",
    "scale": "wall time, memory and bytes of meshes of 16, 50 and 100 nodes",
    "fedc2i": "influence seconds as a share of local training",
    "fedinfluence": "Fed-Influence against exact leave-one-out, cleansing and overhead",
    "faults": "a bounded mesh losing some of its processes at once: do views refill?",
    "against": "a mesh beside another program doing the same job (Flower), alternately",
    "views": "neighbours chosen by benefit against random ones: wall time and where it goes",
    "codecs": "a 45 MB model between two nodes under each codec: bytes, time, MB/s",
    "devices": "one mesh trained on the CPU and on the GPU, alternately: time and memory",
    "sybil": "many identities on few addresses against a bounded mesh: places and weight",
}


def run_benchmark(what: str, argv: list[str]) -> int:
    """Run the benchmark `what` (a key of BENCHMARKS) with its flags `argv`; its exit
    status."""
    module = importlib.import_module(f"{__name__}.{what}")
    status: int = module.main(argv)
    return status
