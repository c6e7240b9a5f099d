"""Models with a named body/head split.

Every model is a ``SplitModel``: ``body`` (the feature extractor θ) followed by
``head`` (the classifier φ). Two split conventions exist because the papers
disagree on what "the classifier" is:

* ``head="last"``: the head is exactly one ``nn.Linear`` (FedC²I reads its rows
  ``weight[c]``, ``bias[c]`` as class vectors).
* ``head="fc"``: the head is every fully connected layer after the
  convolutions, as FedReMa's official code splits it. For ``mlp`` the first
  linear layer plays the role of the convolutions, so its "fc" head is the last
  two linear layers. For ``logreg`` both conventions give the same single layer.

Convolutional models follow their paper where it gives the layers; where the
paper's layers would shrink a small input (8x8 digits) to nothing, the 5x5
convolutions switch from "valid" to "same" padding, and the flattened size is
always measured from the actual input shape rather than hard-coded.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from torch import nn

from meshfl.protocol.errors import UserError


class ModelError(UserError, ValueError):
    """A model the user asked for cannot be built (unknown name, bad shape)."""


HEADS: tuple[str, ...] = ("last", "fc")

NamedLayers = list[tuple[str, nn.Module]]
# A trunk is everything before the fully connected stack, ending in a flat vector.
TrunkBuilder = Callable[[tuple[int, ...]], NamedLayers]

# Inputs at least this wide keep the papers' unpadded 5x5 convolutions
# (16 -> conv 12 -> pool 6 -> conv 2 -> pool 1); smaller ones get "same" padding.
_MIN_SIDE_FOR_VALID_5X5 = 16


class SplitModel(nn.Module):
    """``head(body(x))`` with the split points and build arguments kept alongside."""

    def __init__(
        self,
        body: nn.Module,
        head: nn.Module,
        feature_dim: int,
        *,
        name: str,
        input_shape: tuple[int, ...],
        num_classes: int,
        head_kind: str,
    ) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.feature_dim = feature_dim
        self.name = name
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.head_kind = head_kind
        self.head_prefix = "head."  # the head's state keys start with it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _conv_block(
    index: int,
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    padding: int,
    *,
    batch_norm: bool = False,
    pool: nn.Module | None = None,
) -> NamedLayers:
    # A convolution followed by BatchNorm needs no bias: BatchNorm's shift replaces it.
    layers: NamedLayers = [
        (
            f"conv{index}",
            nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, bias=not batch_norm),
        )
    ]
    if batch_norm:
        layers.append((f"bn{index}", nn.BatchNorm2d(out_channels)))
    layers.append((f"relu{index}", nn.ReLU()))
    if pool is not None:
        layers.append((f"pool{index}", pool))
    return layers


def _padding_for_5x5(image_shape: tuple[int, ...]) -> int:
    return 0 if min(image_shape[1:]) >= _MIN_SIDE_FOR_VALID_5X5 else 2


def _two_conv_5x5_trunk(channels: tuple[int, int], padding: int | None) -> TrunkBuilder:
    """conv5x5 → ReLU → maxpool2, twice: the shape shared by LeNet, FedReMa's and LEAF's CNNs."""

    def build(image_shape: tuple[int, ...]) -> NamedLayers:
        pad = _padding_for_5x5(image_shape) if padding is None else padding
        first, second = channels
        return [
            *_conv_block(1, image_shape[0], first, 5, pad, pool=nn.MaxPool2d(2)),
            *_conv_block(2, first, second, 5, pad, pool=nn.MaxPool2d(2)),
            ("flatten", nn.Flatten()),
        ]

    return build


def _small_cnn_trunk(image_shape: tuple[int, ...]) -> NamedLayers:
    # Adaptive pooling fixes the flat size at 64*4*4 whether the input is 8x8 or 32x32.
    return [
        *_conv_block(1, image_shape[0], 32, 3, 1, pool=nn.MaxPool2d(2)),
        *_conv_block(2, 32, 64, 3, 1, pool=nn.AdaptiveMaxPool2d(4)),
        ("flatten", nn.Flatten()),
    ]


def _alexnet_trunk(image_shape: tuple[int, ...]) -> NamedLayers:
    # FedReMa's simplified AlexNet for CIFAR-10 (3x3 kernels, no dropout, no LRN),
    # with BatchNorm after each convolution; the adaptive pool keeps 3x3 maps on any input.
    return [
        *_conv_block(1, image_shape[0], 32, 3, 1, batch_norm=True, pool=nn.MaxPool2d(2)),
        *_conv_block(2, 32, 64, 3, 1, batch_norm=True, pool=nn.MaxPool2d(2)),
        *_conv_block(3, 64, 128, 3, 1, batch_norm=True),
        *_conv_block(4, 128, 256, 3, 1, batch_norm=True),
        *_conv_block(5, 256, 256, 3, 1, batch_norm=True, pool=nn.AdaptiveMaxPool2d(3)),
        ("flatten", nn.Flatten()),
    ]


def _mlp_trunk(input_shape: tuple[int, ...]) -> NamedLayers:
    # The first linear layer is the MLP's "feature extractor", so head="fc" is the last two.
    return [
        ("flatten", nn.Flatten()),
        ("fc0", nn.Linear(math.prod(input_shape), 128)),
        ("relu0", nn.ReLU()),
    ]


def _flatten_trunk(input_shape: tuple[int, ...]) -> NamedLayers:
    return [("flatten", nn.Flatten())]


# name → (trunk builder, widths of the hidden fully connected layers, needs an image input)
_ARCHITECTURES: dict[str, tuple[TrunkBuilder, tuple[int, ...], bool]] = {
    "mlp": (_mlp_trunk, (64,), False),
    "cnn": (_small_cnn_trunk, (128,), True),
    "lenet": (_two_conv_5x5_trunk((64, 64), padding=None), (384, 192), True),  # FedC²I Table 7
    "fedrema_cnn": (_two_conv_5x5_trunk((32, 64), padding=None), (512,), True),
    "leaf_cnn": (_two_conv_5x5_trunk((32, 64), padding=2), (2048,), True),
    "logreg": (_flatten_trunk, (), False),
    "alexnet": (_alexnet_trunk, (1024, 512), True),
}
MODELS: tuple[str, ...] = tuple(_ARCHITECTURES)


# Held while a model is built from the global RNG: torch's is one per process, and the
# nodes of a host build their models on threads of their own.
_GLOBAL_RNG = threading.RLock()  # re-entrant: a task's model() may build one of ours


def _check_arguments(name: str, input_shape: tuple[int, ...], num_classes: int, head: str) -> None:
    if name not in _ARCHITECTURES:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if head not in HEADS:
        raise ModelError(f"unknown head {head!r}; choose one of {', '.join(HEADS)}")
    if num_classes < 2:
        raise ModelError(f"num_classes must be at least 2, got {num_classes}")
    if not input_shape or any(size < 1 for size in input_shape):
        raise ModelError(f"input shape must be non-empty positive sizes, got {input_shape}")
    needs_image = _ARCHITECTURES[name][2]
    if needs_image and len(input_shape) != 3:
        raise ModelError(
            f"model {name!r} needs image input (channels, height, width), got shape "
            f"{input_shape}; use 'mlp' or 'logreg' for flat features"
        )


def _flat_size(name: str, trunk: nn.Sequential, input_shape: tuple[int, ...]) -> int:
    """Measure the trunk's output size with one dummy sample (eval mode: no BatchNorm update)."""
    trunk.eval()
    try:
        with torch.no_grad():
            features = trunk(torch.zeros(1, *input_shape))
    except RuntimeError as error:
        raise ModelError(
            f"model {name!r} cannot take input shape {input_shape}: too small for its layers"
        ) from error
    finally:
        trunk.train()
    return features.shape[1]


