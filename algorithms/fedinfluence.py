"""Fed-Influence (paper 001): FedAvg with client sampling on the coordinator, plus an
estimate, for every client c, of how the global parameters would differ had c never
taken part (its FIP ε^{-c}).

Client k, when picked, takes `local_steps` plain SGD steps with rate η from the
global model and, before each step i, the per-sample gradients of `samples_per_step`
random samples of its own at that step's weights. They travel with the model as
one extra tensor per parameter: (steps, samples, numel).

Coordinator, each round t with uploads C_t, for every known client c and parameter
tensor j (weight and bias separately):

* combinatorial term κ = w_t(C_t∖{c}) − w_t = n_c (w_t − w^c) / (N − n_c) for a
  participant, 0 otherwise;
* sequential term σ = Σ_{k∈C_t∖{c}} n_k / N(C_t∖{c}) · σ^k, where σ^k starts at
  ε^{-c}_{t−1} and each of k's gradient sets G takes σ^k ← σ^k − (η/s) Gᵀ(G σ^k)
  (Alg. 3: the Fisher stand-in for the Hessian, never formed). All clients move at
  once: ε of every client is one row of a (clients × numel) matrix, so each step of
  each uploader is two matrix products;
* LWET (Alg. 2): while tensor j's flag is up, ε = σ + κ unless ‖σ‖ > ‖ε_{t−1}‖,
  which drops the flag for good; once down, ε = κ. With `lwet: client` the flags
  belong to (uploader k, tensor j) and a failing σ^k is left out of σ (Alg. 4);
  `lwet: off` keeps the basic estimator.

The papers loop over c one at a time, so a flag dropping halfway through a round
would treat the clients before and after it differently, in an order they leave
open. Here each round decides once, for all clients: a flag drops when the test
fails for any of them, and then applies to all of them in that round.

FIL = L(w_t + ε^{-c}) − L(w_t) and FIA (the same for accuracy) are measured on the
coordinator's data, which no client trains on: every split of its shard. Positive
FIL: removing c would raise the loss, so c helps. ε is kept in float64: near the
end of training σ differs from ε_{t−1} by a relative amount far below float32's
resolution, and rounding alone would then trip the LWET test.

Client cleansing (`cleanse_at`): after that round's FIL, the lowest (or highest, or
a random) `cleanse_fraction` of the known clients are never picked again.
`leave_out` removes one client from every C_t of the same seeded schedule: the
exact leave-one-out run that the estimate is checked against.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

import numpy as np
import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call, grad, vmap

from .base import (
    Context,
    CoordinatorAlgorithm,
    Layout,
    State,
    Upload,
    cloned,
    draw_seed,
    sample_weights,
    weighted_average,
)
from .params import PARAMS, Flag, at_least, finite, rule

# Separate random streams, so that e.g. turning the estimator off never changes training.
_PICK_STREAM, _BATCH_STREAM, _GRADIENT_STREAM, _CLEANSE_STREAM = 11, 12, 13, 14
_GRADIENT_DTYPES = {"float32": torch.float32, "float16": torch.float16}


# --------------------------------------------------------------------------- pure rules


def propagate(fip: torch.Tensor, gradient_sets: torch.Tensor, lr: float) -> torch.Tensor:
    """Alg. 3 for every client at once: Π_i (I − η/s G_iᵀ G_i) applied to each row of
    `fip` (clients × p), the steps in order; `gradient_sets` is (steps, s, p)."""
    sigma = fip
    for gradients in gradient_sets:
        sigma = sigma - (lr / gradients.shape[0]) * ((sigma @ gradients.T) @ gradients)
    return sigma


def mixing_weights(n_samples: Sequence[int], rows: Sequence[int], num_clients: int) -> torch.Tensor:
    """mix[c, k] = n_k / N(C_t∖{c}) for k ≠ c, and 0 on k = c: the weight of uploader
    k's local sequential influence in client c's σ. `rows[k]` is uploader k's row."""
    counts = torch.tensor(n_samples, dtype=torch.float64)
    totals = torch.full((num_clients,), counts.sum().item(), dtype=torch.float64)
    row_index = torch.tensor(rows, dtype=torch.long)
    totals[row_index] -= counts
    mix = counts.unsqueeze(0).expand(num_clients, -1).clone()
    mix[row_index, torch.arange(len(rows))] = 0.0
    has_others = totals > 0
    mix[has_others] /= totals[has_others].unsqueeze(1)
    return mix


