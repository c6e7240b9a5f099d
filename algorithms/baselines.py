"""The two baselines every experiment reports: Local and FedAvg."""

from __future__ import annotations

from typing import Any

from .base import MODEL, Aggregate, PeerAlgorithm, PeerModel, Received, weighted_average


class Local(PeerAlgorithm):
    """No communication: every node keeps training its own model."""

    name = "local"

    def wanted(self, round_no: int, offered: dict[str, list[str]]) -> dict[str, list[str]]:
        return {}

    def aggregate(self, round_no: int, own: PeerModel, received: Received, data: Any) -> Aggregate:
        return Aggregate(state=own.state, weights={self.context.node: 1.0})


class FedAvg(PeerAlgorithm):
    """Sample-weighted average of the own model and every model received."""

    name = "fedavg"

    def aggregate(self, round_no: int, own: PeerModel, received: Received, data: Any) -> Aggregate:
        # One order for every node, so that over a full mesh all compute the same bits.
        models = dict(sorted({self.context.node: own, **received.get(MODEL, {})}.items()))
        total = sum(model.n_samples for model in models.values())
        weights = {name: model.n_samples / total for name, model in models.items()}
        state = weighted_average({name: models[name].state for name in models}, weights)
        return Aggregate(state=state, weights=weights)
