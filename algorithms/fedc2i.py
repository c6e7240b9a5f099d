"""FedC²I (paper 000): client- and class-level influence, computed by every peer on its own.

At node m, with M = m plus every peer whose round-t model arrived (K models), on one
random batch B of m's train split:

* client level (Eq. 4-6): θ^{-i} is the uniform mean of the other K-1 bodies, l^{-i} the
  loss of (θ^{-i}, φ_m) on B, λ_i = (l^{-i})^γ / Σ_k (l^{-k})^γ and θ̄_m = Σ_i λ_i θ_i.
  Removing an influential peer hurts, so a large l^{-i} gives peer i a large weight.
* class level (Eq. 7-10): φ_c^{-i} is the mean of the other peers' class vectors c
  (weight row and bias entry); putting it in place of row c of φ_m, on features of m's
  own body, gives l^{i,-c}; Λ[i, c] normalizes those losses over i like Eq. 5, and
  φ̄_{m,c} = Σ_i Λ[i, c] φ_{i,c} (the paper prints φ_{m,c} in the sum, a no-op typo).

The body and the head each follow one of three rules (`influence`, `fedavg`, `local`):
the paper's ablations FedC²I−λ, −Λ/l and −Λ/g are cells of that grid.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast, get_args

import torch
from pydantic import Field
from torch import nn
from torch.nn import functional

from .base import (
    MODEL,
    Aggregate,
    Context,
    PeerAlgorithm,
    PeerModel,
    ReceivedModels,
    State,
    sample_weights,
    state_part,
    weighted_average,
)
from .params import PARAMS, finite

PartRule = Literal["influence", "fedavg", "local"]
# A part's rule as a parameter, its choices named in an error and in the JSON Schema.
_PartSetting = Annotated[PartRule, Field(description=", ".join(get_args(PartRule)))]


# --------------------------------------------------------------------------- pure rules


def influence_weights(losses: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 5 (a vector of K losses) and Eq. 9 (a K x C matrix, per column):
    loss^γ normalized to sum to 1 over the first dimension, in float64.

    Computed as softmax(γ·log loss), the same ratio without overflow for a large γ.
    γ = 0 gives uniform weights, whatever the losses.
    """
    losses = losses.detach().to(torch.float64)
    if gamma == 0:
        return torch.full_like(losses, 1.0 / losses.shape[0])
    # A zero loss would give log 0 = -inf; the smallest normal float keeps it finite.
    logs = losses.clamp_min(torch.finfo(torch.float64).tiny).log()
    return torch.softmax(gamma * logs, dim=0)


def leave_one_out_means(stacked: torch.Tensor) -> torch.Tensor:
    """out[i] = mean of stacked[j] over j != i (Eq. 4, Eq. 7), for K >= 2 stacked entries:
    one sum minus each entry, not K sums of K-1."""
    count = stacked.shape[0]
    if count < 2:
        raise ValueError(f"leave-one-out means need at least 2 entries, got {count}")
    return (stacked.sum(dim=0, keepdim=True) - stacked).div_(count - 1)


def leave_one_out_bodies(bodies: list[State]) -> list[State]:
    """θ^{-i} for every i (Eq. 4): each float entry averaged over the other bodies.

    Integer entries (BatchNorm step counters) are left out: they are not averaged, the
    caller takes them from its own model.
    """
    float_keys = [key for key, tensor in bodies[0].items() if tensor.is_floating_point()]
    means = {
        key: leave_one_out_means(torch.stack([body[key] for body in bodies])) for key in float_keys
    }
    return [{key: means[key][index] for key in float_keys} for index in range(len(bodies))]


