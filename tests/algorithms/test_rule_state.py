"""A rule's state is the values bound to its attributes, and no step changes a value in
place: so putting the bindings back (algorithms/base.py `Rewind`) undoes a step without
copying anything, and the step replayed gives the same outcome. The node's containment
and screening's trials replay steps that way; these tests run every rule, as the mesh
runs it, on real digits shards and a real MLP, and replay each of its steps."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from meshfl.algorithms import (
    MODEL,
    Context,
    PeerModel,
    Upload,
    algorithm_class,
    parse_params,
    screening_setting,
)
from meshfl.algorithms.base import Rewind, rules_within
from meshfl.algorithms.screening import with_screening
from meshfl.node.attacks import noise_like
from meshfl.node.models import body_keys, build_model, head_keys
from meshfl.node.splits import load_node_data
from meshfl.node.trainer import train_local

NODES = 4
ROUNDS = 4


def fingerprint(value: Any, seen: frozenset[int] = frozenset()) -> Any:
    """Everything `value` holds, as nested tuples of plain values: two fingerprints are
    equal where the values are (tensors by their bytes). Modules (a rule's scratch model,
    which holds whatever was loaded last) and the node's context are not a rule's state."""
    if id(value) in seen:
        return ("cycle",)
    seen = seen | {id(value)}
    if isinstance(value, torch.Tensor):
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return ("tensor", str(value.dtype), tuple(value.shape), hashlib.sha256(raw).hexdigest())
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, hashlib.sha256(value.tobytes()).hexdigest())
    if isinstance(value, (nn.Module, Context)):
        return (type(value).__name__,)
    if isinstance(value, Mapping):
        return ("map", tuple((repr(key), fingerprint(item, seen)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(fingerprint(item, seen) for item in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(fingerprint(item, seen)) for item in value)))
    if hasattr(value, "__dict__") and not callable(getattr(value, "__func__", None)):
        return (type(value).__name__, fingerprint(vars(value), seen))
    return repr(value)


def without_timings(diagnostics: Any) -> Any:
    """Diagnostics less the seconds they took, which no replay repeats."""
    if isinstance(diagnostics, Mapping):
        return {
            key: without_timings(value)
            for key, value in diagnostics.items()
            if "seconds" not in str(key)
        }
    return diagnostics


def replayed(rule: Any, step: Callable[[], Any]) -> Any:
    """`step`'s outcome, run twice on `rule`: first under a rewind, which must find
    every value the rule held as it was, then again from there for real, which must give
    the same outcome. In between, the spare models' memory goes, as a node gives it
    back between rounds: what a spare held must never decide anything."""
    held = fingerprint(rule)
    rewind = Rewind(rule)
    first = fingerprint(without_timings(outcome_of(step())))
    rewind()
    assert fingerprint(rule) == held, "the step changed a value the rule held"
    rule.release_scratch()
    assert all(weights_held(part) == 0 for part in rules_within(rule)), "a spare kept its memory"
    second = step()
    assert fingerprint(without_timings(outcome_of(second))) == first, "the replay differed"
    return second


def weights_held(rule: Any) -> int:
    """The bytes the weights of `rule`'s own spare model hold (none built: 0)."""
    spare = rule._scratch
    if spare is None:
        return 0
    return sum(tensor.untyped_storage().nbytes() for tensor in spare.state_dict().values())


def outcome_of(result: Any) -> Any:
    if hasattr(result, "weights"):  # an Aggregate
        return {"state": result.state, "weights": result.weights, "diag": result.diagnostics}
    return result


def new_model() -> nn.Module:
    return build_model("mlp", (1, 8, 8), 10, "last", seed=0)


def train(model, x, y, epochs, seed, max_steps=None):
    return train_local(model, x, y, epochs or 1, 32, "sgd", 0.05, seed=seed, max_steps=max_steps)


def context(name: str, data: Any) -> Context:
    model = new_model()
    return Context(
        name,
        0,
        10,
        tuple(body_keys(model)),
        tuple(head_keys(model)),
        new_model=new_model,
        train=train,
        data=data,
    )


def shards() -> dict[str, Any]:
    return {
        f"node{i}": load_node_data("digits", None, "clusters:2", NODES, i, 0) for i in range(NODES)
    }


