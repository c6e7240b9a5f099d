"""One peer process: the round loop of DESIGN.md.

    train → publish → wait for the announced blobs it wants (until the round's
    deadline) → aggregate → evaluate → metrics line → checkpoint → next round

There is no barrier: a node goes on with whatever arrived by the deadline.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshfl.algorithms import Aggregate, Context, PeerAlgorithm, PeerModel, build_rule
from meshfl.algorithms.base import MODEL, cloned, draw_seed, weighted_average
from meshfl.protocol.codecs import TOPK
from meshfl.protocol.endpoint import Endpoint, EndpointSettings
from meshfl.protocol.errors import UserError
from meshfl.protocol.identity import Identity
from meshfl.protocol.membership import liveness_stretch
from meshfl.protocol.transport import TransportOptions, contact

from . import config as cfgmod
from .about import mesh_about, other_mesh_line
from .attacks import Attack, attack_for
from .blobs import RULE_ERROR, layout_of
from .checkpoint import MetricsLog, load_checkpoint, save_checkpoint, write_atomically
from .containment import run_contained
from .deltas import DeltaGossip
from .devices import peak_memory_mb, resolve_device, visiting
from .mesh_identity import mesh_id, model_digest
from .metrics import RoundRecord
from .model_exchange import ModelExchange, PeerIntake
from .models import batchnorm_keys
from .neighbours import MeshKeeper, caught_copying, keeper_for
from .set_aside import SetAside, remove_set_aside
from .splits import NodeData
from .task import Task, node_info, task_of
from .thread_cpu import cpu_spent, read_cpu
from .trainer import (
    Evaluation,
    TrainRecipe,
    evaluate,
    set_torch_threads,
    state_to_arrays,
    training_recipe,
)

log = logging.getLogger("meshfl.node")

# Test-only: the fault tests make a node fail in the middle of a run with
# MESHFL_TEST_FAIL_AT=NAME:ROUND[,NAME:ROUND...]. Never set in a real run.
PLANTED_FAILURES = "MESHFL_TEST_FAIL_AT"
_planted_done: set[str] = set()


class PlantedFailure(RuntimeError):
    """A failure a test planted ($MESHFL_TEST_FAIL_AT): unexpected on purpose."""


def fail_if_planted(name: str, round_no: int) -> None:
    """Raise PlantedFailure where $MESHFL_TEST_FAIL_AT lists `name`:`round_no`, once per
    process: a node its host starts again goes on past that round."""
    planted = f"{name}:{round_no}"
    if planted in os.environ.get(PLANTED_FAILURES, "").split(",") and planted not in _planted_done:
        _planted_done.add(planted)
        raise PlantedFailure(f"{name}: failing at round {round_no}, as {PLANTED_FAILURES} says")


class JoinError(UserError):
    """Nobody answered a joining node; one line for the user."""


@dataclass
class NodeOptions:
    """How this process takes part: which peer it is and where it writes."""

    config: cfgmod.MeshConfig
    name: str
    listen: str
    out_dir: Path
    key_path: Path
    node_index: int
    num_nodes: int
    bootstrap: list[str] = field(default_factory=list)
    local_nodes: int = 1
    host_nodes: int = 1  # nodes in this process (a node host's), this one included
    joining: bool = False  # a late joiner starts from the mesh's current round
    join_hint: str = ""  # how the next node can join through this one, said once joined


class Node:
    """One peer of the mesh, made of the parts it is given; `build_node` makes them from a
    NodeOptions, and a test may give parts of its own."""

    # The direct messages this role reads (a gossip peer reads none; see coordinator.py).
    DIRECT_KINDS: frozenset[str] = frozenset()

    def __init__(
        self,
        options: NodeOptions,
        *,
        data: NodeData,
        model: torch.nn.Module,
        new_model: Callable[[], torch.nn.Module],
        train: TrainRecipe,
        algorithm: PeerAlgorithm,
        endpoint: Endpoint,
        attack: Attack,
        metrics: MetricsLog,
        checkpoint_path: Path,
        device: torch.device | None = None,
    ) -> None:
        self.options = options
        self.cfg = options.config
        self.data = data
        self.model = model
        self.new_model = new_model  # the mesh's initial model, built afresh
        self.train = train  # the mesh's local training recipe (on the node's device)
        self.device = device or torch.device("cpu")  # where the model trains and is evaluated
        self.algorithm = algorithm
        self.endpoint = endpoint
        self.attack = attack  # an honest Attack() on an honest node
        self.metrics = metrics
        self.checkpoint_path = checkpoint_path
        # Held for CPU work (training, aggregation, evaluation): a node host shares one
        # among its nodes (node/host.py); a node alone in its process needs none.
        self.cpu: AbstractContextManager[Any] = contextlib.nullcontext()
        self._suspects: set[str] = set()  # peers whose input made the rule raise last round
        self._anchors: list[str] = []  # contacts to greet first: a resumed node's anchors
        self._dropped_machines: dict[str, int] = {}  # a resumed node's, to keep out
        # FedBN (`local_batchnorm`): the entries every model taken in carries as ours.
        self.local_keys = batchnorm_keys(model) if self.cfg.local_batchnorm else frozenset()
        # `compression: topk`: models travel as deltas against public copies (deltas.py).
        self.deltas = DeltaGossip() if self.cfg.compression == TOPK else None
        self.exchange = ModelExchange(
            endpoint,
            algorithm,
            model,
            options.name,
            self.cfg.compression,
            self.local_keys,
            self.deltas,
        )

    @property
    def identity(self) -> Identity:
        return self.endpoint.identity

    @functools.cached_property
    def view_keeper(self) -> MeshKeeper:
        """What the node does with its neighbours between rounds, as its overlay has it."""
        return keeper_for(self.endpoint, self.algorithm, self.cfg, self.options.name)

    @functools.cached_property
    def model_wait(self) -> float:
        """How long a round waits for its peers' models (and a finished node serves its
        last one): `round_timeout`, stretched as liveness is by the nodes sharing this
        process (`liveness_stretch`). A host's nodes share its CPU, so a round of all of
        them takes that much longer (docs/measurements.md, at 1,000 nodes). The wait
        still ends as soon as every live neighbour's model is in, and a dead one is not
        waited for once it is marked down (after its stretched timeout)."""
        return self.cfg.round_timeout * liveness_stretch(self.options.host_nodes)

    def wait_for_neighbours(self) -> bool:
        """Wait for as many live peers as the mesh gives a node; whether they came. A
        full mesh waits up to `round_timeout` (its members start together); a bounded
        view at most neighbours.VIEW_PATIENCE_BEATS heartbeat periods for the candidates it greeted
        for its free places, ending as soon as no hello is left to answer."""
        expected = self.endpoint.expected_peers(len(self.cfg.peers))
        return self.endpoint.wait_for_peers(expected, self.view_keeper.patience)

    @property
    def schema(self) -> bytes:
        """The digest of the model's tensor layout, which every blob of ours names."""
        return self.exchange.schema

    def status_extra(self) -> dict[str, Any]:
        """What this node adds to the endpoint's status answer; runs on its worker thread."""
        return {
            "algorithm": self.cfg.algorithm.name,
            "rounds": self.cfg.rounds,
            "accuracies": self.metrics.recent_scores(),
        }

    # --- the run ----------------------------------------------------------

    def run(self) -> None:
        first_round = self._resume()
        if first_round > self.cfg.rounds:
            log.info(
                "%s: this run already finished its %d rounds; nothing to do (start a "
                "new run with another --out)",
                self.options.name,
                self.cfg.rounds,
            )
            self.endpoint.close()  # bound but never started: frees the port
            return
        write_atomically(
            self.options.out_dir / "info.json",
            (
                json.dumps(
                    {
                        "name": self.options.name,
                        "id": self.identity.id,
                        "listen": self.options.listen,
                        "public_key": self.identity.public_key.hex(),
                        "data": self.data.info,
                    },
                    indent=2,
                )
                + "\n"
            ).encode(),
        )
        self.endpoint.start(self.options.bootstrap, self._anchors, self._dropped_machines)
        try:
            joined = self.endpoint.wait_joined(
                self.cfg.round_timeout, until_other_mesh=self.options.joining
            )
            other_mesh = next(iter(self.endpoint.other_meshes.values()), None)
            if self.options.joining and not joined and other_mesh is not None:
                ours = self.endpoint.settings.about or {}
                raise JoinError(other_mesh_line(self.options.name, ours, other_mesh))
            if self.options.joining and not joined:
                raise JoinError(
                    f"no mesh member answered at {', '.join(self.options.bootstrap)} "
                    f"within {self.cfg.round_timeout:g} s (round_timeout); check "
                    "the address, the firewall, that --config has the mesh's "
                    "name, algorithm and model, and in a closed mesh that this "
                    "node's public key is listed; all nodes must run the same "
                    "meshfl version"
                )
            if not joined and len(self.cfg.peers) > 1:
                log.warning(
                    "%s: no peer answered within %g s (round_timeout); training "
                    "alone until one does (check the addresses, the firewall and "
                    "that every node runs the same meshfl version)",
                    self.options.name,
                    self.cfg.round_timeout,
                )
            if joined and self.options.join_hint:
                log.info(
                    "%s: joined; the next node can join with: %s",
                    self.options.name,
                    self.options.join_hint,
                )
            self._run_rounds(first_round)
        finally:
            self.endpoint.close()
            remove_set_aside(self.options.out_dir)

    def _run_rounds(self, first_round: int) -> None:
        """The peer role: gossip rounds until the last, then serve the last blob a while."""
        if self.options.joining and first_round == 1:
            first_round = self._catch_up()
        elif first_round == 1 and self.view_keeper.waits_at_start():
            # A fresh mesh starts together: otherwise a peer still starting up would miss
            # round 1, and the same seed would not give the same run twice.
            self.wait_for_neighbours()
        elif first_round > 1:
            # Resumed: the announces that came with our first hellos were too far ahead of
            # round 0 to be kept; take the round first, then ask for them again.
            self.endpoint.set_round(first_round)
            self.endpoint.refresh_offers()
        round_no = self._keep_up(first_round)
        while round_no <= self.cfg.rounds:
            self._round(round_no)
            round_no = self._keep_up(round_no + 1)
        self._linger()

    def _keep_up(self, round_no: int) -> int:
        """The round to do next: `round_no`, or the round of the slowest live peer when
        every live peer is past it (this node was restarted, frozen or slow). Nobody
        announces a round they all left, so doing it would cost a round_timeout each;
        the node goes on from there with its own model."""
        rounds = [peer.round for peer in self.endpoint.alive_peers()]
        mesh_round = min(min(rounds, default=0), self.cfg.rounds)
        if mesh_round <= round_no:
            return round_no
        log.info(
            "%s: every live peer is past round %d; skipping to round %d",
            self.options.name,
            round_no,
            mesh_round,
        )
        self.endpoint.set_round(mesh_round)
        self.endpoint.refresh_offers()  # the round's models, announced before we came
        return mesh_round

    def _resume(self) -> int:
        state = load_checkpoint(self.checkpoint_path)
        if state is None:
            self.metrics.keep_until(0)
            return 1
        self.model.load_state_dict(state["model"])
        self.algorithm.load_state_dict(state["algorithm"])
        # KEY@ADDRESS: an encrypted mesh is dialled with each node's key (WIRE.md 1.1).
        known = [
            contact(p["addr"], bytes.fromhex(p["key"]))
            for p in json.loads(state["peers"])
            if p["addr"] != self.options.listen
        ]
        self.options.bootstrap = list(dict.fromkeys([*self.options.bootstrap, *known]))
        # Both absent in older checkpoints.
        self._anchors = json.loads(state.get("anchors", "[]"))
        self._dropped_machines = json.loads(state.get("dropped_machines", "{}"))
        self.metrics.keep_until(state["round"])
        log.info("%s: resumed from the checkpoint of round %d", self.options.name, state["round"])
        return state["round"] + 1

    def _catch_up(self) -> int:
        """A late joiner takes the mesh's current round and starts from the average of
        the models it receives for it."""
        peers = self.endpoint.alive_peers()
        # The round most peers are at (a peer's round is what it says: one claiming round
        # 2**64 must not make us skip the whole run), and never past the run's last.
        current = min(statistics.median_low([peer.round for peer in peers] or [0]), self.cfg.rounds)
        if current < 1:
            return 1
        self.endpoint.set_round(current)
        self.endpoint.refresh_offers()  # the current round's models, announced before we came
        deadline = time.monotonic() + self.model_wait
        blobs = self.exchange.collect(
            current, {MODEL}, {peer.public_key for peer in peers}, deadline, everything=True
        )
        models = self.exchange.peer_models(blobs, current).received.get(MODEL, {})
        if models:
            uniform = {name: 1 / len(models) for name in models}
            self.model.load_state_dict(
                weighted_average({name: model.state for name, model in models.items()}, uniform)
            )
        log.info(
            "%s: joined at round %d from %d models", self.options.name, current + 1, len(models)
        )
        return current + 1

    def _round(self, round_no: int) -> None:
        fail_if_planted(self.options.name, round_no)
        seconds: dict[str, float] = {}
        stats_before = self.endpoint.stats()
        cpu_at_start = read_cpu(self.endpoint.thread_ids())
        self.endpoint.set_round(round_no)
        if self.deltas is not None:
            self.deltas.start(round_no, state_to_arrays(self.model))
        with self.cpu:  # seconds are counted once the CPU is ours, here and below
            clock = time.perf_counter()
            self.attack.start_round(self.model)  # a no-op on an honest node
            train_loss = (
                self.train(
                    self.model,
                    self.data.x_train,
                    self.attack.training_labels(self.data.y_train, self.data.num_classes),
                    None,
                    seed=draw_seed(self.cfg.seed, self.options.name, round_no, "train"),
                )
                if self.attack.trains
                else None
            )
            # In the same turn at the CPU: a rule may train here too (pFedLIA's lazy model).
            publications = self.algorithm.publish(round_no, self._state_copy(), self.data)
        self._straggle()
        seconds["train"] = time.perf_counter() - clock

        clock = time.perf_counter()
        publications, claimed = self.attack.tamper(round_no, publications, len(self.data.y_train))
        published_bytes = 0
        for kind, state in publications.items():
            for blob in self.exchange.blobs_of(round_no, kind, state_to_arrays(state), claimed):
                self.endpoint.publish(blob)
                published_bytes += blob.size
        kinds = set(publications)
        del publications  # signed into blobs: a copy of the model less while the round waits
        # Places freed after the last round are being filled. Published first, so no
        # neighbour waits on this; a newcomer hears of our blob when it links.
        seconds.update(self.view_keeper.refill(self.wait_for_neighbours))
        waiting_since = time.monotonic()
        deadline = waiting_since + self.model_wait
        neighbours = {peer.public_key: peer.name for peer in self.endpoint.alive_peers()}
        alive = set(neighbours)
        learning_from = self.view_keeper.learning_from(neighbours, round_no)
        blobs = self.exchange.collect(
            round_no,
            kinds,
            learning_from,
            deadline,
            quorum=self.cfg.round_quorum,
            origins_only=learning_from != alive,
        )
        seconds["communicate"] = time.perf_counter() - clock

        with self.cpu:
            clock = time.perf_counter()
            intake = self.exchange.peer_models(blobs, round_no)
            del blobs  # decoded and forgotten by the endpoint: their bytes go now
            self.attack.observe(intake.received)
            outcome = self._aggregate(round_no, intake)
            self.algorithm.release_scratch()  # until the next round's rule uses it
            self.model.load_state_dict(outcome.state)
            received = intake.received
            seconds["aggregate"] = time.perf_counter() - clock

            clock = time.perf_counter()
            val, test = self.val_and_test()
            seconds["evaluate"] = time.perf_counter() - clock
            # Read once: what the round's record shows is what the drops chose among.
            ended_with = self.view_keeper.neighbours_now()
            dropped = self.view_keeper.drop(
                round_no,
                neighbours.values(),
                ended_with,
                outcome.weights,
                caught_copying(outcome.diagnostics),
                arrived=received.get(MODEL, {}).keys(),
            )

        after = self.endpoint.stats()
        self.metrics.append(
            RoundRecord(
                round=round_no,
                node=self.options.name,
                train_loss=train_loss,
                val_loss=val.loss,
                val_acc=val.accuracy,
                test_loss=test.loss,
                test_acc=test.accuracy,
                weights=outcome.weights,
                diagnostics=outcome.diagnostics,
                received=sorted(received.get(MODEL, {})),
                peers_alive=len(alive),
                fetched={kind: sorted(models) for kind, models in received.items()},
                refused=intake.refused,
                refusals=dict(sorted(intake.reasons.items())),
                transport_fetches=self.exchange.fetches_since(
                    stats_before["fetched"], waiting_since
                ),
                bytes_in=after["bytes_in"] - stats_before["bytes_in"],
                bytes_out=after["bytes_out"] - stats_before["bytes_out"],
                bytes_sent_by_kind=after["bytes_sent_by_kind"],  # since the node started
                cpu_seconds=cpu_spent(cpu_at_start),
                compression=self.cfg.compression,
                published_bytes=published_bytes,
                rejections=after["rejections"],
                seconds=seconds,
                n_train=len(self.data.y_train),
                **self.device_fields(),
                attacker=self.attack.active,
                **self.view_keeper.record(neighbours, ended_with, dropped),
                connections=after["connections"],
            ).to_json()
        )
        self._save(round_no)

    def device_fields(self) -> dict[str, Any]:
        """What a round's record says of the node's device."""
        return {"device": str(self.device), "device_memory_mb": peak_memory_mb(self.device)}

    def val_and_test(self) -> tuple[Evaluation, Evaluation]:
        """The model's val and test figures, computed on the node's device."""
        data = self.data
        with visiting(self.model, self.device):
            return (
                evaluate(self.model, data.x_val, data.y_val, data.num_classes),
                evaluate(self.model, data.x_test, data.y_test, data.num_classes),
            )

    def _straggle(self) -> None:
        """A peer given a `train_delay` (to measure what stragglers cost a mesh) sleeps it
        after training."""
        listed = cfgmod.listed_peer(self.cfg, self.options.name)
        time.sleep(listed.train_delay if listed else 0.0)

    def _state_copy(self) -> dict[str, torch.Tensor]:
        return cloned(self.model.state_dict())

    def _aggregate(self, round_no: int, intake: PeerIntake) -> Aggregate:
        """The rule's aggregate of the admitted peers' models, contained: a peer whose
        models make the rule raise is refused for the round (node/containment.py)."""

        def step(admitted: frozenset[str]) -> Aggregate:
            own = PeerModel(self._state_copy(), len(self.data.y_train))
            received = {
                kind: {name: model for name, model in by_peer.items() if name in admitted}
                for kind, by_peer in intake.received.items()
            }
            return self.algorithm.aggregate(round_no, own, received, self.data)

        peers = {name for by_peer in intake.received.values() for name in by_peer}
        contained = run_contained(
            step, peers, self.algorithm, self.options.name, suspects=self._suspects
        )
        self._suspects = set(contained.refused)
        for name in contained.refused:
            for kind, by_peer in intake.received.items():
                if by_peer.pop(name, None) is not None:
                    intake.refuse(kind, name, RULE_ERROR)
        return contained.outcome

    def _save(self, round_no: int) -> None:
        peers = [
            {"name": p.name, "addr": p.address, "key": p.public_key.hex()}
            for p in self.endpoint.peers()
        ]
        neighbours = self.view_keeper.neighbours_now()
        keys = {neighbours[name] for name in self.view_keeper.anchors() if name in neighbours}
        chosen = [
            contact(p.address, p.public_key) for p in self.endpoint.peers() if p.public_key in keys
        ]
        # A node resumed less than ANCHOR_ROUNDS ago keeps the anchors it resumed with.
        anchors = chosen or self._anchors
        save_checkpoint(
            self.checkpoint_path,
            {
                "round": round_no,
                "model": self.model.state_dict(),
                "algorithm": self.algorithm.state_dict(),
                "peers": json.dumps(peers),
                "anchors": json.dumps(anchors),
                "dropped_machines": json.dumps(self.endpoint.dropped_machines(round_no + 1)),
            },
        )

    def _linger(self) -> None:
        """Keep serving our last blob until every live peer is past the final round, so
        a slower peer is not left waiting for it."""
        self.endpoint.set_round(self.cfg.rounds + 1)
        self.endpoint.finish()
        deadline = time.monotonic() + self.model_wait
        while time.monotonic() < deadline:
            if all(peer.round > self.cfg.rounds for peer in self.endpoint.alive_peers()):
                return
            time.sleep(0.1)


