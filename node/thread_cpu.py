"""The CPU a node's threads spend, read from Linux's per-thread counters.

A host runs dozens of nodes in one process, so the process's CPU tells neither one
node's work from another's nor a node's own work (training, screening, aggregation:
its runtime's thread) from its endpoint's (signatures, decoding, heartbeats: the
endpoint's worker and transport threads). Each round record says both
(`cpu_seconds`), which is how the cost of a mesh's messages is told from the cost of
its models (docs/big-meshes.md). ZeroMQ's own I/O threads (encryption, TCP) are not a
node's: what a run spent there is its processes' CPU less its nodes' threads'.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def threads_cpu_seconds(native_ids: Iterable[int]) -> float | None:
    """The CPU seconds, user and system, that the threads of this process with these
    native ids have spent since they started; None where the system does not say (not
    Linux) or a thread has ended."""
    total = 0.0
    for native_id in native_ids:
        try:
            stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
        except OSError:
            return None
        # The fields after the command name, which may itself hold spaces: utime and
        # stime are the 14th and 15th of the line, in clock ticks.
        fields = stat.rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _TICKS_PER_SECOND
    return total


class RoundCpu:
    """A node's CPU clocks, read on its own thread at a round's start and end: `node`,
    that thread's (time.thread_time, exact); `endpoint`, its endpoint's threads' (the
    system's counters, to a clock tick, 10 ms on most systems)."""

    def __init__(self, endpoint_threads: Callable[[], list[int]]) -> None:
        self._endpoint_threads = endpoint_threads

    def read(self) -> dict[str, float | None]:
        return {
            "node": time.thread_time(),
            "endpoint": threads_cpu_seconds(self._endpoint_threads()),
        }

    def since(self, start: dict[str, float | None]) -> dict[str, float]:
        """The seconds each clock moved since `start`, of those both readings have."""
        now = self.read()
        return {
            clock: now_seconds - then
            for clock, then in start.items()
            if then is not None and (now_seconds := now[clock]) is not None
        }
