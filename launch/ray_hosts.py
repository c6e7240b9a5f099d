"""`meshfl launch --ray ADDRESS`: node hosts as Ray actors, past one machine.

Ray only places and supervises. Each host is an actor pinned to one machine of the
cluster; its nodes bind on that machine's address and talk to every other node over
meshfl's own signed, encrypted wire, exactly as the processes of a local launch do. What
crosses Ray is small and plain: the run's config text, each host's listen addresses and
public keys, and the nodes' text files on their way back to the launcher.

- Keys and checkpoints stay on the machine that runs the node, under a scratch folder of
  its own (`<tmp>/meshfl-ray/<run>/`). A host that Ray restarts (`--restarts N`) lands on
  the same machine and resumes its unfinished nodes from their checkpoints.
- The run folder on the launching machine is filled as for a local run: config.yaml,
  each node's metrics.jsonl, node.log and info.json (mirrored while the run goes on),
  the hosts' logs, processes.json and summary.json.
- Data: a node loads its shard where it runs, from the same `--data-root` path on every
  machine (or the embedded digits).

This is the only module of meshfl that imports Ray, and only when `--ray` is given.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod
from meshfl.node.checkpoint import write_atomically
from meshfl.node.coordinator import COORDINATOR, make_node
from meshfl.node.host import FINISHED, NodeHost, NodeLog, files_per_node, raise_open_files_limit
from meshfl.node.logs import FORMAT, OneLineFormatter
from meshfl.node.runtime import NodeOptions
from meshfl.protocol.identity import Identity
from meshfl.protocol.transport import free_ports

from .contacts import key_path
from .entry import named_node_options, node_options
from .errors import UserError
from .summary import FAILED, write_summary
from .supervise import Progress, host_groups, last_error_line, node_finished, process_log

log = logging.getLogger("meshfl.launch")

INSTALL_HINT = "pip install 'meshfl[ray]' (in a checkout: pip install -e '.[ray]')"
PLACE_LIMIT_S = 120.0  # hosts not placed by then wait for CPUs the cluster lacks
MIRROR_EVERY_S = 1.0  # how often the launcher copies the nodes' files back
MIRROR_WAIT_S = 30.0  # how long the last copy of a run waits for the hosts' answers
STOP_WAIT_S = 15.0  # how long stopping hosts may take before they are ended
SEAT_TRIES = 5  # two hosts of a machine may draw the same free port: draw again
# The files of a node that come back to the run folder; its checkpoint and key stay.
MIRRORED = ("metrics.jsonl", "node.log", "info.json")
# How much of a copied file's end must still match the original for its tail alone to
# be sent: a file written anew (a resumed node's metrics) comes back whole.
MATCHED_TAIL = 256
CPU_GRAIN = 1e-4  # Ray counts resources in ten-thousandths


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError(f"--ray: Ray is not installed; {INSTALL_HINT}") from None
    return ray


# --- the launcher's side: where the hosts go ---------------------------------------


@dataclass(frozen=True)
class Machine:
    """A live Ray node with CPUs: where hosts can go."""

    node_id: str
    ip: str
    cpus: float


def cluster_machines(ray: Any) -> list[Machine]:
    machines = [
        Machine(node["NodeID"], node["NodeManagerAddress"], node["Resources"].get("CPU", 0.0))
        for node in ray.nodes()
        if node["Alive"] and node["Resources"].get("CPU", 0.0) > 0
    ]
    if not machines:
        raise UserError("--ray: the cluster has no live node with a CPU")
    return sorted(machines, key=lambda machine: (machine.ip, machine.node_id))


@dataclass
class Placement:
    """The hosts of one machine: each host's node names."""

    machine: Machine
    groups: list[list[str]]

    @property
    def cpus_per_host(self) -> float:
        """Each host's share of the machine's CPUs, as Ray can grant it in full."""
        return math.floor(self.machine.cpus / len(self.groups) / CPU_GRAIN) * CPU_GRAIN