# --- assembling a node ------------------------------------------------------------


def build_node(options: NodeOptions, role: type[Node] = Node) -> Node:
    """A node of `role` (a gossip peer, or a role of node/coordinator.py) with the parts
    `options` call for: its shard of the data, the mesh's model and rule, its key, its
    endpoint (bound at its listen address), its metrics log and checkpoint path."""
    cfg = options.config
    set_torch_threads(options.local_nodes)
    device = resolve_device(cfg.device, options.node_index)  # before any peer hears of us
    task = task_of(cfg)
    data = task.node_data(node_info(cfg, options.name, options.node_index, options.num_nodes))
    new_model = task.model_maker(data)
    model = new_model()
    task.check_rule(cfg.algorithm, model, data)
    train = training_recipe(cfg, task.training, device)
    algorithm = build_rule(
        cfg.algorithm.name,
        cfg.algorithm.params,
        rule_context(options, data, model, new_model, train, task),
    )
    schema = model_digest(model)
    about = mesh_about(cfg, model, data.num_classes, schema)
    endpoint = Endpoint(
        Identity.load_or_create(options.key_path),
        mesh_id(cfg, schema),
        endpoint_settings(options, role.DIRECT_KINDS, state_to_arrays(model), about),
        schema=schema,
    )
    if not options.joining:  # a joiner says it once, as the reason it stops
        endpoint.on_other_mesh = lambda met: log.warning(other_mesh_line(options.name, about, met))
    options.out_dir.mkdir(parents=True, exist_ok=True)
    node = role(
        options,
        data=data,
        model=model,
        new_model=new_model,
        train=train,
        algorithm=algorithm,
        endpoint=endpoint,
        attack=attack_for(
            options.name,
            cfg.attack.nodes,
            cfg.attack.kind,
            cfg.seed,
            lambda: new_model().state_dict(),
        ),
        metrics=MetricsLog(options.out_dir / "metrics.jsonl"),
        checkpoint_path=options.out_dir / "checkpoint.pt",
        device=device,
    )
    endpoint.status_extra = node.status_extra
    if cfg.topology.select == "benefit":  # a bounded view turns away whom the rule shuns
        endpoint.shuns = algorithm.shuns
    return node


