"""A split too big for memory streams from the task's Dataset (node/streamed.py): the
node trains and evaluates on exactly the samples it would hold whole, a mesh runs on
it, and the val split the rules read is always held."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from meshfl.node import task as taskmod
from meshfl.node.config import MeshConfig
from meshfl.node.streamed import StreamedInputs
from meshfl.node.task import NodeInfo, UserTask, kept_labels, load_task_module
from meshfl.node.trainer import evaluate, training_recipe
from tests.nodes import launch_to_end

TASK = Path(__file__).parents[1] / "tasks" / "digits_task.py"


def digits_task(**settings: object) -> UserTask:
    """The test task with `settings` added, in a module of its own (a task file is
    imported once per process: changing that module would change it for every test)."""
    module = types.ModuleType("digits_task_variant")
    vars(module).update(vars(load_task_module(str(TASK))), **settings)
    return UserTask(str(TASK), module, 0)


def node_data(task: UserTask):
    return task.node_data(NodeInfo("node1", 1, 4, 0, {"root": None}))


def trained_weights(task: UserTask, data) -> dict[str, torch.Tensor]:
    model = task.model_maker(data)()
    training_recipe(MeshConfig(local_epochs=2), task.training)(
        model, data.x_train, data.y_train, None, seed=3
    )
    return model.state_dict()


def test_a_streamed_split_trains_and_evaluates_as_the_same_split_held_whole():
    held, streamed = digits_task(in_memory=True), digits_task(in_memory=False)
    data_held, data_streamed = node_data(held), node_data(streamed)
    assert isinstance(data_streamed.x_train, StreamedInputs)
    assert isinstance(data_streamed.x_val, torch.Tensor), "the rules read val whole"
    assert isinstance(data_streamed.x_test, torch.Tensor), "arrays are held: they are in memory"
    assert torch.equal(data_held.y_train, data_streamed.y_train)
    assert data_streamed.x_train.shape == data_held.x_train.shape
    assert torch.equal(data_streamed.x_train[torch.tensor([5, 0, 7])], data_held.x_train[[5, 0, 7]])
    assert torch.equal(data_streamed.x_train[3:9], data_held.x_train[3:9])
    ours, theirs = trained_weights(held, data_held), trained_weights(streamed, data_streamed)
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key
    model = held.model_maker(data_held)()
    model.load_state_dict(ours)
    assert evaluate(model, data_streamed.x_train, data_streamed.y_train, 10, batch_size=16) == (
        evaluate(model, data_held.x_train, data_held.y_train, 10, batch_size=16)
    )


def test_a_split_bigger_than_the_bound_streams_unless_the_task_holds_it(monkeypatch):
    monkeypatch.setattr(taskmod, "STREAM_ABOVE_BYTES", 1000)  # 90 digits: 23 KB
    assert isinstance(node_data(digits_task()).x_train, StreamedInputs)
    assert isinstance(node_data(digits_task(in_memory=True)).x_train, torch.Tensor)
    monkeypatch.setattr(taskmod, "STREAM_ABOVE_BYTES", 10**9)
    assert isinstance(node_data(digits_task()).x_train, torch.Tensor)


def test_workers_read_ahead_the_same_batches():
    in_thread_task, task = digits_task(in_memory=False), digits_task(in_memory=False, workers=2)
    in_thread_data, data = node_data(in_thread_task), node_data(task)
    assert (in_thread_data.x_train.workers, data.x_train.workers) == (0, 2)
    in_thread = trained_weights(in_thread_task, in_thread_data)
    with_workers = trained_weights(task, data)
    for key, value in in_thread.items():
        assert torch.equal(value, with_workers[key]), key


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("in_memory", "in_memory: got 'no'; expected true, false or unset"),
        ("workers", "workers: got -1; expected an integer >= 0"),
    ],
)
def test_a_bad_streaming_setting_is_one_line(setting, fragment):
    task = digits_task(**{setting: "no" if setting == "in_memory" else -1})
    with pytest.raises(taskmod.TaskError, match=fragment):
        node_data(task)


def test_a_mesh_learns_on_streamed_splits(tmp_path):
    task = tmp_path / "streamed_task.py"
    task.write_text(TASK.read_text() + "\nin_memory = False\n")
    summary = launch_to_end(
        tmp_path / "launch.log",
        tmp_path / "out",
        "--task",
        str(task),
        "--nodes",
        "3",
        "--rounds",
        "3",
        "--set",
        "round_timeout=20",
    )
    assert [node["status"] for node in summary.values()] == ["finished"] * 3
    assert sum(node["test_acc"] for node in summary.values()) / 3 > 0.6
    assert "streaming train (90 samples)" in (tmp_path / "out" / "node0" / "node.log").read_text()
    last = json.loads((tmp_path / "out" / "node0" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["device"] == "cpu" and "device_memory_mb" not in last  # no GPU: no figure


def test_labels_a_dataset_keeps_are_read_without_decoding_its_inputs():
    class Images(torch.utils.data.Dataset):
        targets = [3, 1, 4, 1, 5]

        def __len__(self):
            return 5

        def __getitem__(self, index):
            raise AssertionError("an input was decoded to learn the labels")

    subset = torch.utils.data.Subset(Images(), [4, 0, 2])
    assert kept_labels(subset).tolist() == [5, 3, 4]
    relabelled = Images()
    relabelled.target_transform = lambda label: label + 1
    assert kept_labels(relabelled) is None, "transformed labels must be read as served"
