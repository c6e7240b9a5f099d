"""Both sides of a coordinated round, for the server-centric rules (FedReMa, Fed-Influence).

    coordinator: send each chosen client its `personal` model for round t
    client:      evaluate it (the outcome of round t-1), train, `upload` for round t
    coordinator: aggregate the uploads that arrived by the deadline; checkpoint

The coordinator is a node of the same mesh, with the same keys and signatures.
Both sides checkpoint every round. A client whose coordinator is away keeps
training locally and takes up the next `personal` model it receives, so a
coordinator that restarts from its checkpoint picks the mesh up where it was.

A coordinator that is gone for good must not keep its clients forever: after
`max(rounds, 3) × round_timeout` seconds without a `personal` message (as long as the
whole run may take at its deadlines) a client gives up and the process ends with one error
line and exit status 2 (`CoordinatorGone`). Its metrics and checkpoint stop at the
last round the coordinator answered; started again, it resumes from there.

A rule may send tensors beside a client's model (`personal_extras`, e.g. models to
score) and have the client upload tensors beside its own (`client_update`'s extras);
both travel in the same blob as the model, their names prefixed with `extra/`.
"""

from __future__ import annotations

import logging
import math
import reprlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from meshfl.algorithms import CoordinatorAlgorithm, Upload, is_coordinated
from meshfl.algorithms.base import Layout, PeerModel, draw_seed
from meshfl.protocol.errors import UserError
from meshfl.protocol.wire import Blob, Message

from .blobs import RULE_ERROR, UnusableBlob, peer_model, signed_blob, whole_blob_codec
from .containment import run_contained
from .metrics import CoordinatorRecord, RoundRecord
from .model_exchange import PeerIntake, in_peer_order
from .runtime import Node, NodeOptions, build_node
from .trainer import state_to_arrays

log = logging.getLogger("meshfl.coordinator")

PEER, COORDINATOR = "peer", "coordinator"  # the roles a process runs in
UPLOAD, PERSONAL = "upload", "personal"  # the direct kinds of WIRE.md 7.6
EXTRA = "extra/"  # prefix of the rule's extra tensors in an upload or personal blob
# A client waits this many deadlines at least: a coordinator's wait for its peers at
# start, one round's full deadline for a slow upload and its aggregation fit in it.
MIN_PATIENCE_ROUNDS = 3


class CoordinatorGone(UserError):
    """A client heard nothing from its coordinator for its whole patience; one line."""


