"""The two baselines every experiment reports: Local and FedAvg."""

from __future__ import annotations

from typing import Any

from .base import Aggregate, PeerAlgorithm, PeerModel, weighted_average


class Local(PeerAlgorithm):
    """No communication: every node keeps training its own model."""

    name = "local"

    def wanted_peers(self, round_no: int, offered: list[str]) -> list[str]:
        return []

    def aggregate(
        self, round_no: int, own: PeerModel, received: dict[str, PeerModel], data: Any
    ) -> Aggregate:
        return Aggregate(state=own.state, weights={self.context.node: 1.0})


class FedAvg(PeerAlgorithm):
    """Sample-weighted average of the own model and every model received."""

    name = "fedavg"

    def aggregate(
        self, round_no: int, own: PeerModel, received: dict[str, PeerModel], data: Any
    ) -> Aggregate:
        models = {self.context.node: own, **received}
        total = sum(model.n_samples for model in models.values())
        weights = {name: model.n_samples / total for name, model in models.items()}
        state = weighted_average({name: models[name].state for name in models}, weights)
        return Aggregate(state=state, weights=weights)