def combinatorial_terms(
    uploaded: torch.Tensor,
    n_samples: Sequence[int],
    new_global: torch.Tensor,
    old_global: torch.Tensor,
) -> torch.Tensor:
    """κ for each uploader (rows of `uploaded`, K × p): w_t(C_t∖{c}) − w_t. If c was the
    only uploader, removing it leaves the round without training: w_{t−1} − w_t."""
    counts = torch.tensor(n_samples, dtype=torch.float64).unsqueeze(1)
    others = counts.sum() - counts
    if len(n_samples) == 1:
        return (old_global - new_global).unsqueeze(0)
    return counts * (new_global.unsqueeze(0) - uploaded) / others


@dataclass
class RoundInputs:
    """One tensor's share of a round, as the FIP update needs it."""

    fip: torch.Tensor  # ε_{t−1}, clients × p, float64
    gradients: list[torch.Tensor]  # per uploader: (steps, s, p), float64
    mix: torch.Tensor  # clients × uploaders (see mixing_weights)
    kappa: torch.Tensor  # clients × p, zero rows for non-participants
    lr: float

    def alone(self) -> torch.Tensor:
        """Rows of clients that were the only uploader: nobody else's training moves
        their ε, so it carries over unchanged (σ = ε_{t−1})."""
        return (self.mix.sum(dim=1) == 0).unsqueeze(1)


def update_tensor_flag(inputs: RoundInputs, flag_up: bool) -> tuple[torch.Tensor, bool]:
    """Alg. 2 for one tensor: (ε_t, flag after the round)."""
    if not flag_up:
        return inputs.kappa.clone(), False
    sigma = sequential_term(inputs, [True] * len(inputs.gradients))
    grew = sigma.norm(dim=1) > inputs.fip.norm(dim=1)
    if bool(grew.any()):
        return inputs.kappa.clone(), False
    return sigma + inputs.kappa, True


def update_client_flags(
    inputs: RoundInputs, flags_up: Sequence[bool]
) -> tuple[torch.Tensor, list[bool]]:
    """Alg. 4 for one tensor: each uploader k with its flag up adds σ^k to the clients it
    mixes into, unless ‖σ^k‖ > ‖ε_{t−1}‖ for any of them, which drops k's flag."""
    previous_norm = inputs.fip.norm(dim=1)
    kept = list(flags_up)
    sigma = inputs.fip * inputs.alone()
    for k, gradient_sets in enumerate(inputs.gradients):
        if not kept[k]:
            continue
        local = propagate(inputs.fip, gradient_sets, inputs.lr)
        mixes_into = inputs.mix[:, k] > 0
        if bool((local.norm(dim=1) > previous_norm)[mixes_into].any()):
            kept[k] = False
            continue
        sigma = sigma + inputs.mix[:, k : k + 1] * local
    return sigma + inputs.kappa, kept


def sequential_term(inputs: RoundInputs, included: Sequence[bool]) -> torch.Tensor:
    """σ for every client: the mix of the uploaders' propagated ε (those `included`)."""
    sigma = inputs.fip * inputs.alone()
    for k, gradient_sets in enumerate(inputs.gradients):
        if included[k]:
            sigma = sigma + inputs.mix[:, k : k + 1] * propagate(
                inputs.fip, gradient_sets, inputs.lr
            )
    return sigma


