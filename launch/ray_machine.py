"""The machine's side of `meshfl launch --ray` (ray_hosts.py): one Ray actor per machine
that forks the node hosts there and supervises them.

The actor forks its hosts as a plain launch forks them (supervise.py): they share the
actor's torch, so a machine pays for one interpreter and one torch, not one per host,
and the actor restarts a host that fails. Keys and checkpoints stay on the machine,
under a scratch folder of the run (`<tmp>/meshfl-ray/<run>/`) that outlives the actor
and is removed once the run has finished; the launcher copies the nodes' text files
back through `RayMachine.news`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from meshfl.node import config as cfgmod
from meshfl.node.checkpoint import write_atomically
from meshfl.node.host import FINISHED, raise_open_files_limit
from meshfl.node.trainer import set_torch_threads
from meshfl.protocol.identity import Identity
from meshfl.protocol.ports import free_ports

from .contacts import key_path
from .summary import FAILED
from .supervise import SupervisedProcess, node_finished, node_processes, supervise

HOSTS_GONE_LIMIT_S = 60.0  # an earlier actor's hosts stop within seconds (lifeline.py)
CPU_GRAINS = 10_000  # Ray counts resources in ten-thousandths


@dataclass
class HostListing:
    """One forked host as its machine's actor reports it, for processes.json."""

    label: str
    pid: int | None  # None until its actor has forked it
    nodes: list[str]
    restarts: dict[str, int]


def scratch_folder(run_id: str) -> Path:
    """Where the hosts of the run `run_id` keep their nodes' keys and checkpoints, on
    each machine: kept while the run can be resumed, removed once it finished."""
    return Path(tempfile.gettempdir()) / "meshfl-ray" / run_id


