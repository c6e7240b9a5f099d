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

Failure. A node that raises is logged to its own node.log and stopped alone; the host
and its other nodes go on, and the host's exit status says that one failed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .logs import FORMAT, OneLineFormatter
from .runtime import Node, NodeOptions

log = logging.getLogger("meshfl.host")

FINISHED, FAILED = "finished", "failed"


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


def files_per_node(mesh_size: int) -> int:
    """Open files a node of a full mesh of `mesh_size` nodes may hold at once: per peer
    a DEALER socket, the connection out and the one in, and, until that DEALER's first
    handshake is done, its monitor's two sockets; plus its ROUTER, ZeroMQ context and
    wake pipe. A host of k such nodes needs k times this under one open-files limit."""
    return 5 * (mesh_size - 1) + 16


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


class NodeLog(logging.Filter):
    """Routes a host's log records to one node's node.log: the records of the threads
    that node owns (its round loop, its endpoint's worker and its transport's I/O).
    `outside=True`: the records of no node's threads, for the host's own log."""

    def __init__(self, options: list[NodeOptions], outside: bool = False) -> None:
        super().__init__()
        self.threads = {
            thread
            for each in options
            for thread in (node_thread_name(each.name), f"mesh {each.name}", f"io {each.listen}")
        }
        self.outside = outside

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.threadName in self.threads) != self.outside


def node_thread_name(name: str) -> str:
    return f"node {name}"


class NodeHost:
    """Runs the nodes of `options` in this process until each has finished or failed."""

    def __init__(
        self, options: list[NodeOptions], make_node: Callable[[NodeOptions], Node]
    ) -> None:
        self.options = options
        self.make_node = make_node
        self.cpu = threading.Lock()
        self.ends: dict[str, NodeEnd] = {}
        self.nodes: dict[str, Node] = {}
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
        for node in list(self.nodes.values()):
            node.endpoint.close()

    def _run_one(self, options: NodeOptions) -> None:
        try:
            node = self.make_node(options)
            node.cpu = self.cpu
            self.nodes[options.name] = node
            node.run()
        except Exception:  # this node's fault, not the host's
            log.exception("%s: stopped by an error; the host's other nodes go on", options.name)
            self.ends[options.name] = NodeEnd(FAILED)
            return
        self.ends[options.name] = NodeEnd(FINISHED)

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
