"""Many nodes in one process: a node host.

A node process costs a whole interpreter with torch in it (about 490 MB), so one
machine holds a few dozen. A host runs many node runtimes in one process, one thread
each, and each stays a full peer: its own key and id, listening socket and port, peer
table, blob store, rule state, metrics.jsonl, checkpoint and node.log. Nodes of one
host talk to each other, and to nodes of other hosts, only over the wire (loopback TCP,
WIRE.md), never through shared Python objects: a mesh of hosts behaves like a mesh of
processes and like a LAN.

CPU. A host lets one node at a time do CPU work (training, scoring, aggregation,
evaluation) through `cpu`, a lock every node of the host holds for that work; with
`meshfl launch` starting about one host per core, hosts × torch threads match the
cores. A node that waits for its peers holds nothing, and its endpoint's threads
(heartbeats, fetches) run whenever they have something to do.

Failure. A node that raises stops alone; the host and its other nodes go on. An
expected condition (a full disk, a damaged checkpoint, a config or data error: any
UserError, protocol/errors.py) is one "meshfl: error:" line in its node.log and one in
the host's own log, as a node in a process of its own says it; anything else is unexpected,
and its node.log gets the traceback. With `restarts` the host starts the node again at
once, from its checkpoint, up to that many times in all: each restart, the host's or
`meshfl launch`'s, is counted in the node's folder (RESTARTS_FILE). A node that fails
for good leaves the host's exit status saying so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshfl.protocol.errors import UserError

from .checkpoint import StorageError, write_atomically
from .joining import JoinTogether, LaunchGate
from .logs import BARE, FORMAT, OneLineFormatter
from .runtime import Node, NodeOptions

log = logging.getLogger("meshfl.host")

FINISHED, FAILED = "finished", "failed"

# In a node's folder: how often the node was started again after it failed.
RESTARTS_FILE = "restarts"


def restarts_so_far(node_dir: Path) -> int:
    """How often the node of `node_dir` was started again after it failed, by its host
    or by `meshfl launch`; 0 when never."""
    try:
        return int((node_dir / RESTARTS_FILE).read_text())
    except (OSError, ValueError):
        return 0


def record_restarts(node_dir: Path, count: int) -> None:
    """Say in `node_dir` that its node has been started again `count` times in all;
    StorageError when the disk is full."""
    write_atomically(node_dir / RESTARTS_FILE, f"{count}\n".encode())


def forget_restarts(node_dir: Path) -> None:
    """Count the restarts of the node of `node_dir` from 0 again."""
    (node_dir / RESTARTS_FILE).unlink(missing_ok=True)


# How long a thread of a host may hold the interpreter lock while another waits for it
# (Python's default: 5 ms). A host of hundreds of nodes runs three threads each, and every
# forced hand-over wakes one of hundreds of waiters: at 1,000 nodes on 2 cores shorter
# intervals leave nodes silent past the down timeout as the mesh starts, 20 ms does not
# (docs/measurements.md).
SWITCH_INTERVAL_S = 0.02


class LongerSwitches:
    """SWITCH_INTERVAL_S while at least one host of this process runs (tests run
    several at once), then the process's own interval again."""

    _lock = threading.Lock()
    _running = 0
    _before = 0.0

    def __enter__(self) -> None:
        with LongerSwitches._lock:
            if LongerSwitches._running == 0:
                LongerSwitches._before = sys.getswitchinterval()
                sys.setswitchinterval(SWITCH_INTERVAL_S)
            LongerSwitches._running += 1

    def __exit__(self, *exc: object) -> None:
        with LongerSwitches._lock:
            LongerSwitches._running -= 1
            if LongerSwitches._running == 0:
                sys.setswitchinterval(LongerSwitches._before)


# glibc's mallopt parameter for the number of malloc arenas.
_M_ARENA_MAX = -8
# How often a host gives the memory its nodes freed back to the system.
TRIM_EVERY_S = 2.0


