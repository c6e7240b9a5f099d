"""The `meshfl` command starts itself once more with glibc's per-thread caches off
(launch/console.py), unless the user said how big they are."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from meshfl.launch.console import TCACHE_COUNT, _runs_on_glibc, without_thread_caches

# Prints what the process saw, then runs `meshfl --help` through the command's entry:
# a process that starts itself again runs this code twice.
PROGRAM = """
import os, sys
print("tunables:", os.environ.get("GLIBC_TUNABLES"), flush=True)
sys.argv = ["meshfl", "--help"]
from meshfl.launch.console import main
main()
"""


def _start(tunables: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "usage: meshfl" in done.stdout  # the command itself ran
    return [line for line in done.stdout.splitlines() if line.startswith("tunables:")]


def test_the_setting_is_added_to_what_the_user_set():
    assert without_thread_caches("") == f"{TCACHE_COUNT}=0"
    assert without_thread_caches("glibc.malloc.arena_max=2") == (
        f"glibc.malloc.arena_max=2:{TCACHE_COUNT}=0"
    )
    assert without_thread_caches(f"glibc.malloc.arena_max=2:{TCACHE_COUNT}=7") is None


@pytest.mark.skipif(not _runs_on_glibc(), reason="glibc's setting")
def test_the_command_starts_again_once_with_the_caches_off():
    assert _start(None) == ["tunables: None", f"tunables: {TCACHE_COUNT}=0"]
    assert _start("glibc.malloc.arena_max=4") == [
        "tunables: glibc.malloc.arena_max=4",
        f"tunables: glibc.malloc.arena_max=4:{TCACHE_COUNT}=0",
    ]


@pytest.mark.skipif(not _runs_on_glibc(), reason="glibc's setting")
def test_a_size_the_user_chose_stands():
    assert _start(f"{TCACHE_COUNT}=7") == [f"tunables: {TCACHE_COUNT}=7"]


def test_the_installed_command_starts_here():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "meshfl"]
    assert script.value == "meshfl.launch.console:main"
