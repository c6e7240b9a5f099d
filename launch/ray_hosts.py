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
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod
from meshfl.node.coordinator import COORDINATOR, make_node
from meshfl.node.host import FINISHED, NodeHost, NodeLog, files_per_node, raise_open_files_limit
from meshfl.node.logs import FORMAT, OneLineFormatter
from meshfl.node.runtime import NodeOptions
from meshfl.protocol.identity import Identity
from meshfl.protocol.transport import free_ports

from .contacts import key_path
from .entry import named_node_options, node_options
from .errors import UserError
from .summary import FAILED, last_record, ran_every_round, write_summary
from .supervise import Progress, last_error_line

log = logging.getLogger("meshfl.launch")

INSTALL_HINT = "pip install 'meshfl[ray]' (in a checkout: pip install -e '.[ray]')"
MIRROR_EVERY_S = 1.0  # how often the launcher copies the nodes' files back
STOP_WAIT_S = 15.0  # how long stopping hosts may take before they are killed
# The files of a node that come back to the run folder; its checkpoint and key stay.
MIRRORED = ("metrics.jsonl", "node.log", "info.json")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError(f"--ray: Ray is not installed; {INSTALL_HINT}") from None
    return ray


# --- the launcher's side -----------------------------------------------------------


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
    """The hosts of one machine: each host's node names, and the CPUs each reserves."""

    machine: Machine
    groups: list[list[str]]

    @property
    def cpus_per_host(self) -> float:
        return self.machine.cpus / len(self.groups)


def plan_hosts(names: list[str], machines: list[Machine], hosts: int | None) -> list[Placement]:
    """Spread `names` over `machines` in proportion to their CPUs, in about one host per
    CPU (or `hosts` in all), more where a host's connections would not fit a process's
    open-files limit; consecutive names share a host."""
    total_cpus = sum(machine.cpus for machine in machines)
    shares = _proportional(len(names), [machine.cpus / total_cpus for machine in machines])
    placements, start = [], 0
    for machine, count in zip(machines, shares, strict=True):
        if count == 0:
            continue
        mine = names[start : start + count]
        start += count
        wanted = (
            max(1, round(hosts * count / len(names)))
            if hosts is not None
            else max(1, int(machine.cpus), _hosts_by_files(count, len(names)))
        )
        placements.append(Placement(machine, _even_runs(mine, min(wanted, count))))
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


def _even_runs(names: list[str], runs: int) -> list[list[str]]:
    size, extra = divmod(len(names), runs)
    groups, start = [], 0
    for index in range(runs):
        end = start + size + (index < extra)
        groups.append(names[start:end])
        start = end
    return groups


@dataclass
class RayProcess:
    """One host actor as the launcher sees it: its nodes, where it runs, its run call."""

    label: str
    names: list[str]
    actor: Any
    placement: Placement
    hosts_on_ip: int  # hosts on its machine: they share its cores
    run_id: str  # the run's scratch folder on its machine
    running: list[str] = field(default_factory=list)
    node_restarts: Counter[str] = field(default_factory=Counter)
    pid: int = 0
    run_ref: Any = None
    ended: str | None = None  # how it ended, when it failed for good

    def __post_init__(self) -> None:
        self.running = self.running or list(self.names)

    @property
    def restarts(self) -> int:
        return max(self.node_restarts.values(), default=0)


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
        cfg = _with_seats(cfg, processes, ray)
        cfgmod.validate(cfg)
        config_path = out / "config.yaml"
        cfgmod.save_config(cfgmod.with_explicit_params(cfg), config_path)
        config_text = config_path.read_text()
        for each in processes:
            each.run_ref = each.actor.run.remote(config_text, each.running, each.hosts_on_ip)
        _write_processes(out, address, processes)
        if not quiet:
            machines = {each.placement.machine.node_id for each in processes}
            print(
                f"meshfl: {len(cfg.peers)} nodes in {len(processes)} hosts on "
                f"{len(machines)} Ray nodes at {address}, {cfg.algorithm.name} on "
                f"{cfg.data.dataset} ({cfg.data.partition}), {cfg.rounds} rounds -> {out}",
                flush=True,
            )
        mirror = Mirror(out)
        progress = Progress(out, cfg.rounds, quiet)
        restart = partial(_restart, ray, config_text, out, cfg.rounds, restarts, quiet)
        while any(each.run_ref is not None for each in processes):
            _wait_for_runs(ray, processes, restart)
            mirror.pull(ray, processes)
            progress.show([name for each in processes for name in each.running])
            if any(each.run_ref is not None for each in processes):
                time.sleep(MIRROR_EVERY_S)
        progress.end()
    finally:
        _stop_hosts(ray, out, processes)
        ray.shutdown()
    outcomes = {
        name: _outcome(each, name, out, cfg.rounds, last_error_line)
        for each in processes
        for name in each.names
    }
    return write_summary(cfg, out, outcomes)


