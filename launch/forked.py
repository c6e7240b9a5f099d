"""Starting `meshfl launch`'s processes by forking the launcher, where the system allows.

Importing torch costs a process about 300 MB of memory of its own (relocated library
data, module objects), and a mesh of hosts pays it once per process. A forked child
shares the launcher's copy of those pages until it writes to them, so every process
of a run holds one torch between them: the proportional set size of a 100-node run
falls by about that much per host. The child then calls the entry of the command it
would have been started with (entry.py, hosts.py) directly, in its own session, writing
to its log.

Linux only: on macOS, forking a process that loaded system frameworks is unsafe, and
there (and wherever `can_fork` says no) launch starts a fresh interpreter instead.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from .errors import STOP_SIGNALS, end_process

POLL_S = 0.05


def can_fork() -> bool:
    return sys.platform.startswith("linux")


class ForkedProcess:
    """A forked child, with the part of `subprocess.Popen` that launch uses."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid = pid
        self.args = argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode


def fork_call(
    run: Callable[[], int], argv: list[str], log_path: Path, close_fds: list[int]
) -> ForkedProcess:
    """Call `run` in a forked child, in a session of its own, its output appended to
    `log_path`, the descriptors `close_fds` (the launcher's own ends) closed; its return
    value is the child's exit status. `argv`: the command line it stands for, as
    `subprocess.Popen.args` would be."""
    sys.stdout.flush()  # or the child would write what the launcher had buffered again
    sys.stderr.flush()
    # The collector writes to every object it tracks as it walks them: a child that ran
    # it over the launcher's objects (torch's modules among them) would copy every page
    # they lie on (about 200 MB per host of a 200-node MNIST mesh). Frozen, they are
    # never walked, on either side.
    gc.freeze()
    # Stop signals wait until each side has its own handlers: the launcher's would
    # raise KeyboardInterrupt in the child, which must never run the launcher's code.
    stops = {signal.SIGINT, *STOP_SIGNALS}
    with open(log_path, "ab") as log_file:
        # The caller's mask comes back after the fork: a thread that blocks some of
        # these (a Ray actor's does) keeps them blocked.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        pid = os.fork()
        if pid == 0:  # the child: it never returns from here
            try:
                _become_child(log_file.fileno(), close_fds)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
                run_and_exit(run)
            finally:
                os._exit(1)  # reached only if becoming the child itself failed
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return ForkedProcess(pid, argv)


def _become_child(log_fd: int, close_fds: list[int]) -> None:
    os.setsid()  # Ctrl-C in the terminal reaches the launcher alone, as for a fresh process
    for fd in close_fds:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    # The launcher's own handlers (raise KeyboardInterrupt) are not the child's: it
    # starts from the defaults, and its command sets what it needs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def run_and_exit(run: Callable[[], int]) -> NoReturn:
    """In a forked child: call `run`, then end the process with its status (a bug's
    traceback and 1 where it raised), never returning into the process forked from."""
    code = 1
    try:
        code = run()
    except SystemExit as exit_:
        code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - a child must never return into the launcher
        traceback.print_exc()
    finally:
        end_process(code)
