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


class OneLineFormatter(logging.Formatter):
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