def trained(state: dict[str, torch.Tensor], data: Any, seed: int) -> dict[str, torch.Tensor]:
    model = new_model()
    model.load_state_dict(state)
    train(model, data.x_train, data.y_train, 1, seed)
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


PEER_RULES = [
    ("local", {}),
    ("fedavg", {}),
    ("fedavg", {"trials": True}),
    ("fedc2i", {}),
    ("fedc2i", {"screen": False}),
    ("pfedsv", {}),
    ("pfedsv", {"screen": False}),
    ("pfedsv", {"dp_clip": 5.0, "dp_sigma": 0.01}),
    ("pfedsv", {"shared_body": True}),
    ("pfedlia", {"warmup": 1}),
    ("pfedlia", {"warmup": 1, "screen": False}),
    ("pfedlia", {"warmup": 1, "oracle": True}),
    ("median", {}),
    ("trimmed_mean", {}),
    ("krum", {}),
    ("multikrum", {}),
]
WEIGHTS = (MODEL, "body", "head")  # the kinds that are (parts of) a model
ATTACKER = f"node{NODES - 1}"  # publishes noise: screening keeps it out of the others


@pytest.mark.parametrize(("name", "params"), PEER_RULES)
def test_every_step_of_a_peer_rule_replays_from_its_bindings(one_torch_thread, name, params):
    datas = shards()
    setting = screening_setting(name, params)
    rule_params = parse_params(name, params, ROUNDS)
    rules = {
        node: with_screening(
            algorithm_class(name)(rule_params, context(node, data)),
            setting.get("screen", False),
            setting.get("trials", False),
        )
        for node, data in datas.items()
    }
    states = dict.fromkeys(datas, new_model().state_dict())
    for round_no in range(1, ROUNDS + 1):
        mine = {node: trained(states[node], datas[node], round_no) for node in rules}
        published = {node: rules[node].publish(round_no, mine[node], datas[node]) for node in rules}
        noise = torch.Generator().manual_seed(round_no)
        published[ATTACKER] = {  # its models noise; pFedLIA's other kinds as they are
            kind: noise_like(state, noise) if kind in WEIGHTS else state
            for kind, state in published[ATTACKER].items()
        }
        for node, rule in rules.items():
            offered = {
                kind: sorted(peer for peer in published if peer != node and kind in published[peer])
                for kind in published[node]
            }
            pulls = rule.wanted(round_no, offered)
            received = {
                kind: {peer: PeerModel(published[peer][kind], 100) for peer in peers}
                for kind, peers in pulls.items()
            }
            own = PeerModel(mine[node], 100)
            outcome = replayed(rule, partial(rule.aggregate, round_no, own, received, datas[node]))
            rule.adopted(outcome.state)
            states[node] = outcome.state


INFLUENCE = {"lr": 0.1, "local_steps": 2, "samples_per_step": 3, "cleanse_at": 3}
COORDINATED_RULES = [
    ("fedavg_server", {}),
    ("fedrema", {}),
    ("fedinfluence", INFLUENCE),
    ("fedinfluence", {**INFLUENCE, "lwet": "client"}),
    ("fedinfluence", {**INFLUENCE, "lwet": "off"}),
    ("pfedlia_central", {"warmup": 1, "lazy_epochs": 2, "lazy_batch": 50}),
]


@pytest.mark.parametrize(("name", "params"), COORDINATED_RULES)
def test_every_round_of_a_coordinators_rule_replays_from_its_bindings(
    one_torch_thread, name, params
):
    datas = shards()
    rule_params = parse_params(name, params, ROUNDS)
    cls = algorithm_class(name)
    clients = {node: cls(rule_params, context(node, data)) for node, data in datas.items()}
    held_out = load_node_data("digits", None, "iid", NODES + 1, NODES, 0)
    server = cls(rule_params, context("coordinator", held_out))
    initial = new_model().state_dict()
    for round_no in range(1, ROUNDS + 1):
        uploads = {}
        for node in server.clients_for_round(round_no, sorted(clients)):
            model = new_model()
            model.load_state_dict(server.model_for(round_no, node, initial))
            clients[node].receive_extras(round_no, server.personal_extras(round_no, node))
            _, extras = clients[node].client_update(round_no, model, datas[node])
            state = {key: value.detach().clone() for key, value in model.state_dict().items()}
            uploads[node] = Upload(state, len(datas[node].y_train), extras)
        replayed(server, partial(server.aggregate_uploads, round_no, uploads))