class MemoryReturn:
    """Keeps a host's memory near what its nodes hold, where the C library is glibc.

    Every node thread decodes its peers' blobs each round and frees them again. glibc
    serves threads from up to eight malloc arenas per core and keeps what is freed in
    each for reuse, so a host of dozens of nodes sat on hundreds of MB its nodes had let
    go (a 100-node mesh: about 0.7 GB per host). Two arenas, and a trim every
    TRIM_EVERY_S seconds, return it; elsewhere this does nothing.
    """

    def __init__(self) -> None:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        self._trim = getattr(libc, "malloc_trim", None)
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is not None:
            mallopt(_M_ARENA_MAX, 2)  # before the node threads start: they take arenas
        self._stop = threading.Event()

    def run_in_background(self) -> None:
        if self._trim is not None:
            threading.Thread(target=self._trim_now_and_then, name="memory", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _trim_now_and_then(self) -> None:
        trim = self._trim
        assert trim is not None  # started only where the C library has it
        while not self._stop.wait(TRIM_EVERY_S):
            trim(0)


def files_per_node(links: int) -> int:
    """Open files a node connected to `links` peers (all others in a full mesh) may hold
    at once: per peer a DEALER socket, the connection out and the one in, and, until
    that DEALER's first handshake is done, its monitor's two sockets; plus its ROUTER,
    ZeroMQ context and wake pipe. A host of k such nodes needs k times this under one
    open-files limit."""
    return 5 * links + 16


UNLIMITED_FILES = 1 << 20  # what "no limit" is taken to mean


def raise_open_files_limit() -> int:
    """Lift this process's soft open-files limit (often 1024) to its hard one, where the
    system allows (macOS caps it lower), and return the limit now in effect: a node
    holds a few files per peer, and a host holds dozens of nodes. Processes started
    from this one inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # the system's own cap: keep what we have, and size hosts by it
    return UNLIMITED_FILES if soft == resource.RLIM_INFINITY else soft


@dataclass
class NodeEnd:
    """How one node of a host ended: FINISHED, or FAILED (its node.log says why)."""

    status: str


# Where a node thread's record goes besides its node.log (logging's extra={ROUTE: ...}):
# EVERYWHERE, to the host's own log too; HOST_ONLY, there alone.
ROUTE, EVERYWHERE, HOST_ONLY = "route", "everywhere", "host only"


class NodeLog(logging.Filter):
    """Routes a host's log records to one node's node.log: the records of the threads
    that node owns (its round loop, its endpoint's worker and its transport's I/O).
    `outside=True`: the records of no node's threads, for the host's own log. A record's
    ROUTE changes that."""

    def __init__(self, options: list[NodeOptions], outside: bool = False) -> None:
        super().__init__()
        self.threads = {
            thread
            for each in options
            for thread in (node_thread_name(each.name), f"mesh {each.name}", f"io {each.listen}")
        }
        self.outside = outside

    def filter(self, record: logging.LogRecord) -> bool:
        route = getattr(record, ROUTE, None)
        if route == HOST_ONLY or (route == EVERYWHERE and self.outside):
            return self.outside
        return (record.threadName in self.threads) != self.outside


def node_thread_name(name: str) -> str:
    return f"node {name}"


class NodeHost:
    """Runs the nodes of `options` in this process until each has finished or failed,
    starting a node that fails again from its checkpoint until it has been restarted
    `restarts` times in all. Its nodes join the mesh together once all are built, and,
    with a `gate`, once the other hosts of its launch have built theirs (joining.py)."""

    def __init__(
        self,
        options: list[NodeOptions],
        make_node: Callable[[NodeOptions], Node],
        restarts: int = 0,
        gate: LaunchGate | None = None,
    ) -> None:
        self.options = options
        self.make_node = make_node
        self.restarts = restarts
        self.cpu = threading.Lock()
        self._building = threading.Lock()
        self.ends: dict[str, NodeEnd] = {}
        self.nodes: dict[str, Node] = {}
        self._stopping = threading.Event()
        self._joining = JoinTogether(len(options), gate)
        self._handlers: list[logging.Handler] = []
        self._host_only = NodeLog(options, outside=True)

    def run(self) -> dict[str, NodeEnd]:
        threads = [
            threading.Thread(
                target=self._run_one,
                args=(options,),
                name=node_thread_name(options.name),
                daemon=True,
            )
            for options in self.options
        ]
        self._open_logs()
        memory = MemoryReturn()
        memory.run_in_background()
        try:
            with LongerSwitches():
                for thread in threads:
                    thread.start()
                for thread in threads:
                    while thread.is_alive():  # join in slices, so that signals get through
                        thread.join(timeout=0.5)
        finally:
            memory.stop()
            self._close_logs()
        return self.ends

    def stop(self) -> None:
        """Say bye for every node still running (their last rounds are checkpointed)."""
        self._stopping.set()
        for node in list(self.nodes.values()):
            node.endpoint.close()

    def _run_one(self, options: NodeOptions) -> None:
        first = True
        while True:
            try:
                self._run_node(options, first)
            except Exception as error:  # this node's fault, not the host's
                if self._stopping.is_set():
                    return  # its endpoint was closed under it: the host is stopping
                _say_failed(options.name, error)
                if self._may_restart(options):
                    first = False
                    continue
                self.ends[options.name] = NodeEnd(FAILED)
                return
            self.ends[options.name] = NodeEnd(FINISHED)
            return

    def _run_node(self, options: NodeOptions, first: bool) -> None:
        """Build and run node `options.name`; at the host's `first` start of it, it
        joins the mesh together with the host's other nodes (joining.py)."""
        try:
            # One build at a time: in a process just forked, two threads making their
            # first torch calls at once can crash it (a SIGSEGV in a Linear's forward,
            # about once in 1,200 forks of four threads). A build that hangs holds the
            # builds after it, not the nodes already running.
            with self._building:
                node = self.make_node(options)
        finally:
            if first:
                self._joining.built()
        node.cpu = self.cpu
        self.nodes[options.name] = node
        try:
            node.run()
        finally:
            # One that failed before its endpoint started holds its port still; a
            # restart binds it again.
            node.endpoint.close()

    def _may_restart(self, options: NodeOptions) -> bool:
        """Whether node `options.name`, which just failed, is started again: while it has
        restarts left, each counted in its folder before it starts."""
        name, done = options.name, restarts_so_far(options.out_dir)
        if done >= self.restarts:
            log.info("%s: stopped; the host's other nodes go on", name, extra={ROUTE: EVERYWHERE})
            return False
        try:
            record_restarts(options.out_dir, done + 1)
        except StorageError as error:
            _say_failed(name, error)
            return False
        log.info(
            "%s: restarting from its checkpoint (restart %d of %d); the host's other nodes go on",
            name,
            done + 1,
            self.restarts,
            extra={ROUTE: EVERYWHERE},
        )
        return True

    def _open_logs(self) -> None:
        # What a node logs goes to its node.log only, not also to the host's own log.
        for handler in logging.getLogger().handlers:
            handler.addFilter(self._host_only)
        for options in self.options:
            options.out_dir.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(options.out_dir / "node.log")
            handler.setFormatter(OneLineFormatter(FORMAT))
            handler.addFilter(NodeLog([options]))
            logging.getLogger().addHandler(handler)
            self._handlers.append(handler)

    def _close_logs(self) -> None:
        for handler in self._handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self._host_only)


def _say_failed(name: str, error: Exception) -> None:
    """What node `name` stopped on, in its node.log and in the host's own log: one line
    for an expected condition, as a node alone in its process says it; the traceback,
    in its node.log, for anything else."""
    if isinstance(error, UserError):
        log.error("meshfl: error: %s", error, extra={BARE: True})
        log.error("meshfl: error: %s: %s", name, error, extra={BARE: True, ROUTE: HOST_ONLY})
        return
    log.error("%s: stopped by an unexpected error", name, exc_info=error)
    log.error(
        "%s: stopped by an unexpected error, %s: %s (its node.log has the traceback)",
        name,
        type(error).__name__,
        error,
        extra={ROUTE: HOST_ONLY},
    )
