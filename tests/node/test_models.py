"""Every model builds, splits cleanly into body and head, and initialises from its seed."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from meshfl.node.models import (
    HEADS,
    MODELS,
    ModelError,
    SplitModel,
    body_keys,
    build_model,
    head_keys,
    model_schema,
)

IMAGE_SHAPES = [(1, 8, 8), (1, 16, 16), (1, 28, 28), (3, 32, 32)]
FLAT_SHAPES = [(60,), (800,)]
FLAT_MODELS = ("mlp", "logreg")
IMAGE_MODELS = tuple(name for name in MODELS if name not in FLAT_MODELS)

SUPPORTED = [(name, shape) for name in MODELS for shape in IMAGE_SHAPES] + [
    (name, shape) for name in FLAT_MODELS for shape in FLAT_SHAPES
]


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def _same_weights(first: nn.Module, second: nn.Module) -> bool:
    return all(
        torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize(("name", "shape"), SUPPORTED)
def test_forward_gives_one_logit_per_class(name, shape, head):
    model = build_model(name, shape, num_classes=7, head=head)
    assert isinstance(model, SplitModel)
    logits = model(torch.randn(3, *shape))
    assert logits.shape == (3, 7)
    features = model.body(torch.randn(3, *shape))
    assert features.shape == (3, model.feature_dim)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("name", MODELS)
def test_body_and_head_keys_partition_the_state(name, head):
    model = build_model(name, (3, 32, 32), num_classes=10, head=head)
    body, head_part = body_keys(model), head_keys(model)
    assert set(body).isdisjoint(head_part)
    assert sorted(body + head_part) == sorted(model.state_dict())
    assert head_part, "every model has a classifier"
    # Parameters are covered too, not just the state dict view of them.
    parameter_names = {name for name, _ in model.named_parameters()}
    assert parameter_names <= set(body) | set(head_part)


@pytest.mark.parametrize("name", MODELS)
def test_last_head_is_a_single_linear_over_the_features(name):
    model = build_model(name, (1, 28, 28), num_classes=10, head="last")
    assert isinstance(model.head, nn.Linear)
    assert model.head.weight.shape == (10, model.feature_dim)
    assert head_keys(model) == ["head.weight", "head.bias"]


def test_fc_head_holds_every_fully_connected_layer_after_the_convolutions():
    model = build_model("fedrema_cnn", (1, 28, 28), num_classes=10, head="fc")
    linear_layers = [module for module in model.head if isinstance(module, nn.Linear)]
    assert [layer.out_features for layer in linear_layers] == [512, 10]
    assert not any(isinstance(module, nn.Linear) for module in model.body.modules())
    assert model.feature_dim == 64 * 4 * 4  # the official code's dim=1024 on 28x28 inputs


def test_mlp_fc_head_is_its_last_two_linear_layers():
    model = build_model("mlp", (60,), num_classes=5, head="fc")
    linear_layers = [module for module in model.head if isinstance(module, nn.Linear)]
    assert [(layer.in_features, layer.out_features) for layer in linear_layers] == [
        (128, 64),
        (64, 5),
    ]


def test_logreg_is_one_linear_layer_for_both_heads():
    for head in HEADS:
        model = build_model("logreg", (60,), num_classes=5, head=head)
        assert isinstance(model.head, nn.Linear)
        assert body_keys(model) == []
        assert model.feature_dim == 60


def test_lenet_follows_fedc2i_table_7():
    model = build_model("lenet", (3, 32, 32), num_classes=10, head="fc")
    convs = [module for module in model.body.modules() if isinstance(module, nn.Conv2d)]
    assert [(conv.out_channels, conv.kernel_size) for conv in convs] == [(64, (5, 5))] * 2
    widths = [module.out_features for module in model.head if isinstance(module, nn.Linear)]
    assert widths == [384, 192, 10]


def test_alexnet_has_batchnorm_buffers_in_the_body():
    model = build_model("alexnet", (3, 32, 32), num_classes=10)
    tracked = [key for key in model.state_dict() if key.endswith("num_batches_tracked")]
    assert tracked and set(tracked) <= set(body_keys(model))


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_same_weights_different_seed_different_weights(name):
    shape = (1, 16, 16)
    first = build_model(name, shape, num_classes=10, seed=3)
    again = build_model(name, shape, num_classes=10, seed=3)
    other = build_model(name, shape, num_classes=10, seed=4)
    assert _same_weights(first, again)
    assert not _same_weights(first, other)


def test_building_a_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("cnn", (1, 8, 8), num_classes=10, seed=9)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_image_model_on_flat_input_is_a_model_error(name):
    with pytest.raises(ModelError, match="needs image input"):
        build_model(name, (60,), num_classes=10)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"name": "resnet152"}, "unknown model 'resnet152'"),
        ({"head": "middle"}, "unknown head 'middle'"),
        ({"num_classes": 1}, "num_classes"),
        ({"input_shape": (1, 0, 8)}, "input shape"),
        ({"name": "cnn", "input_shape": (1, 1, 1)}, "too small"),
    ],
)
def test_bad_requests_are_one_line_model_errors(arguments, message):
    request = {"name": "mlp", "input_shape": (1, 8, 8), "num_classes": 10, **arguments}
    with pytest.raises(ModelError, match=message) as caught:
        build_model(**request)
    assert "\n" not in str(caught.value)


def test_schema_is_sorted_and_differs_between_head_conventions():
    last = model_schema(build_model("cnn", (1, 8, 8), num_classes=10, head="last"))
    fc = model_schema(build_model("cnn", (1, 8, 8), num_classes=10, head="fc"))
    assert last == sorted(last)
    assert ("head.weight", "float32", (10, 128)) in last
    assert last != fc
    alexnet = dict(
        (key, dtype) for key, dtype, _ in model_schema(build_model("alexnet", (3, 32, 32), 10))
    )
    assert alexnet["body.bn1.num_batches_tracked"] == "int64"


def test_models_built_at_once_on_several_threads_are_each_the_seeded_one():
    # The nodes of a host build their models on threads of their own, at the same time.
    # lenet on 32x32 takes long enough to build that unguarded builds would interleave.
    expected = build_model("lenet", (3, 32, 32), 10, seed=3).state_dict()
    differing: list[str] = []

    def build_some() -> None:
        for _ in range(5):
            state = build_model("lenet", (3, 32, 32), 10, seed=3).state_dict()
            differing.extend(k for k in expected if not torch.equal(state[k], expected[k]))

    threads = [threading.Thread(target=build_some) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert differing == []