def _start_hosts(
    ray: Any, cfg: cfgmod.MeshConfig, out: Path, restarts: int, hosts: int | None
) -> list[RayProcess]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    names = [peer.name for peer in cfg.peers]
    placements = plan_hosts(names, cluster_machines(ray), hosts)
    if cfg.coordinator is not None:  # a host of its own, on the first machine
        placements.append(Placement(placements[0].machine, [[COORDINATOR]]))
    run_id = _run_id(out)
    hosts_on_ip = Counter(
        placement.machine.ip for placement in placements for _ in placement.groups
    )
    remote_host = ray.remote(RayHost)
    processes: list[RayProcess] = []
    for placement in placements:
        # Pinned to its machine, for good: a restarted host must find its checkpoints.
        where = NodeAffinitySchedulingStrategy(placement.machine.node_id, soft=False)
        for group in placement.groups:
            actor = remote_host.options(
                num_cpus=min(1.0, placement.cpus_per_host),
                scheduling_strategy=where,
                max_restarts=restarts,
                max_concurrency=4,  # its run call, and the mirror's and the stop's calls
            ).remote(run_id, group)
            label = group[0] if len(group) == 1 else f"host{len(processes)}"
            processes.append(
                RayProcess(
                    label, group, actor, placement, hosts_on_ip[placement.machine.ip], run_id
                )
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


def _with_seats(cfg: cfgmod.MeshConfig, processes: list[RayProcess], ray: Any) -> cfgmod.MeshConfig:
    """`cfg` with each peer's listen address on its host's machine and its public key
    (made there; the private key never leaves that machine)."""
    try:
        answers = ray.get([each.actor.seats.remote() for each in processes])
    except ray.exceptions.RayError as err:
        raise UserError(
            f"--ray: a node host could not start on the cluster ({type(err).__name__}); "
            "every machine needs meshfl installed, the same version as here"
        ) from err
    seats: dict[str, tuple[str, str]] = {}
    for each, (pid, node_seats) in zip(processes, answers, strict=True):
        each.pid = pid
        seats.update(node_seats)
    peers = [
        replace(peer, listen=seats[peer.name][0], public_key=seats[peer.name][1])
        for peer in cfg.peers
    ]
    coordinator = seats[COORDINATOR][0] if COORDINATOR in seats else None
    return replace(cfg, peers=peers, coordinator=coordinator)


def _wait_for_runs(
    ray: Any, processes: list[RayProcess], restart: Callable[[RayProcess], None]
) -> None:
    """Take the result of every run call that has ended; restart a host that died."""
    pending = [each.run_ref for each in processes if each.run_ref is not None]
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
    for each in processes:
        if each.run_ref is None or each.run_ref not in done:
            continue
        try:
            ends = ray.get(each.run_ref)
        except ray.exceptions.RayError as err:  # the actor died: killed, OOM, machine lost
            ends, each.ended = {}, f"host died ({type(err).__name__})"
        each.run_ref = None
        if ends and all(status == FINISHED for status in ends.values()):
            continue
        each.ended = each.ended or "a node of the host raised (its node.log says why)"
        restart(each)


def _restart(
    ray: Any,
    config_text: str,
    out: Path,
    rounds: int,
    restarts: int,
    quiet: bool,
    failed: RayProcess,
) -> None:
    """Run the unfinished nodes of a host that failed again, on its machine (Ray
    restarts an actor that died there), from their checkpoints."""
    if failed.restarts >= restarts:
        return
    try:
        failed.pid = ray.get(failed.actor.pid.remote())  # once Ray has it back
    except ray.exceptions.RayError as err:  # its machine is gone: Ray cannot restart it
        failed.ended = f"host lost ({type(err).__name__})"
        return
    Mirror(out).pull(ray, [failed])  # what its nodes finished before it went
    failed.running = [name for name in failed.running if not _finished(out, name, rounds)]
    if not failed.running:
        return
    failed.node_restarts.update(failed.running)
    if not quiet:
        print(
            f"\nmeshfl: {failed.label} failed ({failed.ended}); its nodes resume from "
            f"their checkpoints on its machine ({failed.restarts} of {restarts})",
            flush=True,
        )
    failed.ended = None
    failed.run_ref = failed.actor.run.remote(config_text, failed.running, failed.hosts_on_ip)
    _write_processes(out, None, [failed], update=True)


def _finished(out: Path, name: str, rounds: int) -> bool:
    return ran_every_round(last_record(out / name / "metrics.jsonl"), rounds)


def _outcome(
    each: RayProcess,
    name: str,
    out: Path,
    rounds: int,
    last_error_line: Callable[[Path], str | None],
) -> dict[str, Any]:
    restarts = each.node_restarts[name]
    if _finished(out, name, rounds):
        return {"status": FINISHED, "restarts": restarts}
    return {
        "status": FAILED,
        "restarts": restarts,
        "ended": each.ended or "stopped before its last round",
        "last_error": last_error_line(out / name / "node.log")
        or last_error_line(out / _host_log_name(each.names)),
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
    Mirror(out).pull(ray, processes)
    for each in processes:
        ray.kill(each.actor)


def _write_processes(
    out: Path, address: str | None, processes: list[RayProcess], update: bool = False
) -> None:
    """<out>/processes.json: which host runs which nodes, on which Ray node, with its pid,
    and the name of the run's scratch folders there (`ray_run`)."""
    path = out / "processes.json"
    listing: dict[str, Any] = json.loads(path.read_text()) if update else {"launcher": os.getpid()}
    if address is not None:
        listing["ray"] = address
        listing["ray_run"] = processes[0].run_id
    rows = {row["label"]: row for row in listing.get("processes", [])}
    for each in processes:
        rows[each.label] = {
            "label": each.label,
            "pid": each.pid,
            "nodes": each.running,
            "ray_node": each.placement.machine.node_id,
            "ip": each.placement.machine.ip,
        }
    listing["processes"] = list(rows.values())
    path.write_text(json.dumps(listing, indent=2) + "\n")


class Mirror:
    """Copies what the hosts' nodes write (MIRRORED, and each host's log) into the run
    folder: appended bytes as they come, a file written anew as a whole."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def pull(self, ray: Any, processes: list[RayProcess]) -> None:
        asks = [each.actor.files.remote(self._offsets(each)) for each in processes]
        for ref in asks:
            try:
                files = ray.get(ref, timeout=30)
            except ray.exceptions.RayError:  # died, being restarted, or slow: next time
                continue
            for relative, (start, data) in files.items():
                self._write(relative, start, data)

    def _offsets(self, each: RayProcess) -> dict[str, int]:
        offsets = {}
        for relative in host_files(each.names):
            path = self.out / relative
            offsets[relative] = path.stat().st_size if path.exists() else 0
        return offsets

    def _write(self, relative: str, start: int, data: bytes) -> None:
        path = self.out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if start and path.exists() else "wb") as file:
            file.seek(start)
            file.write(data)
            file.truncate()


def host_files(names: list[str]) -> list[str]:
    """The files of a host's nodes that the run folder mirrors, relative to it."""
    return [f"{name}/{each}" for name in names for each in MIRRORED] + [_host_log_name(names)]


def _host_log_name(names: list[str]) -> str:
    return f"host-{names[0]}-{names[-1]}.log"


# --- the host's side: a Ray actor on some machine of the cluster --------------------


class RayHost:
    """A node host in a Ray actor. Its nodes' folders, keys and checkpoints live under a
    scratch folder of its machine that every host of the run there shares, and that
    outlives the actor: a restarted host finds them again."""

    def __init__(self, run_id: str, names: list[str]) -> None:
        self.root = Path(tempfile.gettempdir()) / "meshfl-ray" / run_id
        self.names = names
        self.host: NodeHost | None = None
        raise_open_files_limit()

    def pid(self) -> int:
        return os.getpid()

    def seats(self) -> tuple[int, dict[str, tuple[str, str]]]:
        """This process's pid, and for each node the address it will listen on (a free
        port of this machine) and its public key (hex)."""
        import ray

        ip = ray.util.get_node_ip_address()
        ports = free_ports(len(self.names), ip)
        seats = {}
        for name, port in zip(self.names, ports, strict=True):
            identity = Identity.load_or_create(key_path(self.root, name))
            seats[name] = (f"tcp://{ip}:{port}", identity.public_key.hex())
        return os.getpid(), seats

    def run(self, config_text: str, names: list[str], local_nodes: int) -> dict[str, str]:
        """Run `names` (resuming from their checkpoints, if any) until each has ended."""
        self.root.mkdir(parents=True, exist_ok=True)
        config_path = self.root / "config.yaml"
        config_path.write_text(config_text)
        cfg = cfgmod.load_config(config_path)
        options = [self._options(cfg, name, local_nodes) for name in names]
        role = COORDINATOR if names == [COORDINATOR] else "peer"
        self.host = NodeHost(options, partial(make_node, role=role))
        with _host_log(self.root / _host_log_name(self.names), options):
            ends = self.host.run()
        return {name: end.status for name, end in ends.items()}

    def stop(self) -> None:
        if self.host is not None:
            self.host.stop()

    def files(self, offsets: dict[str, int]) -> dict[str, tuple[int, bytes]]:
        """What the run folder lacks of each file it asks for, as (where it starts, the
        bytes): the tail past its copy's size, or the whole file where the copy is longer
        (the file was written anew)."""
        found = {}
        for relative, have in offsets.items():
            path = self.root / relative
            try:
                with open(path, "rb") as file:
                    size = file.seek(0, 2)
                    start = have if size >= have else 0
                    file.seek(start)
                    data = file.read()
            except OSError:
                continue  # not written yet
            if data or start == 0 and have:
                found[relative] = (start, data)
        return found

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
