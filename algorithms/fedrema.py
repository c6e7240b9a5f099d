"""FedReMa (paper 002): relevant matching of classifiers, run by the coordinator.

Every round, over the K clients whose uploads arrived (taken in name order):

* body (Eq. 6): θ = Σ_k |D_k| θ̂_k / Σ_k |D_k|, over all of them, every round;
* during the critical co-learning period (CCP), for each client k: a probe
  h_k ~ U[0, probe_high)^d (d = the body's output size; drawn afresh per k from the
  seed, the round and k's name), soft logits p_j = softmax(φ̂_j(h_k) / M) of every
  head j with one temperature M, s_kj = cos(p_k, p_j) and s_kk = 1 (Eq. 5);
  maximum difference segmentation (Alg. 1) of s_k gives the relevant set A_k and
  its gap Δs*_k; φ_k = Σ_{i∈A_k} |D_i| φ̂_i / Σ_{i∈A_k} |D_i| (Eq. 7), and
  G[k, i] += 1 for every i in A_k, k itself included;
* the CCP goes on while Δs̄_t / max_{τ≤t} Δs̄_τ > δ (Eq. 9), Δs̄ the mean of the
  Δs*_k; once it stops it never restarts;
* after the CCP: φ_k = Σ_i G[k, i] φ̂_i / Σ_i G[k, i] (Eq. 10).

Client k then starts its next round from {θ, φ_k}. Two faults of the official code
are not reproduced (ALGORITHMS.md): it used temperature 0.5 for the own head and 1.0
for the peers', and it overwrote heads in place while still reading them, so a
client's φ_k depended on which clients happened to be aggregated before it. Here
every head is aggregated from the round's snapshot of uploads into new tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Annotated, Any, cast

import numpy as np
import torch
from torch import nn

from .base import (
    Context,
    CoordinatorAlgorithm,
    State,
    Upload,
    draw_seed,
    sample_weights,
    state_part,
    weighted_average,
)
from .params import PARAMS, finite

# A client that shares its similarity row with only one peer has nothing to choose:
# MDS ignores the gap between self and the best peer, and with K = 2 no other gap exists.
MIN_CLIENTS_FOR_MATCHING = 3


# --------------------------------------------------------------------------- pure rules


def draw_probe(
    feature_dim: int, high: float, seed: int, round_no: int, client: str
) -> torch.Tensor:
    """The random feature h ~ U[0, high)^d that client `client`'s similarities are read
    at in round `round_no`; the same on every run with the same seed."""
    rng = np.random.default_rng(draw_seed(seed, client, round_no, "fedrema/probe"))
    return torch.from_numpy(rng.uniform(0.0, high, feature_dim).astype(np.float32))


@torch.no_grad()
def probe_logits(
    model: nn.Module, head_states: Sequence[State], probes: torch.Tensor
) -> torch.Tensor:
    """logits[j, k] = φ̂_j(h_k): every head on every probe, shape (heads, probes, classes).

    `model` is a scratch model with a `head` module; each head state (its head keys only)
    is loaded into it in turn, so one model serves any number of clients.
    """
    was_training = model.training
    model.eval()
    try:
        rows = []
        for state in head_states:
            unexpected = model.load_state_dict(state, strict=False).unexpected_keys
            if unexpected:
                raise ValueError(f"head state has keys the model lacks: {unexpected}")
            rows.append(cast(nn.Module, model.head)(probes))
        return torch.stack(rows)
    finally:
        model.train(was_training)


def probe_similarity(logits: torch.Tensor, self_index: int, temperature: float) -> torch.Tensor:
    """Row `self_index` of S (Eq. 5): cosine between client `self_index`'s soft logits and
    every client's, all at the same temperature; `logits` is (clients, classes), every
    head on that client's probe. The diagonal entry is exactly 1."""
    soft = torch.softmax(logits.to(torch.float64) / temperature, dim=1)
    row = nn.functional.cosine_similarity(soft, soft[self_index].expand_as(soft), dim=1)
    row[self_index] = 1.0
    return row


def relevant_set(
    similarities_row: Sequence[float] | torch.Tensor, self_index: int
) -> tuple[list[int], float]:
    """Maximum difference segmentation (Alg. 1): (indices of A_k in ascending order, Δs*_k).

    Sort the row ascending with self on top, take the gaps between neighbours, ignore the
    top gap (self to its best peer, which would otherwise nearly always win and leave
    k alone), and cut at the largest remaining gap; A_k is everyone above the cut, so it
    holds self and at least one peer. Of equal largest gaps the lowest is cut, keeping
    more peers. With fewer than three clients there is no gap to choose: everyone, 0.0.
    """
    values = [float(value) for value in similarities_row]
    if len(values) < MIN_CLIENTS_FOR_MATCHING:
        return list(range(len(values))), 0.0
    peers = sorted((i for i in range(len(values)) if i != self_index), key=lambda i: values[i])
    order = [*peers, self_index]  # self on top even if a peer's cosine rounds above 1
    gaps = [values[upper] - values[lower] for lower, upper in pairwise(order)]
    candidates = gaps[:-1]
    cut = candidates.index(max(candidates))
    return sorted(order[cut + 1 :]), candidates[cut]


