"""The shared averaging and distance of the aggregation rules."""

import math

import torch

from meshfl.algorithms.base import model_distance, weighted_average
from meshfl.node.models import build_model


def test_weighted_average_is_the_weighted_mean_and_keeps_integer_buffers():
    states = []
    for seed, steps in [(1, 3), (2, 5), (3, 7)]:
        model = build_model("alexnet", (1, 8, 8), num_classes=4, seed=seed)
        for _ in range(steps):
            model(torch.randn(2, 1, 8, 8))
        states.append({key: value.clone() for key, value in model.state_dict().items()})
    weights = [1.0, 2.0, 5.0]
    averaged = weighted_average(
        dict(zip("abc", states, strict=True)),
        dict(zip("abc", [w / 8.0 for w in weights], strict=True)),
    )
    for key, value in averaged.items():
        if value.is_floating_point():
            manual = sum(w * state[key] for w, state in zip(weights, states, strict=True)) / 8.0
            torch.testing.assert_close(value, manual)
        else:
            assert torch.equal(value, states[0][key])
    assert int(averaged["body.bn1.num_batches_tracked"]) == 3
    # The result is new memory: changing it must not touch the inputs.
    averaged["head.bias"].add_(1.0)
    averaged["body.bn1.num_batches_tracked"].add_(1)
    assert int(states[0]["body.bn1.num_batches_tracked"]) == 3
    assert not torch.equal(averaged["head.bias"], states[0]["head.bias"])


def test_model_distance_is_the_euclidean_distance_over_floats_and_leaves_both_models_alone():
    for dtype in (torch.float32, torch.float64):
        first = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=dtype), "n": torch.tensor(7)}
        second = {"w": torch.tensor([[1.0, 0.0], [3.0, 1.0]], dtype=dtype), "n": torch.tensor(1)}
        before = {key: value.clone() for key, value in first.items()}
        assert model_distance(first, second) == math.sqrt(2.0**2 + 3.0**2)
        assert all(torch.equal(first[key], before[key]) for key in first)
