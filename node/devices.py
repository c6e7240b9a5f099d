"""Where a node's model trains and is evaluated, and at what precision.

A node's model lives on the CPU, where blobs arrive and leave as bytes and where the
rules average, score and screen state dicts; it visits the node's device for the work
that is worth a trip: local training (the node's and the rules' own, through the
training recipe) and the node's evaluation. A visit moves the module's parameters and
buffers there and back in place, so every reference to the model stays valid.

`device: auto` takes a GPU where the machine has one: CUDA, the nodes of a host spread
over its GPUs by their index (several nodes may share one), else Apple's MPS, else the
CPU. A device that is not there is one line before any peer is contacted.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterator

import torch
from torch import nn

from meshfl.protocol.errors import UserError

from .config import DEVICE_ALLOWED, DEVICE_PATTERN

PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,  # no autocast: every operation in float32
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class DeviceError(UserError, ValueError):
    """The configured device is not on this machine; `str()` is one line."""


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(setting: str, node_index: int = 0) -> torch.device:
    """The device `setting` names on this machine; `auto` spreads nodes over its GPUs by
    `node_index`. Raises DeviceError for a device the machine lacks."""
    if re.fullmatch(DEVICE_PATTERN, setting) is None:
        raise DeviceError(f"device: got {setting!r}; allowed: {DEVICE_ALLOWED}")
    gpus = cuda_count()
    if setting == "auto":
        if gpus:
            return torch.device("cuda", node_index % gpus)
        return torch.device("mps" if mps_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        if not gpus:
            raise DeviceError(
                f"device: {setting}, but torch sees no CUDA GPU on this machine "
                "(use device: auto or cpu)"
            )
        index = 0 if device.index is None else device.index
        if index >= gpus:
            raise DeviceError(
                f"device: {setting}, but this machine has {gpus} CUDA GPU(s), "
                f"cuda:0 to cuda:{gpus - 1}"
            )
        return torch.device("cuda", index)
    if device.type == "mps" and not mps_available():
        raise DeviceError(
            "device: mps, but torch's MPS backend is not available here (use device: auto or cpu)"
        )
    return device


def model_device(model: nn.Module) -> torch.device:
    """Where the model's first parameter (else buffer) lies; the CPU for an empty model."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


@contextlib.contextmanager
def visiting(model: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """`model` moved to `device` for the block and back home after it, whatever happens
    in it; nothing moves where home and device are one."""
    home = model_device(model)
    if home == device:
        yield model
        return
    try:  # a move that fails half-way (a full GPU) is undone too
        model.to(device)
        yield model
    finally:
        model.to(home)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """Mixed precision for the forward passes of a block (`fp32`: none)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def peak_memory_mb(device: torch.device) -> float | None:
    """The most memory torch has allocated on a CUDA `device` in this process so far
    (the nodes of a host that share a GPU share the figure); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20
