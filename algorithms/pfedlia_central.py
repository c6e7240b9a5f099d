"""pFedLIA with centralized clustering (paper 003; ALGORITHMS.md, pFedLIA step 4,
"Centralized variant"): the coordinator gathers every client's row of lazy-influence
scores and clusters the rows with OPTICS, once.

The schedule, by round number (clients run the same rule with the same parameters, so
both sides know W):

1. Rounds 1..W (`warmup`): FedAvg on the coordinator, as `fedavg_server`. θ_0 is the
   model every client starts round W+1 from: the global model after round W (W = 0:
   the mesh's initial model).
2. Round W+1: client j first trains its lazy model θ̃_j from θ_0 (`lazy_epochs` epochs
   on its seeded batch Z_j of `lazy_batch` training samples, drawn as in peer-to-peer
   pFedLIA), then trains as usual, and uploads θ̃_j beside its model. The coordinator
   keeps averaging.
3. Round W+2, and every later round until the coordinator has clustered: the coordinator
   sends each client θ_0 and every lazy model it holds beside the client's model; the
   client scores I(i,j) = Σ_{z∈val_i} [L(z,θ_0) − L(z,θ̃_j)] for each of them (self
   included, on its own validation split) and uploads that row beside its model.
4. In the first round that brings rows, the coordinator clusters and never again:
   scikit-learn's OPTICS on the rows (clients that sent one) over the lazy models that
   every row scored with a finite number (a lazy model whose loss blew up says nothing
   about anyone). Raw scores, Euclidean distance, sklearn's default ξ = 0.05 cluster
   extraction; OPTICS draws nothing at random, so the clusters are a function of the
   rows. `min_samples` (default 2) is both OPTICS's neighbourhood size and its smallest
   cluster: 2 is the least that lets it form a cluster at all, so a cluster of two
   clients can be found; larger values merge small clusters or turn them into noise.
   A client OPTICS calls noise (label −1) is a group of its own, and so is every client
   when fewer rows than `min_samples` arrived, and every client that sent no row.
5. From that round's aggregation on, client i's personal model is the sample-weighted
   average of the round's uploads from its group's members (a group with no upload in
   a round keeps its last model).

What travels. Tensors beside a model are the coordinator role's extras: the upload of
round W+1 carries `lazy/<key>` (θ̃_j), the personal message carries `anchor/<key>` (θ_0)
and `lazy/<client>/<key>` (each θ̃), and the scoring upload `score/<client>` (one
float64 per lazy model). A client whose lazy model missed round W+1 has no column, and
one that missed the clustering round stays alone: clustering happens once.

Diagnostics in the coordinator's metrics: `phase` (warmup, lazy, scoring, clustered,
grouped) every round; FedAvg's `weights` before clustering; in the clustering round
`lazy_scores` (client → {lazy model's client → I}) and `clusters` (client → OPTICS
label, −1 for noise); from then on `groups` (client → its sorted members) and
`group_weights` (client → the weights of its model). The coordinator never knows the
true clusters; the launcher scores `groups` against them (ARI).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any

import numpy as np
import torch

from .base import (
    Context,
    CoordinatorAlgorithm,
    Layout,
    NoParams,
    State,
    Upload,
    cloned,
    prefixed_layout,
    sample_weights,
    weighted_average,
)
from .baselines import ServerFedAvg
from .params import PARAMS, Flag, at_least
from .pfedlia import (
    Warmup,
    lazy_influence_scores,
    lazy_seed,
    require_fitted_warmup,
    train_lazy_model,
    warmup_for_rounds,
)

LAZY, ANCHOR, SCORE = "lazy/", "anchor/", "score/"  # name prefixes of the extras
NOISE = -1  # OPTICS's label for a point in no cluster


@dataclass(frozen=True)
class PFedLIACentralParams:
    __pydantic_config__ = PARAMS

    # W: FedAvg rounds on the coordinator before the lazy round (W+1); the clustering
    # comes in round W+2. Paper: 20. Left out (None): rounds // 2, at most 20, at most
    # rounds - 2 (pfedlia.fitted_warmup).
    warmup: Warmup | None = None
    lazy_epochs: Annotated[int, at_least(1)] = 5  # k: epochs over Z_j that turn θ_0 into θ̃_j
    lazy_batch: Annotated[int, at_least(1)] = 100  # |Z_j|
    # OPTICS's neighbourhood size and smallest cluster.
    min_samples: Annotated[int, at_least(2)] = 2
    # True: the run is the warm-up alone, on purpose (FedAvg; no lazy round, no groups).
    warmup_only: Flag = False

    def for_rounds(self, rounds: int) -> PFedLIACentralParams:
        """These parameters with W fitted to a run of `rounds` rounds (see parse_params)."""
        return replace(
            self,
            warmup=warmup_for_rounds(
                self.warmup,
                self.warmup_only,
                rounds,
                2,
                "the round that clusters the clients (round warmup + 2)",
            ),
        )


# --------------------------------------------------------------------------- clustering


def shared_finite_columns(rows: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The lazy models that every row scored with a finite number, sorted."""
    columns = set.intersection(*(set(row) for row in rows.values())) if rows else set()
    return sorted(
        column for column in columns if all(math.isfinite(row[column]) for row in rows.values())
    )


