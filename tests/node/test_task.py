"""A user's own model and data through the task contract (node/task.py): what a task
file may hold, how the node reads it, and the one line each mistake in it gets before
any peer is contacted."""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from meshfl.algorithms import ALGORITHM_NAMES
from meshfl.algorithms.base import weighted_average
from meshfl.launch.options import ConfigSource, resolve_config
from meshfl.node.config import AlgorithmConfig, DataConfig, DataOverride, MeshConfig, PeerConfig
from meshfl.node.data_rules import DataError
from meshfl.node.runtime import PLANTED_FAILURES
from meshfl.node.task import (
    NodeInfo,
    TaskError,
    UserTask,
    load_task_module,
    node_info,
    task_of,
)
from meshfl.node.trainer import training_recipe
from tests.nodes import (
    first_node_refuses,
    launch_to_end,
    meshfl,
    records,
    start_node,
    stop,
    wait_round,
    write_config,
)
from tests.spawn import run_to_end

TASK = Path(__file__).parents[1] / "tasks" / "digits_task.py"


def node(index: int = 0, nodes: int = 4, seed: int = 0) -> NodeInfo:
    return NodeInfo(f"node{index}", index, nodes, seed, {"root": None})


def user_task(source: Path = TASK, seed: int = 0) -> UserTask:
    return UserTask(str(source), load_task_module(str(source)), seed)


def test_a_task_gives_its_nodes_their_data_and_the_meshs_seeded_model():
    task = user_task()
    data = task.node_data(node(1))
    assert (len(data.y_train), len(data.y_val), len(data.y_test)) == (90, 30, 30)
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    assert data.num_classes == 10, "the model's logits, not the labels a node happens to hold"
    assert data.input_shape == (64,)
    first, again = task.model_maker(data)(), task.model_maker(data)()
    for key, value in first.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    other_seed = UserTask(str(TASK), load_task_module(str(TASK)), 1).model_maker(data)()
    assert not torch.equal(
        first.state_dict()["net.classifier.weight"],
        other_seed.state_dict()["net.classifier.weight"],
    )


def test_the_head_a_task_names_splits_the_state_and_gives_the_rules_its_features():
    task = user_task()
    data = task.node_data(node())
    model = task.model_maker(data)()
    body, head = task.split_keys(model)
    assert head == ("net.classifier.weight", "net.classifier.bias")
    assert "net.batches_seen" in body and "net.features.1.running_mean" in body
    assert model.feature_dim == 32
    model.eval()
    features = model.body(data.x_val)
    assert torch.allclose(model.head(features), model(data.x_val))


def test_a_task_trains_with_its_own_batch_size_loss_and_optimizer():
    task = user_task()
    choices = task.training
    assert choices.batch_size == 30 and choices.loss is not None
    data = task.node_data(node())
    model = task.model_maker(data)()
    before = model.state_dict()["net.classifier.weight"].clone()
    mean_loss = training_recipe(MeshConfig(local_epochs=2), choices)(
        model, data.x_train, data.y_train, None, seed=0
    )
    assert mean_loss > 0 and int(model.state_dict()["net.batches_seen"]) == 6
    assert not torch.equal(before, model.state_dict()["net.classifier.weight"])


def test_a_tasks_augmentation_takes_every_training_batch_seeded_by_the_round(tmp_path):
    """`augment(x)` runs on each batch before the model (noise here), drawing from
    torch's generator as dropout does: the same seed trains the same model."""
    source = TASK.read_text() + (
        "\n\ncalls = []\n\ndef augment(x):\n    calls.append(len(x))\n"
        "    return x + 0.1 * torch.randn_like(x)\n"
    )
    task = UserTask(
        str(write_task(tmp_path, source)), load_task_module(str(tmp_path / "task.py")), 0
    )
    data = task.node_data(node())
    recipe = training_recipe(MeshConfig(local_epochs=1), task.training)
    trained = []
    for seed in (0, 0, 1):
        model = task.model_maker(data)()
        task.module.calls.clear()
        recipe(model, data.x_train, data.y_train, None, seed=seed)
        trained.append(model.state_dict()["net.classifier.weight"])
        assert task.module.calls == [30, 30, 30]  # 90 training samples, batches of 30
    assert torch.equal(trained[0], trained[1]) and not torch.equal(trained[0], trained[2])


