"""Whatever a peer's tensors are, a node takes in only what its rule expects and goes on:
blobs checked against the layouts of their kind, a rule's raise contained to the peer
whose input caused it, and a peer's strings never forging a log line."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from meshfl.algorithms import Context, PeerModel, algorithm_class, parse_params
from meshfl.algorithms.base import Aggregate, PeerAlgorithm, weighted_average
from meshfl.node.blobs import UnusableBlob, layout_of, peer_model
from meshfl.node.containment import run_contained
from meshfl.node.logs import OneLineFormatter, escape_controls
from meshfl.node.models import body_keys, build_model, head_keys
from meshfl.node.trainer import state_to_arrays
from meshfl.protocol.identity import Identity
from meshfl.protocol.wire import make_blob
from tests.rogue_peer import mutate

PEER = Identity.generate()
MODEL = build_model("mlp", (64,), 10, seed=0)
ARRAYS = state_to_arrays(MODEL)
LAYOUT = layout_of(ARRAYS)


def context(**overrides) -> Context:
    return Context(
        "me", 0, 10, tuple(body_keys(MODEL)), tuple(head_keys(MODEL)), layout=LAYOUT, **overrides
    )


def blob_of(arrays, kind="model", n=5):
    return make_blob(PEER, 1, kind, arrays, meta={"n": n})


def mutated(how: str) -> dict[str, np.ndarray]:
    return mutate(ARRAYS, how)


MUTATIONS = [
    "one fewer",
    "one extra",
    "renamed",
    "flattened",
    "float64",
    "int8",
    "truncated",
    "reordered",
]


def test_the_honest_blob_passes():
    model = peer_model(blob_of(ARRAYS), (LAYOUT,))
    assert model.n_samples == 5
    assert set(model.state) == set(MODEL.state_dict())


@pytest.mark.parametrize("how", MUTATIONS)
def test_a_blob_whose_tensors_lie_about_the_schema_is_refused_as_layout(how):
    with pytest.raises(UnusableBlob) as refusal:
        peer_model(blob_of(mutated(how)), (LAYOUT,))
    assert refusal.value.reason == "layout"
    assert "not the mesh's schema" in str(refusal.value)


def test_a_last_tensor_claiming_100_dimensions_is_refused_before_numpy_sees_it():
    # numpy holds at most 64 dimensions: building the arrays would raise. The index is
    # what the signed record claims, so the claim is what gets checked.
    honest = blob_of(ARRAYS)
    last = honest.index[-1]
    index = [*honest.index[:-1], dataclasses.replace(last, shape=last.shape + (1,) * 99)]
    with pytest.raises(UnusableBlob) as refusal:
        peer_model(dataclasses.replace(honest, index=index), (LAYOUT,))
    assert refusal.value.reason == "layout"


@pytest.mark.parametrize(
    ("n", "reason"),
    [(0, "sample_count"), (True, "sample_count"), (2**60, "sample_count"), ("7", "sample_count")],
)
def test_a_sample_count_that_is_not_a_count_is_refused(n, reason):
    with pytest.raises(UnusableBlob) as refusal:
        peer_model(blob_of(ARRAYS, n=n), (LAYOUT,))
    assert refusal.value.reason == reason


def rule(name: str, **params) -> PeerAlgorithm:
    cls = algorithm_class(name)
    return cls(parse_params(name, params), context())


def test_pfedsv_with_a_shared_body_takes_bodies_and_heads_and_no_whole_model():
    sv = rule("pfedsv", shared_body=True)
    body = {k: v for k, v in ARRAYS.items() if k in body_keys(MODEL)}
    head = {k: v for k, v in ARRAYS.items() if k in head_keys(MODEL)}
    assert peer_model(blob_of(body, "body"), sv.layouts("body"))
    assert peer_model(blob_of(head, "head"), sv.layouts("head"))
    for kind, arrays in (("head", body), ("body", head), ("model", ARRAYS)):
        with pytest.raises(UnusableBlob, match="not the mesh's schema"):
            peer_model(blob_of(arrays, kind), sv.layouts(kind))


def test_pfedlia_takes_its_placeholder_and_truth_and_refuses_them_elsewhere():
    lia = rule("pfedlia", warmup=1)
    placeholder = {"pfedlia.not_ready": np.zeros(1, dtype=np.float32)}
    truth = {"true_cluster": np.array([3])}
    for kind in ("lazy", "anchor"):
        assert peer_model(blob_of(ARRAYS, kind), lia.layouts(kind))
        assert peer_model(blob_of(placeholder, kind), lia.layouts(kind))
    assert peer_model(blob_of(truth, "truth"), lia.layouts("truth"))
    for kind, arrays in (
        ("model", placeholder),
        ("truth", ARRAYS),
        ("truth", {"true_cluster": np.array([3.0])}),
    ):
        with pytest.raises(UnusableBlob):
            peer_model(blob_of(arrays, kind), lia.layouts(kind))


def test_fedinfluence_takes_gradient_sets_of_its_own_shape_only():
    rule_ = rule("fedinfluence", local_steps=2, samples_per_step=4)
    weight = LAYOUT[0]
    numel = int(np.prod(weight[2]))
    good = ((weight[0], "float32", (2, 3, numel)),)
    assert rule_.extras_fit("upload", good)
    for bad in (
        ((weight[0], "float32", (3, 3, numel)),),
        ((weight[0], "float32", (2, 5, numel)),),
        ((weight[0], "float64", (2, 3, numel)),),
        (("nope", "float32", (2, 3, numel)),),
        ((weight[0], "float32", (2, 3)),),
    ):
        assert not rule_.extras_fit("upload", bad)
    assert rule_.extras_fit("personal", ()) and not rule_.extras_fit("personal", good)
    # Sent as float16, they arrive as float16, or as float32 where fp16 widened them.
    halves = rule("fedinfluence", local_steps=2, samples_per_step=4, gradient_dtype="float16")
    for dtype in ("float16", "float32"):
        assert halves.extras_fit("upload", ((weight[0], dtype, (2, 3, numel)),))
    assert not halves.extras_fit("upload", ((weight[0], "float64", (2, 3, numel)),))


def test_pfedlia_central_takes_an_anchor_and_whole_lazy_models_only():
    central = rule("pfedlia_central", warmup=1)
    whole = lambda prefix: tuple((prefix + n, d, s) for n, d, s in LAYOUT)  # noqa: E731
    assert central.extras_fit("personal", whole("anchor/") + whole("lazy/a/") + whole("lazy/b/"))
    assert not central.extras_fit("personal", whole("anchor/") + whole("lazy/a/")[:-1])
    assert central.extras_fit("upload", whole("lazy/") + (("score/a", "float64", (1,)),))
    assert not central.extras_fit("upload", (("score/a", "float64", (2,)),))
    assert not central.extras_fit("upload", whole("lazy/")[1:])


class Fragile(PeerAlgorithm):
    """Averages uniformly, counts its rounds, and raises on a model whose first value is
    negative (standing for any input a rule did not foresee)."""

    name = "fragile"

    def __init__(self) -> None:
        super().__init__(None, context())
        self.rounds = 0

    attempts = 0  # every call, rewound or not (a class counter: rewinding resets the rest)

    def aggregate(self, round_no, own, received, data):
        Fragile.attempts += 1
        self.rounds += 1
        models = {"me": own, **received.get("model", {})}
        for model in models.values():
            if float(model.state["w"][0]) < 0:
                raise ValueError("negative")
        weights = {name: 1 / len(models) for name in models}
        return Aggregate(
            weighted_average({k: m.state for k, m in models.items()}, weights), weights
        )

    def state_dict(self):
        return {"rounds": self.rounds}

    def load_state_dict(self, state):
        self.rounds = state["rounds"]


def contained_round(fragile, own, received, suspects=()):
    def step(admitted):
        kept = {name: model for name, model in received.items() if name in admitted}
        return fragile.aggregate(1, own, {"model": kept}, None)

    return run_contained(step, received, fragile, "me", suspects)


def model(value: float) -> PeerModel:
    return PeerModel({"w": torch.tensor([value, 1.0])}, 1)


def test_a_peer_whose_model_makes_the_rule_raise_is_refused_and_the_rest_aggregated():
    fragile = Fragile()
    outcome = contained_round(
        fragile, model(1.0), {"a": model(3.0), "bad": model(-5.0), "b": model(2.0)}
    )
    assert outcome.refused == ["bad"]
    assert sorted(outcome.outcome.weights) == ["a", "b", "me"]
    assert outcome.outcome.state["w"].tolist() == [2.0, 1.0]
    assert fragile.rounds == 1, "the rule's state is rewound before each retry"


def test_last_rounds_culprit_is_tried_without_first_so_a_persistent_one_costs_one_step():
    fragile = Fragile()
    received = {"a": model(3.0), "bad": model(-5.0), "b": model(2.0)}
    first = contained_round(fragile, model(1.0), received)
    steps = fragile.attempts
    second = contained_round(fragile, model(1.0), received, suspects=first.refused)
    assert second.refused == ["bad"]
    assert fragile.attempts - steps == 2, "the full step, then the step without the suspect"


def test_a_rule_that_raises_on_its_own_model_is_the_nodes_fault_and_propagates():
    with pytest.raises(ValueError, match="negative"):
        contained_round(Fragile(), model(-1.0), {"a": model(3.0)})


def test_a_machine_out_of_memory_propagates_at_once_and_blames_no_peer():
    class OutOfMemory(Fragile):
        def aggregate(self, round_no, own, received, data):
            Fragile.attempts += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    steps = Fragile.attempts
    with pytest.raises(torch.cuda.OutOfMemoryError):
        contained_round(OutOfMemory(), model(1.0), {"a": model(3.0), "b": model(2.0)})
    assert Fragile.attempts - steps == 1, "no search for a culprit: it would only repeat"


def test_peer_strings_never_forge_a_log_line():
    assert escape_controls("plain name") == "plain name"
    forged = "tcp://127.0.0.1:9\n2026-01-01 meshfl.node node0 finished\x1b[2J"
    assert escape_controls(forged) == (
        "tcp://127.0.0.1:9\\n2026-01-01 meshfl.node node0 finished\\x1b[2J"
    )
    record = logging.LogRecord(
        "meshfl.node", logging.WARNING, __file__, 1, "cannot connect to %s", (forged,), None
    )
    line = OneLineFormatter("%(name)s %(message)s").format(record)
    assert "\n" not in line and "\x1b" not in line


def direct(blob, kind="personal", sender=PEER.public_key):
    from meshfl.protocol.wire import Message

    return Message(kind, sender, 1, blob.round, b"\0" * 8, {}, blob=blob)


def test_a_coordinators_personal_blob_is_checked_like_any_peers():
    from meshfl.node.coordinator import checked_direct

    client = rule("fedavg_server")
    meta = {"round": 2, "train": True, "weights": {"node0": 1.0}}
    honest = make_blob(PEER, 2, "personal", ARRAYS, meta=meta)
    assert set(checked_direct(client, direct(honest), 11).state) == set(ARRAYS)
    extra = {**ARRAYS, "extra/spare": np.ones(2, dtype=np.float32)}
    for arrays in [*map(mutated, MUTATIONS), extra]:
        with pytest.raises(UnusableBlob, match="not the mesh's schema"):
            checked_direct(client, direct(make_blob(PEER, 2, "personal", arrays, meta=meta)), 11)
    lies = [
        direct(honest, kind="upload"),
        direct(honest, sender=bytes(32)),
        direct(make_blob(PEER, 3, "personal", ARRAYS, meta=meta)),
        direct(make_blob(PEER, 12, "personal", ARRAYS, meta={**meta, "round": 12})),
    ]
    lies += [
        direct(make_blob(PEER, 2, "personal", ARRAYS, meta=bad))
        for bad in (
            {"round": 2},
            {**meta, "train": 1},
            {**meta, "weights": {"a": "1"}},
            {**meta, "weights": [1]},
            {**meta, "weights": {"a": float("nan")}},
        )
    ]
    for lie in lies:
        with pytest.raises(UnusableBlob) as refusal:
            checked_direct(client, lie, 11)
        assert refusal.value.reason == "meta"


def test_an_upload_with_a_personal_record_cannot_smuggle_a_personal_blobs_extras():
    from meshfl.node.coordinator import checked_direct

    central = rule("pfedlia_central", warmup=1)
    anchor = {f"extra/anchor/{name}": array for name, array in ARRAYS.items()}
    forged = make_blob(PEER, 2, "personal", {**ARRAYS, **anchor}, meta={"round": 2, "n": 5})
    with pytest.raises(UnusableBlob) as refusal:
        checked_direct(central, direct(forged, kind="upload"), 2)
    assert refusal.value.reason == "layout"


def test_a_status_answer_cannot_rewrite_the_terminal():
    from meshfl.launch.status import escaped, format_report

    report = {
        "name": "node0\x1b[2J",
        "id": "ab",
        "addr": "tcp://h:1\nforged line",
        "mesh": "m",
        "peers": [
            {
                "name": "p\r",
                "state": "alive",
                "round": 1,
                "last_seen_s": 0.1,
                "id": "cd",
                "addr": "tcp://x:2\x07",
            }
        ],
        "rejections": {},
    }
    text = format_report(escaped(report))
    assert len(text.splitlines()) == 7  # node, progress, accuracy, peers, header, peer, rejected
    assert not any(char in text for char in "\x1b\r\x07")
