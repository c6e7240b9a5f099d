"""`meshfl launch --ray ADDRESS`: node hosts on the machines of a Ray cluster.

Ray only places and supervises. On each machine that gets nodes one actor, pinned
there and holding the machine's CPUs, forks the node hosts as a plain launch forks them
(ray_machine.py): the hosts share the actor's torch, so a machine pays for one
interpreter and one torch, not one per host, and the actor restarts a host that fails.
The nodes bind on their machine's address and talk to every other node over meshfl's
own signed, encrypted wire, exactly as the processes of a local launch do. What
crosses Ray is small and plain: the run's config text, each node's listen address and
public key, each machine's hosts, and the nodes' text files on their way back.

- Keys and checkpoints stay on the machine that runs the node, under a scratch folder of
  its own (`<tmp>/meshfl-ray/<run>/`). When an actor dies its hosts stop
  with it (the lifeline); with `--restarts N` Ray brings the actor back on the same
  machine and its unfinished nodes resume from their checkpoints. The scratch folders
  stay while the run can be resumed (stopped, or a node failed) and are removed once
  every node has finished.
- The run folder on the launching machine is filled as for a local run: config.yaml,
  each node's metrics.jsonl, node.log and info.json (mirrored while the run goes on),
  the hosts' logs, processes.json and summary.json.
- Data: a node loads its shard where it runs, from the same `--data-root` path on every
  machine (or the embedded digits).

This module and its actor's (ray_machine.py) are the only ones of meshfl that import
Ray, and only when `--ray` is given.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod
from meshfl.node.coordinator import COORDINATOR
from meshfl.node.host import FINISHED

from .errors import UserError, stop_signals_as_interrupts
from .placement import host_groups, host_label, hosts_by_files
from .ray_machine import CPU_GRAINS, HostListing, RayMachine
from .summary import FAILED, write_summary
from .supervise import Progress, last_error_line, node_finished, process_log, write_processes

log = logging.getLogger("meshfl.launch")

INSTALL_HINT = "pip install 'meshfl[ray]' (in a checkout: pip install -e '.[ray]')"
PLACE_LIMIT_S = 120.0  # actors not placed by then wait for CPUs the cluster lacks
MIRROR_EVERY_S = 1.0  # how often the launcher copies the nodes' files back
MIRROR_WAIT_S = 30.0  # how long the last copy of a run waits for the hosts' answers
STOP_WAIT_S = 15.0  # how long a machine's hosts may take to stop before its actor ends
SEAT_TRIES = 5  # Ray nodes sharing an address may draw the same free port: draw again
# The files of a node that come back to the run folder; its checkpoint and key stay.
MIRRORED = ("metrics.jsonl", "node.log", "info.json")
# How much of a copied file's end must still match the original for its tail alone to
# be sent: a file written anew (a resumed node's metrics) comes back whole.
MATCHED_TAIL = 256


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
    gpus: float = 0.0  # Ray hides a machine's GPUs from an actor that asks for none


def cluster_machines(ray: Any) -> list[Machine]:
    machines = [
        Machine(
            node["NodeID"],
            node["NodeManagerAddress"],
            node["Resources"].get("CPU", 0.0),
            node["Resources"].get("GPU", 0.0),
        )
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
    def cpus(self) -> float:
        """The machine's CPUs as Ray can grant them in full (it counts ten-thousandths)."""
        return math.floor(self.machine.cpus * CPU_GRAINS) / CPU_GRAINS


def plan_hosts(
    names: list[str], machines: list[Machine], hosts: int | None, links: int | None = None
) -> list[Placement]:
    """Spread `names` over `machines` in proportion to their CPUs, consecutive names
    sharing a host: about one host per CPU, more where a host's connections (`links`
    peers a node, by default all the others) would not fit a process's open-files
    limit; or `hosts` in all (at least one per machine used)."""
    links = len(names) - 1 if links is None else links
    total_cpus = sum(machine.cpus for machine in machines)
    counts = _proportional(len(names), [machine.cpus / total_cpus for machine in machines])
    used = [(machine, count) for machine, count in zip(machines, counts, strict=True) if count]
    if hosts is None:
        wanted = [
            max(1, int(machine.cpus), hosts_by_files(count, links)) for machine, count in used
        ]
    else:
        wanted = [max(1, n) for n in _proportional(hosts, [c / len(names) for _, c in used])]
    placements, start = [], 0
    for (machine, count), hosts_here in zip(used, wanted, strict=True):
        mine = names[start : start + count]
        start += count
        placements.append(Placement(machine, host_groups(mine, min(hosts_here, count))))
    return placements