def test_frozen_layers_stay_and_integer_buffers_are_kept_local_when_averaged():
    task = user_task()
    data = task.node_data(node())
    model = task.model_maker(data)()
    frozen_before = model.state_dict()["net.frozen.weight"].clone()
    train = training_recipe(MeshConfig(local_epochs=1), task.training)
    train(model, data.x_train, data.y_train, None, seed=0)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    assert torch.equal(state["net.frozen.weight"], frozen_before), "frozen: not trained"
    assert int(state["net.batches_seen"]) == 3, "90 samples in the task's batches of 30"
    fresh = task.model_maker(data)().state_dict()
    mixed = weighted_average({"own": state, "peer": fresh}, {"own": 0.5, "peer": 0.5})
    assert mixed["net.batches_seen"].dtype == torch.long
    assert int(mixed["net.batches_seen"]) == int(state["net.batches_seen"]), "the own count"
    expected = (state["net.features.1.running_var"] + fresh["net.features.1.running_var"]) / 2
    assert torch.allclose(mixed["net.features.1.running_var"], expected), "float buffers mix"


def test_the_built_in_models_and_datasets_are_a_task_too():
    cfg = MeshConfig()
    task = task_of(cfg)
    data = task.node_data(node_info(cfg, "node0", 0, 4))
    model = task.model_maker(data)()
    body, head = task.split_keys(model)
    assert head and all(key.startswith("head.") for key in head)
    assert len(body) + len(head) == len(model.state_dict())


# --------------------------------------------------------------------------- mistakes