def rule_context(
    options: NodeOptions,
    data: NodeData,
    model: torch.nn.Module,
    new_model: Callable[[], torch.nn.Module],
    train: TrainRecipe,
    task: Task,
) -> Context:
    """What the node's rule may know about, and do in, this node (algorithms.Context):
    the task gives the model's body and head keys, and may choose the batch size."""
    cfg = options.config
    body, head = task.split_keys(model)
    return Context(
        options.name,
        cfg.seed,
        data.num_classes,
        body,
        head,
        batch_size=task.training.batch_size or cfg.batch_size,
        new_model=new_model,
        train=train,
        data=data,
        layout=layout_of(state_to_arrays(model)),
        set_aside=SetAside(options.out_dir),
    )


def endpoint_settings(
    options: NodeOptions,
    direct_kinds: frozenset[str],
    model: Mapping[str, Any],
    about: dict[str, str | int],
) -> EndpointSettings:
    """The endpoint a node of `options` runs; `model`, its arrays, sizes what it takes in;
    `about` says what its mesh is to nodes of another (node/about.py)."""
    cfg = options.config
    allowlist = None
    if cfg.closed:
        allowlist = frozenset(bytes.fromhex(p.public_key) for p in cfg.peers if p.public_key)
    return EndpointSettings(
        name=options.name,
        listen=options.listen,
        heartbeat_interval=cfg.heartbeat_interval,
        peer_timeout=cfg.peer_timeout,
        allowlist=allowlist,
        encrypt=cfg.encrypt,
        views=cfg.topology.views(len(cfg.peers)),
        crowd=options.host_nodes,
        direct_kinds=direct_kinds,
        transport=TransportOptions(max_frame_bytes=frame_limit(model, direct_kinds)),
        about=about,
    )


def frame_limit(model: Mapping[str, Any], direct_kinds: frozenset[str]) -> int:
    """The largest data frame a node takes (ZeroMQ drops the connection of a sender that
    starts a bigger one, before holding any of it). A gossip peer takes models, heads and
    bodies, none bigger than the whole model: twice that, at least 1 MiB. A coordinator
    and its clients keep the transport's limit: a rule's extras may stack many models."""
    if direct_kinds:
        return TransportOptions().max_frame_bytes
    return max(1 << 20, 2 * sum(array.nbytes for array in model.values()))
