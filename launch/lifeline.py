"""A lifeline from `meshfl launch` to each node it starts: nodes stop when it is gone.

The launcher holds the write end of a pipe and hands each node the read end. Nobody
ever writes to it, so a node's read returns only at end-of-file, which the kernel
delivers the moment the launcher's last copy of the write end closes: when it exits,
however it exits, SIGKILL included.

Why a pipe and not prctl(PR_SET_PDEATHSIG): that is Linux-only (macOS has no
equivalent), and it fires when the parent *thread* exits, not the process. Polling
the parent pid would also work everywhere, but it costs a wake-up every period and
misreads a pid that the system reused. End-of-file on a pipe is portable to every
POSIX system, needs no polling, and cannot be fooled by pid reuse.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("meshfl.launch")

# A node that is still running this long after its SIGTERM (stuck in a C call, or its
# handler replaced) is ended outright: an orphan holds its port and trains for nobody.
FORCE_EXIT_AFTER = 10.0
EXIT_FORCED = 128 + signal.SIGTERM


class Lifeline:
    """The launcher's end: create it before starting nodes, pass `node_fd` to each."""

    def __init__(self) -> None:
        # os.pipe() gives non-inheritable descriptors: only processes that are handed
        # the read end by `pass_fds` get it, and no child ever gets the write end.
        self.node_fd, self._launcher_fd = os.pipe()

    @property
    def launcher_end(self) -> int:
        """The write end: a node forked from the launcher must close its copy."""
        return self._launcher_fd

    def close(self) -> None:
        for fd in (self.node_fd, self._launcher_fd):
            try:
                os.close(fd)
            except OSError:
                pass  # closed already


def watch_launcher(fd: int, name: str) -> None:
    """In a node: stop this process like Ctrl-C (its checkpoint is whole) once the
    launcher holding the other end of `fd` is gone."""
    threading.Thread(
        target=_wait_for_end_of_file, args=(fd, name), name="lifeline", daemon=True
    ).start()


def _wait_for_end_of_file(fd: int, name: str) -> None:
    try:
        while os.read(fd, 1):
            pass  # nobody writes; read anyway, so that a stray byte does not stop us
    except OSError as error:
        log.warning(
            "%s: cannot watch the launcher on descriptor %d (%s); running on without",
            name,
            fd,
            error.strerror or error,
        )
        return
    log.warning("%s: the launcher is gone; stopping", name)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(FORCE_EXIT_AFTER)
    os._exit(EXIT_FORCED)
