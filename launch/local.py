"""Running nodes: N local processes with live progress, one named node, a joiner."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from meshfl.algorithms.fedrema import own_group_fraction
from meshfl.algorithms.pfedlia import groups_ari
from meshfl.node import config as cfgmod
from meshfl.node.coordinator import COORDINATOR, needs_coordinator, node_class
from meshfl.node.data import load_node_data
from meshfl.node.runtime import NodeOptions
from meshfl.protocol.transport import host_towards, split_contact

from .cli import EXIT_NODE_FAILED, Stopped, UserError
from .contacts import join_contact, key_path, listed_contacts, own_contact
from .decisions import node_decisions
from .lifeline import Lifeline, watch_launcher

log = logging.getLogger("meshfl.launch")

FINISHED, FAILED = "finished", "failed"  # a node's status in summary.json
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # taken as Ctrl-C by launch and by nodes


def resolve_config(args: argparse.Namespace, check: bool = True) -> cfgmod.MeshConfig:
    cfg = cfgmod.load_config(args.config)
    cfg = cfgmod.apply_overrides(cfg, _named(args) + list(args.assignments))
    if check:
        cfgmod.validate(cfg)
        # The node runs the rule parameters the check fitted to `rounds` (a warm-up).
        cfg = cfgmod.with_explicit_params(cfg)
    return cfg


def _named(args: argparse.Namespace) -> list[str]:
    from .cli import _named_overrides

    return _named_overrides(args)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the OS calls free right now (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# --- meshfl launch ------------------------------------------------------------


def launch_local(args: argparse.Namespace) -> int:
    cfg = resolve_config(args, check=False)  # run_mesh checks it with its local addresses
    if args.nodes is not None or args.config is None:
        count = args.nodes if args.nodes is not None else len(cfg.peers)
        cfg = with_local_peers(cfg, count)
    if args.restarts < 0:
        raise UserError(f"--restarts: got {args.restarts}; allowed: 0 or more")
    out = Path(args.out or _default_run_dir(cfg))
    summary = run_mesh(cfg, out, quiet=args.quiet, restarts=args.restarts)
    print_table(summary)
    failed = failed_nodes(summary)
    if failed:
        print(f"meshfl: {len(failed)} of {len(summary['nodes'])} nodes failed: "
              f"{', '.join(failed)} (see {out / 'summary.json'})", file=sys.stderr)
        return EXIT_NODE_FAILED
    return 0


def failed_nodes(summary: dict[str, Any]) -> list[str]:
    return [node["name"] for node in summary["nodes"] if node["status"] != FINISHED]


def with_local_peers(cfg: cfgmod.MeshConfig, count: int) -> cfgmod.MeshConfig:
    """`cfg` with `count` peers (and a coordinator) on free loopback ports."""
    if count < 1:
        raise UserError(f"--nodes: got {count}; allowed: 1 or more")
    *ports, coordinator_port = free_ports(count + 1)
    peers = [replace(peer, listen=f"tcp://127.0.0.1:{port}")
             for peer, port in zip(cfgmod.local_peers(count), ports, strict=True)]
    coordinator = f"tcp://127.0.0.1:{coordinator_port}"
    return replace(cfg, peers=peers,
                   coordinator=coordinator if needs_coordinator(cfg.algorithm.name) else None)


def run_mesh(cfg: cfgmod.MeshConfig, out: Path, quiet: bool = False,
             restarts: int = 0) -> dict[str, Any]:
    """Run every peer of `cfg` as a local process until all have exited; write and
    return the summary. A node that fails does not stop the others: it is restarted up
    to `restarts` times, then listed as failed. SIGTERM and SIGHUP stop the mesh as
    Ctrl-C does (KeyboardInterrupt), and the nodes stop on their own if this process
    dies (launch/lifeline.py)."""
    cfgmod.validate(cfg)
    _check_data(cfg)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    # Fitted rule parameters written out: a joiner with other `rounds` still agrees.
    cfgmod.save_config(cfgmod.with_explicit_params(cfg), config_path)
    first = cfg.peers[0]
    # Made before the node that loads it starts, so that the join line can carry its key.
    joinable = own_contact(cfg, first.listen, key_path(out, first.name, first.key))
    names = [peer.name for peer in cfg.peers]
    if cfg.coordinator is not None:
        names.append(COORDINATOR)
    lifeline = Lifeline()
    start = partial(_spawn_node, config_path, out=out, local_nodes=len(names),
                    launcher_fd=lifeline.node_fd)
    nodes: dict[str, SupervisedNode] = {}
    try:
        with _stop_signals_as_interrupts():
            for name in names:
                nodes[name] = SupervisedNode(name, start(name))
            if not quiet:
                print(f"meshfl: {len(nodes)} nodes, {cfg.algorithm.name} on "
                      f"{cfg.data.dataset} ({cfg.data.partition}), {cfg.rounds} rounds -> {out}")
                print(f"meshfl: join this mesh with: meshfl join {joinable} "
                      f"--config {config_path}")
            _supervise(nodes, start, restarts, out, cfg.rounds, quiet=quiet)
    finally:
        _stop([node.process for node in nodes.values()])
        lifeline.close()
    return write_summary(cfg, out, {name: node.outcome(out) for name, node in nodes.items()})


@contextmanager
def _stop_signals_as_interrupts() -> Iterator[None]:
    """SIGTERM (timeout, CI runners, systemd, container stops) and SIGHUP (a closed
    terminal) raise `Stopped`, a KeyboardInterrupt: the mesh stops as on Ctrl-C."""
    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _default_run_dir(cfg: cfgmod.MeshConfig) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{cfg.algorithm.name}-{cfg.data.dataset}")


def _check_data(cfg: cfgmod.MeshConfig) -> None:
    """Load the first node's data here, so a wrong path fails once, before any process."""
    data = cfgmod.data_for(cfg, cfg.peers[0])
    load_node_data(data.dataset, data.root, data.partition, len(cfg.peers), 0, cfg.seed,
                   data.samples_per_node, tuple(data.split))