def optics_clusters(rows: Mapping[str, Mapping[str, float]], min_samples: int) -> dict[str, int]:
    """client → OPTICS cluster of its score row (NOISE: in none). With fewer rows than
    `min_samples`, or no column every row shares, nobody is clustered."""
    # Imported here: scikit-learn is slow to import and only the coordinator needs it.
    # One thread: a few dozen rows cost less than OpenMP's start-up, and the cores
    # belong to the mesh's node processes.
    from sklearn.cluster import OPTICS
    from threadpoolctl import threadpool_limits

    clients = sorted(rows)
    columns = shared_finite_columns(rows)
    if len(clients) < min_samples or not columns:
        return {client: NOISE for client in clients}
    matrix = np.array(
        [[rows[client][column] for column in columns] for client in clients], dtype=np.float64
    )
    with threadpool_limits(limits=1):
        labels = OPTICS(min_samples=min_samples).fit(matrix).labels_
    return {client: int(label) for client, label in zip(clients, labels, strict=True)}


def groups_of(labels: Mapping[str, int]) -> dict[str, list[str]]:
    """client → the sorted members of its cluster; a noise point is a group of its own."""
    members: dict[int, list[str]] = {}
    for client, label in sorted(labels.items()):
        if label != NOISE:
            members.setdefault(label, []).append(client)
    return {
        client: members[label] if label != NOISE else [client]
        for client, label in sorted(labels.items())
    }


def group_averages(
    groups: Mapping[str, list[str]], uploads: Mapping[str, Upload]
) -> tuple[dict[str, State], dict[str, dict[str, float]]]:
    """For every client with a group member among the uploads: the sample-weighted
    average of those members' models and its weights. A client without a group is
    alone. Members that share a group share one average (computed once)."""
    models: dict[str, State] = {}
    weights: dict[str, dict[str, float]] = {}
    averaged: dict[tuple[str, ...], State] = {}
    for client in sorted({*groups, *uploads}):
        present = tuple(m for m in groups.get(client, [client]) if m in uploads)
        if not present:
            continue
        weights[client] = sample_weights({member: uploads[member] for member in sorted(present)})
        if present not in averaged:
            averaged[present] = weighted_average(
                {m: uploads[m].state for m in present}, weights[client]
            )
        models[client] = averaged[present]
    return models, weights


# --------------------------------------------------------------------------- extras


def prefixed(prefix: str, state: State) -> dict[str, torch.Tensor]:
    return {prefix + key: value for key, value in state.items()}


def unprefixed(prefix: str, tensors: Mapping[str, torch.Tensor]) -> State:
    return {
        key.removeprefix(prefix): value for key, value in tensors.items() if key.startswith(prefix)
    }


