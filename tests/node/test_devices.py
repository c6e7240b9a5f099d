"""Where a node trains (node/devices.py): the device a setting names on this machine,
and the one line for a device that is not there (mixed precision: test_trainer.py). These
machines have no GPU: what needs one is the GPU bench's (`meshfl bench devices`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from meshfl.node import devices, runtime, trainer
from meshfl.node.config import MeshConfig
from meshfl.node.devices import DeviceError, resolve_device, visiting
from meshfl.node.trainer import training_recipe
from tests.nodes import first_node_refuses, node_from, write_config


def machine_with(monkeypatch, gpus: int, mps: bool = False) -> None:
    monkeypatch.setattr(devices, "cuda_count", lambda: gpus)
    monkeypatch.setattr(devices, "mps_available", lambda: mps)


def test_auto_spreads_the_nodes_of_a_host_over_its_gpus(monkeypatch):
    machine_with(monkeypatch, gpus=2)
    chosen = [resolve_device("auto", index) for index in range(5)]
    assert chosen == [torch.device("cuda", index % 2) for index in range(5)]
    assert resolve_device("cuda", 3) == torch.device("cuda", 0)  # named: where it is named
    assert resolve_device("cpu", 1) == torch.device("cpu")


def test_auto_takes_mps_then_the_cpu(monkeypatch):
    machine_with(monkeypatch, gpus=0, mps=True)
    assert resolve_device("auto") == torch.device("mps")
    machine_with(monkeypatch, gpus=0)
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize(
    "setting, gpus, fragment",
    [
        ("cuda", 0, "device: cuda, but torch sees no CUDA GPU on this machine"),
        ("cuda:2", 2, "device: cuda:2, but this machine has 2 CUDA GPU(s), cuda:0 to cuda:1"),
        ("mps", 0, "device: mps, but torch's MPS backend is not available here"),
        ("gpu", 1, "device: got 'gpu'; allowed: auto, cpu, cuda, cuda:N or mps"),
    ],
)
def test_a_device_the_machine_lacks_is_one_line(monkeypatch, setting, gpus, fragment):
    machine_with(monkeypatch, gpus=gpus)
    with pytest.raises(DeviceError) as caught:
        resolve_device(setting)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_a_visit_moves_the_model_there_and_home_again_even_on_error():
    model = nn.Linear(3, 2)
    moves: list[torch.device] = []
    real_to = model.to

    def recorded_to(device):
        moves.append(torch.device(device))
        return real_to("cpu")  # these machines have only the CPU to move to

    model.to = recorded_to  # type: ignore[method-assign]
    with pytest.raises(RuntimeError), visiting(model, torch.device("cuda", 1)):
        raise RuntimeError("training failed")
    assert moves == [torch.device("cuda", 1), torch.device("cpu")]
    moves.clear()
    with visiting(model, torch.device("cpu")):  # already there: nothing moves
        pass
    assert moves == []


def visits_from(monkeypatch, module) -> list[torch.device]:
    """The devices `module` asks its models to visit, each visit made on the CPU (all
    these machines have)."""
    visits: list[torch.device] = []

    def recorded(model, device):
        visits.append(device)
        return visiting(model, torch.device("cpu"))

    monkeypatch.setattr(module, "visiting", recorded)
    return visits


def test_the_recipe_trains_on_the_node_device(monkeypatch):
    visits = visits_from(monkeypatch, trainer)
    x, y = torch.rand(20, 4), torch.arange(20) % 2
    train = training_recipe(MeshConfig(local_epochs=1), device=torch.device("cuda", 1))
    train(nn.Linear(4, 2), x, y, None, seed=0)
    assert visits == [torch.device("cuda", 1)]


def test_a_node_evaluates_on_its_device(monkeypatch):
    visits = visits_from(monkeypatch, runtime)
    x, y = torch.rand(6, 4), torch.arange(6) % 2
    data = SimpleNamespace(x_val=x, y_val=y, x_test=x, y_test=y, num_classes=2)
    node = node_from(data=data, model=nn.Linear(4, 2), device=torch.device("cuda", 1))
    val, test = node.val_and_test()
    assert visits == [torch.device("cuda", 1)] and val.n == test.n == 6


def test_a_node_whose_device_is_not_there_says_so_before_any_peer_is_contacted(tmp_path):
    config = tmp_path / "peers.yaml"
    cfg = write_config(config, 2, device="cuda:99")  # no machine here has a hundred GPUs
    assert "device: cuda:99, but" in first_node_refuses(config, cfg, tmp_path / "out")