def ccp_still_on(history: Sequence[float], delta: float) -> bool:
    """Eq. 9: does the CCP go on after the latest Δs̄ in `history` (one per CCP round)?
    Until some round has separated the clients at all (a positive Δs̄), there is no
    decline to measure, so it goes on."""
    if not history:
        return True
    peak = max(history)
    return peak <= 0 or history[-1] / peak > delta


def dependency_weights(
    client: str, counts: dict[str, int], present: Sequence[str]
) -> dict[str, float]:
    """Eq. 10's weights G[k, i] / Σ_i G[k, i] over the clients `present` this round.

    A client with no count for anyone present (it joined after the CCP) keeps its own
    head: self is always in its own relevant set, so weight 1 on self is Eq. 10 with
    the only row entry there can be."""
    total = sum(counts.get(name, 0) for name in present)
    if total == 0:
        return {client: 1.0}
    return {name: counts[name] / total for name in sorted(present) if counts.get(name, 0)}


def counted(
    dependency: Mapping[str, Mapping[str, int]], relevant: Mapping[str, Sequence[str]]
) -> dict[str, dict[str, int]]:
    """A new G: the counts of `dependency` (left as they were) with one more for each
    member of each client's relevant set."""
    rows = {name: dict(row) for name, row in dependency.items()}
    for name, members in relevant.items():
        row = rows.setdefault(name, {})
        for member in members:
            row[member] = row.get(member, 0) + 1
    return rows


def aggregate_heads(
    heads: dict[str, State], weights: dict[str, dict[str, float]]
) -> dict[str, State]:
    """φ_k = Σ_i weights[k][i] φ̂_i for every k in `weights`, into new tensors.

    Reads `heads` (the round's snapshot) and never writes it, and sums in name order,
    so each φ_k is the same bits whatever order the clients are taken in.
    """
    return {
        client: weighted_average({name: heads[name] for name in sorted(row)}, row)
        for client, row in sorted(weights.items())
    }


def own_group_fraction(
    relevant_sets: dict[str, Sequence[str]], group_of: dict[str, int]
) -> float | None:
    """The share of relevant-set members, self left out, that are in their client's own
    group, pooled over the clients whose group is known; None if they chose no peer.
    The coordinator never knows the groups: this is for tests and analysis."""
    peers = [
        (client, peer)
        for client, members in relevant_sets.items()
        if client in group_of
        for peer in members
        if peer != client
    ]
    if not peers:
        return None
    same = sum(group_of.get(peer) == group_of[client] for client, peer in peers)
    return same / len(peers)


# --------------------------------------------------------------------------- the rule