class RayMachine:
    """The node hosts of one machine of the cluster, forked by one Ray actor as a
    plain launch forks them (launch/supervise.py): they share the actor's torch, and
    the actor restarts a host that fails. The hosts' folders, keys and checkpoints live
    under a scratch folder of the machine that outlives the actor: when Ray restarts the
    actor (its hosts stop with it: the lifeline), the new one finds them again."""

    def __init__(self, run_id: str, label: str, hosts: list[tuple[str, list[str]]]) -> None:
        # Shared by the run's actors on this machine: node folders are named by node, and
        # each actor's own files by its label.
        self.root = scratch_folder(run_id)
        self.label = label
        self.hosts = hosts
        self.names = [name for _, names in hosts for name in names]
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._run_done: threading.Event | None = None  # set while a run is under way
        self._ends: dict[str, str] = {}
        self._supervised: list[SupervisedProcess] = []
        raise_open_files_limit()  # the hosts inherit it

    def where(self) -> tuple[int, str]:
        """This process's pid and the Ray node it runs on."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def seats(self) -> tuple[tuple[int, str], dict[str, tuple[str, str]]]:
        """Where this actor runs, and for each node the address it will listen on (a free
        port of this machine) and its public key (hex), made here on the first call."""
        import ray

        ip = ray.util.get_node_ip_address()
        ports = free_ports(len(self.names), ip)
        seats = {}
        for name, port in zip(self.names, ports, strict=True):
            identity = Identity.load_or_create(key_path(self.root, name))
            seats[name] = (f"tcp://{ip}:{port}", identity.public_key.hex())
        return self.where(), seats

    def run(
        self,
        config_text: str,
        names: list[str],
        cpus: float,
        restarts: int,
        restarted: dict[str, int],
    ) -> dict[str, str]:
        """Run `names` in their hosts (resuming from their checkpoints, if any), starting
        a failed host's unfinished nodes again until one of them has been restarted
        `restarts` times (`restarted`: the counts so far), until each has ended; how
        each ended. A call while a run is under way (the launcher lost sight of this
        actor for a while) waits for that one."""
        with self._lock:
            under_way = self._run_done
            if under_way is None:
                self._run_done = threading.Event()
        if under_way is not None:
            under_way.wait()
            return self._ends
        try:
            self._ends = self._run(config_text, names, cpus, restarts, Counter(restarted))
        finally:
            with self._lock:
                done, self._run_done = self._run_done, None
            assert done is not None
            done.set()
        return self._ends

    def stop(self) -> None:
        """End the run: its hosts are stopped (their nodes say bye)."""
        self.stopping.set()

    def remove_scratch(self) -> None:
        """Remove the run's scratch folder on this machine (its run has finished: nothing
        there is needed again)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def news(self, copies: dict[str, tuple[int, bytes]]) -> tuple[list[HostListing], dict]:
        """The hosts of the run under way (or of the last one), and what the launcher's
        copies lack (`files`)."""
        for each in self._supervised:  # the restarts its host made of its nodes itself
            each.count_host_restarts(self.root)
        listing = [
            HostListing(each.label, each.process.pid, each.running, dict(each.node_restarts))
            for each in self._supervised
        ]
        return listing, self.files(copies)

    def files(self, copies: dict[str, tuple[int, bytes]]) -> dict[str, tuple[int, bytes]]:
        """What the launcher's copies lack, as (where it starts, the bytes): the tail past
        a copy's size where the copy's last bytes still match, else the whole file (it
        was written anew)."""
        found = {}
        for relative, (size, last) in copies.items():
            try:
                with open(self.root / relative, "rb") as file:
                    length = file.seek(0, 2)
                    file.seek(max(0, size - len(last)))
                    matches = length >= size and file.read(len(last)) == last
                    start = size if matches else 0
                    file.seek(start)
                    data = file.read()
            except OSError:
                continue  # not written yet
            if data or not matches:
                found[relative] = (start, data)
        return found

    def _run(
        self, config_text: str, names: list[str], cpus: float, restarts: int, restarted: Counter
    ) -> dict[str, str]:
        self._supervised = []  # the hosts of an earlier run are not this one's
        if self.stopping.is_set():
            return {}
        self.root.mkdir(parents=True, exist_ok=True)
        rounds = cfgmod.config_from_text(config_text, "the launcher's config").rounds
        config_path = self.root / f"config-{self.label}.yaml"
        write_atomically(config_path, config_text.encode())
        wanted = set(names)
        hosts = [(label, [n for n in group if n in wanted]) for label, group in self.hosts]
        hosts = [(label, group) for label, group in hosts if group]
        # One torch thread here: an OpenMP pool would not survive the forks; each host
        # then takes its share of the CPUs Ray granted (set_torch_threads).
        cores = os.cpu_count() or 1
        set_torch_threads(cores)
        local_nodes = max(1, round(cores * len(hosts) / max(cpus, 1 / CPU_GRAINS)))
        groups = [group for _, group in hosts]
        labels = [label for label, _ in hosts]
        with (
            self._machine_lock() as lock,
            node_processes(
                config_path, self.root, groups, labels, local_nodes, restarted, (lock,), restarts
            ) as (supervised, start),
        ):
            self._supervised = supervised
            supervise(supervised, start, restarts, self.root, rounds, True, self.stopping)
        return {
            name: FINISHED if node_finished(self.root, name, rounds) else FAILED for name in names
        }

    @contextmanager
    def _machine_lock(self) -> Iterator[int]:
        """A lock on this machine's hosts, taken before they are forked and held by each
        of them (the descriptor is inherited) until it exits: an actor that Ray restarted
        waits here until the hosts of the one that died have let go of their ports and
        checkpoints (they stop on their own: the lifeline)."""
        with open(self.root / f"{self.label}.lock", "a") as file:
            deadline = time.monotonic() + HOSTS_GONE_LIMIT_S
            while True:
                try:
                    fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the hosts of an earlier actor on this machine still run after "
                            f"{HOSTS_GONE_LIMIT_S:.0f} s"
                        ) from None
                    time.sleep(0.2)
            yield file.fileno()
