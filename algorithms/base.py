"""The small interface every aggregation rule implements.

An algorithm sees tensors and data, never a socket: the node hands it the
models that arrived for a round, keyed by peer name, and takes back a new
model plus the weights and diagnostics it wants in the metrics.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .params import PARAMS

State = dict[str, torch.Tensor]

# How a tensor travels: its name, wire dtype ("float32", "int64") and shape. A blob's
# layout is its tensors' specs in order; a peer's blob is taken in only when its layout
# is one the rule expects for its kind (the node checks, before any rule sees it).
TensorSpec = tuple[str, str, tuple[int, ...]]
Layout = tuple[TensorSpec, ...]


@dataclass(frozen=True)
class PeerModel:
    """One model received for a round: its weights and how much data trained it."""

    state: State
    n_samples: int


def cloned(state: Mapping[str, torch.Tensor]) -> State:
    """A copy of `state` that shares no memory with it: a model's `state_dict()` holds
    its live tensors, which its next training step or load changes."""
    return {key: value.detach().clone() for key, value in state.items()}


def kept(state: State) -> Callable[[], State]:
    """A copy of `state` held in memory, and the function that gives it back: what
    `Context.set_aside` does where the node has no file for it."""
    copy = cloned(state)
    return lambda: copy


@dataclass(frozen=True)
class Context:
    """What an algorithm may know about, and do in, the node it runs in.

    `new_model` builds the node's architecture (weights to be loaded);
    `train(model, x, y, epochs, seed=, max_steps=)` runs the node's local training
    recipe (the mesh's optimizer, lr and batch size; epochs None: the mesh's
    local_epochs) and returns the mean loss. Algorithms that score or train models
    (influence, Shapley values, lazy models) use them without reaching into the node.
    `set_aside(state)` keeps a copy of a state the rule reads again in a later round
    (screening's round start) and returns the function that gives it back; the node's
    holds it in a file, so a waiting node holds a model less (node/set_aside.py).
    """

    node: str
    seed: int
    num_classes: int
    body_keys: tuple[str, ...]
    head_keys: tuple[str, ...]
    batch_size: int = 32
    new_model: Callable[[], torch.nn.Module] | None = None
    train: Callable[..., float] | None = None
    data: Any = None  # the node's own data (the coordinator's: a held-out evaluation shard)
    layout: Layout = ()  # the node's whole model as it travels, in state-dict order
    set_aside: Callable[[State], Callable[[], State]] = kept

    def model_part(self, keys: tuple[str, ...]) -> Layout:
        """The layout of the model's entries among `keys` (a body, a head), in model order."""
        wanted = set(keys)
        return tuple(spec for spec in self.layout if spec[0] in wanted)


@dataclass
class Aggregate:
    """The outcome of one aggregation: the node's next model and what to record."""

    state: State
    weights: dict[str, float]
    diagnostics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NoParams:
    __pydantic_config__ = PARAMS


MODEL = "model"  # the kind of blob every node publishes unless its rule says otherwise

# received[kind][peer] = that peer's blob of that kind for the round
ReceivedModels = dict[str, dict[str, PeerModel]]


class PeerAlgorithm:
    """Base for peer-side rules: publish the whole model, fetch everyone's, aggregate.

    A round at a node: local training, then `publish` (the blobs to announce, by
    kind), then `wanted` (whose announced blobs to download), then `aggregate`
    with what arrived by the round's deadline.

    The node asks `wanted` again each time more offers arrived, and fetches what it
    names at once, so within a round a rule's choice must only grow with the offers.
    A rule that ranks the offers against each other (a top-k) sets `ranks_offers`:
    it is asked once, when every live peer announced or half the round's time is gone.

    What a rule keeps from round to round is the values bound to its attributes, and no
    method changes such a value in place: it binds a new one (`self.scores = {**self.
    scores, **new}`, not `self.scores.update(new)`; the same for lists, sets, tensors and
    the records it holds). So the bindings of a moment are the rule's state at that
    moment, and a step is undone by putting them back (`Rewind`), with nothing copied:
    the node replays steps so to find whose input made a rule raise, and screening so to
    try a path. tests/algorithms/test_rule_state.py holds every rule to it.
    """

    name = "base"
    # Its parameters: a frozen dataclass declared as algorithms/params.py says.
    Params: type = NoParams
    ranks_offers = False
    # Whether validation screening (algorithms/screening.py) may wrap the rule, whether
    # its trials (step 7) are on unless a node says otherwise, and whether the rule
    # already guards its aggregate on the val split itself (pFedSV).
    screenable = True
    trials_by_default = False
    guards_aggregate = False
    heads: tuple[str, ...] | None = None  # the model.head settings it can read; None: any

    @classmethod
    def reads_head(cls, params: Any) -> bool:
        """Whether the rule, with these parameters, reads the model's classifier head
        (its own module, its keys, the features it takes): a task must then name it."""
        return cls.heads is not None

    def __init__(self, params: Any, context: Context) -> None:
        self.params = params
        self.context = context
        self._scratch: torch.nn.Module | None = None
        self._scratch_released = False  # its weights' memory given back (release_scratch)

    def scratch_model(self) -> torch.nn.Module:
        """A spare instance of the node's architecture, built on first use and kept: rules
        load peers' weights into it to score them, so building one each time is waste.
        Whatever it holds is what was loaded last; every user loads a state first."""
        if self._scratch is None:
            if self.context.new_model is None:
                raise ValueError(
                    f"{self.name} scores models on local data: the node must pass Context.new_model"
                )
            self._scratch = self.context.new_model()
        elif self._scratch_released:  # a flag, for a model's tensors take time to walk
            regrow_weights(self._scratch)
            self._scratch_released = False
        return self._scratch

    def release_scratch(self) -> None:
        """Give back the memory of the spare models' weights (this rule's and those of the
        rules it holds) until their next use: no user reads what one held before it loads
        a state, so a node waiting on its peers holds one model less (45 MB for a
        ResNet-18). The modules stay, so nothing is built again (a build costs tens of
        milliseconds, a seeded one more)."""
        for rule in rules_within(self):
            if rule._scratch is not None:
                release_weights(rule._scratch)
                rule._scratch_released = True

    def publish(self, round_no: int, state: State, data: Any) -> dict[str, State]:
        """The blobs to announce this round, by kind; `state` is the freshly trained model."""
        return {MODEL: state}

    def wanted(self, round_no: int, offered: dict[str, list[str]]) -> dict[str, list[str]]:
        """Per kind, which of the peers that announced a blob this round to download."""
        return {MODEL: list(offered.get(MODEL, []))}

    def layouts(self, kind: str) -> tuple[Layout, ...]:
        """The layouts a peer's blob of `kind` may have; none: the rule takes no such blob.
        A rule that publishes other kinds than the whole model lists them here."""
        return (self.context.layout,) if kind == MODEL else ()

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        raise NotImplementedError

    def kept_out(self, peers: set[str]) -> None:
        """The peers whose models the node's screening keeps out of this round
        (screening.py), told just before `aggregate`. A rule with memberships of its own
        reports them less these peers: whom it learns from, not whom it would."""

    def benefits(self, peers: Iterable[str], weights: Mapping[str, float]) -> dict[str, float]:
        """How much each of `peers` did for this node in the round just aggregated, the
        higher the better: a node of a bounded mesh drops the neighbour that did least.
        Here, the rule's own weight (`weights`, 0 for a peer it left out); screening
        answers from its evidence records, which add up over rounds."""
        return {peer: float(weights.get(peer, 0.0)) for peer in peers}

    def shuns(self, peer: str) -> bool:
        """Whether this node wants `peer` neither as a neighbour nor its models: by
        default never; screening shuns a peer its record keeps out. Called
        from the mesh's worker thread, so it only reads."""
        return False

    def adopted(self, state: State) -> None:
        """The model the node ends the round with, where a wrapper (screening) may have
        chosen another than this rule's outcome; a rule that keeps a reference to the
        model its next round starts from takes it from here."""

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state for the node's checkpoint: plain values and tensors."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Rewind:
    """A rule as it is now, to put back exactly: a step run only to see its outcome (the
    node's containment, screening's trial) leaves the rule as it found it.

    It copies nothing: a rule changes no value it holds in place (`PeerAlgorithm`), so
    putting back its attributes' bindings of now is putting back its state of now; the
    same for the rules a rule holds (the rule screening wraps, pFedLIA's FedAvg)."""

    def __init__(self, rule: PeerAlgorithm) -> None:
        self.saved = [(part, dict(vars(part))) for part in rules_within(rule)]

    def __call__(self) -> None:
        # Bound back before anything added since goes: the endpoint's worker thread may
        # read the rule (`shuns`) meanwhile, and must never find it without attributes.
        for part, bindings in self.saved:
            current = vars(part)
            current.update(bindings)
            for added in current.keys() - bindings.keys():
                del current[added]


def _loaded_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a state dict loads into `model` (parameters, persistent buffers), in
    memory on a device: a non-persistent buffer is no state's, so it keeps its memory."""
    return [
        tensor
        for tensor in model.state_dict(keep_vars=True).values()
        if tensor.layout == torch.strided and tensor.device.type != "meta"
    ]


def release_weights(model: torch.nn.Module) -> None:
    """`model` keeps its tensors' shapes and frees their memory (regrow_weights undoes it,
    with the values gone)."""
    for tensor in _loaded_tensors(model):
        tensor.untyped_storage().resize_(0)


def regrow_weights(model: torch.nn.Module) -> None:
    """Memory again for every tensor of `model` that release_weights emptied (tied ones
    share it), its values undefined until a state is loaded; a no-op on the others."""
    for tensor in _loaded_tensors(model):
        storage = tensor.untyped_storage()
        if storage.nbytes() < (needed := _bytes_reached(tensor)):
            storage.resize_(needed)


def _bytes_reached(tensor: torch.Tensor) -> int:
    """The bytes of its storage `tensor` reaches, from the storage's start to its last
    element (a view into a larger tensor starts past the storage's start)."""
    if tensor.numel() == 0:
        return 0
    strides = zip(tensor.shape, tensor.stride(), strict=True)
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in strides)
    return int((last + 1) * tensor.element_size())


