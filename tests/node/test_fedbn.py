"""`local_batchnorm` (FedBN): each node keeps its own BatchNorm layers, weights and
running statistics, while every other entry is averaged as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshfl.node.checkpoint import load_checkpoint
from meshfl.node.models import batchnorm_keys
from meshfl.node.task import load_task_module
from tests.nodes import launch_to_end

TASK = Path(__file__).parents[1] / "tasks" / "digits_task.py"


def test_the_batchnorm_keys_are_every_entry_of_every_batchnorm_layer():
    net = load_task_module(str(TASK)).model()
    assert batchnorm_keys(net) == {
        f"features.1.{key}"
        for key in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    }
    assert batchnorm_keys(torch.nn.Linear(3, 2)) == frozenset()


def final_models(tmp_path: Path, *flags: str) -> list[dict[str, torch.Tensor]]:
    """The last checkpointed model of each of 3 nodes of plain FedAvg on the test task."""
    out = tmp_path / "run"
    launch_to_end(
        tmp_path / "launch.log",
        out,
        *("--task", str(TASK), "--nodes", "3", "--rounds", "2", "--quiet"),
        *("--algorithm", "fedavg", "--set", "algorithm.screen=false", *flags),
        # float32 blobs: a full mesh's plain FedAvg then leaves one model, bit for bit
        *("--set", "compression=none"),
    )
    return [load_checkpoint(out / f"node{i}" / "checkpoint.pt")["model"] for i in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize("local", [False, True])
def test_with_local_batchnorm_nodes_share_all_but_their_batchnorm_layers(tmp_path, local):
    models = final_models(tmp_path, "--set", f"local_batchnorm={str(local).lower()}")
    norm = "net.features.1.running_mean"
    shared = "net.classifier.weight"
    assert all(torch.equal(model[shared], models[0][shared]) for model in models)
    same_norm = all(torch.equal(model[norm], models[0][norm]) for model in models)
    assert same_norm is not local
