"""Byzantine-robust baselines as peer rules: each aggregates the models a node received
plus its own, and none trusts a peer's sample count.

With n models (the own one included) of which at most f are an attacker's:

- `median`: the coordinate-wise median. For an even n the lower of the two middle
  values, so that every coordinate is some model's value and a peer's weight is the
  share of coordinates taken from it.
- `trimmed_mean` (beta): per coordinate, drop the floor(beta·n) lowest and highest
  values and average the rest; a peer's weight is its share of the kept values.
- `krum` (f): the model whose summed squared distance to its n − f − 2 nearest models
  is smallest (Blanchard et al., 2017). Where fewer than f + 3 models came (a small
  mesh, or peers screened out), f is lowered to n − 3 for the round, so that each model
  still has a neighbour to be scored by; with n ≤ 2 the rule keeps the own model.
- `multikrum` (f, m): the plain average of the m models with the lowest Krum scores
  (m = 0: n − f).

Integer buffers (a BatchNorm step counter) come from the own model: they are counts,
not estimates. Float tensors are compared in float64, so that the distances of large
models do not lose their small differences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import torch

from .base import MODEL, Aggregate, PeerAlgorithm, PeerModel, ReceivedModels, State
from .params import PARAMS, at_least, finite


def float_keys(state: State) -> list[str]:
    return [key for key, tensor in state.items() if tensor.is_floating_point()]


def stacked(states: list[State], key: str) -> torch.Tensor:
    """The models' values of `key`, one row per model: shape (models, numel)."""
    return torch.stack([state[key].detach().reshape(-1).to(torch.float64) for state in states])


def coordinate_median(states: list[State]) -> tuple[State, list[float]]:
    """The lower coordinate-wise median and each model's share of the coordinates."""
    result, taken = dict(states[0]), torch.zeros(len(states), dtype=torch.float64)
    for key in float_keys(states[0]):
        values, picks = stacked(states, key).median(dim=0)
        result[key] = values.reshape(states[0][key].shape).to(states[0][key].dtype)
        taken += torch.bincount(picks, minlength=len(states)).to(torch.float64)
    return result, _shares(taken)


def trimmed_mean(states: list[State], beta: float) -> tuple[State, list[float]]:
    """The coordinate-wise mean after dropping floor(beta·n) values at each end, and each
    model's share of the kept values."""
    trim = math.floor(beta * len(states))
    result, kept = dict(states[0]), torch.zeros(len(states), dtype=torch.float64)
    for key in float_keys(states[0]):
        ordered, order = stacked(states, key).sort(dim=0)
        middle = slice(trim, len(states) - trim)
        result[key] = (
            ordered[middle].mean(dim=0).reshape(states[0][key].shape).to(states[0][key].dtype)
        )
        kept += torch.bincount(order[middle].reshape(-1), minlength=len(states)).to(torch.float64)
    return result, _shares(kept)


def krum_scores(states: list[State], f: int) -> list[float]:
    """Each model's summed squared distance to its n − f − 2 nearest other models."""
    flat = torch.cat([stacked(states, key) for key in float_keys(states[0])], dim=1)
    distances = torch.cdist(flat, flat).pow(2)
    neighbours = len(states) - f - 2
    scores = []
    for row, model_distances in enumerate(distances):
        others = torch.cat([model_distances[:row], model_distances[row + 1 :]])
        scores.append(float(others.sort().values[:neighbours].sum()))
    return scores


def _shares(counts: torch.Tensor) -> list[float]:
    total = float(counts.sum())
    return [float(count) / total for count in counts]


def _average(states: list[State]) -> State:
    result = dict(states[0])
    for key in float_keys(states[0]):
        result[key] = (
            stacked(states, key).mean(dim=0).reshape(states[0][key].shape).to(states[0][key].dtype)
        )
    return result


class _RobustRule(PeerAlgorithm):
    """Gathers the own model and every received one, in one order on every node."""

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        models = dict(sorted({self.context.node: own, **received.get(MODEL, {})}.items()))
        names = list(models)
        own_ints = {key: value for key, value in own.state.items() if not value.is_floating_point()}
        state, shares = self.combine(
            [models[name].state for name in names], names.index(self.context.node)
        )
        weights = {name: share for name, share in zip(names, shares, strict=True) if share > 0}
        return Aggregate(state={**state, **own_ints}, weights=weights)

    def combine(self, states: list[State], own: int) -> tuple[State, list[float]]:
        raise NotImplementedError


class Median(_RobustRule):
    name = "median"

    def combine(self, states: list[State], own: int) -> tuple[State, list[float]]:
        return coordinate_median(states)


@dataclass(frozen=True)
class TrimmedMeanParams:
    __pydantic_config__ = PARAMS

    # The share of the values dropped at each end, per coordinate.
    beta: Annotated[float, finite("a number >= 0 and < 0.5", ge=0, lt=0.5)] = 0.2


class TrimmedMean(_RobustRule):
    name = "trimmed_mean"
    Params = TrimmedMeanParams

    def combine(self, states: list[State], own: int) -> tuple[State, list[float]]:
        return trimmed_mean(states, self.params.beta)


@dataclass(frozen=True)
class KrumParams:
    __pydantic_config__ = PARAMS

    f: Annotated[int, at_least(0)] = 2  # the attackers the rule is built to outvote
    m: Annotated[int, at_least(0)] = 0  # multikrum only: how many models to average (0: n − f)


class Krum(_RobustRule):
    name = "krum"
    Params = KrumParams

    def chosen(self, states: list[State], own: int) -> list[int]:
        """The models the rule keeps: Krum's best one (the own model when too few)."""
        if len(states) <= 2:
            return [own]
        scores = krum_scores(states, self.round_f(len(states)))
        return [min(range(len(states)), key=lambda i: (scores[i], i))]

    def round_f(self, models: int) -> int:
        """f for a round of `models` models: the configured f, lowered to models − 3."""
        return min(self.params.f, models - 3)

    def combine(self, states: list[State], own: int) -> tuple[State, list[float]]:
        picks = self.chosen(states, own)
        shares = [1 / len(picks) if i in picks else 0.0 for i in range(len(states))]
        return _average([states[i] for i in picks]), shares


class MultiKrum(Krum):
    name = "multikrum"

    def chosen(self, states: list[State], own: int) -> list[int]:
        if len(states) <= 2:
            return [own]
        f = self.round_f(len(states))
        scores = krum_scores(states, f)
        count = self.params.m or len(states) - f
        return sorted(sorted(range(len(states)), key=lambda i: (scores[i], i))[:count])
