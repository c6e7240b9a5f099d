"""Local training learns, is reproducible, and states survive the trip through numpy."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from meshfl.node import trainer
from meshfl.node.models import build_model
from meshfl.node.trainer import (
    evaluate,
    make_optimizer,
    set_torch_threads,
    state_to_arrays,
    train_local,
)


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(labels)
    return x[:600], y[:600], x[600:900], y[600:900]


def _same_weights(first: nn.Module, second: nn.Module) -> bool:
    return all(
        torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize(
    ("name", "optimizer", "lr", "momentum"),
    [("mlp", "sgd", 0.05, 0.9), ("cnn", "adam", 3e-3, 0.0)],
)
def test_training_lowers_loss_and_beats_chance(digits, name, optimizer, lr, momentum):
    x_train, y_train, x_test, y_test = digits
    model = build_model(name, (1, 8, 8), num_classes=10, seed=0)
    before = evaluate(model, x_test, y_test, num_classes=10)
    first_epoch_loss = train_local(
        model, x_train, y_train, 1, 32, optimizer, lr, seed=0, momentum=momentum
    )
    later_loss = train_local(
        model, x_train, y_train, 6, 32, optimizer, lr, seed=1, momentum=momentum
    )
    after = evaluate(model, x_test, y_test, num_classes=10)
    assert later_loss < 0.5 * first_epoch_loss
    assert after.loss < 0.5 * before.loss
    assert after.accuracy > 0.75  # chance is 0.1
    assert after.n == len(y_test)


def test_same_seed_gives_identical_weights_and_another_seed_does_not(digits):
    x_train, y_train, _, _ = digits

    def trained(seed: int) -> nn.Module:
        model = build_model("alexnet", (1, 8, 8), num_classes=10, seed=0)
        train_local(model, x_train[:128], y_train[:128], 1, 32, "sgd", 0.05, seed, momentum=0.9)
        return model

    assert _same_weights(trained(seed=5), trained(seed=5))
    assert not _same_weights(trained(seed=5), trained(seed=6))


def test_training_keeps_no_gradients_past_its_round(digits):
    # Kept, they would be one more copy of the model in every node until its next round.
    x_train, y_train, _, _ = digits
    model = build_model("mlp", (1, 8, 8), num_classes=10, seed=0)
    train_local(model, x_train[:64], y_train[:64], 1, 32, "sgd", 0.05, 0)
    assert all(param.grad is None for param in model.parameters())


def test_max_steps_caps_steps_across_epochs_and_hook_sees_each_step(digits):
    x_train, y_train, _, _ = digits
    model = build_model("logreg", (1, 8, 8), num_classes=10)
    weights_before_each_step = []
    train_local(
        model,
        x_train,
        y_train,
        epochs=3,
        batch_size=100,
        optimizer="sgd",
        lr=0.1,
        seed=0,
        max_steps=8,
        before_step=lambda step: weights_before_each_step.append(model.head.weight.clone()),
    )
    assert len(weights_before_each_step) == 8  # 6 batches per epoch, stopped inside epoch 2
    assert not torch.equal(weights_before_each_step[0], weights_before_each_step[1])
    assert not torch.equal(weights_before_each_step[-1], model.head.weight)


def test_evaluate_restores_training_mode_and_leaves_batchnorm_alone(digits):
    _, _, x_test, y_test = digits
    model = build_model("alexnet", (1, 8, 8), num_classes=10)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    evaluate(model, x_test, y_test, num_classes=10, batch_size=64)
    assert model.training
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())
    model.eval()
    evaluate(model, x_test, y_test, num_classes=10)
    assert not model.training


def test_per_class_accuracy_on_a_crafted_case():
    # Logits are the input itself, so each row's prediction is chosen by hand.
    model = nn.Sequential(nn.Identity())
    model.register_parameter("unused", nn.Parameter(torch.zeros(1)))
    predictions = torch.tensor([0, 0, 1, 1, 1, 3])
    labels = torch.tensor([0, 1, 1, 1, 0, 3])
    logits = nn.functional.one_hot(predictions, num_classes=4).float() * 10
    result = evaluate(model, logits, labels, num_classes=4, batch_size=4)
    assert result.n == 6
    assert result.accuracy == pytest.approx(4 / 6)
    assert result.per_class_accuracy == [0.5, pytest.approx(2 / 3), None, 1.0]
    expected_loss = nn.functional.cross_entropy(logits, labels).item()
    assert result.loss == pytest.approx(expected_loss, rel=1e-6)


def test_evaluate_on_nothing_reports_nan_instead_of_crashing():
    model = build_model("logreg", (4,), num_classes=3)
    result = evaluate(model, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), num_classes=3)
    assert result.n == 0 and math.isnan(result.accuracy)
    assert result.per_class_accuracy == [None, None, None]


def test_arrays_round_trip_and_integer_buffers_keep_their_dtype():
    source = build_model("alexnet", (1, 8, 8), num_classes=10, seed=1)
    source.train()
    source(torch.randn(4, 1, 8, 8))  # move BatchNorm statistics off their defaults
    arrays = state_to_arrays(source)
    assert arrays["body.bn1.weight"].dtype == np.float32
    assert arrays["body.bn1.num_batches_tracked"].dtype == np.int64
    assert int(arrays["body.bn1.num_batches_tracked"]) == 1

    target = build_model("alexnet", (1, 8, 8), num_classes=10, seed=2)
    target.load_state_dict({key: torch.from_numpy(value) for key, value in arrays.items()})
    assert _same_weights(source, target)


def test_state_to_arrays_shares_memory_with_the_model():
    model = build_model("logreg", (4,), num_classes=3)
    arrays = state_to_arrays(model)
    with torch.no_grad():
        model.head.bias.fill_(7.0)
    assert np.all(arrays["head.bias"] == 7.0)


def test_make_optimizer_names_the_choices_on_a_typo():
    parameters = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="sgd, adam"):
        make_optimizer("adagrad", parameters, 0.1)


@pytest.mark.parametrize(
    ("optimizer", "momentum", "weight_decay"),
    [("sgd", 0.9, 1e-3), ("sgd", 0.0, 0.0), ("adam", 0.0, 1e-3)],
)
def test_our_optimizer_steps_exactly_as_torch_optim_does(
    digits, monkeypatch, optimizer, momentum, weight_decay
):
    x, y, _, _ = digits
    ours = build_model("mlp", (1, 8, 8), 10, seed=0)
    theirs = build_model("mlp", (1, 8, 8), 10, seed=0)
    settings = {"seed": 3, "momentum": momentum, "weight_decay": weight_decay}
    train_local(ours, x[:200], y[:200], 3, 32, optimizer, 0.05, **settings)
    torch_class = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
    extra = {"momentum": momentum} if optimizer == "sgd" else {}
    reference = torch_class(theirs.parameters(), lr=0.05, weight_decay=weight_decay, **extra)
    monkeypatch.setattr(trainer, "make_optimizer", lambda *args, **kwargs: reference)
    train_local(theirs, x[:200], y[:200], 3, 32, optimizer, 0.05, **settings)
    assert _same_weights(ours, theirs)


def test_training_leaves_torchs_compiler_unloaded():
    # torch.optim's classes import it: 1.2 s and 150 MB in every node host.
    script = (
        "import sys, torch\n"
        "from meshfl.node.trainer import train_local\n"
        "model = torch.nn.Linear(4, 3)\n"
        "x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))\n"
        "for name in ('sgd', 'adam'):\n"
        "    train_local(model, x, y, 2, 4, name, 0.1, seed=0, momentum=0.5)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


@pytest.mark.parametrize(("users", "expected"), [(None, "1"), ("0", "0")])
def test_mkl_caches_no_buffers_per_node_thread_unless_the_user_says(users, expected):
    """MKL reads its setting when torch loads it: the CLI must set it before that."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    if users is not None:
        env["MKL_DISABLE_FAST_MM"] = users
    script = (
        "import os, sys\n"
        "import meshfl.launch.cli\n"
        "print('torch' in sys.modules, os.environ['MKL_DISABLE_FAST_MM'])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert run.stdout.split() == ["False", expected]


def test_set_torch_threads_divides_the_cores():
    previous = torch.get_num_threads()
    try:
        threads = set_torch_threads(local_nodes=10_000)
        assert threads == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError):
            set_torch_threads(0)
    finally:
        torch.set_num_threads(previous)


