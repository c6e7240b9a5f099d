"""Local training, evaluation, and a model's tensors as numpy arrays (as they travel).

Datasets are small and held in memory as whole tensors, so batches are cut from
a seeded index permutation: no DataLoader, no worker processes, and the same
seed gives the same batches on every run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from .devices import autocast, model_device, visiting
from .streamed import Inputs, StreamedInputs

if TYPE_CHECKING:
    from .config import MeshConfig

OPTIMIZERS: tuple[str, ...] = ("sgd", "adam")

_interop_threads_set = False


def set_torch_threads(local_nodes: int) -> int:
    """Share this machine's cores among ``local_nodes`` node processes; return threads per node.

    Without this every node process would start one thread per core and the
    nodes would fight over the CPUs.
    """
    global _interop_threads_set
    if local_nodes < 1:
        raise ValueError(f"local_nodes must be at least 1, got {local_nodes}")
    threads = max(1, (os.cpu_count() or 1) // local_nodes)
    torch.set_num_threads(threads)
    if not _interop_threads_set:
        # Inter-op parallelism only serves graph-mode models; eager training does not
        # use it. torch allows setting it once, before any parallel work has started.
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass  # parallel work already ran in this process: the setting is frozen
        _interop_threads_set = True
    return threads


def make_optimizer(
    name: str,
    params: Iterable[nn.Parameter],
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> Optimizer:
    """A fresh optimizer; ``momentum`` applies to SGD only (Adam keeps its own moments)."""
    if lr <= 0:
        raise ValueError(f"learning rate must be positive, got {lr}")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return Optimizer(name, params, lr, momentum, weight_decay)


class Optimizer:
    """torch.optim.SGD's or torch.optim.Adam's update (their defaults otherwise), run
    through torch.optim's functional forms, the very functions those classes call.

    The classes import torch._dynamo the first time one is made: 1.2 s and 150 MB of
    resident memory per process (torch 2.x, measured). A node host would pay the time
    while holding its CPU lock, its other nodes waiting, and the memory in every host
    process. The functional forms need no compiler.
    """

    BETAS = (0.9, 0.999)  # Adam's defaults
    EPS = 1e-8

    def __init__(
        self,
        name: str,
        params: Iterable[nn.Parameter],
        lr: float,
        momentum: float,
        weight_decay: float,
    ) -> None:
        self.name, self.lr, self.momentum, self.weight_decay = name, lr, momentum, weight_decay
        self.params: list[torch.Tensor] = [param for param in params if param.requires_grad]
        self._momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)
        self._adam_moments = [
            (torch.zeros_like(p), torch.zeros_like(p), torch.tensor(0.0))
            for p in (self.params if name == "adam" else ())
        ]

    @property
    def param_groups(self) -> list[dict[str, list[torch.Tensor]]]:
        """torch.optim's view of the parameters, all in one group: what a GradScaler
        unscales before `step` (fp16 training)."""
        return [{"params": self.params}]

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        stepped = [i for i, param in enumerate(self.params) if param.grad is not None]
        params = [self.params[i] for i in stepped]
        grads = [cast(torch.Tensor, param.grad) for param in params]
        if self.name == "sgd":
            buffers = [self._momentum_buffers[i] for i in stepped]
            sgd(
                params,
                grads,
                buffers,
                weight_decay=self.weight_decay,
                momentum=self.momentum,
                lr=self.lr,
                dampening=0.0,
                nesterov=False,
                maximize=False,
            )
            for i, buffer in zip(stepped, buffers, strict=True):  # sgd made new ones
                self._momentum_buffers[i] = buffer
            return
        moments = [self._adam_moments[i] for i in stepped]
        adam(
            params,
            grads,
            [first for first, _, _ in moments],
            [second for _, second, _ in moments],
            [],
            [steps for _, _, steps in moments],
            amsgrad=False,
            beta1=self.BETAS[0],
            beta2=self.BETAS[1],
            lr=self.lr,
            weight_decay=self.weight_decay,
            eps=self.EPS,
            maximize=False,
        )


def _shuffled_batches(
    num_samples: int, epochs: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    """Index batches of a fresh permutation per epoch, the last batch of an epoch may be short.

    A private generator makes the order depend on ``seed`` alone, not on whatever
    else drew random numbers in this process. A last batch of one sample joins the
    batch before it: batch normalization cannot train on one sample.
    """
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        batches = list(torch.randperm(num_samples, generator=generator).split(batch_size))
        if len(batches) > 1 and len(batches[-1]) == 1:
            batches[-2:] = [torch.cat(batches[-2:])]
        yield from batches


# train(model, x, y, epochs, seed, max_steps=None) -> mean loss: see training_recipe
TrainRecipe = Callable[..., float]
# loss(logits, labels) -> a scalar tensor; optimizer(trainable parameters) -> an object
# with zero_grad() and step(), such as any torch.optim.Optimizer
LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], "Optimizer | torch.optim.Optimizer"]
Augmentation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainingChoices:
    """What a task may choose about its training in place of the mesh's settings
    (node/task.py): None keeps the config's batch size, cross-entropy, optimizer; and
    `augment`, what each training batch goes through first (None: nothing)."""

    batch_size: int | None = None
    loss: LossFunction | None = None
    optimizer: OptimizerFactory | None = None
    augment: Augmentation | None = None


def training_recipe(
    cfg: MeshConfig, choices: TrainingChoices | None = None, device: torch.device | None = None
) -> TrainRecipe:
    """The mesh's local training, `train(model, x, y, epochs, seed, max_steps=None)`: the
    config's optimizer, lr, batch size, momentum, weight decay and precision (epochs
    None: the mesh's local_epochs), or the task's `choices` where it makes them; it
    returns the mean loss. A node trains its own model with it, and so do the rules that
    train models of their own (algorithms.Context.train). The model trains on `device`
    (None: where it lies) and is back where it lay when `train` returns."""
    choices = choices or TrainingChoices()
    # fp16's loss scale is learnt across rounds, one per device kind: started afresh each
    # round, a model that overflows early would skip its first steps every round.
    scalers: dict[str, torch.amp.GradScaler] = {}

    def train(
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        epochs: int | None,
        seed: int,
        max_steps: int | None = None,
    ) -> float:
        where = device or model_device(model)
        scaler = None
        if cfg.precision == "fp16":
            if where.type not in scalers:
                scalers[where.type] = torch.amp.GradScaler(where.type)
            scaler = scalers[where.type]
        with visiting(model, where):
            return train_local(
                model,
                x,
                y,
                cfg.local_epochs if epochs is None else epochs,
                choices.batch_size or cfg.batch_size,
                cfg.optimizer,
                cfg.lr,
                seed=seed,
                momentum=cfg.momentum,
                weight_decay=cfg.weight_decay,
                max_steps=max_steps,
                loss=choices.loss,
                new_optimizer=choices.optimizer,
                augment=choices.augment,
                precision=cfg.precision,
                scaler=scaler,
            )

    return train


def train_local(
    model: nn.Module,
    x: Inputs,
    y: torch.Tensor,
    epochs: int,
    batch_size: int,
    optimizer: str,
    lr: float,
    seed: int,
    momentum: float = 0.0,
    max_steps: int | None = None,
    weight_decay: float = 0.0,
    before_step: Callable[[int], None] | None = None,
    loss: LossFunction | None = None,
    new_optimizer: OptimizerFactory | None = None,
    augment: Augmentation | None = None,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """Train ``model`` in place with cross-entropy; return the mean loss per sample seen.

    The optimizer is fresh per call: its momentum or Adam moments belong to the
    weights of the last round, which aggregation has since replaced.
    ``max_steps`` caps optimizer steps over all epochs (Fed-Influence's ``m`` local
    steps). ``before_step(i)`` runs before step ``i`` (0-based) while the model still
    holds the weights that step starts from (Fed-Influence samples gradients there).
    `loss` and `new_optimizer` replace cross-entropy and the named optimizer (a task's);
    `augment` takes each batch of inputs before the model does (a task's augmentation,
    drawing from torch's generator, seeded like dropout). `precision` bf16 or fp16 runs
    the forward passes under autocast (fp16 with a dynamically scaled loss, so small
    gradients do not flush to zero: `scaler`'s, or a fresh one's); the weights stay
    float32.
    """
    if len(x) == 0:
        raise ValueError("no training samples: the node's train split is empty")
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
    if epochs < 0 or batch_size < 1:
        raise ValueError(f"need epochs >= 0 and batch_size >= 1, got {epochs} and {batch_size}")
    device = model_device(model)
    y = y.to(device=device, dtype=torch.long)
    if new_optimizer is not None:
        optim = new_optimizer([param for param in model.parameters() if param.requires_grad])
    else:
        optim = make_optimizer(
            optimizer, model.parameters(), lr, momentum=momentum, weight_decay=weight_decay
        )
    loss_of = loss or functional.cross_entropy
    scaler = (scaler or torch.amp.GradScaler(device.type)) if precision == "fp16" else None
    batches = list(islice(_shuffled_batches(len(x), epochs, batch_size, seed), max_steps))
    model.train()
    loss_sum, samples_seen = 0.0, 0
    # Dropout draws from torch's global generator: seeded here (and given back after), a
    # round's training is the same whatever else ran in the process before it.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inputs_of = batch_inputs(x, batches, device, seed)
        for step, (batch, inputs) in enumerate(zip(batches, inputs_of, strict=True)):
            batch = batch.to(device)
            if before_step is not None:
                before_step(step)
            optim.zero_grad()
            if augment is not None:
                inputs = augment(inputs)
            with autocast(device, precision):
                batch_loss = loss_of(model(inputs), y[batch])
            if scaler is None:
                batch_loss.backward()
                optim.step()
            else:
                scaler.scale(batch_loss).backward()
                scaler.step(optim)  # type: ignore[arg-type]  # ours has param_groups
                scaler.update()
            loss_sum += batch_loss.item() * len(batch)
            samples_seen += len(batch)
    # The last step's gradients serve nothing past it: kept, they would be one more copy
    # of the model in every node until its next round.
    model.zero_grad(set_to_none=True)
    return loss_sum / samples_seen if samples_seen else math.nan


def batch_inputs(
    x: Inputs, batches: list[torch.Tensor], device: torch.device, seed: int
) -> Iterator[torch.Tensor]:
    """The inputs of each batch of indices on `device`: cut from the split's tensor, moved
    there once; or read from a streamed split through its DataLoader."""
    if isinstance(x, StreamedInputs):
        return x.batches(batches, device, seed)
    on_device = x.to(device)
    return (on_device[batch] for batch in batches)


@dataclass
class Evaluation:
    loss: float
    accuracy: float
    per_class_accuracy: list[float | None]  # None for a class with no samples
    n: int


def evaluate(
    model: nn.Module, x: Inputs, y: torch.Tensor, num_classes: int, batch_size: int = 512
) -> Evaluation:
    """Mean cross-entropy, accuracy and per-class accuracy; leaves the model's mode as it was."""
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
    device = model_device(model)
    y = y.to(device=device, dtype=torch.long)
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}), got {int(y.min())}..{int(y.max())}"
        )
    was_training = model.training
    model.eval()
    loss_sum = 0.0
    correct = torch.zeros(num_classes, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                logits = model(x[start : start + batch_size].to(device))
                labels = y[start : start + batch_size]
                loss_sum += functional.cross_entropy(logits, labels, reduction="sum").item()
                hits = labels[logits.argmax(dim=1) == labels]
                correct += torch.bincount(hits, minlength=num_classes)
    finally:
        model.train(was_training)
    counts = torch.bincount(y, minlength=num_classes).tolist()
    per_class = [
        hit / count if count else None for hit, count in zip(correct.tolist(), counts, strict=True)
    ]
    n = len(y)
    if n == 0:
        return Evaluation(math.nan, math.nan, per_class, 0)
    return Evaluation(loss_sum / n, int(correct.sum()) / n, per_class, n)


def state_to_arrays(source: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A model's (or a state dict's) tensors as numpy arrays, float entries as float32,
    integer buffers as they are.

    Zero-copy for float32 tensors on the CPU: the arrays share memory with the
    tensors, so encode or copy them before the model trains again.
    """
    state = source.state_dict() if isinstance(source, nn.Module) else source
    arrays = {}
    for key, tensor in state.items():
        tensor = tensor.detach()
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32)
        arrays[key] = tensor.cpu().numpy()
    return arrays
