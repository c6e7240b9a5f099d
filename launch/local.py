"""Running nodes: N local processes with live progress, one named node, a joiner."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from meshfl.algorithms.fedrema import own_group_fraction
from meshfl.algorithms.pfedlia import groups_ari
from meshfl.node import config as cfgmod
from meshfl.node.coordinator import COORDINATOR, needs_coordinator, node_class
from meshfl.node.data import load_node_data
from meshfl.node.runtime import NodeOptions
from meshfl.protocol.transport import host_towards

from .cli import UserError


def resolve_config(args: argparse.Namespace, check: bool = True) -> cfgmod.MeshConfig:
    cfg = cfgmod.load_config(args.config)
    cfg = cfgmod.apply_overrides(cfg, _named(args) + list(args.assignments))
    if check:
        cfgmod.validate(cfg)
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
    out = Path(args.out or _default_run_dir(cfg))
    summary = run_mesh(cfg, out, quiet=args.quiet)
    print_table(summary)
    return 0


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


def run_mesh(cfg: cfgmod.MeshConfig, out: Path, quiet: bool = False) -> dict[str, Any]:
    """Run every peer of `cfg` as a local process until all finish; write and return the
    summary. A node that fails turns into a UserError naming it and its last log line."""
    cfgmod.validate(cfg)
    _check_data(cfg)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.yaml"
    cfgmod.save_config(cfg, config_path)
    names = [peer.name for peer in cfg.peers]
    if cfg.coordinator is not None:
        names.append(COORDINATOR)
    processes = {name: _spawn_node(config_path, name, out, len(names)) for name in names}
    if not quiet:
        print(f"meshfl: {len(processes)} nodes, {cfg.algorithm.name} on {cfg.data.dataset} "
              f"({cfg.data.partition}), {cfg.rounds} rounds -> {out}")
        print(f"meshfl: join this mesh with: meshfl join {cfg.peers[0].listen} "
              f"--config {config_path}")
    try:
        failed = _watch(processes, out, cfg.rounds, quiet=quiet)
    finally:
        _stop(processes.values())
    if failed:
        name, line = next(iter(failed.items()))
        raise UserError(f"node {name} failed: {line.removeprefix('meshfl: error: ')}")
    return write_summary(cfg, out)


def _default_run_dir(cfg: cfgmod.MeshConfig) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{cfg.algorithm.name}-{cfg.data.dataset}")


def _check_data(cfg: cfgmod.MeshConfig) -> None:
    """Load the first node's data here, so a wrong path fails once, before any process."""
    data = cfgmod.data_for(cfg, cfg.peers[0])
    load_node_data(data.dataset, data.root, data.partition, len(cfg.peers), 0, cfg.seed,
                   data.samples_per_node, tuple(data.split))