def test_a_last_batch_of_one_sample_joins_the_batch_before_it():
    """Batch normalization cannot train on one sample: 65 samples in batches of 32
    are 32 and 33, not 32, 32 and 1."""
    from meshfl.node.trainer import _shuffled_batches

    sizes = [len(batch) for batch in _shuffled_batches(65, 1, 32, seed=0)]
    assert sizes == [32, 33]
    assert [len(b) for b in _shuffled_batches(66, 1, 32, seed=0)] == [32, 32, 2]
    assert [len(b) for b in _shuffled_batches(1, 2, 32, seed=0)] == [1, 1]


def test_training_with_dropout_repeats_whatever_ran_before_it():
    """Dropout draws from torch's global generator; a round's training seeds it, so two
    nodes of one host (or one node run twice) train alike from the same start."""
    from meshfl.node.trainer import train_local

    x, y = torch.randn(40, 5), torch.arange(40) % 3

    def trained(draws_before: int) -> torch.Tensor:
        torch.manual_seed(123)
        model = torch.nn.Sequential(
            torch.nn.Linear(5, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)
        )
        torch.rand(draws_before)  # whatever else the process drew
        train_local(model, x, y, 2, 8, "sgd", 0.1, seed=7)
        return model[0].weight.detach().clone()

    assert torch.equal(trained(0), trained(17))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_learns_as_float32_does_and_keeps_float32_weights(digits, precision):
    x_train, y_train, x_test, y_test = digits
    accuracy, weights = {}, {}
    for chosen in ("fp32", precision):
        model = build_model("mlp", tuple(x_train.shape[1:]), 10, seed=0)
        train_local(model, x_train, y_train, 10, 32, "sgd", 0.1, 0, momentum=0.5, precision=chosen)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        accuracy[chosen] = evaluate(model, x_test, y_test, 10).accuracy
        weights[chosen] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.equal(weights[precision], weights["fp32"]), "trained in half precision"
    assert accuracy[precision] > 0.8
    assert abs(accuracy[precision] - accuracy["fp32"]) < 0.05, accuracy


def test_fp16_scales_the_loss_for_a_tasks_own_torch_optimizer_too(digits):
    x_train, y_train, x_test, y_test = digits
    model = build_model("mlp", tuple(x_train.shape[1:]), 10, seed=0)
    scaler = torch.amp.GradScaler("cpu")
    train_local(
        model,
        x_train,
        y_train,
        10,
        32,
        "sgd",
        0.1,
        0,
        precision="fp16",
        scaler=scaler,
        new_optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.5),
    )
    assert scaler.get_scale() > 1, "the scale a recipe carries to its next round"
    assert evaluate(model, x_test, y_test, 10).accuracy > 0.8