def _proportional(total: int, weights: list[float]) -> list[int]:
    """`total` split by `weights` into whole numbers that add up (largest remainders)."""
    exact = [total * weight for weight in weights]
    counts = [int(value) for value in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])
    for index in by_remainder[: total - sum(counts)]:
        counts[index] += 1
    return counts


@dataclass
class MachineRun:
    """The node hosts of one machine as the launcher sees them: the actor that forks
    them there, its run call, and what it last said of its hosts."""

    label: str
    machine: Machine
    hosts: list[tuple[str, list[str]]]  # each host's label and node names, as planned
    actor: Any
    cpus: float  # the machine's CPUs that Ray grants the actor
    run_id: str  # the run's scratch folder on its machine
    running: list[str] = field(default_factory=list)
    # Each node's restarts as last known here; the actor's `listing` may know more.
    node_restarts: Counter[str] = field(default_factory=Counter)
    listing: list[HostListing] = field(default_factory=list)
    pid: int = 0  # the actor's process
    ray_node: str = ""  # where Ray says it runs
    run_ref: Any = None
    ended: str | None = None  # how it ended, when it failed for good

    def __post_init__(self) -> None:
        self.running = self.running or list(self.names)

    @property
    def names(self) -> list[str]:
        return [name for _, names in self.hosts for name in names]

    def planned(self) -> list[HostListing]:
        """The hosts before the actor has said anything of them: no pid yet."""
        return [HostListing(label, None, names, {}) for label, names in self.hosts]

    def restarts_of(self, name: str) -> int:
        """How often node `name` was started again: by the actor (its hosts' counts,
        which start from the counts it was given) or here, after the actor was lost."""
        listed = (host.restarts.get(name, 0) for host in self.listing)
        return max([self.node_restarts[name], *listed])

    def resumable(self, restarts: int) -> list[str]:
        """The running nodes that may be started again: restarted fewer than `restarts`
        times so far."""
        return [name for name in self.running if self.restarts_of(name) < restarts]

    def log_groups(self) -> list[list[str]]:
        """The node names of every host log: the planned hosts', and those of hosts the
        actor started again for fewer nodes (a log is named by its host's nodes)."""
        # A host that failed after all its nodes finished runs none, and names no log.
        return [names for _, names in self.hosts] + [h.nodes for h in self.listing if h.nodes]

    def start_run(self, config_text: str, restarts: int, again: list[str] | None = None) -> None:
        """Run the unfinished nodes, `again` of them started again by this call; each
        host the actor forks may be started again until one of its nodes has been
        restarted `restarts` times in all."""
        for name in self.names:
            self.node_restarts[name] = self.restarts_of(name)
        self.node_restarts.update(again or [])
        self.listing = []
        self.run_ref = self.actor.run.remote(
            config_text, self.running, self.cpus, restarts, dict(self.node_restarts)
        )


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
    have ended; gather the run folder `out` here; write and return the summary. SIGTERM
    and SIGHUP stop the mesh as Ctrl-C does: its hosts stop as on Ctrl-C."""
    with stop_signals_as_interrupts():
        return _run_on_cluster(cfg, out, address, quiet, restarts, hosts)


def _run_on_cluster(
    cfg: cfgmod.MeshConfig, out: Path, address: str, quiet: bool, restarts: int, hosts: int | None
) -> dict[str, Any]:
    ray = import_ray()
    out.mkdir(parents=True, exist_ok=True)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise UserError(f"--ray: cannot reach a Ray cluster at {address}: {err}") from None
    machines: list[MachineRun] = []
    try:
        machines = _start_machines(ray, cfg, out, restarts, hosts)
        cfg = _with_seats(ray, cfg, machines)
        cfgmod.validate(cfg)
        config_path = out / "config.yaml"
        cfgmod.save_config(cfgmod.with_explicit_params(cfg), config_path)
        config_text = config_path.read_text()
        for each in machines:
            each.start_run(config_text, restarts)
        _write_processes(out, address, machines)
        if not quiet:
            print(
                f"meshfl: {cfgmod.counted(len(cfg.peers), 'node')} in "
                f"{cfgmod.counted(sum(len(m.hosts) for m in machines), 'host')} on "
                f"{cfgmod.counted(len(machines), 'Ray node')} at {address}, "
                f"{cfgmod.what_runs(cfg)} -> {out}",
                flush=True,
            )
        _supervise(ray, machines, config_text, out, address, cfg.rounds, restarts, quiet)
    finally:
        _stop_machines(ray, out, address, machines, cfg.rounds)
        ray.shutdown()
    outcomes = {
        name: _outcome(each, name, out, cfg.rounds) for each in machines for name in each.names
    }
    return write_summary(cfg, out, outcomes)


def _start_machines(
    ray: Any, cfg: cfgmod.MeshConfig, out: Path, restarts: int, hosts: int | None
) -> list[MachineRun]:
    """An actor on each machine that gets nodes, holding all of that machine's CPUs and
    GPUs (its nodes' `device: auto` spreads them over the GPUs)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    names = [peer.name for peer in cfg.peers]
    links = cfg.topology.connections(len(names))
    placements = plan_hosts(names, cluster_machines(ray), hosts, links)
    if cfg.coordinator is not None:  # a host of its own, beside the first machine's
        placements[0].groups.append([COORDINATOR])
    run_id = _run_id(out)
    remote_machine = ray.remote(RayMachine)
    machines: list[MachineRun] = []
    count = 0
    for index, placement in enumerate(placements):
        labelled = []
        for group in placement.groups:
            labelled.append((host_label(count, group), group))
            count += 1
        actor = remote_machine.options(
            num_cpus=placement.cpus,
            num_gpus=placement.machine.gpus,
            # Pinned to its machine, for good: a restarted actor must find the checkpoints.
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                placement.machine.node_id, soft=False
            ),
            max_restarts=restarts,
            max_concurrency=4,  # its run call, and the mirror's and the stop's calls
        ).remote(run_id, f"machine{index}", labelled)
        machines.append(
            MachineRun(
                f"machine{index}", placement.machine, labelled, actor, placement.cpus, run_id
            )
        )
    return machines


