"""How a `meshfl` command ends: the errors a user can fix, stop signals, exit codes.

Every launch module raises these and `meshfl`'s main (cli.py) turns them into its exit
status; they live apart from cli.py so that no module has to import the command back.
"""

from __future__ import annotations

import signal
from typing import Any

EXIT_USAGE = 2
EXIT_NODE_FAILED = 3  # the mesh ran, but some node failed (summary.json, node.log)
EXIT_INTERRUPTED = 130  # Ctrl-C; a SIGTERM or SIGHUP gives 128 + its number

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # taken as Ctrl-C by launch and by nodes


class UserError(Exception):
    """A mistake the user can fix: printed as one line, exit code 2."""


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP) taken like Ctrl-C; exits with 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.exit_code = 128 + signum


def raise_stopped(signum: int, frame: Any) -> None:
    """A signal handler for STOP_SIGNALS: the stop unwinds as a Ctrl-C would."""
    raise Stopped(signum)