def rules_within(rule: PeerAlgorithm) -> Iterator[PeerAlgorithm]:
    """`rule` and the rules it holds, at any depth."""
    yield rule
    for value in vars(rule).values():
        if isinstance(value, PeerAlgorithm):
            yield from rules_within(value)


@dataclass(frozen=True)
class Upload:
    """What a client sent the coordinator for a round: its trained model, how much data
    trained it, and the rule's extra tensors (e.g. per-step gradients)."""

    state: State
    n_samples: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


class CoordinatorAlgorithm(PeerAlgorithm):
    """Base for server-centric rules run by the mesh's coordinator node.

    A round: the coordinator sends each chosen client the model to start from
    (`model_for`), each client runs `client_update` on its own data and uploads,
    and the coordinator aggregates what arrived by the deadline. The same class
    runs on both sides: clients only call `client_update`.
    """

    coordinated = True
    screenable = False  # the coordinator's rule decides for its clients

    def clients_for_round(self, round_no: int, clients: list[str]) -> list[str]:
        """Who trains this round (default: every client that is alive)."""
        return list(clients)

    def model_for(self, round_no: int, client: str, initial: State) -> State:
        """The model `client` starts round `round_no` from (`initial`: the mesh's
        common initial model, for clients the rule has no model for yet)."""
        raise NotImplementedError

    def weights_for(self, client: str) -> dict[str, float]:
        """Which clients' models shaped `client`'s model, for its metrics."""
        return {client: 1.0}

    def personal_extras(self, round_no: int, client: str) -> dict[str, torch.Tensor]:
        """Tensors to send `client` beside its model for round `round_no` (e.g. models it
        is to score); they reach the client's `receive_extras`. Default: none."""
        return {}

    def extras_fit(self, kind: str, extras: Layout) -> bool:
        """Whether the extra tensors of an `upload` (from a client) or a `personal` blob
        (from the coordinator) are what this rule sends; the model beside them is checked
        by the node. Default: a rule without extras takes none."""
        return not extras

    def receive_extras(self, round_no: int, extras: dict[str, torch.Tensor]) -> None:
        """On the client, before `client_update`: the `personal_extras` that came with
        round `round_no`'s model (empty for most rules and rounds)."""

    def aggregate_uploads(self, round_no: int, uploads: dict[str, Upload]) -> dict[str, Any]:
        """Fold the round's uploads into the rule's state; return diagnostics."""
        raise NotImplementedError

    def client_update(
        self, round_no: int, model: torch.nn.Module, data: Any
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """On the client: train `model` in place; return (mean loss, extra tensors to
        upload). Default: the node's own local training, no extras."""
        assert self.context.train is not None
        seed = draw_seed(self.context.seed, self.context.node, round_no, "train")
        return self.context.train(model, data.x_train, data.y_train, None, seed=seed), {}


def draw_seed(mesh_seed: int, node: str, round_no: int, purpose: str) -> int:
    """The seed of every random draw in meshfl: a 63-bit number that differs for every
    node, round and purpose ("train", "lazy", "pfedsv/select", ...) and is the same in
    every process and run (a digest: Python's str hash is salted per process). A draw
    that belongs to the mesh rather than to one node passes the coordinator's name."""
    text = f"{mesh_seed}/{node}/{round_no}/{purpose}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def prefixed_layout(prefix: str, layout: Layout) -> Layout:
    return tuple((prefix + name, dtype, shape) for name, dtype, shape in layout)


def sample_weights(models: Mapping[str, PeerModel | Upload]) -> dict[str, float]:
    """FedAvg's weights: each model's share n_i / Σ_j n_j of the samples that trained
    them all, in the order of `models` (the order a weighted average sums in)."""
    total = sum(model.n_samples for model in models.values())
    return {name: model.n_samples / total for name, model in models.items()}


def state_part(state: State, keys: Iterable[str]) -> State:
    """The entries of `state` under `keys` (a body, a head), in the order of `keys`."""
    return {key: state[key] for key in keys}


def model_distance(first: State, second: State, keys: Iterable[str] | None = None) -> float:
    """‖first − second‖ over the floating-point entries (integer buffers mean no distance),
    summed in float64. One temporary a tensor, worked in place: with three, each freshly
    allocated, a distance between two MNIST models took ten times as long."""
    total = 0.0
    for key in keys if keys is not None else first:
        if first[key].is_floating_point():
            # A copy even of a float64 tensor (.double() would hand back the same one).
            difference = first[key].to(torch.float64, copy=True).sub_(second[key])
            total += float(difference.square_().sum())
    return math.sqrt(total)


def weighted_average(states: dict[str, State], weights: dict[str, float]) -> State:
    """Average float tensors by weight into new tensors; integer buffers come from the
    first state (averaging a BatchNorm step counter means nothing)."""
    names = list(states)
    first = states[names[0]]
    result: State = {}
    for key, tensor in first.items():
        if not tensor.is_floating_point():
            result[key] = tensor.clone()
            continue
        total = torch.zeros_like(tensor)
        for name in names:
            total.add_(states[name][key], alpha=weights[name])
        result[key] = total
    return result