def plan_hosts(names: list[str], machines: list[Machine], hosts: int | None) -> list[Placement]:
    """Spread `names` over `machines` in proportion to their CPUs, consecutive names
    sharing a host: about one host per CPU, more where a host's connections would not
    fit a process's open-files limit; or `hosts` in all (at least one per machine used)."""
    total_cpus = sum(machine.cpus for machine in machines)
    counts = _proportional(len(names), [machine.cpus / total_cpus for machine in machines])
    used = [(machine, count) for machine, count in zip(machines, counts, strict=True) if count]
    if hosts is None:
        wanted = [
            max(1, int(machine.cpus), _hosts_by_files(count, len(names))) for machine, count in used
        ]
    else:
        wanted = [max(1, n) for n in _proportional(hosts, [c / len(names) for _, c in used])]
    placements, start = [], 0
    for (machine, count), hosts_here in zip(used, wanted, strict=True):
        mine = names[start : start + count]
        start += count
        placements.append(Placement(machine, host_groups(mine, min(hosts_here, count))))
    return placements


def _hosts_by_files(count: int, mesh_size: int) -> int:
    return math.ceil(count * files_per_node(mesh_size) / (0.8 * raise_open_files_limit()))


def _proportional(total: int, weights: list[float]) -> list[int]:
    """`total` split by `weights` into whole numbers that add up (largest remainders)."""
    exact = [total * weight for weight in weights]
    counts = [int(value) for value in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])
    for index in by_remainder[: total - sum(counts)]:
        counts[index] += 1
    return counts


@dataclass
class RayProcess:
    """One host actor as the launcher sees it: its nodes, where it runs, its run call."""

    label: str
    names: list[str]
    actor: Any
    machine: Machine
    cpus: float  # its share of the machine's CPUs
    run_id: str  # the run's scratch folder on its machine
    running: list[str] = field(default_factory=list)
    node_restarts: Counter[str] = field(default_factory=Counter)
    pid: int = 0
    ray_node: str = ""  # where Ray says it runs
    run_ref: Any = None
    ended: str | None = None  # how it ended, when it failed for good

    def __post_init__(self) -> None:
        self.running = self.running or list(self.names)

    @property
    def restarts(self) -> int:
        return max(self.node_restarts.values(), default=0)

    def start_run(self, config_text: str) -> None:
        self.run_ref = self.actor.run.remote(config_text, self.running, self.cpus)


# --- the launcher's side: the run ---------------------------------------------------


def run_mesh_on_ray(
    cfg: cfgmod.MeshConfig,
    out: Path,
    address: str,
    quiet: bool = False,
    restarts: int = 0,
    hosts: int | None = None,
) -> dict[str, Any]:
    """Run every peer of `cfg` in node hosts on the Ray cluster at `address` until all
    have ended; gather the run folder `out` here; write and return the summary."""
    ray = import_ray()
    out.mkdir(parents=True, exist_ok=True)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise UserError(f"--ray: cannot reach a Ray cluster at {address}: {err}") from None
    processes: list[RayProcess] = []
    try:
        processes = _start_hosts(ray, cfg, out, restarts, hosts)
        cfg = _with_seats(ray, cfg, processes)
        cfgmod.validate(cfg)
        config_path = out / "config.yaml"
        cfgmod.save_config(cfgmod.with_explicit_params(cfg), config_path)
        config_text = config_path.read_text()
        for each in processes:
            each.start_run(config_text)
        _write_processes(out, address, processes)
        if not quiet:
            machines = {each.ray_node for each in processes}
            print(
                f"meshfl: {len(cfg.peers)} nodes in {len(processes)} hosts on "
                f"{len(machines)} Ray nodes at {address}, {cfg.algorithm.name} on "
                f"{cfg.data.dataset} ({cfg.data.partition}), {cfg.rounds} rounds -> {out}",
                flush=True,
            )
        _supervise(ray, processes, config_text, out, address, cfg.rounds, restarts, quiet)
    finally:
        _stop_hosts(ray, out, processes)
        ray.shutdown()
    outcomes = {
        name: _outcome(each, name, out, cfg.rounds) for each in processes for name in each.names
    }
    return write_summary(cfg, out, outcomes)


