"""A state a rule sets aside comes back bit for bit, from a file that lives as long as
the function reading it."""

from __future__ import annotations

import gc

import torch

from meshfl.node.config import MeshConfig
from meshfl.node.runtime import NodeOptions, rule_context
from meshfl.node.set_aside import SetAside, remove_set_aside
from meshfl.node.task import node_info, task_of
from meshfl.node.trainer import training_recipe


def a_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(16, 8, generator=generator),
        "layer.bias": torch.randn(8, 3, generator=generator).t(),  # not contiguous
        "norm.num_batches_tracked": torch.tensor(seed, dtype=torch.int64),
        "half": torch.randn(5, generator=generator).to(torch.bfloat16),
        "mask": torch.rand(7, generator=generator) > 0.5,
        "empty": torch.zeros(0, 4),
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[key].dtype == b[key].dtype
        and a[key].shape == b[key].shape
        and torch.equal(a[key], b[key])
        for key in a
    )


def test_a_state_comes_back_bit_for_bit_and_its_file_goes_with_its_reader(tmp_path):
    set_aside = SetAside(tmp_path)
    state = a_state(1)
    read = set_aside(state)
    state["layer.weight"].add_(1.0)  # the node trains on: the set-aside copy stays
    assert same(read(), a_state(1)) and same(read(), a_state(1))
    assert len(list((tmp_path / "set-aside").iterdir())) == 1
    del read
    gc.collect()
    assert list((tmp_path / "set-aside").iterdir()) == []


def test_a_newer_state_leaves_an_older_reader_its_own(tmp_path):
    """A step undone and replayed reads the round start it read the first time."""
    set_aside = SetAside(tmp_path)
    first, second = set_aside(a_state(1)), set_aside(a_state(2))
    assert same(first(), a_state(1)) and same(second(), a_state(2))


def test_what_a_stopped_run_left_is_removed_at_start(tmp_path):
    folder = tmp_path / "set-aside"
    folder.mkdir()
    (folder / "7.pt").write_bytes(b"left by a killed node")
    SetAside(tmp_path)
    assert not folder.exists()


def test_where_no_file_can_be_written_the_state_is_kept_in_memory(tmp_path):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    read = SetAside(blocked)(a_state(3))
    assert same(read(), a_state(3))


def test_a_node_at_its_end_leaves_nothing_set_aside(tmp_path):
    read = SetAside(tmp_path)(a_state(4))
    remove_set_aside(tmp_path)
    assert not (tmp_path / "set-aside").exists()
    del read  # its file is gone already
    gc.collect()


def test_a_node_hands_its_rule_a_file_in_its_own_folder(tmp_path):
    """What build_node gives the rule: set_aside writes into the node's folder, so a
    waiting node holds the state on disk, not in memory."""
    config = MeshConfig()
    options = NodeOptions(
        config,
        "node0",
        listen="tcp://127.0.0.1:0",
        out_dir=tmp_path,
        key_path=tmp_path / "key",
        node_index=0,
        num_nodes=4,
    )
    task = task_of(config)
    data = task.node_data(node_info(config, "node0", 0, 4))
    new_model = task.model_maker(data)
    model = new_model()
    train = training_recipe(config, task.training, torch.device("cpu"))
    context = rule_context(options, data, model, new_model, train, task)
    read = context.set_aside(model.state_dict())
    assert len(list((tmp_path / "set-aside").iterdir())) == 1
    assert same(read(), model.state_dict())
