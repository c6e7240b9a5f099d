"""How a node's log lines are written: one record, one line, whatever a peer sent.

Peers' strings (names, addresses, refusal reasons) reach log messages. A control
character in one (a newline, a carriage return, an escape sequence) could forge a line
of the sender's choosing or rewrite the terminal, so every message is escaped when it
is formatted. Tracebacks keep their own lines, with each line escaped the same way.
"""

from __future__ import annotations

import logging
from typing import Any

FORMAT = "%(asctime)s %(name)s %(message)s"


def escape_controls(text: str) -> str:
    """`text` with every non-printable character written as its Python escape."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


# A record logged with extra={BARE: True} is written as its message alone, no time or
# logger name: a node's "meshfl: error: ..." line, as a node in a process of its own
# prints it, so that whoever reads the log for its last error finds it either way.
BARE = "bare"


class OneLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, BARE, False):
            return escape_controls(record.getMessage())
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = escape_controls(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:  # noqa: N802 (logging's name)
        # A traceback's lines are ours, but its exception's message may quote a peer.
        return "\n".join(map(escape_controls, super().formatException(ei).split("\n")))


def configure(level: int) -> None:
    """The process's logging: `level` and up, to stderr, one escaped line a record."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(FORMAT))
    # force: a process forked from `meshfl launch` replaces the launcher's settings.
    logging.basicConfig(level=level, handlers=[handler], force=True)