def _dense_stack(in_features: int, widths: Sequence[int], num_classes: int) -> NamedLayers:
    layers: NamedLayers = []
    for index, width in enumerate(widths, start=1):
        layers += [(f"fc{index}", nn.Linear(in_features, width)), (f"relu_fc{index}", nn.ReLU())]
        in_features = width
    return [*layers, ("out", nn.Linear(in_features, num_classes))]


def _split(
    trunk: NamedLayers, dense: NamedLayers, flat_size: int, head: str
) -> tuple[nn.Module, nn.Module, int]:
    """Cut trunk + dense layers into (body, head, feature_dim) by the head convention."""
    if head == "last" or len(dense) == 1:
        # The final Linear alone; a model without hidden fc layers (logreg) ends up here too.
        body_layers, head_module = trunk + dense[:-1], dense[-1][1]
        feature_dim = cast(nn.Linear, head_module).in_features  # _dense_stack ends in a Linear
    else:
        body_layers, head_module = trunk, nn.Sequential(OrderedDict(dense))
        feature_dim = flat_size
    return nn.Sequential(OrderedDict(body_layers)), head_module, feature_dim


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, head: str = "last", seed: int = 0
) -> SplitModel:
    """Build model ``name`` for inputs of ``input_shape`` (without the batch dimension).

    Weights depend only on ``seed`` (`seeded`).
    """
    shape = tuple(int(size) for size in input_shape)
    _check_arguments(name, shape, num_classes, head)
    trunk_builder, hidden_widths, _ = _ARCHITECTURES[name]
    with seeded(seed):
        trunk = trunk_builder(shape)
        flat_size = _flat_size(name, nn.Sequential(OrderedDict(trunk)), shape)
        dense = _dense_stack(flat_size, hidden_widths, num_classes)
    body, head_module, feature_dim = _split(trunk, dense, flat_size, head)
    return SplitModel(
        body,
        head_module,
        feature_dim,
        name=name,
        input_shape=shape,
        num_classes=num_classes,
        head_kind=head,
    )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Model building seeded by `seed` alone: the global RNG is forked (nothing else's
    stream is read or disturbed) and one thread builds at a time (the nodes of a host
    share that RNG)."""
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def body_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the body (parameters and buffers), in state-dict order."""
    return [key for key in model.state_dict() if key.startswith("body.")]


def head_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the head, in state-dict order."""
    return [key for key in model.state_dict() if key.startswith("head.")]


def model_schema(model: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, dtype, shape) of every state entry, sorted by key: peers hash it into the mesh id.

    dtypes are written without the ``torch.`` prefix ("float32", "int64"), the way
    numpy names them, so the schema reads the same on the wire side.
    """
    return sorted(
        (key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        for key, tensor in model.state_dict().items()
    )


BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def batchnorm_keys(model: nn.Module) -> frozenset[str]:
    """The state keys of the model's BatchNorm layers: their weights, biases, running
    statistics and batch counters (what FedBN keeps local)."""
    return frozenset(
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        if isinstance(module, BATCHNORMS)
        for key in module.state_dict()
    )
