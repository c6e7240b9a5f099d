"""What a node sends and takes in each round: its blobs, made from its models, and its
peers' blobs, chosen from their offers, fetched, waited for and read back as models.
The round loop (runtime.py) and the coordinator hold one each."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from meshfl.algorithms import PeerAlgorithm, PeerModel
from meshfl.algorithms.base import MODEL
from meshfl.protocol.codecs import COPY
from meshfl.protocol.endpoint import Endpoint
from meshfl.protocol.identity import Identity, node_id
from meshfl.protocol.offers import Offer
from meshfl.protocol.wire import Blob, make_blob

from .blobs import UnusableBlob, peer_model, signed_blob
from .deltas import (
    DELTA,
    PUBLIC,
    Copy,
    DeltaGossip,
    copy_named_by,
    is_public_copy,
    read_as,
)
from .mesh_identity import model_digest

log = logging.getLogger("meshfl.node")

Received = TypeVar("Received")


def in_peer_order(by_peer: Mapping[str, Received]) -> dict[str, Received]:
    """`by_peer` ordered by peer name, the order every rule is handed its peers' input
    in (here and on the coordinator): floating-point sums depend on their order, and
    blobs arrive in whatever order the network and the peers' speed give, so that a
    rerun of the same seed sums the same numbers in the same order. By name, not by
    id: an id follows the node's key, which a fresh run folder makes anew."""
    return dict(sorted(by_peer.items()))


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


@dataclass
class PeerIntake:
    """A round's peer models by kind and name, and what was refused: by kind the peers,
    and how many blobs for each reason of node/blobs.py."""

    received: dict[str, dict[str, PeerModel]] = field(default_factory=dict)
    refused: dict[str, list[str]] = field(default_factory=dict)
    reasons: Counter[str] = field(default_factory=Counter)

    def refuse(self, kind: str, name: str, reason: str) -> None:
        self.refused.setdefault(kind, []).append(name)
        self.reasons[reason] += 1


