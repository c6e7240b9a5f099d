"""Every training setting of the config reaches local training, and every random draw
comes from one seed recipe that tells nodes, rounds and purposes apart."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from meshfl.algorithms import Context, algorithm_class, parse_params
from meshfl.algorithms.base import draw_seed
from meshfl.node.config import MeshConfig
from meshfl.node.models import build_model
from meshfl.node.trainer import training_recipe

TRAINING_FIELDS = {
    "local_epochs": 2,
    "batch_size": 8,
    "optimizer": "adam",
    "lr": 0.01,
    "momentum": 0.9,
    "weight_decay": 0.5,
    "precision": "bf16",
}


def trained(cfg: MeshConfig) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=generator)
    y = torch.randint(0, 10, (40,), generator=generator)
    model = build_model("mlp", (64,), 10, seed=0)
    training_recipe(cfg)(model, x, y, None, seed=1)  # the node's recipe
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# Every other field of the config, and why it is not a training field. A new field must
# land in one of the two lists, so that one accepted but never used shows up here.
NOT_TRAINING = {
    "mesh",
    "algorithm",
    "model",
    "task",  # the model and data; its own training choices are tested in test_task.py
    "data",
    "rounds",
    "seed",
    "round_timeout",
    "round_quorum",
    "heartbeat_interval",
    "peer_timeout",
    "closed",
    "encrypt",
    "coordinator",
    "attack",
    "topology",  # whom a node learns from, not how it trains
    "local_batchnorm",  # what a node takes of its peers' models (test_fedbn.py)
    "compression",  # how a node's blobs travel (test_codecs.py, test_compressed_mesh.py)
    "device",  # where it trains, not what (test_devices.py): the CPU is all these have
    "peers",
}


def test_the_fields_checked_here_are_every_training_field_of_the_config():
    names = {field.name for field in dataclasses.fields(MeshConfig)}
    assert names - NOT_TRAINING == set(TRAINING_FIELDS), "a config field nobody sorted"
    defaults = MeshConfig()
    for name, value in TRAINING_FIELDS.items():
        assert getattr(defaults, name) != value, f"{name}: pick a value other than the default"


@pytest.mark.parametrize("field", sorted(TRAINING_FIELDS))
def test_every_training_field_changes_what_local_training_does(field):
    base = MeshConfig(local_epochs=1)
    changed = dataclasses.replace(base, **{field: TRAINING_FIELDS[field]})
    assert not torch.equal(trained(base), trained(changed)), f"{field} never reaches training"


def test_two_clients_of_one_round_shuffle_with_different_seeds():
    seeds: dict[str, int] = {}

    def train(model, x, y, epochs, seed):
        seeds[current] = seed
        return 0.0

    data = SimpleNamespace(x_train=torch.zeros(4, 2), y_train=torch.zeros(4))
    for current in ("node0", "node1"):
        context = Context(current, seed=7, num_classes=2, body_keys=(), head_keys=(), train=train)
        rule = algorithm_class("fedavg_server")(parse_params("fedavg_server", {}), context)
        rule.client_update(3, None, data)
    assert seeds["node0"] != seeds["node1"]


def test_the_seed_recipe_is_stable_and_tells_node_round_and_purpose_apart():
    seed = draw_seed(0, "node0", 1, "train")
    assert seed == draw_seed(0, "node0", 1, "train") and 0 <= seed < 2**63
    others = {
        draw_seed(1, "node0", 1, "train"),
        draw_seed(0, "node1", 1, "train"),
        draw_seed(0, "node0", 2, "train"),
        draw_seed(0, "node0", 1, "lazy"),
    }
    assert seed not in others and len(others) == 4
