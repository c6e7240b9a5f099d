"""Where the `meshfl` command starts: glibc's per-thread caches off, then the command.

glibc gives every thread a cache of the small blocks it freed (its tcache), which no
other thread takes from and which glibc gives back only when the thread ends. A node
host runs five threads a node (the node, its endpoint's worker, its transport, ZeroMQ's
I/O thread and reaper), so a host of 200 nodes holds about 1,000 such caches (what they
cost: docs/measurements.md, "Memory with a real model"). glibc reads its settings only
when a process starts, and `meshfl launch` forks its node hosts, so the command starts
itself once more with the caches off, before it has imported anything. A setting the
user made stands: `GLIBC_TUNABLES=glibc.malloc.tcache_count=7` (glibc's own default)
keeps them. `python -m meshfl.launch.cli` and `meshfl.launch(...)` from Python run
without this step.
"""

from __future__ import annotations

import os
import sys

TCACHE_COUNT = "glibc.malloc.tcache_count"


def main() -> int:
    _restart_without_thread_caches()
    from .cli import main as run_command

    return run_command(own_process=True)


def without_thread_caches(tunables: str) -> str | None:
    """`tunables` (GLIBC_TUNABLES' syntax: `name=value` joined by colons) with the
    per-thread caches off; None where they already say how big those caches are."""
    if any(setting.startswith(TCACHE_COUNT + "=") for setting in tunables.split(":")):
        return None
    return ":".join(filter(None, [tunables, f"{TCACHE_COUNT}=0"]))


def _restart_without_thread_caches() -> None:
    if not _runs_on_glibc():
        return
    tunables = without_thread_caches(os.environ.get("GLIBC_TUNABLES", ""))
    if tunables is None:
        return  # this is the second start, or the user chose
    os.environ["GLIBC_TUNABLES"] = tunables
    try:
        os.execv(sys.executable, sys.orig_argv)
    except OSError:
        pass  # an interpreter that cannot start itself again runs with glibc's defaults


def _runs_on_glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr, or one without the name
        return False