def _spawn_node(config_path: Path, name: str, out: Path, local_nodes: int) -> subprocess.Popen:
    node_dir = out / name
    node_dir.mkdir(parents=True, exist_ok=True)
    role = ["coordinator"] if name == COORDINATOR else ["node", "--name", name]
    command = [sys.executable, "-m", "meshfl.launch.cli", *role, "--config", str(config_path),
               "--out", str(out), "--local-nodes", str(local_nodes)]
    with open(node_dir / "node.log", "ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)


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


def _watch(processes: dict[str, subprocess.Popen], out: Path, rounds: int,
           quiet: bool) -> dict[str, str]:
    """Show progress until every node exits; return {name: last log line} of failures."""
    live = sys.stdout.isatty() and not quiet
    shown_round = 0
    while any(process.poll() is None for process in processes.values()):
        time.sleep(0.5)
        records = {name: last_record(out / name / "metrics.jsonl") for name in processes}
        done = [r["round"] for r in records.values() if r] or [0]
        if live:
            accuracies = " ".join(f"{name}:{r['test_acc']:.2f}" for name, r in records.items()
                                  if r)
            print(f"\r  round {min(done)}/{rounds}  {accuracies}   ", end="", flush=True)
        elif not quiet and min(done) > shown_round:
            shown_round = min(done)
            print(f"  round {shown_round}/{rounds} done by every node", flush=True)
    if live:
        print()
    return {name: _last_line(out / name / "node.log") for name, process in processes.items()
            if process.returncode != 0}


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "exited without a word"


def _stop(processes) -> None:
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


def write_summary(cfg: cfgmod.MeshConfig, out: Path) -> dict[str, Any]:
    history = {peer.name: records(out / peer.name / "metrics.jsonl") for peer in cfg.peers}
    nodes, groups = [], {}
    for peer in cfg.peers:
        record = history[peer.name][-1] if history[peer.name] else None
        if record is not None:
            info_path = out / peer.name / "info.json"
            info = json.loads(info_path.read_text()) if info_path.exists() else {}
            nodes.append({"name": peer.name, "test_acc": record["test_acc"],
                          "val_acc": record["val_acc"], "n_train": record["n_train"],
                          "round": record["round"], "data": info.get("data", {})})
            group = record.get("diagnostics", {}).get("group")  # rules that group (pFedLIA)
            if group is not None:
                groups[peer.name] = group
    accuracies = [node["test_acc"] for node in nodes]
    labels = _node_labels(nodes)
    summary = {
        "algorithm": cfg.algorithm.name, "dataset": cfg.data.dataset,
        "partition": cfg.data.partition, "rounds": cfg.rounds, "seed": cfg.seed,
        "nodes": nodes,
        "mean_test_acc": statistics.fmean(accuracies) if accuracies else None,
        "std_test_acc": statistics.pstdev(accuracies) if accuracies else None,
        **_grouping_scores(nodes, groups, out / COORDINATOR / "metrics.jsonl"),
        **_top_k_precision(history, labels),
        **_shapley_by_label_overlap(history, labels),
        **_own_versus_average(history),
        **_influence_shape(history),
        "cost": _round_costs(history),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


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
    received, shapley_share = [], []
    for _, record in _node_rounds(history):
        if "bytes_in" in record:
            received.append(record["bytes_in"] / 1e6)
        train = record.get("seconds", {}).get("train")
        shapley = record.get("diagnostics", {}).get("shapley_seconds")
        if shapley is not None and train:
            shapley_share.append(shapley / train)
    return _pooled(statistics.median, mb_in_per_round=received, shapley_to_train=shapley_share)


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
    print(f"\n{'node':<12}{'rounds':>7}{'n_train':>9}{'val_acc':>9}{'test_acc':>10}")
    for node in summary["nodes"]:
        print(f"{node['name']:<12}{node['round']:>7}{node['n_train']:>9}"
              f"{node['val_acc']:>9.3f}{node['test_acc']:>10.3f}")
    if summary["mean_test_acc"] is not None:
        print(f"{'mean (std)':<37}{summary['mean_test_acc']:>7.3f} "
              f"({summary['std_test_acc']:.3f})")


# --- meshfl node / meshfl join ----------------------------------------------------


def run_named_node(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    peer = cfgmod.peer_by_name(cfg, args.name)
    out = Path(args.out)
    others = [p.listen for p in cfg.peers if p.name != peer.name]
    options = NodeOptions(
        config=cfg, name=peer.name, listen=peer.listen, out_dir=out / peer.name,
        key_path=Path(args.key or peer.key or out / "keys" / f"{peer.name}.pem"),
        node_index=cfg.peers.index(peer), num_nodes=len(cfg.peers),
        bootstrap=_with_coordinator(cfg, others), local_nodes=args.local_nodes)
    return _run(options)


def run_coordinator(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if cfg.coordinator is None or not needs_coordinator(cfg.algorithm.name):
        raise UserError(f"algorithm {cfg.algorithm.name} runs without a coordinator; a "
                        "coordinator needs a server-centric algorithm and `coordinator: ADDR`")
    out = Path(args.out)
    # The coordinator's own data is a held-out shard (node N of N+1), for the rules that
    # evaluate on the coordinator.
    options = NodeOptions(
        config=cfg, name=COORDINATOR, listen=cfg.coordinator, out_dir=out / COORDINATOR,
        key_path=Path(args.key or out / "keys" / f"{COORDINATOR}.pem"),
        node_index=len(cfg.peers), num_nodes=len(cfg.peers) + 1,
        bootstrap=[p.listen for p in cfg.peers], local_nodes=args.local_nodes)
    return _run(options, role=COORDINATOR)


def _with_coordinator(cfg: cfgmod.MeshConfig, addresses: list[str]) -> list[str]:
    return [cfg.coordinator, *addresses] if cfg.coordinator else addresses


def run_joiner(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    # A late member listed in peers.yaml (the only way into a closed mesh) joins with
    # its listed address, key and shard; anyone else is node N of N+1 on a free port.
    listed = next((peer for peer in cfg.peers if peer.name == args.name), None)
    if listed is None:
        host = host_towards(args.address)
        listen = args.listen or f"tcp://{host}:{free_ports(1, host)[0]}"
        key, index, count = None, len(cfg.peers), len(cfg.peers) + 1
    else:
        listen, key = args.listen or listed.listen, listed.key
        index, count = cfg.peers.index(listed), len(cfg.peers)
    name = args.name or f"joiner-{listen.rsplit(':', 1)[1]}"
    out = Path(args.out)
    options = NodeOptions(
        config=cfg, name=name, listen=listen, out_dir=out / name,
        key_path=Path(args.key or key or out / "keys" / f"{name}.pem"),
        node_index=index, num_nodes=count,
        bootstrap=_with_coordinator(cfg, [args.address]), joining=True,
        local_nodes=args.local_nodes,
        join_hint=f"meshfl join {listen}" + (f" --config {args.config}" if args.config else "")
        + " --name NAME")
    print(f"meshfl: {name} joining through {args.address}", flush=True)
    return _run(options)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run(options: NodeOptions, role: str = "peer") -> int:
    # SIGTERM (from `meshfl launch` or a service manager) ends the node like Ctrl-C:
    # it says bye; the last finished round is already checkpointed.
    signal.signal(signal.SIGTERM, _interrupt)
    node_class(options.config.algorithm.name, role)(options).run()
    _say_finished(options)
    return 0


def _say_finished(options: NodeOptions) -> None:
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
