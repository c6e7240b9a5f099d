"""A node's round collection (node/model_exchange.py, ModelExchange.collect) over real
endpoints on loopback: wanted blobs are fetched as their offers arrive, and the round's
deadline bounds the whole wait; what comes in is decoded with unusable (NaN or inf)
models refused."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from meshfl.node.blobs import UnusableBlob, peer_model
from meshfl.node.config import MeshConfig
from meshfl.node.coordinator import CoordinatorNode
from meshfl.node.runtime import Node
from meshfl.protocol.identity import Identity
from meshfl.protocol.membership import liveness_stretch
from meshfl.protocol.wire import make_blob
from tests.nodes import node_from
from tests.protocol.endpoints import SCHEMA, WAIT
from tests.protocol.endpoints import make_endpoint as make_endpoint  # the fixture

DEADLINE = 2.0


class Wanted:
    """A rule's `wanted` that takes every model and remembers what it was shown."""

    def __init__(self, ranks_offers: bool) -> None:
        self.ranks_offers = ranks_offers
        self.listings: list[dict[str, list[str]]] = []

    def wanted(self, round_no: int, offered: dict[str, list[str]]) -> dict[str, list[str]]:
        self.listings.append(offered)
        return {"model": list(offered.get("model", []))}


def collector(endpoint, rule) -> Node:
    """A Node made of what its round collection uses: its endpoint and rule."""
    return node_from(endpoint=endpoint, algorithm=rule)


@pytest.fixture
def mesh_with_a_silent_peer(make_endpoint):
    """A puller, a peer that publishes its round-1 model and a live peer that never does."""
    puller = make_endpoint("puller")
    puller.start()
    publisher, silent = make_endpoint("publisher"), make_endpoint("silent")
    for peer in (publisher, silent):
        peer.start([puller.contact])
    for endpoint in (puller, publisher, silent):
        assert endpoint.wait_for_peers(2, WAIT), endpoint.settings.name
    puller.set_round(1)
    arrays = {"w": np.arange(6, dtype=np.float32)}
    blob = make_blob(publisher.identity, 1, "model", arrays, schema=SCHEMA)
    publisher.publish(blob)
    origins = {publisher.identity.public_key, silent.identity.public_key}
    return SimpleNamespace(puller=puller, blob=blob, origins=origins)


@pytest.mark.parametrize("ranks_offers", [False, True])
def test_a_peer_that_never_announces_does_not_cost_the_others_blobs(
    mesh_with_a_silent_peer, ranks_offers
):
    mesh = mesh_with_a_silent_peer
    rule = Wanted(ranks_offers)
    started = time.monotonic()
    blobs = collector(mesh.puller, rule).exchange.collect(
        1, {"model"}, mesh.origins, started + DEADLINE
    )
    waited = time.monotonic() - started
    assert set(blobs) == {"model"} and set(blobs["model"]) == {"publisher"}
    assert blobs["model"]["publisher"].id == mesh.blob.id
    assert DEADLINE - 0.1 <= waited <= DEADLINE + 1.0, "it waited for the silent peer"
    assert rule.listings[-1] == {"model": ["publisher"]}
    if ranks_offers:
        assert len(rule.listings) == 1, "a ranking rule is asked once"


def test_the_wait_ends_once_every_live_peer_announced_and_its_blob_arrived(make_endpoint):
    puller = make_endpoint("puller")
    puller.start()
    publisher = make_endpoint("publisher")
    publisher.start([puller.contact])
    assert puller.wait_for_peers(1, WAIT) and publisher.wait_for_peers(1, WAIT)
    blob = make_blob(
        publisher.identity, 1, "model", {"w": np.ones(3, dtype=np.float32)}, schema=SCHEMA
    )
    publisher.publish(blob)
    started = time.monotonic()
    blobs = collector(puller, Wanted(False)).exchange.collect(
        1, {"model"}, {publisher.identity.public_key}, started + 10 * DEADLINE
    )
    assert blobs["model"]["publisher"].id == blob.id
    assert time.monotonic() - started < DEADLINE


def test_a_round_fetches_no_model_of_a_peer_outside_those_it_learns_from(
    mesh_with_a_silent_peer,
):
    # A view past its places learns from some of its neighbours: the publisher's model
    # is on offer, but the round learns from the silent peer alone.
    mesh = mesh_with_a_silent_peer
    offered = time.monotonic() + WAIT
    while not mesh.puller.offers(1, "model") and time.monotonic() < offered:
        time.sleep(0.01)
    assert mesh.puller.offers(1, "model"), "the publisher's offer never came"
    fetched = mesh.puller.stats()["fetched"]
    blobs = collector(mesh.puller, Wanted(False)).exchange.collect(
        1,
        {"model"},
        mesh.origins - {mesh.blob.origin},
        time.monotonic() + DEADLINE,
        quorum=0.0,
        origins_only=True,
    )
    assert blobs == {} and mesh.puller.stats()["fetched"] == fetched, "it was fetched"


LAYOUT = (("w", "float32", (3,)), ("count", "int64", (3,)))