class FedReMa(CoordinatorAlgorithm):
    """A shared body for everyone, a head per client from its most relevant peers.

    Diagnostics of a round: `ccp` (this round's heads came from MDS), `dependency` (G,
    counts > 0 only) and `head_weights` (client -> weights of its new head); in a CCP
    round also `ccp_continues`, `clients` (the order of S's rows and columns),
    `similarity` (S), `relevant_sets`, `max_gaps` (Δs*_k), `mean_max_gap` (Δs̄) and
    `peak_mean_max_gap`.
    """

    name = "fedrema"

    @classmethod
    def reads_head(cls, params: Any) -> bool:
        return True  # it aggregates and compares classifiers

    @dataclass(frozen=True)
    class Params:
        __pydantic_config__ = PARAMS

        # CCP threshold δ of Eq. 9 (paper: 0.5).
        delta: Annotated[float, finite("a number in [0, 1]", ge=0, le=1)] = 0.5
        # M of the soft logits, for every head alike (paper: 0.5).
        temperature: Annotated[float, finite("a finite number > 0", gt=0)] = 0.5
        # Probe entries ~ U[0, probe_high) (ALGORITHMS.md: 0.5).
        probe_high: Annotated[float, finite("a finite number > 0", gt=0)] = 0.5

    def __init__(self, params: Any, context: Context) -> None:
        super().__init__(params, context)
        if context.new_model is None:
            raise ValueError(
                "fedrema reads heads on random features: the node must pass Context.new_model"
            )
        self.body: State | None = None  # θ
        # φ_k, the last one computed for each client (`heads` is the base class's model.head
        # settings that a rule can read)
        self.client_heads: dict[str, State] = {}
        self.head_weights: dict[str, dict[str, float]] = {}
        self.dependency: dict[str, dict[str, int]] = {}  # G, counts > 0 only
        self.gap_history: list[float] = []  # Δs̄ of each CCP round that could choose
        self.ccp = True

    # --- what clients receive ----------------------------------------------

    def model_for(self, round_no: int, client: str, initial: State) -> State:
        if self.body is None:
            return initial
        # A client the rule has no head for (new, or absent so far) starts from the
        # initial head on the shared body.
        head = self.client_heads.get(client) or state_part(initial, self.context.head_keys)
        merged = {**self.body, **head}
        return {key: merged[key] for key in initial}

    def weights_for(self, client: str) -> dict[str, float]:
        return dict(self.head_weights.get(client, {client: 1.0}))

    # --- the round -----------------------------------------------------------

    def aggregate_uploads(self, round_no: int, uploads: dict[str, Upload]) -> dict[str, Any]:
        if not uploads:
            return {"ccp": self.ccp}
        snapshot = dict(sorted(uploads.items()))  # read, never written
        names = list(snapshot)
        heads = {
            name: state_part(upload.state, self.context.head_keys)
            for name, upload in snapshot.items()
        }
        self.body = weighted_average(  # Eq. 6: |D_i| / Σ_j |D_j| over every upload
            {
                name: state_part(upload.state, self.context.body_keys)
                for name, upload in snapshot.items()
            },
            sample_weights(snapshot),
        )
        if self.ccp:
            weights, diagnostics = self._match(round_no, heads, snapshot)
        else:
            weights = {
                name: dependency_weights(name, self.dependency.get(name, {}), names)
                for name in names
            }
            diagnostics = {"ccp": False}
        self.client_heads = {**self.client_heads, **aggregate_heads(heads, weights)}
        self.head_weights = {**self.head_weights, **weights}
        diagnostics["dependency"] = {k: dict(row) for k, row in sorted(self.dependency.items())}
        diagnostics["head_weights"] = weights
        return diagnostics

    def _match(
        self, round_no: int, heads: dict[str, State], uploads: dict[str, Upload]
    ) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
        """One CCP round: S, the relevant sets, Eq. 7's weights, G and the CCP test."""
        names = list(heads)
        similarity = self._similarity(round_no, heads)
        relevant: dict[str, list[str]] = {}
        gaps: dict[str, float] = {}
        for index, name in enumerate(names):
            members, gaps[name] = relevant_set(similarity[index], index)
            relevant[name] = [names[i] for i in members]
        self.dependency = counted(self.dependency, relevant)
        mean_gap = sum(gaps.values()) / len(gaps)
        if len(names) >= MIN_CLIENTS_FOR_MATCHING:
            # A round of one or two uploads separates nobody; its Δs̄ = 0 would end the CCP.
            self.gap_history = [*self.gap_history, mean_gap]
            self.ccp = ccp_still_on(self.gap_history, self.params.delta)
        # Eq. 7: |D_i| / Σ_{j ∈ A_k} |D_j| over each client's relevant set A_k
        weights = {
            name: sample_weights({member: uploads[member] for member in sorted(members)})
            for name, members in relevant.items()
        }
        return weights, {
            "ccp": True,
            "ccp_continues": self.ccp,
            "clients": names,
            "similarity": similarity.tolist(),
            "relevant_sets": relevant,
            "max_gaps": gaps,
            "mean_max_gap": mean_gap,
            "peak_mean_max_gap": max(self.gap_history, default=0.0),
        }

    def _similarity(self, round_no: int, heads: dict[str, State]) -> torch.Tensor:
        """S (K x K): row k compares every head with k's on k's own probe."""
        model = self.scratch_model()
        names = list(heads)
        probes = torch.stack(
            [
                draw_probe(
                    cast(int, model.feature_dim),
                    self.params.probe_high,
                    self.context.seed,
                    round_no,
                    name,
                )
                for name in names
            ]
        )
        logits = probe_logits(model, list(heads.values()), probes)  # (heads, probes, classes)
        return torch.stack(
            [probe_similarity(logits[:, k], k, self.params.temperature) for k in range(len(names))]
        )

    # --- checkpoint ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "body": self.body,
            "heads": self.client_heads,
            "head_weights": self.head_weights,
            "dependency": self.dependency,
            "gap_history": self.gap_history,
            "ccp": self.ccp,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.body, self.client_heads = state["body"], state["heads"]
        self.head_weights, self.dependency = state["head_weights"], state["dependency"]
        self.gap_history, self.ccp = list(state["gap_history"]), bool(state["ccp"])