def per_client(prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, State]:
    """`<prefix><client>/<key>` tensors regrouped as client → state (names hold no '/')."""
    states: dict[str, State] = {}
    for name, value in unprefixed(prefix, tensors).items():
        client, _, key = name.partition("/")
        states.setdefault(client, {})[key] = value
    return states


# --------------------------------------------------------------------------- the rule


class PFedLIACentral(CoordinatorAlgorithm):
    """Warm-up FedAvg, one lazy round, rows of scores clustered once by OPTICS on the
    coordinator, then FedAvg within each cluster."""

    name = "pfedlia_central"
    Params = PFedLIACentralParams

    def __init__(self, params: PFedLIACentralParams, context: Context) -> None:
        require_fitted_warmup(params.warmup)
        super().__init__(params, context)
        self._fedavg = ServerFedAvg(NoParams(), context)
        # The coordinator's side.
        self.anchor: State | None = None  # θ_0
        self.lazy_models: dict[str, State] = {}  # client → θ̃
        self.rows: dict[str, dict[str, float]] = {}  # client → I(client, ·)
        self.groups: dict[str, list[str]] | None = None  # None until clustered
        self.personal: dict[str, State] = {}  # client → its group's latest average
        self.group_weights: dict[str, dict[str, float]] = {}
        # The client's side: θ_0 and the lazy models to score in this round.
        self._to_score: tuple[State, dict[str, State]] | None = None

    def _lazy_round(self) -> int:
        return self.params.warmup + 1

    def _scoring(self, round_no: int) -> bool:
        return round_no > self._lazy_round() and self.groups is None and bool(self.lazy_models)

    # --- the extras on the wire ------------------------------------------------

    def extras_fit(self, kind: str, extras: Layout) -> bool:
        """Uploads carry a lazy model (whole) and one float64 score per scored peer;
        `personal` blobs the anchor and the lazy models, each a whole model."""
        model = self.context.layout
        if kind == "upload":
            lazy = tuple(spec for spec in extras if spec[0].startswith(LAZY))
            scores = [spec for spec in extras if not spec[0].startswith(LAZY)]
            return lazy in ((), prefixed_layout(LAZY, model)) and all(
                name.startswith(SCORE) and dtype == "float64" and shape == (1,)
                for name, dtype, shape in scores
            )
        if not extras:
            return True
        anchor = prefixed_layout(ANCHOR, model)
        lazy = extras[len(anchor) :]
        owners = dict.fromkeys(name.removeprefix(LAZY).partition("/")[0] for name, _, _ in lazy)
        return extras[: len(anchor)] == anchor and lazy == tuple(
            spec for owner in owners for spec in prefixed_layout(f"{LAZY}{owner}/", model)
        )

    # --- the coordinator: what clients receive -------------------------------

    def model_for(self, round_no: int, client: str, initial: State) -> State:
        if client in self.personal:
            return self.personal[client]
        state = self._fedavg.model_for(round_no, client, initial)
        if round_no == self._lazy_round() and self.anchor is None:
            self.anchor = {key: value.clone() for key, value in state.items()}
        return state

    def personal_extras(self, round_no: int, client: str) -> dict[str, torch.Tensor]:
        if not self._scoring(round_no) or self.anchor is None:
            return {}
        extras = prefixed(ANCHOR, self.anchor)
        for owner, state in sorted(self.lazy_models.items()):
            extras.update(prefixed(f"{LAZY}{owner}/", state))
        return extras

    def weights_for(self, client: str) -> dict[str, float]:
        if self.groups is None:
            return self._fedavg.weights_for(client)
        return dict(self.group_weights.get(client, {client: 1.0}))

    # --- the coordinator: the round ------------------------------------------

    def aggregate_uploads(self, round_no: int, uploads: dict[str, Upload]) -> dict[str, Any]:
        for client, upload in sorted(uploads.items()):
            if lazy := unprefixed(LAZY, upload.extras):
                self.lazy_models = {**self.lazy_models, client: lazy}
            if row := unprefixed(SCORE, upload.extras):
                scores = {peer: float(score.reshape(-1)[0]) for peer, score in sorted(row.items())}
                self.rows = {**self.rows, client: scores}
        if self.groups is None and self.rows:
            return {"phase": "clustered", **self._cluster(), **self._average_groups(uploads)}
        if self.groups is not None:
            return {"phase": "grouped", **self._average_groups(uploads)}
        diagnostics = self._fedavg.aggregate_uploads(round_no, uploads)
        return {"phase": self._phase_before_clustering(round_no), **diagnostics}

    def _phase_before_clustering(self, round_no: int) -> str:
        if round_no <= self.params.warmup:
            return "warmup"
        return "lazy" if round_no == self._lazy_round() else "scoring"

    def _cluster(self) -> dict[str, Any]:
        labels = optics_clusters(self.rows, self.params.min_samples)
        self.groups = groups_of(labels)
        return {"lazy_scores": dict(sorted(self.rows.items())), "clusters": labels}

    def _average_groups(self, uploads: dict[str, Upload]) -> dict[str, Any]:
        assert self.groups is not None
        models, weights = group_averages(self.groups, uploads)
        self.personal = {**self.personal, **models}
        self.group_weights = {**self.group_weights, **weights}
        return {"groups": self.groups, "group_weights": weights}

    # --- the client ------------------------------------------------------------

    def receive_extras(self, round_no: int, extras: dict[str, torch.Tensor]) -> None:
        anchor, lazy_models = unprefixed(ANCHOR, extras), per_client(LAZY, extras)
        self._to_score = (anchor, lazy_models) if anchor and lazy_models else None

    def client_update(
        self, round_no: int, model: torch.nn.Module, data: Any
    ) -> tuple[float, dict[str, torch.Tensor]]:
        extras: dict[str, torch.Tensor] = {}
        if round_no == self._lazy_round():
            # The model this round starts from is θ_0: keep it before training moves it.
            anchor = cloned(model.state_dict())
            extras.update(prefixed(LAZY, self._train_lazy_model(anchor, data)))
        if self._to_score is not None:
            extras.update(self._score_row(data))
        loss, _ = super().client_update(round_no, model, data)
        return loss, extras

    def _train_lazy_model(self, anchor: State, data: Any) -> State:
        assert self.context.new_model is not None and self.context.train is not None
        return train_lazy_model(
            self.context.new_model(),
            anchor,
            data.x_train,
            data.y_train,
            self.params.lazy_batch,
            self.params.lazy_epochs,
            self.context.train,
            lazy_seed(self.context.seed, self.context.node),
        )

    def _score_row(self, data: Any) -> dict[str, torch.Tensor]:
        assert self._to_score is not None and self.context.new_model is not None
        anchor, lazy_models = self._to_score
        self._to_score = None
        scores = lazy_influence_scores(
            self.context.new_model(), anchor, lazy_models, data.x_val, data.y_val
        )
        # A lazy model so far off that its loss overflows scores NaN or inf: leave its
        # column out (the coordinator keeps the columns every row has), rather than
        # spoil this client's upload, which the coordinator would refuse whole.
        return {
            SCORE + peer: torch.tensor([score], dtype=torch.float64)
            for peer, score in scores.items()
            if math.isfinite(score)
        }

    # --- checkpoint ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "fedavg": self._fedavg.state_dict(),
            "anchor": self.anchor,
            "lazy_models": self.lazy_models,
            "rows": self.rows,
            "groups": self.groups,
            "personal": self.personal,
            "group_weights": self.group_weights,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fedavg.load_state_dict(state["fedavg"])
        self.anchor, self.lazy_models = state["anchor"], dict(state["lazy_models"])
        self.rows, self.groups = dict(state["rows"]), state["groups"]
        self.personal, self.group_weights = dict(state["personal"]), state["group_weights"]
