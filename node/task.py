"""The task contract: the model a mesh learns, and the data each node learns it from.

A task is a Python file (`task: path/to/task.py` in the config, `--task` on the command
line) or an importable module (`task: package.module`) that defines

    def model() -> torch.nn.Module:       # any module mapping a batch to class logits
        ...
    def data(node: NodeInfo):             # this node's (train, val, test)
        ...

and, if it likes, `head = "name"`: the module (as `model().get_submodule` names it)
that forms the classifier head, which FedC²I, FedReMa and pFedSV's shared body read;
`batch_size`, `loss(logits, labels)` and `optimizer(parameters)` in place of the mesh's
batch size, cross-entropy and optimizer.
Each of train, val and test is a torch `Dataset` of (input, label) pairs or an
`(inputs, labels)` pair of arrays or tensors. `data` is told who the node is
(`NodeInfo`): its name, index, the node count, the mesh's seed and the data settings
of its peer entry, so that one file serves a partition simulated on one machine and a
LAN machine that reads its own files.

The number of classes is the model's: the width of its logits. It is part of the
model's tensor layout, which every blob names and the mesh id hashes, so it is a fact
of the mesh, and labels outside it are refused before any peer is contacted.

The built-in models and datasets (`model:` and `data:` settings) are a task too
(`BuiltinTask`): the node builds its model and reads its data through this one
interface, whichever kind it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import logging
import random
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, Protocol

import numpy as np
import torch
from torch import nn

from meshfl.protocol.errors import UserError

from . import config as cfgmod
from .data_rules import NPZ_PREFIX, DataError
from .models import body_keys, build_model, head_keys, seeded
from .splits import NodeData, load_node_data
from .streamed import STREAM_ABOVE_BYTES, Inputs, StreamedInputs, as_input
from .trainer import TrainingChoices

log = logging.getLogger("meshfl.node")

# How many samples a data split's torch Dataset yields per step while it is read into
# memory (a DataLoader batch; the node then holds each split as two tensors).
READ_BATCH = 512
SPLITS = ("train", "val", "test")


# Said where a model cannot take inputs that are whole numbers: raw images (uint8 pixels)
# become int64, as token ids do, not floats.
WHOLE_NUMBER_INPUTS = (
    " (the inputs are whole numbers, so the node keeps them as int64, as token ids; "
    "give images as floats, e.g. x.float() / 255)"
)


class TaskError(UserError, ValueError):
    """A task the user wrote cannot be used: one line naming the file and the problem."""


@dataclass(frozen=True)
class NodeInfo:
    """Who a node is, as a task's `data` function is told: its `name` and `index` in the
    mesh's peer list, the number of `nodes`, the mesh's `seed`, and `data`: the data
    settings of its peer entry over the mesh-wide ones (root, partition,
    samples_per_node, split, dataset, classes)."""

    name: str
    index: int
    nodes: int
    seed: int
    data: Mapping[str, Any]


class Task(Protocol):
    """What a node needs of a task: its data, a builder of the mesh's initial model,
    which state keys form the classifier head, and its choices about training."""

    @property
    def training(self) -> TrainingChoices: ...

    def node_data(self, node: NodeInfo) -> NodeData: ...

    def model_maker(self, data: NodeData) -> Callable[[], nn.Module]: ...

    def split_keys(self, model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]: ...

    def check_rule(
        self, algorithm: cfgmod.AlgorithmConfig, model: nn.Module, data: NodeData
    ) -> None: ...


# --------------------------------------------------------------------------- built in


@dataclass(frozen=True)
class BuiltinTask:
    """The models of node/models.py on the datasets of node/datasets.py, as the
    config's `model:` and `data:` settings name them."""

    cfg: cfgmod.MeshConfig
    training: TrainingChoices = TrainingChoices()  # the config's, all of them

    def node_data(self, node: NodeInfo) -> NodeData:
        """The node's shard of the mesh's partition; or, where its peer entry names a
        dataset of its own (a LAN machine's own file), all of that one."""
        settings = node.data
        listed = cfgmod.listed_peer(self.cfg, node.name)
        own = listed is not None and listed.data is not None and listed.data.dataset is not None
        if own and settings["dataset"].startswith(NPZ_PREFIX) and settings["classes"] is None:
            raise DataError(
                f"peer {node.name}: its own file {settings['dataset']!r} needs data.classes "
                "(the mesh's number of classes): nodes that read their own files count "
                "their classes alike only when the config says how many there are"
            )
        return load_node_data(
            settings["dataset"],
            settings["root"],
            "iid" if own else settings["partition"],
            1 if own else node.nodes,
            0 if own else node.index,
            node.seed,
            settings["samples_per_node"],
            tuple(settings["split"]),
            settings["classes"],
        )

    def model_maker(self, data: NodeData) -> Callable[[], nn.Module]:
        """Seeded: every call, on every node, gives the mesh's initial model."""
        model = self.cfg.model
        return lambda: build_model(
            model.name, data.input_shape, data.num_classes, model.head, seed=self.cfg.seed
        )

    def split_keys(self, model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(body_keys(model)), tuple(head_keys(model))

    def check_rule(
        self, algorithm: cfgmod.AlgorithmConfig, model: nn.Module, data: NodeData
    ) -> None:
        """Nothing to check: the config's own check matched model.head to the rule, and
        every split of a built-in dataset holds samples."""


# --------------------------------------------------------------------------- a user's


# A task's own module is the `net` of its TaskModel: what its state keys start with.
USER_PREFIX = "net."


class TaskModel(nn.Module):
    """A task's model with the split the rules read: `head`, the module the task names
    (None where it names none), `body(x)`, the features that module takes (caught on
    their way in, whatever the model computes before), and `feature_dim`, their width.
    The task's own module is `net`, so its state keys read `net.<the task's keys>`."""

    def __init__(self, net: nn.Module, head_name: str | None) -> None:
        super().__init__()
        self.net = net
        self.head_name = head_name
        self.feature_dim: int | None = None  # measured by `UserTask.check` on one batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @property
    def head(self) -> nn.Module | None:
        return None if self.head_name is None else self.net.get_submodule(self.head_name)

    @property
    def head_prefix(self) -> str:
        return f"{USER_PREFIX}{self.head_name}."

    def body(self, x: torch.Tensor) -> torch.Tensor:
        """The head's input for a batch `x`."""
        head = self.head
        if head is None:
            raise TaskError("the task names no head (`head = ...`): this rule needs one")
        caught: list[torch.Tensor] = []
        hook = head.register_forward_pre_hook(lambda _module, args: caught.append(args[0]))
        try:
            self.net(x)
        finally:
            hook.remove()
        return caught[-1]


@dataclass(frozen=True)
class UserTask:
    """A task file or module a user wrote (see the module's docstring)."""

    source: str  # the path or module name, as the config gives it
    module: ModuleType
    seed: int

    @property
    def head_name(self) -> str | None:
        head = getattr(self.module, "head", None)
        if head is not None and not (isinstance(head, str) and head):
            self.fail(f"head: got {head!r}; expected the name of a module of the model")
        return head

    @property
    def training(self) -> TrainingChoices:
        """The task's `batch_size`, `loss(logits, labels)`, `optimizer(parameters)` and
        `augment(x)`, where it defines them."""
        batch_size = getattr(self.module, "batch_size", None)
        if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
            self.fail(f"batch_size: got {batch_size!r}; expected an integer >= 1")
        names = ("loss", "optimizer", "augment")
        functions = {name: getattr(self.module, name, None) for name in names}
        for name, function in functions.items():
            if function is not None and not callable(function):
                self.fail(f"{name}: got {type(function).__name__}; expected a function")
        return TrainingChoices(batch_size, *functions.values())

    @property
    def in_memory(self) -> bool | None:
        """The task's `in_memory`: True holds every split whole, False streams its train
        and test splits from their Datasets; None (unset) streams a split whose inputs
        would take more than STREAM_ABOVE_BYTES."""
        value = getattr(self.module, "in_memory", None)
        if value is not None and not isinstance(value, bool):
            self.fail(f"in_memory: got {value!r}; expected true, false or unset")
        return value

    @property
    def workers(self) -> int:
        """The task's `workers`: DataLoader processes that read a streamed split ahead of
        training (0, the default: read in the node's own thread)."""
        value = getattr(self.module, "workers", 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            self.fail(f"workers: got {value!r}; expected an integer >= 0")
        return value

    def fail(self, problem: str) -> NoReturn:
        raise TaskError(f"task {self.source}: {problem}")

    def node_data(self, node: NodeInfo) -> NodeData:
        try:
            splits = self.module.data(node)
        except Exception as err:  # the user's code: report it as theirs, in one line
            self.fail(f"data() raised {_where(err, self.module)}")
        if not isinstance(splits, Sequence) or len(splits) != len(SPLITS):
            self.fail(f"data() returned {type(splits).__name__}; expected (train, val, test)")
        tensors = [self._tensors(name, split) for name, split in zip(SPLITS, splits, strict=True)]
        if any(isinstance(x, StreamedInputs) for x, _ in tensors):
            log.info("task %s: streaming %s", self.source, streamed_splits(tensors))
        if len(tensors[0][1]) == 0:
            self.fail("data(): the train split is empty")
        sample_shape = tuple(tensors[0][0].shape[1:])
        tensors = [  # an empty Dataset says nothing of its inputs' shape: the train split's
            (x.reshape(0, *sample_shape) if isinstance(x, torch.Tensor) and not len(y) else x, y)
            for x, y in tensors
        ]
        (x_train, y_train), (x_val, y_val), (x_test, y_test) = tensors
        assert isinstance(x_val, torch.Tensor), "the val split is never streamed"
        shapes = {
            name: tuple(x.shape[1:]) for name, (x, y) in zip(SPLITS, tensors, strict=True) if len(y)
        }
        if len(set(shapes.values())) > 1:
            self.fail(f"data(): the splits' inputs differ in shape: {shapes}")
        classes = self._classes(x_train)
        for name, (_, y) in zip(SPLITS, tensors, strict=True):
            if len(y) and (int(y.min()) < 0 or int(y.max()) >= classes):
                self.fail(
                    f"data(): {name} labels run {int(y.min())}..{int(y.max())}, outside "
                    f"0..{classes - 1}: the model gives {classes} logits, one per class"
                )
        info = {
            "labels": sorted(int(c) for c in y_train.unique()),
            "n_train": len(y_train),
            "n_val": len(y_val),
            "n_test": len(y_test),
        }
        return NodeData(
            x_train, y_train, x_val, y_val, x_test, y_test, classes, shapes["train"], info
        )

    def _tensors(self, name: str, split: Any) -> tuple[Inputs, torch.Tensor]:
        """A split as inputs (float32, or int64 where they are whole numbers: an
        embedding's token ids) and int64 labels, one class index per input. A train or
        test split too big for memory (or one the task's `in_memory = False` names) is
        streamed from its Dataset: its labels are read once here, its inputs when asked
        for. The val split is always held: every rule reads it whole, several times a
        round."""
        in_memory = True if name == "val" else self.in_memory
        try:
            x, y = _read_split(split, in_memory, self.workers)
        except Exception as err:
            self.fail(f"data(): the {name} split cannot be read: {_where(err, self.module)}")
        if len(x.shape) == 0 or y.dim() == 0:
            self.fail(f"data(): the {name} split holds one value, not a batch of samples")
        if y.dim() == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        if y.dim() != 1:
            self.fail(
                f"data(): the {name} labels have shape {tuple(y.shape)}; expected one class "
                "index per input (one-hot labels: give their argmax)"
            )
        if len(x) != len(y):
            self.fail(f"data(): the {name} split has {len(x)} inputs but {len(y)} labels")
        if y.is_floating_point() and not bool((y == y.round()).all()):
            self.fail(f"data(): the {name} labels are not whole numbers (class indices)")
        return x if isinstance(x, StreamedInputs) else as_input(x), y.long()

    def _classes(self, x_train: Inputs) -> int:
        """The model's number of logits, from one batch of the train split (which also
        shows whether the model takes this node's inputs at all)."""
        model = self.model_maker(None)()
        logits = None
        for training in (False, True):  # evaluation, then a training step's forward
            model.train(training)
            inputs = self._augmented(x_train[:2]) if training else x_train[:2]
            try:
                with torch.set_grad_enabled(training):
                    logits = model(inputs)
            except Exception as err:
                shape = tuple(x_train.shape[1:])
                whole = "" if inputs.is_floating_point() else WHOLE_NUMBER_INPUTS
                self.fail(f"model() cannot take this node's inputs of shape {shape}: {err}{whole}")
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
                got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
                self.fail(f"model() must map a batch to logits (batch, classes); it gave {got}")
        assert logits is not None
        self._check_training(model, logits)
        return int(logits.shape[1])

    def _augmented(self, x: torch.Tensor) -> torch.Tensor:
        """One batch through the task's `augment`, checked as training will take it."""
        augment = self.training.augment
        if augment is None:
            return x
        try:
            out = augment(x.clone())
        except Exception as err:
            self.fail(f"augment(x) raised {_where(err, self.module)}")
        if not (isinstance(out, torch.Tensor) and out.dim() >= 1 and len(out) == len(x)):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            self.fail(f"augment(x) must return a batch of {len(x)} inputs; it gave {got}")
        return out

    def _check_training(self, model: nn.Module, logits: torch.Tensor) -> None:
        """The task's loss on one batch of logits, backward through the model, and its
        optimizer on the model's trainable parameters, as training will call them."""
        choices = self.training
        labels = logits.detach().argmax(dim=1)
        loss = choices.loss or torch.nn.functional.cross_entropy
        try:
            value = loss(logits, labels)
        except Exception as err:
            self.fail(f"loss(logits, labels) raised {_where(err, self.module)}")
        if not (isinstance(value, torch.Tensor) and value.dim() == 0):
            self.fail("loss(logits, labels) must return a scalar tensor")
        if value.requires_grad:
            value.backward()
        elif any(param.requires_grad for param in model.parameters()):
            self.fail("loss(logits, labels) does not depend on the model's parameters")
        if choices.optimizer is not None:
            trainable = [param for param in model.parameters() if param.requires_grad]
            try:
                optimizer = choices.optimizer(trainable)
            except Exception as err:
                self.fail(f"optimizer(parameters) raised {_where(err, self.module)}")
            if not all(callable(getattr(optimizer, m, None)) for m in ("step", "zero_grad")):
                self.fail("optimizer(parameters) must return an optimizer (step, zero_grad)")

    def model_maker(self, data: NodeData | None) -> Callable[[], nn.Module]:
        """Seeded: every call, on every node, gives the mesh's initial model."""
        return functools.partial(self._new_model, data)

    def _new_model(self, data: NodeData | None) -> TaskModel:
        with seeded(self.seed), _python_and_numpy_seeded(self.seed):
            try:
                net = self.module.model()
            except Exception as err:
                self.fail(f"model() raised {_where(err, self.module)}")
        if not isinstance(net, nn.Module):
            self.fail(f"model() returned {type(net).__name__}; expected a torch.nn.Module")
        # At home on the CPU, whatever device model() chose: the node moves it to its
        # own device to train (node/devices.py).
        model = TaskModel(net.cpu(), self._checked_head(net))
        if model.head is not None and data is not None and len(data.y_train):
            model.eval()
            try:
                with torch.no_grad():
                    features = model.body(data.x_train[:1])
            except IndexError:
                self.fail(f"head: the model's forward never calls {model.head_name!r}")
            model.feature_dim = int(features.reshape(1, -1).shape[1])
            model.train()
        return model

    def check_rule(
        self, algorithm: cfgmod.AlgorithmConfig, model: nn.Module, data: NodeData
    ) -> None:
        """That the config's rule finds in the model and the data what it reads: a head
        where it reads one (FedC²I, FedReMa, pFedSV with shared_body), one linear layer
        for FedC²I; a validation split where screening judges peers on it (on an empty
        one it would judge nothing, and let every peer in)."""
        from meshfl.algorithms import SCREEN_KEY, algorithm_class, parse_params, screening_setting

        name = algorithm.name
        if not len(data.y_val) and screening_setting(name, algorithm.params).get(SCREEN_KEY):
            self.fail(
                "data(): the validation split is empty, and screening judges this node's "
                "peers on it: give it some of the node's samples (a fifth is usual), or "
                "set algorithm.screen=false"
            )
        rule = algorithm_class(name)
        if not rule.reads_head(parse_params(name, algorithm.params)):
            return
        head = model.head if isinstance(model, TaskModel) else None
        if head is None:
            self.fail(f"algorithm {name} reads the classifier head: name its module (head = ...)")
        if rule.heads == ("last",) and not isinstance(head, nn.Linear):
            self.fail(
                f"algorithm {name} reads class vectors as the rows of one nn.Linear head; "
                f"head {model.head_name!r} is a {type(head).__name__}"
            )

    def _checked_head(self, net: nn.Module) -> str | None:
        name = self.head_name
        if name is None:
            return None
        modules = dict(net.named_modules())
        if name not in modules or name == "":
            known = ", ".join(m for m in modules if m) or "none"
            self.fail(f"head: {name!r} names no module of the model; its modules: {known}")
        return name

    def split_keys(self, model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        keys = tuple(model.state_dict())
        if not isinstance(model, TaskModel) or model.head_name is None:
            return keys, ()
        head = tuple(key for key in keys if key.startswith(model.head_prefix))
        return tuple(key for key in keys if key not in head), head


def _read_split(
    split: Any, in_memory: bool | None, workers: int
) -> tuple[torch.Tensor | StreamedInputs, torch.Tensor]:
    """(inputs, labels) of an (x, y) pair of arrays or tensors, or of a torch Dataset read
    through a DataLoader: whole, or (`in_memory` False, or None and the inputs bigger
    than STREAM_ABOVE_BYTES) its labels only, the inputs left to stream."""
    if isinstance(split, tuple | list) and len(split) == 2:
        return torch.as_tensor(np.asarray(split[0])), torch.as_tensor(np.asarray(split[1]))
    if not isinstance(split, torch.utils.data.Dataset):
        raise TypeError(f"got {type(split).__name__}; expected a Dataset or an (x, y) pair")
    size = len(split)  # type: ignore[arg-type]
    if size == 0:
        return torch.empty(0), torch.empty(0, dtype=torch.long)
    first = as_input(split[0][0])
    if in_memory is None:
        in_memory = first.numel() * first.element_size() * size <= STREAM_ABOVE_BYTES
    loader = torch.utils.data.DataLoader(split, batch_size=READ_BATCH, shuffle=False)
    if not in_memory:
        labels = kept_labels(split)
        if labels is None:  # a pass over the split, its inputs read and let go
            labels = torch.cat([torch.as_tensor(y) for _, y in loader])
        return StreamedInputs(split, first, workers), labels
    batches = [(x, torch.as_tensor(y)) for x, y in loader]
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def kept_labels(dataset: Any) -> torch.Tensor | None:
    """The labels a Dataset keeps beside its inputs (torchvision's `targets`, through any
    Subset), read without decoding one input; None where it keeps none, or transforms
    them."""
    if isinstance(dataset, torch.utils.data.Subset):
        inner = kept_labels(dataset.dataset)
        return None if inner is None else inner[torch.as_tensor(list(dataset.indices))]
    targets = getattr(dataset, "targets", None)
    if targets is None or getattr(dataset, "target_transform", None) is not None:
        return None
    labels = torch.as_tensor(np.asarray(targets))
    return labels if labels.dim() == 1 and len(labels) == len(dataset) else None


def streamed_splits(splits: Sequence[tuple[Inputs, torch.Tensor]]) -> str:
    """Which splits stream, for the node's log: "train (48000 samples), test (...)"."""
    return ", ".join(
        f"{name} ({len(x)} samples)"
        for name, (x, _) in zip(SPLITS, splits, strict=True)
        if isinstance(x, StreamedInputs)
    )


def _where(err: Exception, module: ModuleType) -> str:
    """`Type: message (file, line N)` at the deepest frame of the task's own file, the
    message's first line only: an error is one line."""
    own = getattr(module, "__file__", None)
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if frame.filename == own]
    place = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    message = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {message}{place}"


@contextlib.contextmanager
def _python_and_numpy_seeded(seed: int) -> Iterator[None]:
    """`random` and numpy's global generator seeded by `seed` while a task builds its
    model (an initialisation may draw from them), and given back as they were."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


# --------------------------------------------------------------------------- loading


def task_of(cfg: cfgmod.MeshConfig) -> Task:
    """The config's task: the file or module `task:` names, else the built-in one."""
    if cfg.task is None:
        return BuiltinTask(cfg)
    return UserTask(cfg.task, load_task_module(cfg.task), cfg.seed)


def load_task_module(source: str) -> ModuleType:
    """The task file (a path ending .py) or module (dotted name) `source` names,
    imported once per process (the nodes of a host share it); TaskError with the
    file's own line where it does not import or lacks model() or data()."""
    if source.endswith(".py"):
        return _task_module(source, str(Path(source).expanduser().resolve()))
    return _task_module(source, None)


@functools.cache
def _task_module(source: str, path_text: str | None) -> ModuleType:
    if path_text is not None:
        path = Path(path_text)
        if not path.is_file():
            raise TaskError(f"task {source}: no such file")
        if str(path.parent) not in sys.path:  # its own helper modules lie beside it
            sys.path.insert(0, str(path.parent))
        name = "meshfl_task_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, "a .py file has a spec"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise TaskError(f"task {source}: does not import: {_where(err, module)}") from None
    else:
        try:
            module = importlib.import_module(source)
        except Exception as err:
            raise TaskError(
                f"task {source}: does not import: {type(err).__name__}: {err}"
            ) from None
    for function in ("model", "data"):
        if not callable(getattr(module, function, None)):
            raise TaskError(f"task {source}: defines no {function}() function")
    return module


def node_info(cfg: cfgmod.MeshConfig, name: str, index: int, nodes: int) -> NodeInfo:
    """What a task's data function is told about node `name`: its entry's data settings
    over the mesh-wide ones (a node not in the peer list, the mesh-wide ones)."""
    settings = cfgmod.data_for(cfg, cfgmod.listed_peer(cfg, name))
    return NodeInfo(name, index, nodes, cfg.seed, dataclasses.asdict(settings))


__all__ = [
    "BuiltinTask",
    "NodeInfo",
    "Task",
    "TaskError",
    "TaskModel",
    "UserTask",
    "load_task_module",
    "node_info",
    "task_of",
]