def _start_hosts(
    ray: Any, cfg: cfgmod.MeshConfig, out: Path, restarts: int, hosts: int | None
) -> list[RayProcess]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    placements = plan_hosts([peer.name for peer in cfg.peers], cluster_machines(ray), hosts)
    if cfg.coordinator is not None:  # a host of its own, sharing the first machine's CPUs
        placements[0].groups.append([COORDINATOR])
    run_id = _run_id(out)
    remote_host = ray.remote(RayHost)
    processes: list[RayProcess] = []
    for placement in placements:
        # Pinned to its machine, for good: a restarted host must find its checkpoints.
        where = NodeAffinitySchedulingStrategy(placement.machine.node_id, soft=False)
        for group in placement.groups:
            actor = remote_host.options(
                num_cpus=placement.cpus_per_host,
                scheduling_strategy=where,
                max_restarts=restarts,
                max_concurrency=4,  # its run call, and the mirror's and the stop's calls
            ).remote(run_id, group)
            label = group[0] if len(group) == 1 else f"host{len(processes)}"
            processes.append(
                RayProcess(label, group, actor, placement.machine, placement.cpus_per_host, run_id)
            )
    return processes


def _run_id(out: Path) -> str:
    """The name of the run's scratch folders on the cluster's machines: the one a run
    in `out` had before (a run stopped and launched again resumes from the checkpoints
    there), else a new one (a folder made anew never resumes a stale run)."""
    try:
        return str(json.loads((out / "processes.json").read_text())["ray_run"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{out.resolve().name}-{uuid.uuid4().hex[:8]}"


def _with_seats(ray: Any, cfg: cfgmod.MeshConfig, processes: list[RayProcess]) -> cfgmod.MeshConfig:
    """`cfg` with each peer's listen address on its host's machine and its public key
    (made there; the private key never leaves that machine)."""
    seats: dict[str, tuple[str, str]] = {}
    asking = processes
    for _ in range(SEAT_TRIES):
        for each, (where, drawn) in zip(asking, _ask(ray, asking, "seats"), strict=True):
            each.pid, each.ray_node = where
            seats.update(drawn)
        taken = Counter(address for address, _ in seats.values())
        asking = [each for each in processes if any(taken[seats[n][0]] > 1 for n in each.names)]
        if not asking:
            break  # else the hosts that drew a port twice draw again
    peers = [
        # The key is the one made where the node runs, not a path of this machine.
        replace(peer, listen=seats[peer.name][0], public_key=seats[peer.name][1], key=None)
        for peer in cfg.peers
    ]
    coordinator = seats[COORDINATOR][0] if COORDINATOR in seats else None
    return replace(cfg, peers=peers, coordinator=coordinator)


def _ask(ray: Any, processes: list[RayProcess], method: str) -> list[Any]:
    """Every host's answer to `method`, once Ray has placed them all; UserError when it
    cannot, in words a user can act on."""
    refs = [getattr(each.actor, method).remote() for each in processes]
    try:
        return ray.get(refs, timeout=PLACE_LIMIT_S)
    except ray.exceptions.GetTimeoutError:
        raise UserError(
            f"--ray: the cluster did not place {len(processes)} node hosts within "
            f"{PLACE_LIMIT_S:.0f} s: its CPUs are taken (`ray status` shows them)"
        ) from None
    except ray.exceptions.RayError as err:
        raise UserError(
            f"--ray: a node host could not start on the cluster ({type(err).__name__}); "
            "every machine needs meshfl installed, the same version as here"
        ) from err


def _supervise(
    ray: Any,
    processes: list[RayProcess],
    config_text: str,
    out: Path,
    address: str,
    rounds: int,
    restarts: int,
    quiet: bool,
) -> None:
    """Mirror the files, show progress and restart failed hosts until every run ended."""
    mirror, progress = Mirror(out), Progress(out, rounds, quiet)
    while any(each.run_ref is not None for each in processes):
        for each in _ended_runs(ray, processes):
            _run_again(ray, each, config_text, out, rounds, restarts, quiet, mirror)
            _write_processes(out, address, processes)
        mirror.pull(ray, processes)
        progress.show([name for each in processes if each.run_ref for name in each.running])
        time.sleep(MIRROR_EVERY_S)
    progress.end()


def _ended_runs(ray: Any, processes: list[RayProcess]) -> list[RayProcess]:
    """The hosts whose run call has ended and left a node unfinished; the others' run
    calls are taken as they end."""
    pending = [each.run_ref for each in processes if each.run_ref is not None]
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
    failed = []
    for each in processes:
        if each.run_ref is None or each.run_ref not in done:
            continue
        try:
            ends = ray.get(each.run_ref)
        except ray.exceptions.RayTaskError as err:  # run() raised: its first line says why
            ends, each.ended = {}, f"host raised: {str(err).strip().splitlines()[-1][:200]}"
        except ray.exceptions.RayError as err:  # gone or unreachable: killed, OOM, network
            ends, each.ended = {}, f"host lost ({type(err).__name__})"
        each.run_ref = None
        if not ends or any(status != FINISHED for status in ends.values()):
            each.ended = each.ended or "a node of the host raised (its node.log says why)"
            failed.append(each)
    return failed


def _run_again(
    ray: Any,
    failed: RayProcess,
    config_text: str,
    out: Path,
    rounds: int,
    restarts: int,
    quiet: bool,
    mirror: Mirror,
) -> None:
    """Start the unfinished nodes of a host whose run ended, on its machine (Ray
    restarts an actor that died there), from their checkpoints. An actor that was only
    out of reach and still runs its nodes is joined again instead (RayHost.run)."""
    try:
        pid = _pid_once_back(ray, failed)
    except ray.exceptions.RayError as err:  # its machine is gone, or its restarts spent
        failed.ended = f"host lost ({type(err).__name__})"
        return
    if pid == failed.pid and failed.ended and failed.ended.startswith("host lost"):
        failed.ended = None  # the same process, out of reach for a while: join it again
        failed.start_run(config_text)
        return
    failed.pid = pid
    _pull_all(ray, mirror, [failed])  # what its nodes finished before it went
    failed.running = [name for name in failed.running if not node_finished(out, name, rounds)]
    if not failed.running or failed.restarts >= restarts:
        return
    failed.node_restarts.update(failed.running)
    if not quiet:
        print(
            f"\nmeshfl: {failed.label} failed ({failed.ended}); its nodes resume from "
            f"their checkpoints on its machine ({failed.restarts} of {restarts})",
            flush=True,
        )
    failed.ended = None
    failed.start_run(config_text)


def _pid_once_back(ray: Any, host: RayProcess) -> int:
    """The pid of the host's process once it answers: Ray calls an actor it is still
    restarting unavailable. RayError when it does not come back (ActorDiedError: its
    restarts are spent or its machine is gone)."""
    deadline = time.monotonic() + PLACE_LIMIT_S
    while True:
        try:
            return int(ray.get(host.actor.where.remote(), timeout=PLACE_LIMIT_S)[0])
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(MIRROR_EVERY_S)


def _outcome(each: RayProcess, name: str, out: Path, rounds: int) -> dict[str, Any]:
    restarts = each.node_restarts[name]
    if node_finished(out, name, rounds):
        return {"status": FINISHED, "restarts": restarts}
    return {
        "status": FAILED,
        "restarts": restarts,
        "ended": each.ended or "stopped before its last round",
        "last_error": last_error_line(out / name / "node.log")
        or last_error_line(process_log(out, each.names)),
    }


def _stop_hosts(ray: Any, out: Path, processes: list[RayProcess]) -> None:
    """Stop every host still running (its nodes say bye; their last rounds are
    checkpointed), copy the files back one last time, and end the actors."""
    running = [each for each in processes if each.run_ref is not None]
    if running:
        stops = [each.actor.stop.remote() for each in running]
        ray.wait(stops, num_returns=len(stops), timeout=STOP_WAIT_S)
        refs = [each.run_ref for each in running]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_WAIT_S)
    _pull_all(ray, Mirror(out), processes)
    for each in processes:
        ray.kill(each.actor)


def _pull_all(ray: Any, mirror: Mirror, processes: list[RayProcess]) -> None:
    """Everything the hosts' nodes wrote, as far as the hosts answer in MIRROR_WAIT_S."""
    mirror.asked.clear()  # earlier requests may carry older copies' sizes
    mirror.pull(ray, processes, wait=MIRROR_WAIT_S)


def _write_processes(out: Path, address: str, processes: list[RayProcess]) -> None:
    """<out>/processes.json: which host runs which nodes, on which Ray node and address,
    with its pid, and the name of the run's scratch folders there (`ray_run`)."""
    listing = {
        "launcher": os.getpid(),
        "ray": address,
        "ray_run": processes[0].run_id,
        "processes": [
            {
                "label": each.label,
                "pid": each.pid,
                "nodes": each.running,
                "ray_node": each.ray_node,
                "ip": each.machine.ip,
            }
            for each in processes
        ],
    }
    write_atomically(out / "processes.json", (json.dumps(listing, indent=2) + "\n").encode())


class Mirror:
    """Copies what the hosts' nodes write (MIRRORED, and each host's log) into the run
    folder: appended bytes as they come, a file written anew as a whole. One request
    per host is out at a time, taken when it is answered: a host slow to answer (a
    loaded machine) delays its own copies, never piles requests up."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.asked: dict[str, Any] = {}  # host label -> its unanswered request

    def pull(self, ray: Any, processes: list[RayProcess], wait: float = 0.0) -> None:
        """Ask every host not asked yet; copy what the answered ones sent, waiting up to
        `wait` seconds for answers."""
        for each in processes:
            if each.label not in self.asked:
                self.asked[each.label] = each.actor.files.remote(self._copies(each))
        refs = list(self.asked.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
        for label, ref in list(self.asked.items()):
            if ref not in ready:
                continue
            del self.asked[label]
            try:
                files = ray.get(ref)
            except ray.exceptions.RayError:  # died or being restarted: ask again
                continue
            for relative, (start, data) in files.items():
                self._write(relative, start, data)

    def _copies(self, each: RayProcess) -> dict[str, tuple[int, bytes]]:
        """For each file of the host: its copy's size and last bytes ((0, b"") for none)."""
        copies = {}
        for relative in host_files(each.names):
            try:
                with open(self.out / relative, "rb") as file:
                    size = file.seek(0, 2)
                    file.seek(max(0, size - MATCHED_TAIL))
                    copies[relative] = (size, file.read())
            except OSError:
                copies[relative] = (0, b"")
        return copies

    def _write(self, relative: str, start: int, data: bytes) -> None:
        path = self.out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if start and path.exists() else "wb") as file:
            file.seek(start)
            file.write(data)
            file.truncate()


