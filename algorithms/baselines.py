"""The baselines every experiment reports: Local and FedAvg (peer-to-peer and on a
coordinator)."""

from __future__ import annotations

from typing import Any

from .base import (
    MODEL,
    Aggregate,
    Context,
    CoordinatorAlgorithm,
    PeerAlgorithm,
    PeerModel,
    ReceivedModels,
    State,
    Upload,
    sample_weights,
    weighted_average,
)


class Local(PeerAlgorithm):
    """No communication: every node keeps training its own model."""

    name = "local"
    screenable = False  # takes nothing from peers

    def wanted(self, round_no: int, offered: dict[str, list[str]]) -> dict[str, list[str]]:
        return {}

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        return Aggregate(state=own.state, weights={self.context.node: 1.0})


class FedAvg(PeerAlgorithm):
    """Sample-weighted average of the own model and every model received."""

    name = "fedavg"

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        # One order for every node, so that over a full mesh all compute the same bits.
        models = dict(sorted({self.context.node: own, **received.get(MODEL, {})}.items()))
        weights = sample_weights(models)
        state = weighted_average({name: models[name].state for name in models}, weights)
        return Aggregate(state=state, weights=weights)


class ServerFedAvg(CoordinatorAlgorithm):
    """FedAvg on the coordinator: every client starts each round from the sample-weighted
    average of the last uploads. The baseline of the server-centric papers, and the
    simplest exercise of the coordinator role."""

    name = "fedavg_server"

    def __init__(self, params: Any, context: Context) -> None:
        super().__init__(params, context)
        self.global_state: State | None = None
        self.weights: dict[str, float] = {}

    def model_for(self, round_no: int, client: str, initial: State) -> State:
        return self.global_state if self.global_state is not None else initial

    def weights_for(self, client: str) -> dict[str, float]:
        return dict(self.weights)

    def aggregate_uploads(self, round_no: int, uploads: dict[str, Upload]) -> dict[str, Any]:
        if not uploads:
            return {}
        self.weights = sample_weights(dict(sorted(uploads.items())))
        self.global_state = weighted_average(
            {name: upload.state for name, upload in uploads.items()}, self.weights
        )
        return {"weights": self.weights}

    def state_dict(self) -> dict[str, Any]:
        return {"global_state": self.global_state, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_state, self.weights = state["global_state"], state["weights"]
