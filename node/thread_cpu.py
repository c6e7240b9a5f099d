"""The CPU a node's threads spend in a round, read from Linux's per-thread counters.

A host runs dozens of nodes in one process, so the process's CPU tells neither one
node's work from another's nor a node's own work (training, screening, aggregation,
evaluation, signing its blobs: its runtime's thread) from its endpoint's (checking
signatures, decoding, heartbeats: the endpoint's worker and transport threads). Each
gossip peer's round record says both (`cpu_seconds`), which is how the cost of a mesh's
messages is told from the cost of its models (docs/big-meshes.md).

Not counted: ZeroMQ's own threads (each endpoint's context has an I/O thread, which
encrypts and moves the bytes, but Python cannot name it), torch's intra-op threads
where a node trains with more than one, and what a node does outside its rounds
(start-up, joining, checkpoints, the linger after its last round).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads_cpu_seconds(native_ids: Iterable[int]) -> float | None:
    """The CPU seconds, user and system, that the threads of this process with these
    native ids have spent since they started (0 for none); None where the system does
    not say (no Linux counters) or one of them has ended."""
    total = 0.0
    for native_id in native_ids:
        try:
            stat = Path(f"/proc/self/task/{native_id}/stat").read_bytes()
            # The fields after the thread's name, which may hold spaces or a character
            # cut in two: utime and stime are the 14th and 15th of the line, in ticks.
            fields = stat.rsplit(b")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS_PER_SECOND
        except (OSError, IndexError, ValueError):
            return None
    return total


@dataclass(frozen=True)
class CpuReading:
    """A node's CPU clocks, read on its own thread when a round starts."""

    thread: int  # threading.get_ident() of the thread that read them
    node: float  # its time.thread_time(): exact
    endpoint_threads: tuple[int, ...]
    endpoint: float | None  # theirs, to a clock tick (10 ms on most systems)


def read_cpu(endpoint_threads: Iterable[int]) -> CpuReading:
    """The calling thread's CPU clock, and the `endpoint_threads`' together."""
    threads = tuple(endpoint_threads)
    return CpuReading(
        threading.get_ident(), time.thread_time(), threads, threads_cpu_seconds(threads)
    )


def cpu_spent(start: CpuReading) -> dict[str, float]:
    """The CPU seconds since `start`, read again on the same thread: `node`, that
    thread's, and `endpoint`, the endpoint's threads' where the system counts them.
    Nothing where read on another thread, whose clock is not the one `start` read."""
    if threading.get_ident() != start.thread:
        return {}
    now = read_cpu(start.endpoint_threads)
    spent = {"node": now.node - start.node}
    if start.endpoint is not None and now.endpoint is not None:
        spent["endpoint"] = now.endpoint - start.endpoint
    return spent