def test_an_unusable_blob_is_refused_and_the_round_goes_on_without_it():
    # Decoding uses the node's name and its rule's layouts only; then the endpoint forgets
    # every blob read, refused or not (a node serves its peers only its own).
    forgotten: list[bytes] = []
    node = node_from(
        name="me",
        algorithm=SimpleNamespace(layouts=lambda kind: (LAYOUT,) if kind == "model" else ()),
        endpoint=SimpleNamespace(forget_fetched=forgotten.extend),
    )

    def signed(value, n=7):
        weights = np.array([0.5, value, 1.5], dtype=np.float32)
        return make_blob(
            Identity.generate(),
            1,
            "model",
            {"w": weights, "count": np.arange(3)},
            schema=SCHEMA,
            meta={"n": n},
        )

    blobs = {
        "model": {
            "good": signed(1.0),
            "nan": signed(np.nan),
            "inf": signed(-np.inf),
            "no_samples": signed(1.0, n=0),
            "vague": signed(1.0, n="many"),
        }
    }
    intake = node.exchange.peer_models(blobs)
    assert intake.refused == {"model": ["inf", "nan", "no_samples", "vague"]}
    assert intake.reasons == {"not_finite": 2, "sample_count": 2}
    assert list(intake.received["model"]) == ["good"]
    good = intake.received["model"]["good"]
    assert good.n_samples == 7
    assert good.state["w"].tolist() == [0.5, 1.0, 1.5]
    assert good.state["count"].tolist() == [0, 1, 2]
    assert sorted(forgotten) == sorted(blob.id for blob in blobs["model"].values())
    with pytest.raises(UnusableBlob, match="'model' blob of round 1 holds NaN or inf in 'w'"):
        peer_model(blobs["model"]["nan"], (LAYOUT,))
    with pytest.raises(UnusableBlob, match="sample count n is 0, not an integer in 1..2"):
        peer_model(blobs["model"]["no_samples"], (LAYOUT,))


def coordinated(make_endpoint, quorum=1.0):
    """A coordinator's endpoint with two clients, "sane" and "spoilt"; `upload(name,
    round, value)` sends one upload, and `collect()` runs the coordinator's wait for round
    1's uploads, returning them with its intake and the seconds it took."""
    coordinator = make_endpoint("coordinator")
    coordinator.start()
    clients = {name: make_endpoint(name) for name in ("sane", "spoilt")}
    for client in clients.values():
        client.start([coordinator.contact])
    for endpoint in (coordinator, *clients.values()):
        assert endpoint.wait_for_peers(2, WAIT), endpoint.settings.name

    def upload(name, round_no, value):
        client = clients[name]
        blob = make_blob(
            client.identity,
            round_no,
            "upload",
            {"w": np.array([value, 2.0], dtype=np.float32)},
            schema=SCHEMA,
            meta={"round": round_no, "n": 5},
        )
        assert client.send_blob(coordinator.identity.public_key, "upload", blob)

    def collect():
        node = node_from(
            CoordinatorNode,
            name="coordinator",
            endpoint=coordinator,
            config=MeshConfig(round_timeout=30.0, rounds=5, round_quorum=quorum),
            algorithm=SimpleNamespace(
                context=SimpleNamespace(layout=(("w", "float32", (2,)),)),
                extras_fit=lambda kind, extras: not extras,
            ),
        )
        started = time.monotonic()
        uploads, intake = node.collect_uploads(
            1, {client.identity.public_key: name for name, client in clients.items()}
        )
        return uploads, intake, time.monotonic() - started

    return upload, collect


def test_the_coordinator_refuses_an_unusable_upload_without_waiting_out_the_round(make_endpoint):
    upload, collect = coordinated(make_endpoint)
    upload("sane", 0, 9.0)  # late for an earlier round: ignored, the client still counts
    upload("sane", 1, 1.0)
    upload("spoilt", 1, np.nan)
    upload("spoilt", 1, 3.0)  # one upload a round: the first was refused
    uploads, refused, seconds = collect()
    assert seconds < 10, "a refused upload still ends the wait for it"
    assert refused.refused == {"upload": ["spoilt"]}
    assert refused.reasons == {"not_finite": 1}
    assert list(uploads) == ["sane"]
    assert uploads["sane"].state["w"].tolist() == [1.0, 2.0]
    assert uploads["sane"].n_samples == 5


def test_a_coordinator_waits_for_its_quorum_of_clients_only(make_endpoint):
    upload, collect = coordinated(make_endpoint, quorum=0.5)
    upload("sane", 1, 1.0)  # "spoilt" never uploads: half of two is one
    uploads, _, seconds = collect()
    assert list(uploads) == ["sane"]
    assert seconds < 10, "the round closes at its quorum, not at round_timeout (30 s)"


def test_a_round_waits_for_models_longer_in_a_crowded_host_as_liveness_does():
    """200 nodes sharing two cores take 20 times as long over a round as one node alone,
    and so do their neighbours in the other hosts: a 30 s wait ended 38 to 51% of the
    rounds of a 1,000-node run short of models."""
    config = MeshConfig(round_timeout=30.0)
    alone, crowded = node_from(config=config), node_from(config=config)
    crowded.options = replace(crowded.options, host_nodes=200)
    assert alone.model_wait == 30.0
    assert crowded.model_wait == 30.0 * liveness_stretch(200) == 600.0


def test_a_finished_node_in_a_crowded_host_serves_its_last_blob_for_the_stretched_wait(
    make_endpoint,
):
    """A neighbour still in the last round may need our blob: a node of a host of 200
    keeps serving it for 20 times `round_timeout`, as its rounds wait for models."""
    finished = make_endpoint("finished")
    finished.start()
    behind = make_endpoint("behind")  # stays at round 0: not past the last round
    behind.start([finished.contact])
    assert finished.wait_for_peers(1, WAIT)
    config = MeshConfig(rounds=1, round_timeout=0.05)
    spent = {}
    for host_nodes in (1, 200):
        node = node_from(endpoint=finished, config=config)
        node.options = replace(node.options, host_nodes=host_nodes)
        clock = time.monotonic()
        node._linger()
        spent[host_nodes] = time.monotonic() - clock
    assert spent[1] < 0.5 and spent[200] >= 0.05 * liveness_stretch(200) == 1.0, spent