def write_task(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "task.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


GOOD_DATA = textwrap.dedent("""
    import torch
    from torch import nn

    def data(node):
        x = torch.rand(40, 5)
        y = torch.arange(40) % 3
        return (x[:20], y[:20]), (x[20:30], y[20:30]), (x[30:], y[30:])
""")

MISTAKES = {
    "does not import": (
        "import torch\n\ndef model():\n    return torch.nn.Linear(5, 3)\n\nraise_here(\n",
        ["does not import", "SyntaxError"],
    ),
    "fails on import": (
        GOOD_DATA + "\nimport not_a_module_anywhere\n\ndef model():\n    return nn.Linear(5, 3)\n",
        ["does not import", "not_a_module_anywhere", "line 10"],
    ),
    "no model function": (GOOD_DATA, ["defines no model() function"]),
    "model is no module": (
        GOOD_DATA + "\ndef model():\n    return 'a model'\n",
        ["model() returned str", "torch.nn.Module"],
    ),
    "labels outside the classes": (
        GOOD_DATA + "\ndef model():\n    return nn.Linear(5, 2)\n",
        ["labels run 0..2", "outside 0..1", "2 logits"],
    ),
    "inputs the model cannot take": (
        GOOD_DATA + "\ndef model():\n    return nn.Linear(7, 3)\n",
        ["cannot take this node's inputs of shape (5,)"],
    ),
    "a head that names no module": (
        GOOD_DATA + "\nhead = 'classifier'\n\ndef model():\n    return nn.Linear(5, 3)\n",
        ["head: 'classifier' names no module"],
    ),
    "a loss that gives no scalar": (
        GOOD_DATA + "\ndef model():\n    return nn.Linear(5, 3)\n\n"
        "def loss(logits, labels):\n    return logits\n",
        ["loss(logits, labels) must return a scalar tensor"],
    ),
    "an optimizer that is none": (
        GOOD_DATA + "\ndef model():\n    return nn.Linear(5, 3)\n\n"
        "def optimizer(parameters):\n    return parameters\n",
        ["optimizer(parameters) must return an optimizer"],
    ),
    "an augmentation that drops the batch": (
        GOOD_DATA + "\ndef model():\n    return nn.Linear(5, 3)\n\n"
        "def augment(x):\n    return x[:1]\n",
        ["augment(x) must return a batch of 2 inputs; it gave (1, 5)"],
    ),
    "a batch size of none": (
        GOOD_DATA + "\nbatch_size = 0\n\ndef model():\n    return nn.Linear(5, 3)\n",
        ["batch_size: got 0"],
    ),
    "one-hot labels": (
        "import torch\nfrom torch import nn\n\ndef model():\n    return nn.Linear(5, 3)\n\n"
        "def data(node):\n    x, y = torch.rand(30, 5), torch.eye(3)[torch.arange(30) % 3]\n"
        "    return (x, y), (x, y), (x, y)\n",
        ["labels have shape (30, 3)", "one-hot labels: give their argmax"],
    ),
    "a head the forward never calls": (
        GOOD_DATA + "\nhead = 'unused'\n\nclass Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.used, self.unused = nn.Linear(5, 3), nn.Linear(3, 3)\n\n"
        "    def forward(self, x):\n        return self.used(x)\n\n"
        "def model():\n    return Net()\n",
        ["the model's forward never calls 'unused'"],
    ),
    "a rule that reads a head the task does not name": (
        GOOD_DATA + "\ndef model():\n    return nn.Linear(5, 3)\n",
        ["algorithm fedc2i reads the classifier head"],
    ),
    "raw pixels as whole numbers": (
        "import torch\nfrom torch import nn\n\ndef model():\n    return nn.Linear(5, 3)\n\n"
        "def data(node):\n    x = torch.randint(0, 256, (30, 5), dtype=torch.uint8)\n"
        "    y = torch.arange(30) % 3\n    return (x, y), (x, y), (x, y)\n",
        ["cannot take this node's inputs of shape (5,)", "x.float() / 255"],
    ),
    "data raises": (
        "from torch import nn\n\ndef model():\n    return nn.Linear(5, 3)\n\n"
        "def data(node):\n    return open('/nonexistent/meshfl-part.npz')\n",
        ["data() raised FileNotFoundError", "line 7"],
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_in_a_task_is_one_line_before_any_peer_is_contacted(tmp_path, mistake):
    source, fragments = MISTAKES[mistake]
    task = write_task(tmp_path, source)
    config = tmp_path / "peers.yaml"
    algorithm = "fedc2i" if "rule" in mistake else "fedavg"
    cfg = write_config(config, 2, task=str(task), algorithm=algorithm)
    line = first_node_refuses(config, cfg, tmp_path / "out")
    assert line.startswith(f"meshfl: error: task {task}: ")
    for fragment in fragments:
        assert fragment in line, line


def test_fedc2i_needs_a_head_of_one_linear_layer(tmp_path):
    task_file = write_task(
        tmp_path,
        GOOD_DATA + "\nhead = 'classifier'\n\ndef model():\n    return nn.Sequential()\n",
    )
    source = str(task_file)
    module = load_task_module(source)
    plain = write_task(
        tmp_path / "plain", GOOD_DATA + "\ndef model():\n    return nn.Linear(5, 3)\n"
    )
    data = UserTask(str(plain), load_task_module(str(plain)), 0).node_data(node())
    module.model = lambda: torch.nn.ModuleDict(
        {"classifier": torch.nn.Sequential(torch.nn.Linear(5, 3))}
    )
    task = UserTask(source, module, 0)
    model = task.model_maker(None)()
    with pytest.raises(TaskError, match="one nn.Linear head; head 'classifier' is a Sequential"):
        task.check_rule(AlgorithmConfig("fedc2i"), model, data)
    task.check_rule(AlgorithmConfig("fedavg"), model, data)  # reads no head
    module.head = None
    headless = task.model_maker(None)()
    task.check_rule(AlgorithmConfig("pfedsv"), headless, data)  # a whole model: no head read
    with pytest.raises(TaskError, match="algorithm pfedsv reads the classifier head"):
        task.check_rule(AlgorithmConfig("pfedsv", {"shared_body": True}), headless, data)


def test_screening_needs_a_validation_split_to_judge_peers_on(tmp_path):
    """On an empty one it would judge nothing and let every peer in; a rule without
    screening (Flower's job as a task: train and test only) runs as it is."""
    task_file = write_task(
        tmp_path,
        "import torch\nfrom torch import nn\n\ndef model():\n    return nn.Linear(5, 3)\n\n"
        "def data(node):\n    x, y = torch.rand(30, 5), torch.arange(30) % 3\n"
        "    return (x, y), (x[:0], y[:0]), (x, y)\n",
    )
    task = UserTask(str(task_file), load_task_module(str(task_file)), 0)
    data = task.node_data(node())
    model = task.model_maker(data)()
    with pytest.raises(TaskError, match="the validation split is empty, and screening judges"):
        task.check_rule(AlgorithmConfig("fedavg"), model, data)
    task.check_rule(AlgorithmConfig("fedavg", {"screen": False}), model, data)
    task.check_rule(AlgorithmConfig("local"), model, data)


def test_token_ids_stay_integers_and_an_empty_dataset_split_takes_the_train_shape(tmp_path):
    task_file = write_task(
        tmp_path,
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\n\n"
        "class Bag(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.embed, self.out = nn.EmbeddingBag(50, 8), nn.Linear(8, 2)\n\n"
        "    def forward(self, x):\n        return self.out(self.embed(x))\n\n"
        "def model():\n    return Bag()\n\n"
        "def data(node):\n    x = torch.randint(0, 50, (40, 6))\n"
        "    y = (x[:, 0] > 25).long().reshape(-1, 1)\n"
        "    empty = TensorDataset(torch.empty(0, 6).long(), torch.empty(0).long())\n"
        "    return (x[:30], y[:30]), TensorDataset(x[30:], y[30:, 0]), empty\n",
    )
    task = UserTask(str(task_file), load_task_module(str(task_file)), 0)
    data = task.node_data(node())
    assert data.x_train.dtype == torch.int64 and data.y_train.shape == (30,)
    assert data.x_test.shape == (0, 6) and data.num_classes == 2


def test_a_model_drawn_from_numpy_is_the_same_on_every_node(tmp_path):
    task_file = write_task(
        tmp_path,
        GOOD_DATA + "\nimport numpy as np\n\ndef model():\n    layer = nn.Linear(5, 3)\n"
        "    layer.weight.data = torch.tensor(np.random.rand(3, 5), dtype=torch.float32)\n"
        "    return layer\n",
    )
    task = UserTask(str(task_file), load_task_module(str(task_file)), 0)
    first, second = task.model_maker(None)(), task.model_maker(None)()
    assert torch.equal(first.state_dict()["net.weight"], second.state_dict()["net.weight"])


def test_a_task_file_is_found_from_the_folder_the_command_runs_in(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    cfg = resolve_config(ConfigSource(None, ("task=../task.py",)), check=False)
    assert cfg.task == str(tmp_path / "task.py")
    module = resolve_config(ConfigSource(None, ("task=tests.tasks.digits_task",)), check=False)
    assert module.task == "tests.tasks.digits_task", "a module name stays as it is"


def test_a_task_module_on_the_python_path_loads_like_a_file():
    module = load_task_module("tests.tasks.digits_task")
    assert callable(module.model) and module.head == "classifier"


def test_a_task_that_is_no_file_or_module_is_named(tmp_path):
    with pytest.raises(TaskError, match="no such file"):
        load_task_module(str(tmp_path / "missing.py"))
    with pytest.raises(TaskError, match="does not import: ModuleNotFoundError"):
        load_task_module("meshfl_no_such_task_module")


# --------------------------------------------------------------------------- a live mesh


def test_a_mesh_of_processes_learns_a_users_task(tmp_path):
    """`meshfl launch --task FILE`: real node processes train the task's model on its
    data and exchange its state, BatchNorm statistics and integer buffer included."""
    out = tmp_path / "run"
    result = run_to_end(
        ["launch", "--task", str(TASK), "--nodes", "3", "--rounds", "3"]
        + ["--out", str(out), "--quiet"],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == str(TASK)
    finished = [n for n in summary["nodes"] if n["status"] == "finished"]
    assert len(finished) == 3, summary
    for name in ("node0", "node1", "node2"):
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").open()]
        last = [r for r in records if "test_acc" in r][-1]
        assert last["test_acc"] > 0.5, (name, last["test_acc"])  # chance: 0.1
        heard = {peer for record in records for peer in record.get("received", ())}
        assert len(heard) == 2, "it took in both peers' blobs (in some round)"


@pytest.mark.slow  # thirteen small meshes of real processes, about 80 s on two cores
@pytest.mark.parametrize("rule", ALGORITHM_NAMES)
def test_every_rule_learns_a_users_task(tmp_path, rule):
    """Each rule, the coordinator's included, on a task with batch normalization,
    dropout, a frozen layer, an integer buffer and its own loss and optimizer."""
    out = tmp_path / "run"
    result = run_to_end(
        ["launch", "--task", str(TASK), "--algorithm", rule, "--nodes", "3", "--rounds", "2"]
        + ["--out", str(out), "--quiet"],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [node["status"] for node in summary["nodes"]] == ["finished"] * 3
    if rule != "fedinfluence":  # five SGD steps a round: two rounds are near chance
        assert summary["mean_test_acc"] > 0.3, summary["mean_test_acc"]  # chance: 0.1


def test_a_task_node_killed_mid_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A node of a task fails in round 3 and `--restarts 1` brings it back: it resumes
    from its checkpoint (the task's state, buffers included) and the mesh finishes."""
    monkeypatch.setenv(PLANTED_FAILURES, "node1:3")  # the launch's processes inherit it
    out = tmp_path / "run"
    nodes = launch_to_end(
        tmp_path / "launch.log",
        out,
        *("--task", str(TASK), "--nodes", "3", "--rounds", "6", "--restarts", "1"),
        *("--set", "heartbeat_interval=0.3", "--set", "peer_timeout=1.5"),
        *("--set", "round_timeout=10", "--quiet"),
    )
    assert {name: (node["status"], node["round"]) for name, node in nodes.items()} == {
        name: ("finished", 6) for name in ("node0", "node1", "node2")
    }
    assert nodes["node1"]["restarts"] == 1
    assert "resumed from the checkpoint of round 2" in (out / "node1" / "node.log").read_text()


def test_nodes_of_a_task_on_their_own_and_a_joiner_learn_it_together(tmp_path):
    """`meshfl node` per peer of a peers.yaml naming the task, and `meshfl join` through
    one member's address: the joiner runs the same task and takes part."""
    config = tmp_path / "peers.yaml"
    # A member busy training beside another test's mesh may take seconds to answer the
    # joiner's hello, which waits a round timeout for it.
    settings = write_config(config, 3, task=str(TASK), rounds=12, round_timeout=30.0)
    for peer in settings["peers"]:  # rounds long enough for the joiner to start and join
        peer["train_delay"] = 0.5
    config.write_text(yaml.safe_dump(settings))
    out = tmp_path / "out"
    nodes = [start_node(config, f"node{index}", out) for index in range(3)]
    joiner = None
    try:
        # The joiner starts with the members, not after their first round: on a busy
        # machine, its own start (the task, its data) may outlast many of the mesh's rounds.
        listen = yaml.safe_load(config.read_text())["peers"][1]["listen"]
        joiner = meshfl(
            *("join", listen, "--config", str(config), "--name", "delta", "--out", str(out)),
            log=tmp_path / "delta.log",
        )
        for process in [*nodes, joiner]:
            assert process.wait(timeout=240) == 0, (tmp_path / "delta.log").read_text()[-2000:]
    finally:
        stop([*nodes, *([joiner] if joiner else [])])
    joined = records(out, "delta")
    assert joined and joined[-1]["round"] == 12 and joined[-1]["test_acc"] > 0.5
    assert any(record.get("received") for record in joined), "it took in members' models"
    members = {peer for record in records(out, "node0") for peer in record.get("received", ())}
    assert "delta" in members, "and the members took in its"


def test_a_joiner_with_another_task_is_told_in_one_line_how_the_meshes_differ(tmp_path):
    """A joiner whose task has a wider hidden layer dials a member: both say, in one line
    naming both tasks and models, that the other runs another mesh; the joiner stops at
    once rather than waiting out its round timeout, and neither learns from the other."""
    config = tmp_path / "peers.yaml"
    # Rounds enough that the members outlive the joiner's start on a busy machine; they
    # are stopped at the end.
    settings = write_config(config, 2, task=str(TASK), rounds=1000)
    settings["round_timeout"] = 60.0
    for peer in settings["peers"]:
        peer["train_delay"] = 0.2
    config.write_text(yaml.safe_dump(settings))
    wide = tmp_path / "wide_task.py"
    wide.write_text(
        TASK.read_text()
        .replace("nn.Linear(64, 32)", "nn.Linear(64, 48)")
        .replace("BatchNorm1d(32)", "BatchNorm1d(48)")
        .replace("Linear(32, 10)", "Linear(48, 10)")
    )
    out = tmp_path / "out"
    nodes = [start_node(config, f"node{index}", out) for index in range(2)]
    try:
        wait_round(out, "node0", 1, timeout=120)
        listen = settings["peers"][1]["listen"]
        joined = run_to_end(
            [
                *("join", listen, "--config", str(config), "--task", str(wide)),
                *("--name", "wide", "--out", str(out)),
            ],
            timeout=50,
        )
        member_log = (out / "node1" / "node.log").read_text()
    finally:
        stop(nodes)
    assert joined.returncode != 0
    said = [line for line in joined.stderr.splitlines() if "runs another mesh" in line]
    assert len(said) == 1, joined.stderr[-2000:]
    assert "task: its digits_task.py, ours wide_task.py" in said[0]
    assert "classifier.weight 10×32, ours" in said[0] and "classifier.weight 10×48" in said[0]
    assert "Traceback" not in joined.stderr
    heard = [line for line in member_log.splitlines() if "wide at tcp://" in line]
    assert len(heard) == 1 and "task: its wide_task.py, ours digits_task.py" in heard[0]


# --------------------------------------------------------------------------- own files


def npz_file(path: Path, labels, samples_per_label: int = 10) -> str:
    y = np.repeat(np.array(labels), samples_per_label)
    x = np.random.default_rng(0).random((len(y), 6)).astype(np.float32)
    np.savez(path, x=x, y=y)
    return f"npz:{path}"


def three_peers(**data) -> MeshConfig:
    peers = [
        PeerConfig(
            f"node{i}", f"tcp://127.0.0.1:{7700 + i}", data=DataOverride(**data) if i == 0 else None
        )
        for i in range(3)
    ]
    return MeshConfig(peers=peers)


def test_a_peer_that_names_its_own_file_trains_on_all_of_it(tmp_path):
    cfg = three_peers(dataset=npz_file(tmp_path / "own.npz", range(10), 12))
    with pytest.raises(DataError, match="needs data.classes"):
        task_of(cfg).node_data(node_info(cfg, "node0", 0, 3))
    cfg = replace(cfg, data=replace(cfg.data, classes=10))
    data = task_of(cfg).node_data(node_info(cfg, "node0", 0, 3))
    assert data.info["n_train"] + data.info["n_val"] + data.info["n_test"] == 120
    shared = task_of(cfg).node_data(node_info(cfg, "node1", 1, 3))
    assert shared.info["n_train"] < 1797 / 3, "the others still share the mesh's dataset"


def test_a_file_whose_labels_skip_a_class_is_refused_unless_the_classes_are_set(tmp_path):
    """Labels 1..10, or a file lacking a class, would size the model apart from the
    other nodes' (another mesh id: a node that trains alone while its table says
    finished)."""
    from_one = MeshConfig(data=DataConfig(dataset=npz_file(tmp_path / "one.npz", range(1, 11))))
    with pytest.raises(DataError, match=r"labels 1..10 leave class 0 with no sample"):
        task_of(from_one).node_data(node_info(from_one, "node0", 0, 3))
    gap = npz_file(tmp_path / "gap.npz", [0, 1, 2, 4, 5, 6, 7, 8, 9])
    lacking = MeshConfig(data=DataConfig(dataset=gap))
    with pytest.raises(DataError, match="set data.classes"):
        task_of(lacking).node_data(node_info(lacking, "node0", 0, 3))
    sized = replace(lacking, data=replace(lacking.data, classes=10))
    assert task_of(sized).node_data(node_info(sized, "node0", 0, 3)).num_classes == 10
    too_few = replace(lacking, data=replace(lacking.data, classes=5))
    with pytest.raises(DataError, match="labels run up to 9, but data.classes is 5"):
        task_of(too_few).node_data(node_info(too_few, "node0", 0, 3))


# --------------------------------------------------------------------------- meshfl new


def test_meshfl_new_writes_a_task_and_a_peers_yaml_that_run_as_they_are(tmp_path):
    """From any folder: the task file a peers.yaml names lies beside the peers.yaml."""
    folder = tmp_path / "mine"
    made = run_to_end(["new", str(folder)], timeout=60)
    assert made.returncode == 0, made.stderr
    again = run_to_end(["new", str(folder)], timeout=60)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = write_config(tmp_path / "ports.yaml", 4)  # free ports for the four peers
    peers_yaml = (folder / "peers.yaml").read_text()
    for index, peer in enumerate(config["peers"]):
        peers_yaml = peers_yaml.replace(f"tcp://127.0.0.1:{7700 + index}", peer["listen"])
    (folder / "peers.yaml").write_text(peers_yaml)
    result = run_to_end(
        ["launch", "--config", "../mine/peers.yaml"]
        + ["--rounds", "2", "--quiet", "--out", str(tmp_path / "run")],
        timeout=300,
        cwd=elsewhere,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["task"] == str(folder / "task.py")
    assert summary["mean_test_acc"] > 0.5


def test_data_classes_beside_a_task_is_refused_by_name():
    from meshfl.node.config import ConfigError, validate

    cfg = MeshConfig(task=str(TASK), data=DataConfig(classes=10))
    with pytest.raises(ConfigError, match="data.classes.*the task's model gives the number"):
        validate(cfg)
    validate(replace(cfg, data=DataConfig()))


def test_the_other_mesh_line_names_each_field_that_differs_and_only_those():
    from meshfl.node.about import other_mesh_line
    from meshfl.protocol.parts import OtherMesh

    ours = {"mesh": "lab", "task": "a.py", "classes": 10, "model": "m1", "layout": "ab"}
    met = OtherMesh("beta", "tcp://10.0.0.2:7700", {**ours, "model": "m2", "classes": 9})
    line = other_mesh_line("alpha", ours, met)
    assert line.startswith("alpha: beta at tcp://10.0.0.2:7700 runs another mesh")
    assert line.endswith("classes: its 9, ours 10; model: its m2, ours m1")
    hostile = OtherMesh("x", "tcp://10.0.0.3:1", {**ours, "task": "a\nb\x1b[2J"})
    assert other_mesh_line("alpha", ours, hostile).endswith("task: its a?b?[2J, ours a.py")
