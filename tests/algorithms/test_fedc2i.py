"""FedC²I: λ and Λ against brute force, the Eq. 10 fix, the ablation grid, a real mesh."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional

from meshfl.algorithms import Context, PeerModel, parse_params
from meshfl.algorithms.fedc2i import (
    FedC2I,
    class_losses_naive,
    class_losses_vectorized,
    influence_head,
    influence_weights,
    leave_one_out_means,
)
from tests.algorithms.config_lines import params_error
from tests.spawn import run_to_end

PEERS = ("a", "b", "c", "d")
ME = "b"
CLASSES = 3
N_TRAIN = 12
GAMMA = 5.0


class TinySplitModel(nn.Module):
    """A body with BatchNorm (float statistics and an integer step counter), a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def random_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = TinySplitModel().state_dict()
    for key, tensor in state.items():
        if tensor.is_floating_point():
            state[key] = torch.randn(tensor.shape, generator=generator)
        else:
            state[key] = torch.tensor(seed * 10 + 7)
    state["body.1.running_var"] = state["body.1.running_var"].abs() + 0.5
    return state


def make_rule(batch_size: int = 16, **params: object) -> FedC2I:
    model = TinySplitModel()
    keys = list(model.state_dict())
    context = Context(
        ME,
        seed=3,
        num_classes=CLASSES,
        body_keys=tuple(k for k in keys if k.startswith("body.")),
        head_keys=tuple(k for k in keys if k.startswith("head.")),
        batch_size=batch_size,
        new_model=TinySplitModel,
    )
    return FedC2I(parse_params("fedc2i", {"gamma": GAMMA, **params}), context)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These tensors are tiny: on a busy machine, spreading them over threads costs more in
    waiting for each other than it saves (one naive loop: 0.3 s on one thread, 20 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def mesh():
    """Own model, received models (sample counts differ), and data where B is the whole
    train split (batch size 16 > 12 samples), so brute force needs no batch sampling."""
    generator = torch.Generator().manual_seed(11)
    data = SimpleNamespace(
        x_train=torch.randn(N_TRAIN, 5, generator=generator),
        y_train=torch.arange(N_TRAIN) % CLASSES,
        num_classes=CLASSES,
    )
    models = {
        name: PeerModel(random_state(index), 50 + 10 * index) for index, name in enumerate(PEERS)
    }
    own = models[ME]
    received = {"model": {name: model for name, model in models.items() if name != ME}}
    return own, received, models, data


def mean_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    return sum(tensors) / len(tensors)


def loss_of(state: dict[str, torch.Tensor], data: SimpleNamespace) -> float:
    model = TinySplitModel()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return functional.cross_entropy(model(data.x_train), data.y_train).item()


def brute_force(models: dict[str, PeerModel], data: SimpleNamespace):
    """λ, l^{-i} and Λ by building every leave-one-out model and scoring it."""
    own = models[ME].state
    body_float = [k for k, t in own.items() if k.startswith("body.") and t.is_floating_point()]
    batch_losses, class_losses = [], []
    for left_out in PEERS:
        others = [models[name].state for name in PEERS if name != left_out]
        loo = dict(own)
        loo.update({key: mean_of([state[key] for state in others]) for key in body_float})
        batch_losses.append(loss_of(loo, data))
        row = []
        for c in range(CLASSES):
            modified = {key: tensor.clone() for key, tensor in own.items()}
            for key in ("head.weight", "head.bias"):
                modified[key][c] = mean_of([state[key][c] for state in others])
            row.append(loss_of(modified, data))
        class_losses.append(row)
    losses = torch.tensor(batch_losses, dtype=torch.float64)
    vector = losses**GAMMA / (losses**GAMMA).sum()
    class_table = torch.tensor(class_losses, dtype=torch.float64)
    matrix = class_table**GAMMA / (class_table**GAMMA).sum(dim=0, keepdim=True)
    return vector, losses, matrix


def test_influence_vector_and_matrix_equal_a_brute_force_loop(mesh):
    own, received, models, data = mesh
    outcome = make_rule().aggregate(1, own, received, data)
    vector, losses, matrix = brute_force(models, data)
    found = outcome.diagnostics
    assert list(found["influence_vector"]) == list(PEERS)
    assert torch.tensor(list(found["batch_losses"].values())) == pytest.approx(losses, abs=1e-5)
    assert torch.tensor(list(found["influence_vector"].values())) == pytest.approx(vector, abs=1e-5)
    assert torch.tensor(list(found["influence_matrix"].values())) == pytest.approx(matrix, abs=1e-5)
    assert outcome.weights == found["influence_vector"]
    assert sum(outcome.weights.values()) == pytest.approx(1.0)
    assert found["influence_seconds"] > 0
    # Eq. 6 and Eq. 10 with these weights.
    for key in ("body.0.weight", "body.1.running_mean"):
        expected = sum(vector[i].item() * models[n].state[key] for i, n in enumerate(PEERS))
        assert torch.allclose(outcome.state[key], expected, atol=1e-5)
    for key in ("head.weight", "head.bias"):
        rows = torch.stack([models[n].state[key] for n in PEERS])
        weights = matrix.float().reshape(*matrix.shape, *[1] * (rows.dim() - 2))
        assert torch.allclose(outcome.state[key], (weights * rows).sum(dim=0), atol=1e-5)


def test_gamma_zero_weighs_every_peer_alike(mesh):
    own, received, _, data = mesh
    found = make_rule(gamma=0).aggregate(1, own, received, data).diagnostics
    assert list(found["influence_vector"].values()) == pytest.approx([1 / len(PEERS)] * 4)
    for row in found["influence_matrix"].values():
        assert row == pytest.approx([1 / len(PEERS)] * CLASSES)
    assert influence_weights(torch.tensor([0.1, 3.0, 0.0]), 0).tolist() == [1 / 3] * 3


def test_influence_weights_survive_large_gamma_and_zero_losses():
    weights = influence_weights(torch.tensor([50.0, 100.0, 0.0]), 200.0)
    assert torch.isfinite(weights).all() and weights.sum().item() == pytest.approx(1.0)
    assert weights[1].item() == pytest.approx(1.0)
    assert influence_weights(torch.zeros(4), 5.0).tolist() == pytest.approx([0.25] * 4)


def test_each_class_column_of_the_matrix_sums_to_one_over_peers(mesh):
    own, received, _, data = mesh
    matrix = make_rule().aggregate(2, own, received, data).diagnostics["influence_matrix"]
    column_sums = torch.tensor(list(matrix.values()), dtype=torch.float64).sum(dim=0)
    assert column_sums.tolist() == pytest.approx([1.0] * CLASSES, abs=1e-12)


class ProbeModel(nn.Module):
    """Any body of width `width` and a linear head, for the class-level comparison."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.Tanh())
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "peers, classes, width, samples", [(2, 2, 3, 5), (5, 10, 192, 32), (7, 62, 16, 9)]
)
def test_vectorized_class_losses_equal_the_naive_loop(peers, classes, width, samples, dtype):
    generator = torch.Generator().manual_seed(peers * classes)
    model = ProbeModel(width, classes).to(dtype)
    x = torch.randn(samples, 4, generator=generator, dtype=dtype) * 3
    heads_weight = torch.randn(peers, classes, width, generator=generator, dtype=dtype)
    heads_bias = torch.randn(peers, classes, generator=generator, dtype=dtype)
    labels = torch.randint(classes, (samples,), generator=generator)
    with torch.no_grad():
        model.head.weight.copy_(heads_weight[0])
        model.head.bias.copy_(heads_bias[0])
        own_head = [tensor.clone() for tensor in model.head.parameters()]
        fast = class_losses_vectorized(
            model.body(x), heads_weight, heads_bias, heads_weight[0], heads_bias[0], labels
        )
    slow = class_losses_naive(model, heads_weight, heads_bias, x, labels)
    assert fast.shape == slow.shape == (peers, classes)
    # The same math up to summation order: 1e-6 absolute in float64, and in float32 1e-6
    # relative (these losses reach ~10, where one float32 step is already 1e-6).
    tolerance = {"atol": 1e-6, "rtol": 0} if dtype == torch.float64 else {"atol": 0, "rtol": 1e-6}
    assert torch.allclose(fast, slow, **tolerance), (fast - slow).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(model.head.parameters(), own_head, strict=True))


def test_leave_one_out_means_equal_the_mean_of_the_others():
    stacked = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(0))
    loo = leave_one_out_means(stacked)
    for i in range(4):
        others = torch.cat([stacked[:i], stacked[i + 1 :]])
        assert torch.allclose(loo[i], others.mean(dim=0), atol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        leave_one_out_means(stacked[:1])


def test_the_eq10_fix_lets_an_influential_peer_move_the_own_class_vector():
    # Λ all on peer 2 for class 0, uniform elsewhere: row 0 becomes peer 2's row. With the
    # paper's printed Eq. 10 (Σ_i Λ φ_{m,c}) every row would stay the own one.
    heads_weight, heads_bias = torch.randn(3, 2, 4), torch.randn(3, 2)
    matrix = torch.tensor([[0.0, 1 / 3], [0.0, 1 / 3], [1.0, 1 / 3]], dtype=torch.float64)
    weight, bias = influence_head(heads_weight, heads_bias, matrix)
    assert torch.equal(weight[0], heads_weight[2, 0]) and bias[0] == heads_bias[2, 0]
    assert torch.allclose(weight[1], heads_weight[:, 1].mean(dim=0))


def test_aggregated_head_leaves_the_own_rows(mesh):
    own, received, _, data = mesh
    state = make_rule().aggregate(1, own, received, data).state
    for row in range(CLASSES):
        assert not torch.allclose(state["head.weight"][row], own.state["head.weight"][row])


def sample_weighted(models: dict[str, PeerModel], key: str) -> torch.Tensor:
    total = sum(model.n_samples for model in models.values())
    return sum(model.n_samples / total * model.state[key] for model in models.values())


def test_body_local_keeps_the_own_body_bit_for_bit_and_still_mixes_the_head(mesh):
    own, received, models, data = mesh
    outcome = make_rule(body="local").aggregate(1, own, received, data)
    for key in own.state:
        if key.startswith("body."):
            assert torch.equal(outcome.state[key], own.state[key]), key
    assert not torch.equal(outcome.state["head.weight"], own.state["head.weight"])
    assert outcome.weights == {name: float(name == ME) for name in PEERS}
    assert "influence_matrix" in outcome.diagnostics
    assert "influence_vector" not in outcome.diagnostics  # not measured when not used


def test_head_local_keeps_the_own_head_and_fedavg_parts_are_sample_weighted(mesh):
    own, received, models, data = mesh
    outcome = make_rule(body="fedavg", head="local").aggregate(1, own, received, data)
    assert torch.equal(outcome.state["head.weight"], own.state["head.weight"])
    assert torch.allclose(
        outcome.state["body.0.weight"], sample_weighted(models, "body.0.weight"), atol=1e-6
    )
    total = sum(model.n_samples for model in models.values())
    assert outcome.weights == pytest.approx({n: m.n_samples / total for n, m in models.items()})
    head_fedavg = make_rule(head="fedavg").aggregate(1, own, received, data)
    assert torch.allclose(
        head_fedavg.state["head.bias"], sample_weighted(models, "head.bias"), atol=1e-6
    )
    assert "influence_matrix" not in head_fedavg.diagnostics


def test_integer_buffers_stay_own_and_received_tensors_are_not_touched(mesh):
    own, received, models, data = mesh
    before = {
        name: {k: t.clone() for k, t in model.state.items()} for name, model in models.items()
    }
    for params in ({}, {"body": "fedavg", "head": "fedavg"}):
        state = make_rule(**params).aggregate(1, own, received, data).state
        assert torch.equal(
            state["body.1.num_batches_tracked"], own.state["body.1.num_batches_tracked"]
        )
        state["body.0.weight"].add_(1.0)  # the result must not alias the own model either
    for name, model in models.items():
        for key, tensor in model.state.items():
            assert torch.equal(tensor, before[name][key]), (name, key)


def test_alone_the_node_keeps_its_model(mesh):
    own, _, _, data = mesh
    outcome = make_rule().aggregate(1, own, {}, data)
    assert outcome.state is own.state
    assert outcome.weights == {ME: 1.0}
    assert outcome.diagnostics["influence_vector"] == {ME: 1.0}


def test_the_influence_batch_is_one_seeded_batch_per_round(mesh):
    own, received, _, data = mesh
    rule = make_rule(batch_size=4)  # 4 of the 12 samples
    first = rule.aggregate(1, own, received, data).diagnostics["batch_losses"]
    again = make_rule(batch_size=4).aggregate(1, own, received, data).diagnostics["batch_losses"]
    other_round = rule.aggregate(2, own, received, data).diagnostics["batch_losses"]
    assert first == again
    assert first != other_round


@pytest.mark.parametrize(
    "raw, problem",
    [
        ({"gamma": -1}, "'algorithm.gamma': got -1; allowed: a finite number >= 0"),
        ({"body": "mean"}, "'algorithm.body': got 'mean'; allowed: influence, fedavg, local"),
        ({"head": "all"}, "'algorithm.head': got 'all'; allowed: influence, fedavg, local"),
    ],
)
def test_bad_parameters_name_the_field_and_what_is_allowed(raw, problem):
    assert params_error("fedc2i", raw) == "config field " + problem


def test_a_head_of_several_layers_is_refused_with_a_reason():
    context = Context(
        ME,
        0,
        CLASSES,
        ("body.0.weight",),
        ("head.0.weight", "head.0.bias", "head.2.weight", "head.2.bias"),
        new_model=TinySplitModel,
    )
    with pytest.raises(ValueError, match="model.head=last"):
        FedC2I(FedC2I.Params(), context)


def test_a_real_mesh_records_influence_diagnostics_every_round(tmp_path):
    out = tmp_path / "run"
    done = run_to_end(
        [
            *("launch", "--algorithm", "fedc2i", "--nodes", "3", "--rounds", "3"),
            *("--out", str(out), "--quiet"),
            *("--set", "algorithm.screen=false"),  # the paper's rule: every peer weighed
        ],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for node in ("node0", "node1", "node2"):
        lines = (out / node / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [record["round"] for record in records] == [1, 2, 3]
        for record in records:
            arrived = sorted([node, *record["received"]])
            found = record["diagnostics"]
            assert sorted(found["influence_vector"]) == arrived
            assert sum(found["influence_vector"].values()) == pytest.approx(1.0)
            assert record["weights"] == found["influence_vector"]
            assert sorted(found["batch_losses"]) == arrived
            matrix = torch.tensor([found["influence_matrix"][name] for name in arrived])
            assert matrix.shape == (len(arrived), 10)
            assert matrix.sum(dim=0).tolist() == pytest.approx([1.0] * 10)
            assert found["influence_seconds"] >= 0
        assert len(records[-1]["received"]) == 2, "a full mesh of three on loopback"
