"""One peer process: the round loop of DESIGN.md.

    train → publish → wait for the announced blobs it wants (until the round's
    deadline) → aggregate → evaluate → metrics line → checkpoint → next round

There is no barrier: a node goes on with whatever arrived by the deadline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import reprlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from meshfl.algorithms import Context, PeerModel, algorithm_class, parse_params
from meshfl.algorithms.base import MODEL, weighted_average
from meshfl.protocol.endpoint import Endpoint, EndpointSettings
from meshfl.protocol.gossip import Offer
from meshfl.protocol.identity import Identity, node_id
from meshfl.protocol.membership import ALIVE
from meshfl.protocol.wire import Blob, make_blob

from . import config as cfgmod
from .checkpoint import MetricsLog, load_checkpoint, save_checkpoint
from .data import NodeData, load_node_data
from .models import body_keys, build_model, head_keys, model_schema
from .trainer import evaluate, set_torch_threads, state_to_arrays, train_local

log = logging.getLogger("meshfl.node")

MODEL_KIND = MODEL


class JoinError(Exception):
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
    joining: bool = False  # a late joiner starts from the mesh's current round
    join_hint: str = ""  # how the next node can join through this one, said once joined


def schema_digest(schema: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
    return hashlib.sha256(msgpack.packb([list(item) for item in schema])).digest()


def mesh_id(cfg: cfgmod.MeshConfig, schema: bytes) -> bytes:
    """16 bytes every peer derives alike from the settings they must share."""
    settings = json.dumps(cfgmod.shared_settings(cfg), sort_keys=True).encode()
    return hashlib.sha256(settings + schema).digest()[:16]


class UnusableBlob(ValueError):
    """A peer's blob no rule should take in: signatures prove who sent a model, not
    that it is usable."""


def tensors_from_blob(blob: Blob) -> dict[str, torch.Tensor]:
    # One copy: the received bytes are read-only ZeroMQ buffers.
    return {name: torch.from_numpy(np.array(array)) for name, array in blob.arrays().items()}


def usable_peer_model(blob: Blob) -> PeerModel:
    """A peer's tensors and sample count, or UnusableBlob when a floating-point tensor
    holds NaN or inf (averaged in, one such value spoils every weight) or the sample
    count `n` is not a positive integer (it weighs the averages; absent, it is 1). A
    count that is merely inflated cannot be told from a big dataset."""
    n = blob.meta.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UnusableBlob(f"{blob.kind} blob of round {blob.round}: its sample count n is "
                           f"{reprlib.repr(n)}, not an integer >= 1")
    tensors = tensors_from_blob(blob)
    spoilt = [name for name, tensor in tensors.items()
              if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if spoilt:
        raise UnusableBlob(f"{blob.kind} blob of round {blob.round} holds NaN or inf in "
                           f"{', '.join(spoilt)}")
    return PeerModel(tensors, n)


@dataclass
class _RoundPull:
    """What a round's collection chose to fetch so far. A rule that ranks the offers
    (`ranks_offers`) is asked once: when every live peer announced, or at `choose_by`,
    half-way to the deadline, so that there is time left to fetch. Any other rule is
    asked again whenever offers may have come in."""

    ask_once: bool
    choose_by: float
    chosen: dict[tuple[str, str], Offer] | None = None

    def should_ask(self, complete: bool) -> bool:
        if not self.ask_once:
            return True
        return self.chosen is None and (complete or time.monotonic() >= self.choose_by)

    def wake_by(self, deadline: float) -> float:
        return deadline if self.chosen is not None else min(deadline, self.choose_by)


class Node:
    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        cfg = options.config
        self.cfg = cfg
        self.threads = set_torch_threads(options.local_nodes)
        data_cfg = cfgmod.data_for(cfg, cfgmod.PeerConfig(options.name, options.listen))
        data_cfg = self._own_data(data_cfg)
        self.data: NodeData = load_node_data(
            data_cfg.dataset, data_cfg.root, data_cfg.partition, options.num_nodes,
            options.node_index, cfg.seed, data_cfg.samples_per_node, tuple(data_cfg.split))
        self.model = build_model(cfg.model.name, self.data.input_shape, self.data.num_classes,
                                 cfg.model.head, seed=cfg.seed)
        self.schema = schema_digest(model_schema(self.model))
        self.algorithm = algorithm_class(cfg.algorithm.name)(
            parse_params(cfg.algorithm.name, cfg.algorithm.params),
            Context(options.name, cfg.seed, self.data.num_classes,
                    tuple(body_keys(self.model)), tuple(head_keys(self.model)),
                    batch_size=cfg.batch_size, new_model=self._new_model, train=self._train,
                    data=self.data))
        self.identity = Identity.load_or_create(options.key_path)
        self.endpoint = Endpoint(self.identity, mesh_id(cfg, self.schema), self._settings(),
                                 schema=self.schema)
        options.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(options.out_dir / "metrics.jsonl")
        self.checkpoint_path = options.out_dir / "checkpoint.pt"
        self.endpoint.status_extra = self._status_extra

    def _status_extra(self) -> dict[str, Any]:
        """What this node adds to the endpoint's status answer; runs on its worker thread."""
        return {"algorithm": self.cfg.algorithm.name, "rounds": self.cfg.rounds,
                "accuracies": self.metrics.recent_scores()}

    def _new_model(self) -> torch.nn.Module:
        return build_model(self.cfg.model.name, self.data.input_shape, self.data.num_classes,
                           self.cfg.model.head, seed=self.cfg.seed)

    def _train(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
               epochs: int | None, seed: int, max_steps: int | None = None) -> float:
        """The node's local training recipe, for algorithms that train models of their own."""
        epochs = self.cfg.local_epochs if epochs is None else epochs
        return train_local(model, x, y, epochs, self.cfg.batch_size, self.cfg.optimizer,
                           self.cfg.lr, seed=seed, momentum=self.cfg.momentum,
                           max_steps=max_steps)

    def _own_data(self, data_cfg: cfgmod.DataConfig) -> cfgmod.DataConfig:
        for peer in self.cfg.peers:
            if peer.name == self.options.name:
                return cfgmod.data_for(self.cfg, peer)
        return data_cfg

    def _settings(self) -> EndpointSettings:
        cfg = self.cfg
        allowlist = None
        if cfg.closed:
            allowlist = frozenset(bytes.fromhex(p.public_key) for p in cfg.peers if p.public_key)
        return EndpointSettings(
            name=self.options.name, listen=self.options.listen,
            heartbeat_interval=cfg.heartbeat_interval, peer_timeout=cfg.peer_timeout,
            allowlist=allowlist)

    # --- the run ----------------------------------------------------------

    def run(self) -> None:
        first_round = self._resume()
        if first_round > self.cfg.rounds:
            log.info("%s: this run already finished its %d rounds; nothing to do (start a "
                     "new run with another --out)", self.options.name, self.cfg.rounds)
            self.endpoint.close()  # bound but never started: frees the port
            return
        (self.options.out_dir / "info.json").write_text(json.dumps({
            "name": self.options.name, "id": self.identity.id, "listen": self.options.listen,
            "public_key": self.identity.public_key.hex(), "data": self.data.info,
        }, indent=2) + "\n")
        self.endpoint.start(self.options.bootstrap)
        try:
            joined = self.endpoint.wait_joined(timeout=self.cfg.round_timeout)
            if self.options.joining and not joined:
                raise JoinError(f"no mesh member answered at {', '.join(self.options.bootstrap)} "
                                f"within {self.cfg.round_timeout:g} s (round_timeout); check "
                                "the address, the firewall, that --config has the mesh's "
                                "name, algorithm and model, and in a closed mesh that this "
                                "node's public key is listed; all nodes must run the same "
                                "meshfl version")
            if not joined and len(self.cfg.peers) > 1:
                log.warning("%s: no peer answered within %g s (round_timeout); training "
                            "alone until one does (check the addresses, the firewall and "
                            "that every node runs the same meshfl version)",
                            self.options.name, self.cfg.round_timeout)
            if joined and self.options.join_hint:
                log.info("%s: joined; the next node can join with: %s", self.options.name,
                         self.options.join_hint)
            self._run_rounds(first_round)
        finally:
            self.endpoint.close()

    def _run_rounds(self, first_round: int) -> None:
        """The peer role: gossip rounds until the last, then serve the last blob a while."""
        if self.options.joining and first_round == 1:
            first_round = self._catch_up()
        elif first_round == 1 and self.endpoint.alive_peers():
            # A fresh mesh starts together: otherwise a peer still starting up would miss
            # round 1, and the same seed would not give the same run twice.
            self.endpoint.wait_for_peers(len(self.cfg.peers) - 1, self.cfg.round_timeout)
        for round_no in range(first_round, self.cfg.rounds + 1):
            self._round(round_no)
        self._linger()

    def _resume(self) -> int:
        state = load_checkpoint(self.checkpoint_path)
        if state is None:
            self.metrics.keep_until(0)
            return 1
        self.model.load_state_dict(state["model"])
        self.algorithm.load_state_dict(state["algorithm"])
        known = [p["addr"] for p in json.loads(state["peers"]) if p["addr"] != self.options.listen]
        self.options.bootstrap = list(dict.fromkeys([*self.options.bootstrap, *known]))
        self.metrics.keep_until(state["round"])
        log.info("%s: resumed from the checkpoint of round %d", self.options.name, state["round"])
        return state["round"] + 1

    def _catch_up(self) -> int:
        """A late joiner takes the mesh's current round and starts from the average of
        the models it receives for it."""
        peers = self.endpoint.alive_peers()
        current = max((peer.round for peer in peers), default=0)
        if current < 1:
            return 1
        self.endpoint.set_round(current)
        self.endpoint.refresh_offers()  # the current round's models, announced before we came
        deadline = time.monotonic() + self.cfg.round_timeout
        blobs = self._collect(current, {MODEL_KIND}, {peer.public_key for peer in peers},
                              deadline, everything=True)
        models = self._peer_models(blobs)[0].get(MODEL_KIND, {})
        if models:
            uniform = {name: 1 / len(models) for name in models}
            self.model.load_state_dict(
                weighted_average({name: model.state for name, model in models.items()}, uniform))
        log.info("%s: joined at round %d from %d models", self.options.name, current + 1,
                 len(models))
        return current + 1

    def _round(self, round_no: int) -> None:
        seconds: dict[str, float] = {}
        stats_before = self.endpoint.stats()
        self.endpoint.set_round(round_no)
        clock = time.perf_counter()
        train_loss = train_local(
            self.model, self.data.x_train, self.data.y_train, self.cfg.local_epochs,
            self.cfg.batch_size, self.cfg.optimizer, self.cfg.lr,
            seed=self.cfg.seed * 100_003 + self.options.node_index * 1009 + round_no,
            momentum=self.cfg.momentum)
        seconds["train"] = time.perf_counter() - clock

        clock = time.perf_counter()
        publications = self.algorithm.publish(round_no, self._state_copy(), self.data)
        for kind, state in publications.items():
            self.endpoint.publish(make_blob(self.identity, round_no, kind, state_to_arrays(state),
                                            self.schema, {"n": len(self.data.y_train)}))
        deadline = time.monotonic() + self.cfg.round_timeout
        alive = {peer.public_key for peer in self.endpoint.alive_peers()}
        blobs = self._collect(round_no, set(publications), alive, deadline)
        seconds["communicate"] = time.perf_counter() - clock

        clock = time.perf_counter()
        received, refused = self._peer_models(blobs)
        own = PeerModel(self._state_copy(), len(self.data.y_train))
        outcome = self.algorithm.aggregate(round_no, own, received, self.data)
        self.model.load_state_dict(outcome.state)
        seconds["aggregate"] = time.perf_counter() - clock

        clock = time.perf_counter()
        val = evaluate(self.model, self.data.x_val, self.data.y_val, self.data.num_classes)
        test = evaluate(self.model, self.data.x_test, self.data.y_test, self.data.num_classes)
        seconds["evaluate"] = time.perf_counter() - clock

        after = self.endpoint.stats()
        self.metrics.append({
            "round": round_no, "node": self.options.name, "train_loss": train_loss,
            "val_loss": val.loss, "val_acc": val.accuracy,
            "test_loss": test.loss, "test_acc": test.accuracy,
            "weights": outcome.weights, "diagnostics": outcome.diagnostics,
            "received": sorted(received.get(MODEL_KIND, {})), "peers_alive": len(alive),
            "fetched": {kind: sorted(models) for kind, models in received.items()},
            "refused": refused,
            "transport_fetches": self._fetches_since(stats_before["fetched"]),
            "bytes_in": after["bytes_in"] - stats_before["bytes_in"],
            "bytes_out": after["bytes_out"] - stats_before["bytes_out"],
            "rejections": after["rejections"], "seconds": seconds,
            "n_train": len(self.data.y_train),
        })
        self._save(round_no)

    def _collect(self, round_no: int, kinds: set[str], origins: set[bytes], deadline: float,
                 everything: bool = False) -> dict[str, dict[str, Blob]]:
        """The blobs of round `round_no` this node wants, by kind and peer name.

        Wanted blobs are fetched as their offers come in, so a live peer that never
        announces costs the wait, not the others' blobs. The wait ends once every live
        peer among `origins` announced every kind of `kinds` and every chosen blob is
        here, or at the monotonic `deadline`.
        """
        pull = _RoundPull(ask_once=self.algorithm.ranks_offers and not everything,
                          choose_by=(time.monotonic() + deadline) / 2)
        while True:
            seen = self.endpoint.changes()
            offered, complete = self._offered(round_no, kinds, origins)
            if pull.should_ask(complete):
                pull.chosen = self._choose(round_no, offered, everything)
                self.endpoint.fetch(list(pull.chosen.values()))
            chosen = pull.chosen or {}
            arrived = self.endpoint.held([offer.id for offer in chosen.values()])
            if (pull.chosen is not None and complete and len(arrived) == len(chosen)) \
                    or time.monotonic() >= deadline:
                break
            self.endpoint.wait_change(seen, pull.wake_by(deadline))
        blobs: dict[str, dict[str, Blob]] = {}
        for (kind, name), offer in chosen.items():
            if offer.id in arrived:
                blobs.setdefault(kind, {})[name] = arrived[offer.id]
        return blobs

    def _offered(self, round_no: int, kinds: set[str], origins: set[bytes]
                 ) -> tuple[dict[str, dict[str, Offer]], bool]:
        """The round's offers of `kinds` by kind and peer name, and whether every live
        peer among `origins` has announced every kind."""
        peers = self.endpoint.peers()
        names = {peer.public_key: peer.name for peer in peers}
        offered: dict[str, dict[str, Offer]] = {}
        for offer in self.endpoint.offers(round_no):
            if offer.kind in kinds and offer.origin in names \
                    and offer.origin != self.identity.public_key:
                offered.setdefault(offer.kind, {})[names[offer.origin]] = offer
        announced = {(offer.origin, offer.kind) for by_name in offered.values()
                     for offer in by_name.values()}
        alive = {peer.public_key for peer in peers if peer.state == ALIVE} & origins
        complete = all((origin, kind) in announced for origin in alive for kind in kinds)
        return offered, complete

    def _choose(self, round_no: int, offered: dict[str, dict[str, Offer]],
                everything: bool) -> dict[tuple[str, str], Offer]:
        """The offers to fetch, by (kind, peer name): the algorithm's `wanted`."""
        listing = {kind: sorted(by_name) for kind, by_name in offered.items()}
        wanted = listing if everything else self.algorithm.wanted(round_no, listing)
        return {(kind, name): offered[kind][name] for kind, names in wanted.items()
                for name in names if name in offered.get(kind, {})}

    def _fetches_since(self, start: int) -> list[dict[str, Any]]:
        """What the endpoint pulled since its `start`-th fetch: origin by peer name."""
        names = {node_id(peer.public_key): peer.name for peer in self.endpoint.peers()}
        return [{"origin": names.get(record.origin, record.origin), "round": record.round,
                 "kind": record.kind, "bytes": record.size, "from": record.holder}
                for record in self.endpoint.fetches_since(start)]

    def _state_copy(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().clone() for key, value in self.model.state_dict().items()}

    def _peer_models(self, blobs: dict[str, dict[str, Blob]]
                     ) -> tuple[dict[str, dict[str, PeerModel]], dict[str, list[str]]]:
        """The round's blobs as peer models by kind and peer name, and by kind the peers
        whose blobs were refused as unusable (logged; the round goes on without them)."""
        received: dict[str, dict[str, PeerModel]] = {}
        refused: dict[str, list[str]] = {}
        for kind, by_peer in blobs.items():
            for name, blob in sorted(by_peer.items()):
                try:
                    received.setdefault(kind, {})[name] = usable_peer_model(blob)
                except UnusableBlob as error:
                    log.warning("%s: refused %s's blob: %s", self.options.name, name, error)
                    refused.setdefault(kind, []).append(name)
        return received, refused

    def _save(self, round_no: int) -> None:
        peers = [{"name": p.name, "addr": p.address, "key": p.public_key.hex()}
                 for p in self.endpoint.peers()]
        save_checkpoint(self.checkpoint_path, {
            "round": round_no, "model": self.model.state_dict(),
            "algorithm": self.algorithm.state_dict(), "peers": json.dumps(peers),
        })

    def _linger(self) -> None:
        """Keep serving our last blob until every live peer is past the final round, so
        a slower peer is not left waiting for it."""
        self.endpoint.set_round(self.cfg.rounds + 1)
        deadline = time.monotonic() + self.cfg.round_timeout
        while time.monotonic() < deadline:
            if all(peer.round > self.cfg.rounds for peer in self.endpoint.alive_peers()):
                return
            time.sleep(0.1)