def _spawn_node(config_path: Path, name: str, out: Path, local_nodes: int,
                launcher_fd: int) -> subprocess.Popen:
    node_dir = out / name
    node_dir.mkdir(parents=True, exist_ok=True)
    role = ["coordinator"] if name == COORDINATOR else ["node", "--name", name]
    command = [sys.executable, "-m", "meshfl.launch.cli", *role, "--config", str(config_path),
               "--out", str(out), "--local-nodes", str(local_nodes),
               "--launcher-fd", str(launcher_fd)]
    # Its own session, so that a Ctrl-C in the terminal reaches launch alone, which then
    # stops every node in order; the lifeline covers a launcher that cannot.
    with open(node_dir / "node.log", "ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True, pass_fds=(launcher_fd,))


@dataclass
class SupervisedNode:
    """A node process of `meshfl launch`, and how often it was restarted."""

    name: str
    process: subprocess.Popen
    restarts: int = 0

    def failed(self) -> bool:
        return self.process.poll() not in (None, 0)

    def outcome(self, out: Path) -> dict[str, Any]:
        """How it ended, for the summary: finished, or failed with how and the last
        error line of its log."""
        code = self.process.poll()
        if code == 0:
            return {"status": FINISHED, "restarts": self.restarts}
        return {"status": FAILED, "restarts": self.restarts, "ended": how_it_ended(code),
                "last_error": last_error_line(out / self.name / "node.log")}


def how_it_ended(code: int | None) -> str:
    """A process's end in words: "exit code 2", "SIGKILL", or "still running"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _complete_records(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash or being written right now


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def records(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics file ([] when there is none yet)."""
    return list(_complete_records(_lines(path)))


def last_record(path: Path) -> dict[str, Any] | None:
    return next(_complete_records(reversed(_lines(path))), None)


def _supervise(nodes: dict[str, SupervisedNode], start: Callable[[str], subprocess.Popen],
               restarts: int, out: Path, rounds: int, quiet: bool) -> None:
    """Show progress and restart failed nodes (up to `restarts` times each) until every
    node has exited."""
    progress = _Progress(out, rounds, quiet)
    while any(node.process.poll() is None for node in nodes.values()):
        time.sleep(0.5)
        for node in nodes.values():
            if node.failed() and node.restarts < restarts:
                _restart(node, start, restarts, out, quiet)
        progress.show([name for name, node in nodes.items() if not node.failed()])
    progress.end()


def _restart(node: SupervisedNode, start: Callable[[str], subprocess.Popen], restarts: int,
             out: Path, quiet: bool) -> None:
    node.restarts += 1
    if not quiet:
        record = last_record(out / node.name / "metrics.jsonl")
        print(f"\nmeshfl: {node.name} failed ({how_it_ended(node.process.returncode)}) "
              f"after round {record['round'] if record else 0}; restarting it from its "
              f"checkpoint ({node.restarts} of {restarts})", flush=True)
    node.process = start(node.name)


class _Progress:
    """The live line on a terminal, else a line each time every running node finished
    another round."""

    def __init__(self, out: Path, rounds: int, quiet: bool) -> None:
        self.out, self.rounds, self.quiet = out, rounds, quiet
        self.live = sys.stdout.isatty() and not quiet
        self.shown_round = 0

    def show(self, names: list[str]) -> None:
        records = {name: last_record(self.out / name / "metrics.jsonl") for name in names}
        done = min((r["round"] if r else 0 for r in records.values()), default=0)
        if self.live:
            accuracies = " ".join(f"{name}:{r['test_acc']:.2f}" for name, r in records.items()
                                  if r and "test_acc" in r)
            print(f"\r  round {done}/{self.rounds}  {accuracies}   ", end="", flush=True)
        elif not self.quiet and done > self.shown_round:
            self.shown_round = done
            print(f"  round {done}/{self.rounds} done by every running node", flush=True)

    def end(self) -> None:
        if self.live:
            print()


# What counts as an error in a node's log: our one-line errors, a traceback's last line
# (an exception name and its message), and the warnings a node logs when it gives up.
_ERROR_LINE = re.compile(r"(meshfl: error: .*|Traceback \(most recent call last\):"
                         r"|[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: .*)?)")


def last_error_line(log_path: Path) -> str | None:
    """The last error or traceback line of a node's log, or None when it has none (a
    SIGKILL leaves no word)."""
    errors = [line.strip() for line in _lines(log_path) if _ERROR_LINE.fullmatch(line.strip())]
    return errors[-1] if errors else None


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


History = dict[str, list[dict[str, Any]]]  # node -> its metrics records, round by round


def _node_rounds(history: History) -> Iterator[tuple[str, dict[str, Any]]]:
    """(node, metrics record) for every complete round of every node."""
    for name, rounds in history.items():
        for record in rounds:
            yield name, record


def write_summary(cfg: cfgmod.MeshConfig, out: Path,
                  outcomes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Summarize the run in `out` and write summary.json. `outcomes` says how each node
    ended (SupervisedNode.outcome); without it (a summary made again later) it is what
    the previous summary.json said, else judged by the rounds each node finished."""
    outcomes = outcomes or _recorded_outcomes(out)
    history = {peer.name: records(out / peer.name / "metrics.jsonl") for peer in cfg.peers}
    decisions = node_decisions(cfg.algorithm.name, history,
                               records(out / COORDINATOR / "metrics.jsonl"))
    nodes, groups = [], {}
    for peer in cfg.peers:
        record = history[peer.name][-1] if history[peer.name] else None
        outcome = outcomes.get(peer.name) or _judged_by_rounds(record, cfg.rounds)
        nodes.append(_node_entry(peer.name, record, outcome, out))
        group = (record or {}).get("diagnostics", {}).get("group")  # rules that group
        if group is not None:
            groups[peer.name] = group
    for node in nodes:
        if node["name"] in decisions:
            node["decision"] = decisions[node["name"]]
    if COORDINATOR in outcomes and outcomes[COORDINATOR]["status"] != FINISHED:
        nodes.append({"name": COORDINATOR, "round": _last_round(out / COORDINATOR),
                      "test_acc": None, "val_acc": None, "n_train": None, "data": {},
                      **outcomes[COORDINATOR]})
    attackers = set(cfg.attack.nodes)
    for node in nodes:
        if node["name"] in attackers:
            node["attacker"] = True
    # Failed nodes stopped early: their accuracies are of another round, left out; an
    # attacker's own scores say nothing of what the rule does for honest nodes.
    accuracies = [node["test_acc"] for node in nodes
                  if node["status"] == FINISHED and node["test_acc"] is not None
                  and node["name"] not in attackers]
    scored = [node for node in nodes if node["test_acc"] is not None]
    labels = _node_labels(scored)
    summary = {
        "algorithm": cfg.algorithm.name, "dataset": cfg.data.dataset,
        "partition": cfg.data.partition, "rounds": cfg.rounds, "seed": cfg.seed,
        "nodes": nodes,
        "mean_test_acc": statistics.fmean(accuracies) if accuracies else None,
        "std_test_acc": statistics.pstdev(accuracies) if accuracies else None,
        "mean_over": f"{len(accuracies)} finished nodes of {len(nodes)}"
                     + (f" ({len(attackers)} attackers left out)" if attackers else ""),
        "worst_test_acc": min(accuracies) if accuracies else None,
        **_attacker_weight(history, attackers),
        **_grouping_scores(scored, groups, out / COORDINATOR / "metrics.jsonl"),
        **_top_k_precision(history, labels),
        **_shapley_by_label_overlap(history, labels),
        **_own_versus_average(history),
        **_influence_shape(history),
        "cost": _round_costs(history),
    }
    _write_summary_file(out / "summary.json", summary)
    return summary


def _attacker_weight(history: dict[str, list[dict[str, Any]]],
                     attackers: set[str]) -> dict[str, float]:
    """The attackers' share of the honest nodes' aggregation weights: the weight on
    attackers summed per round, averaged over honest nodes and rounds."""
    shares = [sum(weight for peer, weight in record.get("weights", {}).items()
                  if peer in attackers)
              for node, node_records in history.items() if node not in attackers
              for record in node_records]
    return {"attacker_weight": statistics.fmean(shares)} if attackers and shares else {}


def _node_entry(name: str, record: dict[str, Any] | None, outcome: dict[str, Any],
                out: Path) -> dict[str, Any]:
    """A node's line of the summary: its last round's scores (None before its first
    round) and how it ended."""
    record = record or {}
    return {"name": name, "test_acc": record.get("test_acc"), "val_acc": record.get("val_acc"),
            "n_train": record.get("n_train"), "round": record.get("round", 0),
            "data": _read_info(out / name / "info.json").get("data", {}), **outcome}


def _judged_by_rounds(record: dict[str, Any] | None, rounds: int) -> dict[str, Any]:
    finished = record is not None and record["round"] >= rounds
    return {"status": FINISHED if finished else FAILED}


def _recorded_outcomes(out: Path) -> dict[str, dict[str, Any]]:
    """How each node ended, as a previous summary.json of `out` says ({} without one)."""
    try:
        nodes = json.loads((out / "summary.json").read_text())["nodes"]
        keys = ("status", "restarts", "ended", "last_error")
        return {node["name"]: {key: node[key] for key in keys if key in node}
                for node in nodes if "status" in node}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _last_round(node_dir: Path) -> int:
    record = last_record(node_dir / "metrics.jsonl")
    return record["round"] if record else 0


def _read_info(path: Path) -> dict[str, Any]:
    """A node's info.json ({} when missing, or cut short by a crash: said once)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("%s is unreadable (%s); its data facts are left out of the summary",
                    path, error)
        return {}


def _write_summary_file(path: Path, summary: dict[str, Any]) -> None:
    """Write summary.json whole or not at all; a full disk is one line, not a crash (the
    table still shows what it holds)."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        log.warning("cannot write %s: %s", path, (error.strerror or str(error)).lower())


def _pooled(pool: Callable[[list[float]], float], **samples: list[float]) -> dict[str, float]:
    """{name: pool(values)} for every name that has values."""
    return {name: pool(values) for name, values in samples.items() if values}


def _node_labels(nodes: list[dict[str, Any]]) -> dict[str, set[int]]:
    """The labels in each node's train split, where the partition recorded them."""
    return {node["name"]: set(node["data"]["labels"]) for node in nodes
            if "labels" in node["data"]}


def _top_k_precision(history: History, labels: dict[str, set[int]]) -> dict[str, float]:
    """Where a rule ranks peers (pFedSV): mean over nodes of the share of a node's final
    top-k (the peers it chose in its last round) that holds one of its labels, its
    relevance against the truth "shares a label"."""
    precisions = []
    for name, rounds in history.items():
        chosen = rounds[-1].get("diagnostics", {}).get("selected") if rounds else None
        if chosen and name in labels and all(peer in labels for peer in chosen):
            precisions.append(statistics.fmean(bool(labels[peer] & labels[name])
                                               for peer in chosen))
    return {"top_k_precision": statistics.fmean(precisions)} if precisions else {}


def _shapley_by_label_overlap(history: History, labels: dict[str, set[int]]
                              ) -> dict[str, float]:
    """Where a rule scores peers by Shapley value (pFedSV): the mean value of a peer that
    shares one of the node's labels and of one that shares none, over every node and
    round, and the weight the label-sharing peers got per round (why the rule helps
    or hurts a node)."""
    sharing, disjoint, shared_weight, rounds = [], [], 0.0, 0
    for name, record in _node_rounds(history):
        shapley = record.get("diagnostics", {}).get("shapley")
        if shapley is None or name not in labels:
            continue
        rounds += 1
        shares = {peer: bool(labels[peer] & labels[name]) for peer in shapley
                  if peer != name and peer in labels}
        for peer, shares_a_label in shares.items():
            (sharing if shares_a_label else disjoint).append(shapley[peer])
        shared_weight += sum(weight for peer, weight in record.get("weights", {}).items()
                             if shares.get(peer))
    scores = _pooled(statistics.fmean, shapley_sharing_a_label=sharing,
                     shapley_sharing_no_label=disjoint)
    if rounds:
        scores["weight_on_label_sharing_peers"] = shared_weight / rounds
    return scores


def _own_versus_average(history: History) -> dict[str, float]:
    """Where a rule records v({i}), the own model's val accuracy (pFedSV), over every
    node-round: how often the weighted average it computed scored a lower val accuracy
    than that (without the guard the average is what the node evaluated, val_acc; with
    it, the average the guard judged, v_aggregate), and how often the node adopted an
    average rather than keeping its own model."""
    below, adopted = [], []
    for name, record in _node_rounds(history):
        diagnostics = record.get("diagnostics", {})
        if "v_own" not in diagnostics:
            continue
        adopted.append(record.get("weights", {}) != {name: 1.0})
        average = diagnostics.get("v_aggregate", record.get("val_acc"))
        if average is not None:
            below.append(average < diagnostics["v_own"])
    return _pooled(statistics.fmean, average_below_own=below, average_adopted=adopted)


def _influence_shape(history: History) -> dict[str, float]:
    """Where a rule weighs models by influence (FedC²I), over every node and round: the
    share of the body the influence vector λ gives the node's own model, and the largest
    weight per class of the influence matrix Λ as a multiple of the uniform 1/K (1.0:
    the class level weighs every model alike)."""
    own_share, peak = [], []
    for name, record in _node_rounds(history):
        diagnostics = record.get("diagnostics", {})
        vector = diagnostics.get("influence_vector", {})
        matrix = diagnostics.get("influence_matrix", {})
        if len(vector) > 1 and name in vector:  # alone, a node's share is 1 by definition
            own_share.append(vector[name])
        if len(matrix) > 1:
            for column in zip(*matrix.values(), strict=True):  # a class over the models
                peak.append(max(column) * len(matrix))
    return _pooled(statistics.fmean, influence_own_share=own_share, class_influence_peak=peak)


def _round_costs(history: History) -> dict[str, float]:
    """Medians over every node's rounds: MB (10^6 bytes) received and, where the rule
    plays a Shapley game (pFedSV), its seconds over the round's training seconds."""
    received, shapley_share, aggregate_share = [], [], []
    for _, record in _node_rounds(history):
        if "bytes_in" in record:
            received.append(record["bytes_in"] / 1e6)
        train = record.get("seconds", {}).get("train")
        aggregate = record.get("seconds", {}).get("aggregate")
        if aggregate is not None and train:  # the rule with its screening, if any
            aggregate_share.append(aggregate / train)
        shapley = record.get("diagnostics", {}).get("shapley_seconds")
        if shapley is not None and train:
            shapley_share.append(shapley / train)
    return _pooled(statistics.median, mb_in_per_round=received, shapley_to_train=shapley_share,
                   aggregate_to_train=aggregate_share)


def _grouping_scores(nodes: list[dict[str, Any]], groups: dict[str, list[str]],
                     coordinator_metrics: Path) -> dict[str, Any]:
    """How well the rule found who shares data, where the partition knows the truth:
    `ari` of the peers' last groups against the true clusters (pFedLIA; where the peers
    record none, the coordinator's last `groups`: pfedlia_central), and the share
    of FedReMa's relevant-set members from the client's own group, per round and mean
    over the critical co-learning period."""
    scores: dict[str, Any] = {}
    truth = {node["name"]: node["data"]["true_cluster"] for node in nodes
             if "true_cluster" in node["data"]}
    groups = groups or _last_coordinator_groups(coordinator_metrics)
    if groups.keys() & truth.keys():
        scores["ari"] = groups_ari(groups, truth)
    group_of = {node["name"]: node["data"]["group"] for node in nodes if "group" in node["data"]}
    if group_of and coordinator_metrics.exists():
        shares = {}
        for record in records(coordinator_metrics):
            relevant = record.get("diagnostics", {}).get("relevant_sets")
            if record.get("diagnostics", {}).get("ccp") and relevant:
                share = own_group_fraction(relevant, group_of)
                if share is not None:
                    shares[str(record["round"])] = share
        if shares:
            scores["own_group_share"] = shares
            scores["own_group_share_ccp"] = statistics.fmean(shares.values())
            scores["own_group_share_lowest"] = min(shares.values())
    return scores


def _last_coordinator_groups(coordinator_metrics: Path) -> dict[str, list[str]]:
    for record in reversed(records(coordinator_metrics)):
        groups = record.get("diagnostics", {}).get("groups")
        if groups:
            return groups
    return {}


def print_table(summary: dict[str, Any]) -> None:
    # The rule's decision per node (launch/decisions.py); no column for the baselines.
    decided = max((len(node.get("decision", "")) for node in summary["nodes"]), default=0)
    decision = f"  {'decision':<{decided}}" if decided else ""
    print(f"\n{'node':<12}{'rounds':>7}{'n_train':>9}{'val_acc':>9}{'test_acc':>10}"
          f"{decision}  status")
    for node in summary["nodes"]:
        decision = f"  {node.get('decision', '-'):<{decided}}" if decided else ""
        print(f"{node['name']:<12}{node['round']:>7}{_cell(node['n_train'], 9, 'd')}"
              f"{_cell(node['val_acc'], 9, '.3f')}{_cell(node['test_acc'], 10, '.3f')}"
              f"{decision}  {_status_cell(node)}")
    if summary["mean_test_acc"] is not None:
        print(f"{'mean (std)':<37}{summary['mean_test_acc']:>7.3f} "
              f"({summary['std_test_acc']:.3f})  over {summary['mean_over']}")
    else:
        print("mean: no node finished")
    for node in summary["nodes"]:
        if node.get("last_error"):
            print(f"{node['name']}: {node['last_error']}")


def _cell(value: float | int | None, width: int, form: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{form}}"


def _status_cell(node: dict[str, Any]) -> str:
    """"finished", or "failed (SIGKILL)", with the restarts when there were any."""
    status = node["status"] + (f" ({node['ended']})" if node.get("ended") else "")
    restarts = node.get("restarts", 0)
    return status + (f", restarted {restarts}x" if restarts else "")


# --- meshfl node / meshfl join ----------------------------------------------------


def run_named_node(args: argparse.Namespace) -> int:
    options = named_node_options(resolve_config(args), args.name, Path(args.out), args.key,
                                 args.local_nodes)
    return _run(options, launcher_fd=args.launcher_fd)


def named_node_options(cfg: cfgmod.MeshConfig, name: str, out: Path, key: str | None = None,
                       local_nodes: int = 1) -> NodeOptions:
    """How peer `name` of `cfg` takes part, writing under `out`: its listed address and
    shard, its key (made here if it has none), and the others' contacts to dial."""
    peer = cfgmod.peer_by_name(cfg, name)
    own_key = Path(key) if key else key_path(out, peer.name, peer.key)
    own_contact(cfg, peer.listen, own_key)  # our key first, then the others': contacts.py
    return NodeOptions(
        config=cfg, name=peer.name, listen=peer.listen, out_dir=out / peer.name,
        key_path=own_key, node_index=cfg.peers.index(peer), num_nodes=len(cfg.peers),
        bootstrap=listed_contacts(cfg, out, but=peer.name), local_nodes=local_nodes)


def run_coordinator(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if cfg.coordinator is None or not needs_coordinator(cfg.algorithm.name):
        raise UserError(f"algorithm {cfg.algorithm.name} runs without a coordinator; a "
                        "coordinator needs a server-centric algorithm and `coordinator: ADDR`")
    out = Path(args.out)
    # The coordinator's own data is a held-out shard (node N of N+1), for the rules that
    # evaluate on the coordinator.
    own_key = Path(args.key) if args.key else key_path(out, COORDINATOR)
    own_contact(cfg, cfg.coordinator, own_key)  # our key first, then the others': contacts.py
    options = NodeOptions(
        config=cfg, name=COORDINATOR, listen=cfg.coordinator, out_dir=out / COORDINATOR,
        key_path=own_key, node_index=len(cfg.peers), num_nodes=len(cfg.peers) + 1,
        bootstrap=listed_contacts(cfg, out, but=COORDINATOR), local_nodes=args.local_nodes)
    return _run(options, role=COORDINATOR, launcher_fd=args.launcher_fd)


def run_joiner(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    # A late member listed in peers.yaml (the only way into a closed mesh) joins with
    # its listed address, key and shard; anyone else is node N of N+1 on a free port.
    listed = next((peer for peer in cfg.peers if peer.name == args.name), None)
    out = Path(args.out)
    through = join_contact(cfg, out, args.address)
    if listed is None:
        host = host_towards(split_contact(through)[0])
        listen = args.listen or f"tcp://{host}:{free_ports(1, host)[0]}"
        key, index, count = None, len(cfg.peers), len(cfg.peers) + 1
    else:
        listen, key = args.listen or listed.listen, listed.key
        index, count = cfg.peers.index(listed), len(cfg.peers)
    name = args.name or f"joiner-{listen.rsplit(':', 1)[1]}"
    own_key = Path(args.key) if args.key else key_path(out, name, key)
    coordinator = listed_contacts(replace(cfg, peers=[]), out, but=name)
    options = NodeOptions(
        config=cfg, name=name, listen=listen, out_dir=out / name, key_path=own_key,
        node_index=index, num_nodes=count, bootstrap=[*coordinator, through], joining=True,
        local_nodes=args.local_nodes,
        join_hint=f"meshfl join {own_contact(cfg, listen, own_key)}"
        + (f" --config {args.config}" if args.config else "") + " --name NAME")
    print(f"meshfl: {name} joining through {args.address}", flush=True)
    return _run(options)


def _interrupt(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def _run(options: NodeOptions, role: str = "peer", launcher_fd: int | None = None) -> int:
    # SIGTERM (from `meshfl launch` or a service manager) and SIGHUP end the node like
    # Ctrl-C: it says bye; the last finished round is already checkpointed.
    for signum in STOP_SIGNALS:
        signal.signal(signum, _interrupt)
    if launcher_fd is not None:
        watch_launcher(launcher_fd, options.name)
    node_class(options.config.algorithm.name, role)(options).run()
    say_finished(options)
    return 0


def say_finished(options: NodeOptions) -> None:
    """One closing line, so whoever started the node sees how it ended without
    reading the metrics."""
    metrics = options.out_dir / "metrics.jsonl"
    record = last_record(metrics)
    if record is None:
        print(f"meshfl: {options.name} ran no round (rounds: {options.config.rounds})",
              flush=True)
    elif "test_acc" in record:
        print(f"meshfl: {options.name} finished round {record['round']}/"
              f"{options.config.rounds}, test accuracy {record['test_acc']:.3f} ({metrics})",
              flush=True)