def class_losses_vectorized(
    features: torch.Tensor,
    heads_weight: torch.Tensor,
    heads_bias: torch.Tensor,
    own_weight: torch.Tensor,
    own_bias: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    """l^{i,-c} for all K peers and C classes (K x C), from one batch of features.

    heads_weight (K, C, D) and heads_bias (K, C) are the K heads; own_weight (C, D) and
    own_bias (C,) the node's. Replacing class row c changes only logit column c, so
    every candidate's logits are the own logits with column c swapped for
    features · φ_c^{-i}: one (N, K, C) product gives all swapped columns at once.
    """
    loo_weight = leave_one_out_means(heads_weight)
    loo_bias = leave_one_out_means(heads_bias)
    own_logits = features @ own_weight.T + own_bias  # (N, C)
    swapped_columns = torch.einsum("nd,kcd->nkc", features, loo_weight) + loo_bias
    samples, peers, classes = swapped_columns.shape
    # logits[n, i, c, j]: the swapped value where j == c, the own logit everywhere else.
    is_swapped = torch.eye(classes, dtype=torch.bool, device=features.device)
    logits = torch.where(is_swapped, swapped_columns.unsqueeze(-1), own_logits[:, None, None, :])
    per_sample = functional.cross_entropy(
        logits.reshape(-1, classes), labels.repeat_interleave(peers * classes), reduction="none"
    )
    return per_sample.view(samples, peers, classes).mean(dim=0)


def class_losses_naive(
    model: nn.Module,
    heads_weight: torch.Tensor,
    heads_bias: torch.Tensor,
    x: torch.Tensor,
    labels: torch.Tensor,
) -> torch.Tensor:
    """The reference for `class_losses_vectorized`, read literally from the paper: for each
    of the K·C candidates, put row c of the own head (which `model` holds, with the own
    body) to the mean of the other peers' rows c and run the whole model on the batch.
    `model` is left as it came."""
    peers, classes, _ = heads_weight.shape
    head = cast(nn.Linear, model.head)  # model.head=last: one linear layer
    own_weight, own_bias = head.weight.detach().clone(), head.bias.detach().clone()
    losses = torch.empty(peers, classes, dtype=own_weight.dtype)
    with torch.no_grad():
        for i in range(peers):
            others = [j for j in range(peers) if j != i]
            for c in range(classes):
                head.weight.copy_(own_weight)
                head.bias.copy_(own_bias)
                head.weight[c] = heads_weight[others, c].mean(dim=0)
                head.bias[c] = heads_bias[others, c].mean(dim=0)
                losses[i, c] = functional.cross_entropy(model(x), labels)
        head.weight.copy_(own_weight)
        head.bias.copy_(own_bias)
    return losses


def body_losses(
    model: nn.Module, own_state: State, loo_bodies: list[State], x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """l^{-i} (Eq. 4-5): the loss on (x, y) of each θ^{-i} under the node's own head.

    `model` is scratch space: it is overwritten with own_state plus each body in turn.
    Evaluation mode, so no BatchNorm statistic moves while scoring.
    """
    losses = torch.empty(len(loo_bodies))
    model.eval()
    with torch.no_grad():
        for index, body in enumerate(loo_bodies):
            model.load_state_dict({**own_state, **body})
            losses[index] = functional.cross_entropy(model(x), y)
    return losses


def influence_head(
    heads_weight: torch.Tensor, heads_bias: torch.Tensor, matrix: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 10 with its typo fixed: φ̄_c = Σ_i Λ[i, c] φ_{i,c}, for weight rows and biases."""
    weights = matrix.to(heads_weight.dtype)
    return (torch.einsum("kc,kcd->cd", weights, heads_weight), (weights * heads_bias).sum(dim=0))


# --------------------------------------------------------------------------- the measurement


@dataclass
class Influence:
    """What one round's measurement found; a field is None when its rule did not need it."""

    vector: torch.Tensor | None = None  # λ, (K,)
    batch_losses: torch.Tensor | None = None  # l^{-i}, (K,)
    matrix: torch.Tensor | None = None  # Λ, (K, C)
    seconds: float = 0.0


def measure_influence(
    model: nn.Module,
    states: list[State],
    own_index: int,
    body_keys: list[str],
    head_weight_key: str,
    head_bias_key: str,
    x: torch.Tensor,
    y: torch.Tensor,
    gamma: float,
    vector: bool = True,
    matrix: bool = True,
    naive: bool = False,
) -> Influence:
    """λ and/or Λ of the node at `own_index` among `states`, on the batch (x, y).

    `model` (the node's architecture, with a `body` and a one-layer `head`) is scratch
    space. `naive` scores the class level with `class_losses_naive` (K·C model passes),
    for tests and the overhead benchmark.
    """
    started = time.perf_counter()
    own_state = states[own_index]
    result = Influence()
    if vector:
        bodies = [state_part(state, body_keys) for state in states]
        result.batch_losses = body_losses(model, own_state, leave_one_out_bodies(bodies), x, y)
        result.vector = influence_weights(result.batch_losses, gamma)
    if matrix:
        heads_weight = torch.stack([state[head_weight_key] for state in states])
        heads_bias = torch.stack([state[head_bias_key] for state in states])
        model.eval()
        with torch.no_grad():
            model.load_state_dict(own_state)  # m's own current body and head
            if naive:
                losses = class_losses_naive(model, heads_weight, heads_bias, x, y)
            else:
                losses = class_losses_vectorized(  # the one feature pass
                    cast(nn.Module, model.body)(x),
                    heads_weight,
                    heads_bias,
                    own_state[head_weight_key],
                    own_state[head_bias_key],
                    y,
                )
        result.matrix = influence_weights(losses, gamma)
    result.seconds = time.perf_counter() - started
    return result


def influence_batch(
    x: torch.Tensor, y: torch.Tensor, size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One random batch B of `size` samples (all of them if fewer), drawn without replacement."""
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(len(y), generator=generator)[:size]
    return x[chosen], y[chosen].long()


def round_seed(seed: int, node: str, round_no: int) -> int:
    """A seed for node `node`'s batch in round `round_no`, stable across processes
    (Python's own str hash is salted per process)."""
    digest = hashlib.sha256(f"fedc2i/{seed}/{node}/{round_no}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes up to 2**63 - 1


# --------------------------------------------------------------------------- the rule


class FedC2I(PeerAlgorithm):
    """Personalized aggregation by influence vector (body) and influence matrix (head)."""

    name = "fedc2i"
    heads = ("last",)  # class vectors are the rows of one linear head
    # Its influence vector mixes in the bodies of peers whose data differ in kind, which
    # validates worse the round they are mixed in and better some rounds of training
    # later (feature shift): only screening's trials see that far ahead.
    trials_by_default = True

    @dataclass(frozen=True)
    class Params:
        __pydantic_config__ = PARAMS

        # Sensitivity to influence; 0 gives uniform weights (paper: 5).
        gamma: Annotated[float, finite("a finite number >= 0", ge=0)] = 5.0
        body: _PartSetting = "influence"
        head: _PartSetting = "influence"

    def __init__(self, params: Any, context: Context) -> None:
        super().__init__(params, context)
        self.head_weight_key, self.head_bias_key = _class_vector_keys(context.head_keys)
        if context.new_model is None:
            raise ValueError(
                "fedc2i scores models on local data: the node must pass Context.new_model"
            )

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        me = self.context.node
        # One order for every node; the snapshot is read, never written.
        models = dict(sorted({me: own, **received.get(MODEL, {})}.items()))
        names = list(models)
        if len(models) == 1:
            return Aggregate(
                state=own.state,
                weights={me: 1.0},
                diagnostics={"influence_vector": {me: 1.0}, "influence_seconds": 0.0},
            )
        x, y = influence_batch(
            data.x_train,
            data.y_train,
            self.context.batch_size,
            round_seed(self.context.seed, me, round_no),
        )
        states = [models[name].state for name in names]
        float_body_keys = [
            key for key in self.context.body_keys if own.state[key].is_floating_point()
        ]
        influence = measure_influence(
            self.scratch_model(),
            states,
            names.index(me),
            float_body_keys,
            self.head_weight_key,
            self.head_bias_key,
            x,
            y,
            self.params.gamma,
            vector=self.params.body == "influence",
            matrix=self.params.head == "influence",
        )
        body_weights = self._body_weights(models, influence)
        mixed: State = {}
        if self.params.body != "local":  # local: the own body bit for bit, not 1·own + 0·peers
            mixed.update(
                weighted_average(
                    {name: state_part(models[name].state, float_body_keys) for name in names},
                    body_weights,
                )
            )
        mixed.update(self._head(models, influence))
        # Integer buffers and the parts a rule keeps local are copies of the own entries.
        state = {
            key: mixed[key] if key in mixed else tensor.clone() for key, tensor in own.state.items()
        }
        return Aggregate(
            state=state, weights=body_weights, diagnostics=_diagnostics(names, influence)
        )

    def _body_weights(self, models: dict[str, PeerModel], influence: Influence) -> dict[str, float]:
        rule = self.params.body
        if rule == "influence":
            assert influence.vector is not None, "measured for the influence rule"
            return dict(zip(models, influence.vector.tolist(), strict=True))
        if rule == "fedavg":
            return sample_weights(models)
        return {name: float(name == self.context.node) for name in models}

    def _head(self, models: dict[str, PeerModel], influence: Influence) -> State:
        rule, keys = self.params.head, (self.head_weight_key, self.head_bias_key)
        if rule == "local":
            return {}
        states = {name: state_part(model.state, keys) for name, model in models.items()}
        if rule == "fedavg":
            return weighted_average(states, sample_weights(models))
        assert influence.matrix is not None, "measured for the influence rule"
        weight, bias = influence_head(
            torch.stack([state[self.head_weight_key] for state in states.values()]),
            torch.stack([state[self.head_bias_key] for state in states.values()]),
            influence.matrix,
        )
        return {self.head_weight_key: weight, self.head_bias_key: bias}


def _class_vector_keys(head_keys: tuple[str, ...]) -> tuple[str, str]:
    """The weight and bias keys of a head that is one linear layer (model.head=last)."""
    weights = [key for key in head_keys if key.endswith(".weight")]
    biases = [key for key in head_keys if key.endswith(".bias")]
    if len(head_keys) != 2 or len(weights) != 1 or len(biases) != 1:
        raise ValueError(
            "fedc2i reads class vectors as the rows of one linear head "
            f"(model.head=last); this model's head has {list(head_keys)}"
        )
    return weights[0], biases[0]


def _diagnostics(names: list[str], influence: Influence) -> dict[str, Any]:
    """JSON-able: λ and l^{-i} per peer, Λ as a row of C values per peer."""
    found: dict[str, Any] = {"influence_seconds": influence.seconds}
    if influence.vector is not None:
        found["influence_vector"] = dict(zip(names, influence.vector.tolist(), strict=True))
        assert influence.batch_losses is not None, "measured with the vector"
        found["batch_losses"] = dict(zip(names, influence.batch_losses.tolist(), strict=True))
    if influence.matrix is not None:
        found["influence_matrix"] = dict(zip(names, influence.matrix.tolist(), strict=True))
    return found