def per_sample_gradients(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Gradient of each sample's cross-entropy, per parameter: name → (samples, *shape),
    by vectorizing one sample's gradient over the batch (no Python loop over samples).
    In eval mode: a sample's gradient is its own only where batch normalization uses
    its running statistics (a batch of one has none of its own) and dropout is off."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss_of_one(
        weights: dict[str, torch.Tensor], sample: torch.Tensor, label: torch.Tensor
    ) -> torch.Tensor:
        logits = functional_call(model, (weights, buffers), (sample.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, label.unsqueeze(0))

    was_training = model.training
    model.eval()
    try:
        return vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)
    finally:
        model.train(was_training)


@torch.no_grad()
def loss_and_accuracy(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of `model` on (x, y)."""
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(y), batch):
        logits = model(x[start : start + batch])
        labels = y[start : start + batch]
        total_loss += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == labels).sum())
    model.train()
    return total_loss / max(1, len(y)), correct / max(1, len(y))


def pick_clients(pool: Sequence[str], count: int, seed: int, round_no: int) -> list[str]:
    """C_t: `count` of the `pool` (all if 0 or more than there are), seeded by round."""
    ordered = sorted(pool)
    if count <= 0 or count >= len(ordered):
        return ordered
    rng = np.random.default_rng((seed, _PICK_STREAM, round_no))
    return sorted(ordered[i] for i in rng.choice(len(ordered), size=count, replace=False))


def clients_to_cleanse(fil: dict[str, float], fraction: float, mode: str, seed: int) -> list[str]:
    """The share `fraction` of the clients in `fil` (rounded, at least one if the
    fraction is positive) with the lowest or highest FIL, or drawn at random."""
    names = sorted(fil)
    count = min(len(names), max(1 if fraction > 0 else 0, round(fraction * len(names))))
    if mode == "random":
        rng = np.random.default_rng((seed, _CLEANSE_STREAM))
        return sorted(names[i] for i in rng.choice(len(names), size=count, replace=False))
    ranked = sorted(names, key=lambda name: (fil[name], name), reverse=mode == "highest")
    return sorted(ranked[:count])


def client_stream(seed: int, stream: int, round_no: int, client: str) -> torch.Generator:
    return torch.Generator().manual_seed(
        draw_seed(seed, client, round_no, f"fedinfluence/{stream}")
    )


def _flat(state: State, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    return {key: state[key].detach().reshape(-1).to(torch.float64) for key in keys}


# --------------------------------------------------------------------------- the rule


class FedInfluence(CoordinatorAlgorithm):
    """FedAvg over K sampled clients a round, with every client's influence estimated.

    Diagnostics of a round: `weights` (uploader → sample weight), `test_loss` and
    `test_acc` of w_t on the coordinator's data, and, with the estimator on,
    `fip_norm` (client → ‖ε^{-c}‖), `lwet_flags` (tensor → 1 while its sequential
    term is kept; with `lwet: client`, tensor → {uploader → 0/1}), `fil` and `fia`
    (client → value, on evaluation rounds), `seconds` (average, fip, evaluate);
    `cleansed` in the cleansing round, `rejected` (client → why) for malformed uploads.
    """

    name = "fedinfluence"

    @dataclass(frozen=True)
    class Params:
        __pydantic_config__ = PARAMS

        # η of the clients' plain SGD, also used by the recursion.
        lr: Annotated[float, finite("a finite number > 0", gt=0)] = 0.01
        local_steps: Annotated[int, at_least(1)] = 5  # m
        # N_s, per-sample gradients recorded per step.
        samples_per_step: Annotated[int, at_least(1)] = 50
        clients_per_round: Annotated[int, at_least(0)] = 10  # K = |C_t|; 0: every client
        # The dtype of the uploaded gradients.
        gradient_dtype: Annotated[
            Literal["float32", "float16"], Field(description="float32 or float16")
        ] = "float32"
        lwet: Annotated[  # Alg. 2, Alg. 4, none
            Literal["tensor", "client", "off"], Field(description="tensor, client or off")
        ] = "tensor"
        estimator: Flag = True  # False: plain FedAvg on the same schedule
        # FIL/FIA every this many rounds (and at cleanse_at).
        evaluate_every: Annotated[int, at_least(1)] = 1
        # After this round's FIL, drop clients; 0: never.
        cleanse_at: Annotated[int, at_least(0)] = 0
        cleanse_fraction: Annotated[float, finite("a number >= 0 and < 1", ge=0, lt=1)] = 0.1
        cleanse_mode: Annotated[
            Literal["lowest", "highest", "random"], Field(description="lowest, highest or random")
        ] = "lowest"
        # A client removed from every C_t (exact leave-one-out).
        leave_out: Annotated[str, rule("a client name, or empty for none")] = ""

        def for_rounds(self, rounds: int) -> FedInfluence.Params:
            """These parameters, checked against a run of `rounds` rounds (see
            parse_params): the cleansing round must come, and with the estimator on,
            some round must measure FIL (every `evaluate_every`-th, and `cleanse_at`)."""
            if self.cleanse_at > rounds:
                raise ValueError(
                    f"cleanse_at: got {self.cleanse_at}, but with rounds {rounds} "
                    f"the cleansing never comes; allowed: 0 (never) or 1 to "
                    f"{rounds}, or rounds >= {self.cleanse_at}"
                )
            if self.estimator and self.evaluate_every > rounds and not self.cleanse_at:
                raise ValueError(
                    f"evaluate_every: got {self.evaluate_every}, but with rounds "
                    f"{rounds} no round measures the clients' influence (FIL); "
                    f"allowed: 1 to {rounds}, rounds >= {self.evaluate_every}, "
                    "a cleanse_at round, or algorithm.estimator=false"
                )
            return self

    def __init__(self, params: Any, context: Context) -> None:
        super().__init__(params, context)
        self.global_state: State | None = None
        self.initial: State | None = None
        self.weights: dict[str, float] = {}
        self.clients: list[str] = []  # row order of the FIP matrices
        self.fip: dict[str, torch.Tensor] = {}  # tensor → clients × numel, float64
        self.tensor_flags: dict[str, bool] = {}  # Alg. 2: tensor → flag up
        self.client_flags: dict[str, dict[str, bool]] = {}  # Alg. 4: tensor → uploader → up
        self.cleansed: list[str] = []
        self.last_fil: dict[str, float] = {}
        self._keys: list[str] | None = None

    # --- the schedule --------------------------------------------------------

    def clients_for_round(self, round_no: int, clients: list[str]) -> list[str]:
        self._register(clients)
        pool = [name for name in clients if name not in self.cleansed]
        chosen = pick_clients(pool, self.params.clients_per_round, self.context.seed, round_no)
        return [name for name in chosen if name != self.params.leave_out]

    def model_for(self, round_no: int, client: str, initial: State) -> State:
        if self.initial is None:
            self.initial = cloned(initial)
        return self.global_state if self.global_state is not None else initial

    def weights_for(self, client: str) -> dict[str, float]:
        return dict(self.weights)

    def extras_fit(self, kind: str, extras: Layout) -> bool:
        """An upload's extras are per-sample gradient sets of the model's float entries:
        (local_steps, 1..samples_per_step, numel) in `gradient_dtype`, or in float32 where
        the blob's codec widened them (fp16 widens every half float it carries: WIRE.md
        9.2); nothing else. The rule reads them in float64 either way."""
        if kind != "upload" or not self.params.estimator:
            return not extras
        numels = {
            name: math.prod(shape)
            for name, dtype, shape in self.context.layout
            if dtype == "float32"
        }
        return all(
            name in numels
            and dtype in (self.params.gradient_dtype, "float32")
            and len(shape) == 3
            and shape[0] == self.params.local_steps
            and 1 <= shape[1] <= self.params.samples_per_step
            and shape[2] == numels[name]
            for name, dtype, shape in extras
        )

    # --- the client ------------------------------------------------------------

    def client_update(
        self, round_no: int, model: nn.Module, data: Any
    ) -> tuple[float, dict[str, torch.Tensor]]:
        """`local_steps` plain SGD steps on batches of the mesh's batch size (the whole
        train split if it is smaller), with the gradient sets recorded before each step."""
        x, y = data.x_train, data.y_train
        node, seed = self.context.node, self.context.seed
        batches = client_stream(seed, _BATCH_STREAM, round_no, node)
        picks = client_stream(seed, _GRADIENT_STREAM, round_no, node)
        batch_size = min(self.context.batch_size, len(y))
        sample_count = min(self.params.samples_per_step, len(y))
        recorded: dict[str, list[torch.Tensor]] = {}
        losses = []
        model.train()
        for _ in range(self.params.local_steps):
            if self.params.estimator:
                chosen = torch.randperm(len(y), generator=picks)[:sample_count]
                for name, grads in per_sample_gradients(model, x[chosen], y[chosen]).items():
                    recorded.setdefault(name, []).append(grads.reshape(sample_count, -1))
            batch = torch.randperm(len(y), generator=batches)[:batch_size]
            losses.append(self._sgd_step(model, x[batch], y[batch]))
        model.zero_grad(set_to_none=True)  # as training does: no copy of the model kept
        dtype = _GRADIENT_DTYPES[self.params.gradient_dtype]
        extras = {name: torch.stack(steps).to(dtype) for name, steps in recorded.items()}
        return sum(losses) / len(losses), extras

    def _sgd_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-self.params.lr)
        return loss.item()

    # --- the coordinator ---------------------------------------------------------

    def aggregate_uploads(self, round_no: int, uploads: dict[str, Upload]) -> dict[str, Any]:
        self._register(list(uploads))
        uploads, rejected = self._well_formed(uploads)
        diagnostics: dict[str, Any] = {"rejected": rejected} if rejected else {}
        if not uploads:
            return diagnostics
        clock = time.perf_counter()
        uploads = dict(sorted(uploads.items()))
        old_global = self.global_state or self.initial or next(iter(uploads.values())).state
        self.weights = sample_weights(uploads)
        self.global_state = weighted_average(
            {name: upload.state for name, upload in uploads.items()}, self.weights
        )
        seconds = {"average": time.perf_counter() - clock}
        diagnostics["weights"] = dict(self.weights)
        if self.params.estimator:
            clock = time.perf_counter()
            self._update_fip(uploads, old_global)
            seconds["fip"] = time.perf_counter() - clock
            diagnostics["fip_norm"] = self.fip_norms()
            diagnostics["lwet_flags"] = self._flags_for_metrics()
        clock = time.perf_counter()
        diagnostics.update(self._evaluate(round_no))
        seconds["evaluate"] = time.perf_counter() - clock
        if self.params.cleanse_at and round_no == self.params.cleanse_at:
            diagnostics["cleansed"] = self.cleanse()
        diagnostics["seconds"] = seconds
        return diagnostics

    def _register(self, clients: Sequence[str]) -> None:
        """New clients get a row of zeros: ε_0 = 0, nothing of theirs is in w yet."""
        new = [name for name in sorted(clients) if name not in self.clients]
        if not new:
            return
        self.clients = [*self.clients, *new]
        self.fip = {
            key: torch.cat([matrix, matrix.new_zeros(len(new), matrix.shape[1])])
            for key, matrix in self.fip.items()
        }

    def _parameter_keys(self) -> list[str]:
        """The tensors ε covers: the parameters (buffers, if any, are only averaged)."""
        if self._keys is None:
            self._keys = [name for name, _ in self.scratch_model().named_parameters()]
        return self._keys

    def _well_formed(self, uploads: dict[str, Upload]) -> tuple[dict[str, Upload], dict[str, str]]:
        """The uploads fit to aggregate, and why the others are not: their gradients come
        off the network, so a wrong shape must cost the sender its round, not the run."""
        if not self.params.estimator:
            return uploads, {}
        shapes = {name: p.numel() for name, p in self.scratch_model().named_parameters()}
        good, rejected = {}, {}
        for client, upload in uploads.items():
            problem = _gradient_problem(upload, shapes, self.params)
            if problem:
                rejected[client] = problem
            else:
                good[client] = upload
        return good, rejected

    def _update_fip(self, uploads: dict[str, Upload], old_global: State) -> None:
        names = list(uploads)
        counts = [uploads[name].n_samples for name in names]
        rows = [self.clients.index(name) for name in names]
        mix = mixing_weights(counts, rows, len(self.clients))
        keys = self._parameter_keys()
        assert self.global_state is not None, "the round's average comes first"
        new_flat, old_flat = _flat(self.global_state, keys), _flat(old_global, keys)
        flat_uploads = [_flat(uploads[name].state, keys) for name in names]
        fip = dict(self.fip)
        for key in keys:
            uploaded = torch.stack([flat[key] for flat in flat_uploads])
            kappa = torch.zeros(len(self.clients), new_flat[key].numel(), dtype=torch.float64)
            kappa[rows] = combinatorial_terms(uploaded, counts, new_flat[key], old_flat[key])
            inputs = RoundInputs(
                fip=fip.get(key, torch.zeros_like(kappa)),
                gradients=[uploads[n].extras[key].to(torch.float64) for n in names],
                mix=mix,
                kappa=kappa,
                lr=self.params.lr,
            )
            fip[key] = self._lwet(key, names, inputs)
        self.fip = fip

    def _lwet(self, key: str, uploaders: list[str], inputs: RoundInputs) -> torch.Tensor:
        if self.params.lwet == "off":
            return sequential_term(inputs, [True] * len(uploaders)) + inputs.kappa
        if self.params.lwet == "tensor":
            fip, flag = update_tensor_flag(inputs, self.tensor_flags.get(key, True))
            self.tensor_flags = {**self.tensor_flags, key: flag}
            return fip
        flags = self.client_flags.get(key, {})
        fip, kept = update_client_flags(inputs, [flags.get(n, True) for n in uploaders])
        self.client_flags = {
            **self.client_flags,
            key: {**flags, **dict(zip(uploaders, kept, strict=True))},
        }
        return fip

    def fip_of(self, client: str) -> State:
        """ε^{-c} as a state of parameter tensors (float64)."""
        row = self.clients.index(client)
        reference = self.scratch_model().state_dict()
        return {
            key: self.fip[key][row].reshape(reference[key].shape) for key in self._parameter_keys()
        }

    def fip_norms(self) -> dict[str, float]:
        if not self.fip:
            return {name: 0.0 for name in self.clients}
        # A tensor, never sum()'s start 0: fip is not empty.
        squares = cast(torch.Tensor, sum(matrix.pow(2).sum(dim=1) for matrix in self.fip.values()))
        return {
            name: float(value) for name, value in zip(self.clients, squares.sqrt(), strict=True)
        }

    def _flags_for_metrics(self) -> dict[str, Any]:
        if self.params.lwet == "client":
            return {
                key: {name: int(up) for name, up in sorted(flags.items())}
                for key, flags in self.client_flags.items()
            }
        return {key: int(self.tensor_flags.get(key, True)) for key in self._parameter_keys()}

    # --- influence on loss and accuracy, cleansing ---------------------------------

    def _evaluate(self, round_no: int) -> dict[str, Any]:
        x, y = self.evaluation_set()
        if len(y) == 0:
            return {}
        assert self.global_state is not None, "the round's average comes first"
        model = self.scratch_model()
        model.load_state_dict(self.global_state)
        loss, accuracy = loss_and_accuracy(model, x, y)
        result: dict[str, Any] = {"test_loss": loss, "test_acc": accuracy}
        due = round_no % self.params.evaluate_every == 0 or round_no == self.params.cleanse_at
        if self.params.estimator and due:
            fil, fia = self.influence_on_performance(x, y, loss, accuracy)
            self.last_fil = fil
            result.update(fil=fil, fia=fia)
        return result

    def evaluation_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The coordinator trains on nothing, so its whole shard is held out."""
        data = self.context.data
        if data is None:
            return torch.zeros(0), torch.zeros(0, dtype=torch.long)
        # Sliced whole: a split the node streams (a task's big Dataset) is read in here.
        splits = (data.x_train, data.x_val, data.x_test)
        return (
            torch.cat([split[: len(split)] for split in splits]),
            torch.cat([data.y_train, data.y_val, data.y_test]),
        )

    def influence_on_performance(
        self, x: torch.Tensor, y: torch.Tensor, loss: float, accuracy: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        """FIL and FIA of every known client: w_t + ε^{-c} scored against w_t."""
        assert self.global_state is not None, "w_t is the last round's average"
        model = self.scratch_model()
        fil, fia = {}, {}
        for client in self.clients:
            shifted = {key: value.to(torch.float64) for key, value in self.global_state.items()}
            for key, delta in self.fip_of(client).items():
                shifted[key] = shifted[key] + delta
            model.load_state_dict(
                {key: value.to(self.global_state[key].dtype) for key, value in shifted.items()}
            )
            shifted_loss, shifted_accuracy = loss_and_accuracy(model, x, y)
            fil[client], fia[client] = shifted_loss - loss, shifted_accuracy - accuracy
        return fil, fia

    def cleanse(self) -> list[str]:
        """Drop `cleanse_fraction` of the clients not yet dropped, by the latest FIL (or at
        random), from every later round; the round `cleanse_at` calls it."""
        candidates = {
            name: value for name, value in self.last_fil.items() if name not in self.cleansed
        }
        if self.params.cleanse_mode == "random":
            candidates = {name: 0.0 for name in self.clients if name not in self.cleansed}
        dropped = clients_to_cleanse(
            candidates, self.params.cleanse_fraction, self.params.cleanse_mode, self.context.seed
        )
        self.cleansed = sorted({*self.cleansed, *dropped})
        return dropped

    # --- checkpoint ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_state": self.global_state,
            "initial": self.initial,
            "weights": self.weights,
            "clients": list(self.clients),
            "fip": self.fip,
            "tensor_flags": self.tensor_flags,
            "client_flags": self.client_flags,
            "cleansed": list(self.cleansed),
            "last_fil": self.last_fil,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_state, self.initial = state["global_state"], state["initial"]
        self.weights, self.clients = state["weights"], list(state["clients"])
        self.fip, self.tensor_flags = state["fip"], state["tensor_flags"]
        self.client_flags, self.cleansed = state["client_flags"], list(state["cleansed"])
        self.last_fil = state["last_fil"]


def _gradient_problem(upload: Upload, numels: dict[str, int], params: Any) -> str:
    """Why an upload's gradient sets cannot be used ('' if they can)."""
    for name, numel in numels.items():
        grads = upload.extras.get(name)
        if grads is None:
            return f"no gradients for {name}"
        if grads.dim() != 3 or grads.shape[0] != params.local_steps or grads.shape[2] != numel:
            return f"gradients of {name} have shape {tuple(grads.shape)}"
        if not 1 <= grads.shape[1] <= params.samples_per_step or not grads.is_floating_point():
            return f"gradients of {name} have {grads.shape[1]} samples or a non-float dtype"
        # The coordinator's runtime refuses NaN, inf and n < 1 before a rule sees an
        # upload; these checks stand for callers that hand uploads in directly.
        if not bool(torch.isfinite(grads).all()):
            return f"gradients of {name} are not finite"
    if upload.n_samples < 1:
        return "no samples"
    return ""