def run_id_of(out: Path) -> str | None:
    """The `ray_run` of the run folder `out`, if a Ray launch made it."""
    try:
        return str(json.loads((out / "processes.json").read_text())["ray_run"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _run_id(out: Path) -> str:
    """The name of the run's scratch folders on the cluster's machines: the one a run
    in `out` had before (a run stopped and launched again resumes from the checkpoints
    there), else a new one (a folder made anew never resumes a stale run)."""
    return run_id_of(out) or f"{out.resolve().name}-{uuid.uuid4().hex[:8]}"


def _with_seats(ray: Any, cfg: cfgmod.MeshConfig, machines: list[MachineRun]) -> cfgmod.MeshConfig:
    """`cfg` with each peer's listen address on its machine and its public key (made
    there; the private key never leaves that machine)."""
    seats: dict[str, tuple[str, str]] = {}
    asking = machines
    for _ in range(SEAT_TRIES):
        for each, (where, drawn) in zip(asking, _ask(ray, asking, "seats"), strict=True):
            each.pid, each.ray_node = where
            seats.update(drawn)
        taken = Counter(address for address, _ in seats.values())
        asking = [each for each in machines if any(taken[seats[n][0]] > 1 for n in each.names)]
        if not asking:
            break  # else the machines (Ray nodes of one host) that drew a port twice draw again
    peers = [
        # The key is the one made where the node runs, not a path of this machine.
        replace(peer, listen=seats[peer.name][0], public_key=seats[peer.name][1], key=None)
        for peer in cfg.peers
    ]
    coordinator = seats[COORDINATOR][0] if COORDINATOR in seats else None
    return replace(cfg, peers=peers, coordinator=coordinator)


def _ask(ray: Any, machines: list[MachineRun], method: str) -> list[Any]:
    """Every actor's answer to `method`, once Ray has placed them all; UserError when it
    cannot, in words a user can act on."""
    refs = [getattr(each.actor, method).remote() for each in machines]
    try:
        return ray.get(refs, timeout=PLACE_LIMIT_S)
    except ray.exceptions.GetTimeoutError:
        raise UserError(
            f"--ray: the cluster did not place the node hosts of {len(machines)} machines "
            f"within {PLACE_LIMIT_S:.0f} s: their CPUs are taken (`ray status` shows them)"
        ) from None
    except ray.exceptions.RayError as err:
        raise UserError(
            f"--ray: node hosts could not start on the cluster ({type(err).__name__}); "
            "every machine needs meshfl installed, the same version as here"
        ) from err


def _supervise(
    ray: Any,
    machines: list[MachineRun],
    config_text: str,
    out: Path,
    address: str,
    rounds: int,
    restarts: int,
    quiet: bool,
) -> None:
    """Mirror the files, show progress and start the unfinished nodes of a machine whose
    actor was lost again, until every run ended."""
    mirror, progress = Mirror(out), Progress(out, rounds, quiet)
    while any(each.run_ref is not None for each in machines):
        for each in _ended_runs(ray, machines):
            _run_again(ray, each, config_text, out, rounds, restarts, quiet, mirror)
            _write_processes(out, address, machines)
        if mirror.pull(ray, machines):
            _write_processes(out, address, machines)
        progress.show([name for each in machines if each.run_ref for name in each.running])
        time.sleep(MIRROR_EVERY_S)
    progress.end()


def _ended_runs(ray: Any, machines: list[MachineRun]) -> list[MachineRun]:
    """The machines whose run call has ended and left a node unfinished; the others'
    run calls are taken as they end."""
    pending = [each.run_ref for each in machines if each.run_ref is not None]
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
    failed = []
    for each in machines:
        if each.run_ref is None or each.run_ref not in done:
            continue
        try:
            ends = ray.get(each.run_ref)
        except ray.exceptions.RayTaskError as err:  # run() raised: its first line says why
            ends, each.ended = {}, f"raised: {str(err).strip().splitlines()[-1][:200]}"
        except ray.exceptions.RayError as err:  # gone or unreachable: killed, OOM, network
            ends, each.ended = {}, f"lost ({type(err).__name__})"
        each.run_ref = None
        if not ends or any(status != FINISHED for status in ends.values()):
            each.ended = each.ended or "a host failed (its log says why)"
            failed.append(each)
    return failed


def _run_again(
    ray: Any,
    failed: MachineRun,
    config_text: str,
    out: Path,
    rounds: int,
    restarts: int,
    quiet: bool,
    mirror: Mirror,
) -> None:
    """Start the unfinished nodes of a machine whose run ended without them, from their
    checkpoints there, each while it has restarts left: after its actor was lost (Ray
    restarts the actor on its machine; the actor's hosts stopped with it), or after the
    actor gave up on a host. An actor that was only out of reach and still runs its
    hosts is joined again instead (RayMachine.run)."""
    try:
        pid = _pid_once_back(ray, failed)
    except ray.exceptions.RayError as err:  # its machine is gone
        failed.ended = f"lost ({type(err).__name__})"
        return
    _pull_all(ray, mirror, [failed])  # what its nodes finished meanwhile
    failed.running = [name for name in failed.running if not node_finished(out, name, rounds)]
    if pid == failed.pid and failed.ended and failed.ended.startswith("lost"):
        failed.ended = None  # the same process, out of reach for a while: join it again
        failed.run_ref = failed.actor.run.remote(
            config_text, failed.running, failed.cpus, restarts, dict(failed.node_restarts)
        )
        return
    failed.pid = pid
    resumed = failed.resumable(restarts)
    if not resumed:
        return  # its nodes are listed as failed
    if not quiet:
        print(
            f"\nmeshfl: the hosts of {failed.label} ({failed.machine.ip}) ended "
            f"({failed.ended}); {len(resumed)} unfinished nodes resume from their "
            "checkpoints there",
            flush=True,
        )
    failed.running, failed.ended = resumed, None
    failed.start_run(config_text, restarts, again=resumed)


def _pid_once_back(ray: Any, machine: MachineRun) -> int:
    """The pid of the actor's process once it answers: Ray calls an actor it is still
    restarting unavailable. RayError when it does not come back (ActorDiedError: its
    machine is gone)."""
    deadline = time.monotonic() + PLACE_LIMIT_S
    while True:
        try:
            return int(ray.get(machine.actor.where.remote(), timeout=PLACE_LIMIT_S)[0])
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(MIRROR_EVERY_S)


def _outcome(each: MachineRun, name: str, out: Path, rounds: int) -> dict[str, Any]:
    restarts = each.restarts_of(name)
    if node_finished(out, name, rounds):
        return {"status": FINISHED, "restarts": restarts}
    logs = [process_log(out, names) for names in each.log_groups() if name in names]
    return {
        "status": FAILED,
        "restarts": restarts,
        "ended": each.ended or "stopped before its last round",
        "last_error": last_error_line(out / name / "node.log")
        or next(filter(None, map(last_error_line, logs)), None),
    }


def _stop_machines(
    ray: Any, out: Path, address: str, machines: list[MachineRun], rounds: int
) -> None:
    """Stop every machine's hosts still running (their nodes say bye; their last rounds
    are checkpointed), copy the files back one last time, remove the scratch folders if
    every node finished (else a resume needs their checkpoints), and end the actors."""
    running = [each for each in machines if each.run_ref is not None]
    if running:
        stops = [each.actor.stop.remote() for each in running]
        ray.wait(stops, num_returns=len(stops), timeout=STOP_WAIT_S)
        refs = [each.run_ref for each in running]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_WAIT_S)
    if _pull_all(ray, Mirror(out), machines):
        _write_processes(out, address, machines)
    if all(node_finished(out, name, rounds) for each in machines for name in each.names):
        removals = [each.actor.remove_scratch.remote() for each in machines]
        ray.wait(removals, num_returns=len(removals), timeout=STOP_WAIT_S)
    for each in machines:
        ray.kill(each.actor)


def _pull_all(ray: Any, mirror: Mirror, machines: list[MachineRun]) -> bool:
    """Everything the hosts' nodes wrote, as far as the actors answer in MIRROR_WAIT_S;
    whether a machine's hosts changed."""
    mirror.asked.clear()  # earlier requests may carry older copies' sizes
    return mirror.pull(ray, machines, wait=MIRROR_WAIT_S)


def _write_processes(out: Path, address: str, machines: list[MachineRun]) -> None:
    """processes.json (supervise.py) of a Ray run: each host with its pid (null until
    known), on which Ray node and address, under which machine's actor (`agent`: its
    pid); and the cluster's address and the name of the run's scratch folders there
    (`ray_run`)."""
    hosts = [
        {
            "label": host.label,
            "pid": host.pid,
            "nodes": host.nodes,
            "ray_node": each.ray_node,
            "ip": each.machine.ip,
            "agent": each.pid,
        }
        for each in machines
        for host in each.listing or each.planned()
    ]
    write_processes(out, hosts, ray=address, ray_run=machines[0].run_id)


class Mirror:
    """Copies what the hosts' nodes write (MIRRORED, and each host's log) into the run
    folder: appended bytes as they come, a file written anew as a whole; and keeps each
    machine's listing of its hosts. One request per machine is out at a time, taken
    when it is answered: a machine slow to answer (a loaded one) delays its own copies,
    never piles requests up."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.asked: dict[str, Any] = {}  # machine label -> its unanswered request

    def pull(self, ray: Any, machines: list[MachineRun], wait: float = 0.0) -> bool:
        """Ask every machine not asked yet; copy what the answered ones sent, waiting up
        to `wait` seconds for answers. Whether a machine's hosts changed."""
        for each in machines:
            if each.label not in self.asked:
                self.asked[each.label] = each.actor.news.remote(self._copies(each))
        refs = list(self.asked.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
        changed = False
        for each in machines:
            ref = self.asked.get(each.label)
            if ref is None or ref not in ready:
                continue
            del self.asked[each.label]
            try:
                listing, files = ray.get(ref)
            except ray.exceptions.RayError:  # died or being restarted: ask again
                continue
            if listing and listing != each.listing:
                each.listing, changed = listing, True
            for relative, (start, data) in files.items():
                self._write(relative, start, data)
        return changed

    def _copies(self, each: MachineRun) -> dict[str, tuple[int, bytes]]:
        """For each file of the machine's hosts: its copy's size and last bytes ((0, b"")
        for none)."""
        copies = {}
        for relative in host_files(each.log_groups()):
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


def host_files(groups: list[list[str]]) -> list[str]:
    """The files of the hosts' nodes that the run folder mirrors, relative to it: the
    nodes', and each host's own log (a lone node's host writes to its node.log)."""
    files = [f"{name}/{each}" for names in groups for name in names for each in MIRRORED]
    logs = {str(process_log(Path(), names)) for names in groups}
    return files + sorted(logs - set(files))