class ModelExchange:
    """The blob side of one node's rounds, over its endpoint, for its rule and its model
    (whose entries named `local_keys` stay the node's own in every model taken in);
    `deltas` where models travel as top-k deltas (`compression: topk`, deltas.py)."""

    def __init__(
        self,
        endpoint: Endpoint,
        algorithm: PeerAlgorithm,
        model: torch.nn.Module,
        name: str,
        compression: str = "none",
        local_keys: frozenset[str] = frozenset(),
        deltas: DeltaGossip | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.algorithm = algorithm
        self.model = model
        self.name = name
        self.compression = compression
        self.local_keys = local_keys
        self.deltas = deltas

    @property
    def identity(self) -> Identity:
        return self.endpoint.identity

    @functools.cached_property
    def schema(self) -> bytes:
        """The digest of the model's tensor layout, which every blob of ours names."""
        return model_digest(self.model)

    def collect(
        self,
        round_no: int,
        kinds: set[str],
        origins: set[bytes],
        deadline: float,
        everything: bool = False,
        quorum: float = 1.0,
        origins_only: bool = False,
    ) -> dict[str, dict[str, Blob]]:
        """The blobs of round `round_no` this node wants, by kind and peer name: of the
        peers among `origins` where `origins_only`, else of any (one linked while the
        round waits, too).

        Wanted blobs are fetched as their offers come in, so a live peer that never
        announces costs the wait, not the others' blobs. The wait ends once a `quorum`
        share of the peers among `origins` still alive announced every kind of `kinds`
        and every chosen blob that a live peer can send is here, or at the monotonic
        `deadline`. Liveness is judged anew each time: a peer marked down during the
        round (dead or frozen) stops holding it.
        """
        pull = _RoundPull(
            ask_once=self.algorithm.ranks_offers and not everything,
            choose_by=(time.monotonic() + deadline) / 2,
        )
        while True:
            seen = self.endpoint.changes()
            offered, complete = self._offered(round_no, kinds, origins, quorum, origins_only)
            if pull.should_ask(complete):
                pull.chosen = self._choose(round_no, offered, everything)
                self.endpoint.fetch(list(pull.chosen.values()))
            chosen = pull.chosen or {}
            arrived = self.endpoint.held([offer.id for offer in chosen.values()])
            if (
                pull.chosen is not None and complete and not self._coming(chosen, arrived)
            ) or time.monotonic() >= deadline:
                break
            self.endpoint.wait_change(seen, pull.wake_by(deadline))
        blobs: dict[str, dict[str, Blob]] = {}
        for (kind, name), offer in chosen.items():
            if offer.id in arrived:
                blobs.setdefault(kind, {})[name] = arrived[offer.id]
        return blobs

    def _offered(
        self,
        round_no: int,
        kinds: set[str],
        origins: set[bytes],
        quorum: float = 1.0,
        origins_only: bool = False,
    ) -> tuple[dict[str, dict[str, Offer]], bool]:
        """The round's offers of `kinds` by kind and peer name (`origins_only`: of the
        peers among `origins`), and whether a `quorum` share (1.0: every one) of the
        live peers among `origins` announced every kind (Endpoint.round_offers)."""
        names = {
            peer.public_key: peer.name
            for peer in self.endpoint.peers()
            if not origins_only or peer.public_key in origins
        }
        offers, complete = self.endpoint.round_offers(round_no, kinds, origins, quorum)
        offered: dict[str, dict[str, Offer]] = {}
        for offer in offers:
            # Not our own blob (a peer may relay it), nor one of a peer we do not know.
            if offer.origin in names and offer.origin != self.identity.public_key:
                offered.setdefault(offer.kind, {})[names[offer.origin]] = offer
        return offered, complete

    def _coming(
        self, chosen: dict[tuple[str, str], Offer], arrived: dict[bytes, Blob]
    ) -> list[Offer]:
        """The chosen blobs not here yet that a live peer can still send: one whose
        origin and every other holder are marked down, or answered that they no longer
        hold it, holds the round no longer."""
        return [
            offer
            for offer in chosen.values()
            if offer.id not in arrived and self.endpoint.may_come(offer)
        ]

    def _choose(
        self, round_no: int, offered: dict[str, dict[str, Offer]], everything: bool
    ) -> dict[tuple[str, str], Offer]:
        """The offers to fetch, by (kind, peer name): the algorithm's `wanted`; a model
        as its delta where this node holds the delta's base (deltas.py)."""
        listing = {kind: sorted(by_name) for kind, by_name in offered.items()}
        wanted = listing if everything else self.algorithm.wanted(round_no, listing)
        chosen = {
            (kind, name): offered[kind][name]
            for kind, names in wanted.items()
            for name in names
            if name in offered.get(kind, {})
        }
        if self.deltas is not None and not everything:
            name_of = {peer.public_key: peer.name for peer in self.endpoint.peers()}
            for offer in self.endpoint.offers(round_no, DELTA):
                name = name_of.get(offer.origin)
                if name is None or (MODEL, name) not in chosen:
                    continue
                if self.deltas.base_for(name, round_no) is not None:
                    chosen[(MODEL, name)] = offer
        return chosen

    def blobs_of(
        self, round_no: int, kind: str, arrays: dict[str, np.ndarray], claimed: int
    ) -> list[Blob]:
        """What this node publishes of a rule's `kind`: its arrays, signed under the
        node's codec; under `topk` a model is its delta and its whole public copy."""
        meta = {"n": claimed}
        if self.deltas is None or kind != MODEL:
            return [
                signed_blob(
                    self.identity, round_no, kind, arrays, self.schema, meta, self.compression
                )
            ]
        public, delta = self.deltas.publish(arrays)
        blobs = []
        if delta is not None:  # announced first: a peer that sees the model sees it
            changes, named = delta
            blobs.append(
                make_blob(self.identity, round_no, DELTA, changes, self.schema, {**meta, **named})
            )
        blobs.append(
            make_blob(
                self.identity,
                round_no,
                kind,
                public.arrays,
                self.schema,
                {**meta, PUBLIC: True, COPY: public.name},
            )
        )
        return blobs

    def fetches_since(self, start: int, waiting_since: float) -> list[dict[str, Any]]:
        """What the endpoint pulled since its `start`-th fetch: origin by peer name, and
        when each came in seconds after the round began `waiting_since` (monotonic)."""
        names = {node_id(peer.public_key): peer.name for peer in self.endpoint.peers()}
        return [
            {
                "origin": names.get(record.origin, record.origin),
                "round": record.round,
                "kind": record.kind,
                "bytes": record.size,
                "from": record.holder,
                "seconds": round(record.arrived - waiting_since, 3),
            }
            for record in self.endpoint.fetches_since(start)
        ]

    def peer_models(self, blobs: dict[str, dict[str, Blob]], round_no: int = 0) -> PeerIntake:
        """The round's blobs as peer models by kind and peer name; a blob that fails the
        checks of node/blobs.py is refused (logged; the round goes on without it). Read,
        the blobs leave the endpoint's store: the models are decoded into memory of
        their own, and a node serves its peers only its own blobs."""
        intake = PeerIntake()
        public_copies: dict[str, Copy] = {}
        own_lag = self.deltas.lag(self.model.state_dict()) if self.deltas is not None else {}
        for kind, by_peer in in_peer_order(blobs).items():  # kinds too, for a rule of several
            expected = self.algorithm.layouts(kind)
            for name, blob in in_peer_order(by_peer).items():
                delta = self.deltas is not None and blob.kind == DELTA
                base = self.deltas.base_for(name, round_no) if self.deltas and delta else None
                try:
                    model = peer_model(blob, expected, base=base, delta=delta)
                except UnusableBlob as error:
                    log.warning("%s: refused %s's blob: %s", self.name, name, error)
                    intake.refuse(kind, name, error.reason)
                    continue
                if kind == MODEL and self.deltas is not None and is_public_copy(blob):
                    # The base of the peer's next delta; any other model is read as it is.
                    copy = copy_named_by(blob, {k: v.numpy() for k, v in model.state.items()})
                    if copy is not None:
                        public_copies[name] = copy
                    model = PeerModel(read_as(model.state, own_lag), model.n_samples)
                intake.received.setdefault(kind, {})[name] = self.with_own_local(model)
        if self.deltas is not None:
            self.deltas.took_in(round_no, public_copies)
        self.endpoint.forget_fetched(
            blob.id for by_peer in blobs.values() for blob in by_peer.values()
        )
        return intake

    def with_own_local(self, model: PeerModel) -> PeerModel:
        """`model` with this node's own values in its local entries (`local_keys`): every
        rule then averages, scores and screens the peers' models as they would be here,
        with our BatchNorm layers, and an average of them leaves ours as they are."""
        if not self.local_keys:
            return model
        ours = self.model.state_dict()
        for key in self.local_keys & model.state.keys():
            model.state[key] = ours[key].detach().clone()
        return model