def _split_upload(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(model state, the rule's extras) of an `upload` or `personal` blob's tensors."""
    state = {k: v for k, v in tensors.items() if not k.startswith(EXTRA)}
    extras = {k.removeprefix(EXTRA): v for k, v in tensors.items() if k.startswith(EXTRA)}
    return state, extras


def _extra_arrays(extras: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {EXTRA + k: v.detach().cpu().numpy() for k, v in extras.items()}


def checked_direct(rule: CoordinatorAlgorithm, message: Message, last_round: int) -> PeerModel:
    """An `upload` or `personal` message's tensors, checked in WIRE.md 9.1's order: the
    mesh's whole model then the rule's extras for this kind, the sample count, finite
    values, then the meta: the signed record is the sender's own, of the message's kind
    and of the round its meta names (at most `last_round`); a `personal` blob also says
    whether to train and the weights that shaped it (finite numbers by peer name)."""
    blob = message.blob
    assert blob is not None
    model: Layout = rule.context.layout

    def fits(layout: Layout) -> bool:
        extras = tuple(
            (name.removeprefix(EXTRA), dtype, shape) for name, dtype, shape in layout[len(model) :]
        )
        return (
            layout[: len(model)] == model
            and all(name.startswith(EXTRA) for name, _, _ in layout[len(model) :])
            and rule.extras_fit(message.kind, extras)
        )

    checked = peer_model(blob, (model,), fits)
    meta = blob.meta
    weights = meta.get("weights", {})
    fine = (
        blob.kind == message.kind
        and blob.origin == message.sender
        and meta.get("round") == blob.round <= last_round
    )
    if message.kind == PERSONAL:
        fine = (
            fine
            and isinstance(meta.get("train"), bool)
            and isinstance(weights, dict)
            and all(
                isinstance(name, str)
                and isinstance(weight, (int, float))
                and not isinstance(weight, bool)
                and math.isfinite(weight)
                for name, weight in weights.items()
            )
        )
    if not fine:
        raise UnusableBlob(
            "meta",
            f"its record or meta does not fit a {message.kind} of "
            f"its sender: {reprlib.repr(blob.kind)}, round "
            f"{blob.round}, meta {reprlib.repr(meta)}",
        )
    return checked


class CoordinatorNode(Node):
    """Runs the rule's server side; its metrics go to <out>/coordinator/metrics.jsonl."""

    DIRECT_KINDS = frozenset({UPLOAD})
    algorithm: CoordinatorAlgorithm

    def _run_rounds(self, first_round: int) -> None:
        self.endpoint.wait_for_peers(len(self.cfg.peers), timeout=self.cfg.round_timeout)
        initial = self.new_model().state_dict()
        for round_no in range(first_round, self.cfg.rounds + 1):
            self._coordinate(round_no, initial)
        final_round = self.cfg.rounds + 1
        for peer in self.endpoint.alive_peers():
            self._send_personal(peer.public_key, peer.name, final_round, initial, train=False)
        self._wait_for_clients_to_leave()

    def _coordinate(self, round_no: int, initial: dict[str, torch.Tensor]) -> None:
        self.endpoint.set_round(round_no)
        before = self.endpoint.stats()
        clock = time.perf_counter()
        clients = {peer.name: peer.public_key for peer in self.endpoint.alive_peers()}
        chosen = self.algorithm.clients_for_round(round_no, sorted(clients))
        sent = sum(
            self._send_personal(clients[name], name, round_no, initial, train=True)
            for name in chosen
        )
        uploads, intake = self.collect_uploads(round_no, {clients[name]: name for name in chosen})
        seconds = {"wait": time.perf_counter() - clock}
        clock = time.perf_counter()
        contained = run_contained(
            lambda admitted: self.algorithm.aggregate_uploads(
                round_no, {name: upload for name, upload in uploads.items() if name in admitted}
            ),
            uploads,
            self.algorithm,
            COORDINATOR,
            suspects=self._suspects,
        )
        self._suspects = set(contained.refused)
        diagnostics = contained.outcome
        for name in contained.refused:
            intake.refuse(UPLOAD, name, RULE_ERROR)
        seconds["aggregate"] = time.perf_counter() - clock
        after = self.endpoint.stats()
        self.metrics.append(
            CoordinatorRecord(
                round=round_no,
                clients=chosen,
                uploaded=sorted(uploads),
                refused=sorted(intake.refused.get(UPLOAD, [])),
                published_bytes=sent,
                refusals=dict(sorted(intake.reasons.items())),
                rejections=after["rejections"],
                diagnostics=diagnostics,
                seconds=seconds,
                bytes_in=after["bytes_in"] - before["bytes_in"],
                bytes_out=after["bytes_out"] - before["bytes_out"],
            ).to_json()
        )
        self._save(round_no)

    def _send_personal(
        self, key: bytes, name: str, round_no: int, initial: dict[str, torch.Tensor], train: bool
    ) -> int:
        """Sends `name` the model it starts round `round_no` from; the blob's bytes."""
        state = self.algorithm.model_for(round_no, name, initial)
        arrays = {k: a.copy() for k, a in state_to_arrays(state).items()}
        arrays.update(_extra_arrays(self.algorithm.personal_extras(round_no, name)))
        meta = {"round": round_no, "train": train, "weights": self.algorithm.weights_for(name)}
        blob = _signed(self, round_no, PERSONAL, arrays, meta)
        self.endpoint.send_blob(key, PERSONAL, blob)
        return blob.size

    def collect_uploads(
        self, round_no: int, expected: dict[bytes, str]
    ) -> tuple[dict[str, Upload], PeerIntake]:
        """The round's uploads by client name, and the clients whose upload was refused as
        unusable (logged; the round goes on as if they had not uploaded)."""
        uploads: dict[str, Upload] = {}
        intake = PeerIntake()
        deadline = time.monotonic() + self.cfg.round_timeout
        waiting = dict(expected)
        # round_quorum: the share of the chosen clients whose uploads the round waits for
        # (rounded up, as for peers); a refused upload counts as come.
        needed = math.ceil(self.cfg.round_quorum * len(expected) - 1e-9)
        while len(expected) - len(waiting) < needed and (left := deadline - time.monotonic()) > 0:
            message = self.endpoint.next_message(UPLOAD, timeout=min(left, 0.5))
            if message is None or message.sender not in waiting:
                continue  # nothing, or not from a client still awaited this round
            if message.refused is not None and message.round == round_no:
                # Its frames were refused as they came: not waited for any longer.
                name = waiting.pop(message.sender)
                log.warning("coordinator: refused %s's upload: %s", name, message.refused)
                intake.refuse(UPLOAD, name, message.refused)
                continue
            if message.blob is None:
                continue  # a refused upload of an earlier round
            if message.blob.meta.get("round") != round_no:
                continue  # a late upload of an earlier round: that round is closed
            name = waiting.pop(message.sender)
            try:
                upload = checked_direct(self.algorithm, message, round_no)
            except UnusableBlob as error:
                log.warning("coordinator: refused %s's upload: %s", name, error)
                intake.refuse(UPLOAD, name, error.reason)
                continue
            state, extras = _split_upload(upload.state)
            uploads[name] = Upload(state, upload.n_samples, extras)
        return in_peer_order(uploads), intake  # as they arrived: not the order rules sum in

    def _wait_for_clients_to_leave(self) -> None:
        deadline = time.monotonic() + self.cfg.round_timeout
        while self.endpoint.alive_peers() and time.monotonic() < deadline:
            time.sleep(0.1)


@dataclass
class _RoundInFlight:
    """A client's round between its upload and the coordinator's answer."""

    round: int
    train_loss: float
    seconds: dict[str, float]
    bytes_before: dict[str, Any] = field(default_factory=dict)
    uploaded_bytes: int = 0  # the upload's tensors as they travelled


class ClientNode(Node):
    """A peer of a coordinated mesh: trains when the coordinator hands it a model."""

    DIRECT_KINDS = frozenset({PERSONAL})
    algorithm: CoordinatorAlgorithm

    def _run_rounds(self, first_round: int) -> None:
        self.last_written = first_round - 1
        self.refusals: Counter[str] = Counter()  # the coordinator's blobs refused, by reason
        in_flight: _RoundInFlight | None = None
        while True:
            message = self._next_personal()
            assert message.blob is not None, "a personal message carries a blob"
            meta = message.blob.meta
            try:
                state, extras = _split_upload(
                    checked_direct(self.algorithm, message, self.cfg.rounds + 1).state
                )
            except UnusableBlob as error:
                self._refuse_personal(error.reason, error)
                continue
            try:
                self.algorithm.receive_extras(meta["round"], extras)
            except Exception as error:  # the coordinator's tensors made the rule raise
                self._refuse_personal(RULE_ERROR, error)
                continue
            self.model.load_state_dict(self.exchange.with_own_local(PeerModel(state, 1)).state)
            if in_flight is not None and meta["round"] > in_flight.round:
                self._record(in_flight, meta.get("weights", {}))
            if not meta["train"]:
                return
            in_flight = self._train_and_upload(meta["round"], message.sender)

    def _refuse_personal(self, reason: str, error: Exception) -> None:
        """Drop a `personal` blob the checks or the rule refused; counted in the metrics of
        the next round this client records, logged (with the rule's traceback, if any)."""
        log.warning(
            "%s: refused the coordinator's model: %s",
            self.options.name,
            error,
            exc_info=reason == RULE_ERROR,
        )
        self.refusals[reason] += 1

    def _next_personal(self) -> Message:
        """The coordinator's next `personal` message. While it is away the time goes into
        local training; after `patience` seconds without a word, CoordinatorGone."""
        patience = max(self.cfg.rounds, MIN_PATIENCE_ROUNDS) * self.cfg.round_timeout
        silent_since = time.monotonic()
        away_logged = False
        while True:
            message = self.endpoint.next_message(PERSONAL, timeout=self.cfg.round_timeout)
            if message is not None and self._from_coordinator(message):
                return message
            silent = time.monotonic() - silent_since
            if silent >= patience:
                raise CoordinatorGone(
                    f"{self.options.name}: no word from the coordinator at "
                    f"{self.cfg.coordinator} for {silent:.0f} s (max(rounds, 3) x round_timeout"
                    f" = {patience:g} s); gave up after round {self.last_written} of "
                    f"{self.cfg.rounds}. Start the coordinator and this node again to resume"
                )
            if not away_logged:
                log.warning(
                    "%s: no word from the coordinator; training locally until it "
                    "is back (at most %g s)",
                    self.options.name,
                    patience,
                )
                away_logged = True
            self._train_locally()

    def _from_coordinator(self, message: Message) -> bool:
        entry = next((p for p in self.endpoint.peers() if p.public_key == message.sender), None)
        return (
            entry is not None and entry.address == self.cfg.coordinator and message.blob is not None
        )

    def _train_locally(self) -> None:
        """While the coordinator is away, the time still goes into the own model."""
        with self.cpu:
            self.train(
                self.model,
                self.data.x_train,
                self.data.y_train,
                None,
                seed=draw_seed(self.cfg.seed, self.options.name, self.last_written, "train_alone"),
            )

    def _train_and_upload(self, round_no: int, coordinator: bytes) -> _RoundInFlight:
        self.endpoint.set_round(round_no)
        before = self.endpoint.stats()
        with self.cpu:  # counted once the CPU is ours, as a peer's seconds are
            clock = time.perf_counter()
            train_loss, extras = self.algorithm.client_update(round_no, self.model, self.data)
            seconds = {"train": time.perf_counter() - clock}
        arrays = {k: a.copy() for k, a in state_to_arrays(self.model).items()}
        arrays.update(_extra_arrays(extras))
        meta = {"round": round_no, "n": len(self.data.y_train)}
        blob = _signed(self, round_no, UPLOAD, arrays, meta)
        self.endpoint.send_blob(coordinator, UPLOAD, blob)
        return _RoundInFlight(round_no, train_loss, seconds, before, blob.size)

    def _record(self, done: _RoundInFlight, weights: dict[str, float]) -> None:
        """Evaluate the coordinator's answer to round `done.round` and write its line."""
        if done.round <= self.last_written:
            return
        with self.cpu:
            clock = time.perf_counter()
            val, test = self.val_and_test()
            seconds = time.perf_counter() - clock
        after = self.endpoint.stats()
        self.metrics.append(
            RoundRecord(
                round=done.round,
                node=self.options.name,
                train_loss=done.train_loss,
                val_loss=val.loss,
                val_acc=val.accuracy,
                test_loss=test.loss,
                test_acc=test.accuracy,
                weights=weights,
                diagnostics={},
                bytes_in=after["bytes_in"] - done.bytes_before["bytes_in"],
                bytes_out=after["bytes_out"] - done.bytes_before["bytes_out"],
                rejections=after["rejections"],
                refusals=dict(sorted(self.refusals.items())),
                bytes_sent_by_kind=after["bytes_sent_by_kind"],  # since the node started
                seconds={**done.seconds, "evaluate": seconds},
                n_train=len(self.data.y_train),
                compression=whole_blob_codec(self.cfg.compression),
                published_bytes=done.uploaded_bytes,
                **self.device_fields(),
            ).to_json()
        )
        self.refusals.clear()
        self.last_written = done.round
        self._save(done.round)


def _signed(node: Node, round_no: int, kind: str, arrays: dict, meta: dict[str, Any]) -> Blob:
    """A direct blob of `node`'s, under its `compression` as its gossip would be."""
    return signed_blob(
        node.identity, round_no, kind, arrays, node.schema, meta, node.cfg.compression
    )


def needs_coordinator(algorithm_name: str) -> bool:
    return is_coordinated(algorithm_name)


def make_node(options: NodeOptions, role: str = PEER) -> Node:
    """The node `options` describe, in `role` (PEER or COORDINATOR): a gossip peer, or
    under a server-centric rule a coordinated client or the coordinator."""
    if not needs_coordinator(options.config.algorithm.name):
        return build_node(options, Node)
    return build_node(options, CoordinatorNode if role == COORDINATOR else ClientNode)


__all__ = [
    "COORDINATOR",
    "PEER",
    "ClientNode",
    "CoordinatorGone",
    "CoordinatorNode",
    "make_node",
    "needs_coordinator",
]