def host_files(names: list[str]) -> list[str]:
    """The files of a host's nodes that the run folder mirrors, relative to it: theirs,
    and the host's own log (a lone node's host writes to its node.log)."""
    files = [f"{name}/{each}" for name in names for each in MIRRORED]
    host_log = str(process_log(Path(), names))
    return files if host_log in files else [*files, host_log]


# --- the host's side: a Ray actor on some machine of the cluster --------------------


class RayHost:
    """A node host in a Ray actor. Its nodes' folders, keys and checkpoints live under a
    scratch folder of its machine that every host of the run there shares, and that
    outlives the actor: a restarted host finds them again."""

    def __init__(self, run_id: str, names: list[str]) -> None:
        self.root = Path(tempfile.gettempdir()) / "meshfl-ray" / run_id
        self.names = names
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._run_done: threading.Event | None = None  # set while a run is under way
        self._ends: dict[str, str] = {}
        self.host: NodeHost | None = None
        raise_open_files_limit()

    def where(self) -> tuple[int, str]:
        """This process's pid and the Ray node it runs on."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def seats(self) -> tuple[tuple[int, str], dict[str, tuple[str, str]]]:
        """Where this host runs, and for each node the address it will listen on (a free
        port of this machine) and its public key (hex), made here on the first call."""
        import ray

        ip = ray.util.get_node_ip_address()
        ports = free_ports(len(self.names), ip)
        seats = {}
        for name, port in zip(self.names, ports, strict=True):
            identity = Identity.load_or_create(key_path(self.root, name))
            seats[name] = (f"tcp://{ip}:{port}", identity.public_key.hex())
        return self.where(), seats

    def run(self, config_text: str, names: list[str], cpus: float) -> dict[str, str]:
        """Run `names` (resuming from their checkpoints, if any) until each has ended,
        with torch threads for `cpus` CPUs; how each ended. A call while a run is under
        way (the launcher lost sight of this actor for a while) waits for that one."""
        with self._lock:
            under_way = self._run_done
            if under_way is None:
                self._run_done = threading.Event()
        if under_way is not None:
            under_way.wait()
            return self._ends
        try:
            self._ends = self._run(config_text, names, cpus)
        finally:
            with self._lock:
                done, self._run_done = self._run_done, None
            assert done is not None
            done.set()
        return self._ends

    def stop(self) -> None:
        self.stopping.set()
        if self.host is not None:
            self.host.stop()

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

    def _run(self, config_text: str, names: list[str], cpus: float) -> dict[str, str]:
        if self.stopping.is_set():
            return {}
        self.root.mkdir(parents=True, exist_ok=True)
        cfg = cfgmod.config_from_text(config_text, "the launcher's config")
        # Torch threads per host: its CPUs (set_torch_threads divides the machine's cores).
        local_nodes = max(1, (os.cpu_count() or 1) // max(1, int(cpus)))
        options = [self._options(cfg, name, local_nodes) for name in names]
        role = COORDINATOR if names == [COORDINATOR] else "peer"
        self.host = NodeHost(options, partial(make_node, role=role))
        if self.stopping.is_set():  # a stop that came while the host was being made
            return {}
        with _host_log(self.root / process_log(Path(), self.names), options):
            ends = self.host.run()
        return {name: end.status for name, end in ends.items()}

    def _options(self, cfg: cfgmod.MeshConfig, name: str, local_nodes: int) -> NodeOptions:
        if name != COORDINATOR:
            return named_node_options(cfg, name, self.root, local_nodes=local_nodes)
        assert cfg.coordinator is not None, "a coordinator host runs a coordinated rule"
        shard = (len(cfg.peers), len(cfg.peers) + 1)
        key = key_path(self.root, COORDINATOR)
        return node_options(cfg, COORDINATOR, cfg.coordinator, self.root, key, shard, local_nodes)


class _host_log:  # noqa: N801 - used as a context manager, like open()
    """The host's own log lines (none of a node's) in its log file, at INFO, while it runs."""

    def __init__(self, path: Path, options: list[NodeOptions]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)  # a lone node's: its node.log
        self.handler = logging.FileHandler(path)
        self.handler.setFormatter(OneLineFormatter(FORMAT))
        self.handler.addFilter(NodeLog(options, outside=True))

    def __enter__(self) -> None:
        root = logging.getLogger()
        root.setLevel(logging.INFO)
        root.addHandler(self.handler)

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self.handler)
        self.handler.close()
