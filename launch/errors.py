"""How a `meshfl` command ends: the errors a user can fix, stop signals, exit codes.

Every launch module raises these and `command_status` turns them into the exit status,
both for `meshfl`'s main (cli.py) and for a node process forked by `meshfl launch`;
they live apart from cli.py so that no module has to import the command back.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from meshfl.protocol.errors import UserError

EXIT_USAGE = 2
EXIT_NODE_FAILED = 3  # the mesh ran, but some node failed (summary.json, node.log)
EXIT_INTERRUPTED = 130  # Ctrl-C; a SIGTERM or SIGHUP gives 128 + its number

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # taken as Ctrl-C by launch and by nodes


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP) taken like Ctrl-C; exits with 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.exit_code = 128 + signum


def raise_stopped(signum: int, frame: Any) -> None:
    """A signal handler for STOP_SIGNALS: the stop unwinds as a Ctrl-C would."""
    raise Stopped(signum)


@contextmanager
def stop_signals_as_interrupts() -> Iterator[None]:
    """SIGTERM (timeout, CI runners, systemd, container stops) and SIGHUP (a closed
    terminal) raise `Stopped`, a KeyboardInterrupt, while the block runs: a launcher's
    mesh stops as on Ctrl-C."""
    previous = {signum: signal.signal(signum, raise_stopped) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def command_status(command: Callable[[], int]) -> int:
    """Run `command` as `meshfl` runs every command: its exit status; a stop as Ctrl-C's
    status (or 128 + the signal's number); a mistake the user can fix as one line and
    EXIT_USAGE. Anything else is a bug and raises."""
    try:
        return command()
    except KeyboardInterrupt as interrupt:
        return getattr(interrupt, "exit_code", EXIT_INTERRUPTED)
    except UserError as err:
        print(f"meshfl: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def end_process(status: int) -> NoReturn:
    """End a node's or a launcher's process with `status` once its command has returned:
    output flushed, then gone, without the interpreter's teardown. By then its files
    are closed and its sockets' last words sent; the teardown would only collect
    torch's and scipy's objects one by one, 0.5 to 0.7 s of every node's exit here.
    What runs at the interpreter's exit does not run: a profiler such as `python -m
    cProfile` must call cli.main() itself to get its figures written."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
