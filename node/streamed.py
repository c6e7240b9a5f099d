"""A split too big to hold as one tensor: its inputs read from the task's torch Dataset
when they are asked for, its labels held (a few bytes a sample).

`StreamedInputs` answers what the node and the rules ask of a split's inputs: its
length and shape, and the inputs at some indices (`x[indices]`, `x[a:b]`), stacked into
one tensor. Local training asks for whole epochs of batches at once (`batches`), and
gets them through torch's DataLoader: read by `workers` processes ahead of the model,
in pinned memory where the model trains on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

# A split whose inputs would take more than this as one tensor is streamed, unless the
# task says (`in_memory`). Every node of a local mesh holds its own splits.
STREAM_ABOVE_BYTES = 256 * 2**20


def as_input(value: Any) -> torch.Tensor:
    """One sample's input as the node holds inputs: float32, or int64 where it is whole
    numbers (an embedding's token ids)."""
    tensor = torch.as_tensor(value)
    is_float = tensor.is_floating_point() or tensor.dtype == torch.bool
    return tensor.float() if is_float else tensor.long()


class _Inputs(torch.utils.data.Dataset[torch.Tensor]):
    """The inputs of a Dataset of (input, label) samples, each as `as_input` makes it."""

    def __init__(self, dataset: torch.utils.data.Dataset[Any]) -> None:
        self.dataset = dataset

    def __getitem__(self, index: int) -> torch.Tensor:
        return as_input(self.dataset[index][0])

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


class StreamedInputs:
    """A split's inputs, read from `dataset` by index; `workers` DataLoader processes read
    ahead of training (0: read in the training thread)."""

    def __init__(
        self, dataset: torch.utils.data.Dataset[Any], sample: torch.Tensor, workers: int = 0
    ) -> None:
        self.inputs = _Inputs(dataset)
        self.sample_shape = tuple(sample.shape)
        self.dtype = sample.dtype
        self.workers = workers

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), *self.sample_shape))

    def __getitem__(self, index: int | slice | Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(index, int):
            return self.inputs[index]
        if isinstance(index, slice):
            indices: Sequence[int] = range(*index.indices(len(self)))
        else:
            indices = torch.as_tensor(index).reshape(-1).tolist()
        if not indices:
            return torch.empty((0, *self.sample_shape), dtype=self.dtype)
        return torch.stack([self.inputs[i] for i in indices])

    def batches(
        self, index_batches: list[torch.Tensor], device: torch.device, seed: int
    ) -> Iterator[torch.Tensor]:
        """The inputs of each batch of indices, in order, read ahead by the workers. The
        loader draws its workers' seeds from `seed`, not from torch's global generator,
        whose draws (dropout's) must not depend on how the inputs are read."""
        loader = torch.utils.data.DataLoader(
            self.inputs,
            batch_sampler=[batch.tolist() for batch in index_batches],
            generator=torch.Generator().manual_seed(seed),
            num_workers=self.workers,
            pin_memory=device.type == "cuda",
            # Not fork: the node's threads (its endpoint, a host's other nodes) would be
            # copied mid-step into every worker.
            multiprocessing_context="spawn" if self.workers else None,
            persistent_workers=False,
        )
        for inputs in loader:
            yield inputs.to(device, non_blocking=True)


# A split's inputs: one tensor, or a task's Dataset read when asked.
Inputs = torch.Tensor | StreamedInputs


def whole_inputs(x: Inputs) -> torch.Tensor:
    """A split's inputs known to be held whole (built-in data always is)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError("a streamed split where inputs held whole are needed")
    return x
