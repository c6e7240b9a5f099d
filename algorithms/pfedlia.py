"""pFedLIA (paper 003, ALGORITHMS.md): every peer clusters the mesh on its own, once, by
the lazy influence of each peer's data on its own validation split.

The schedule at node i, by round number (the same for every node, so every node
publishes the same kinds in a round and nobody waits on a kind a peer never sends):

1. Rounds 1..W (`warmup`): FedAvg over the whole mesh. The model after round W's
   aggregation is θ_0, the anchor (W = 0: the mesh's seeded initial model).
2. Round W+1: node j trains θ̃_j from θ_0 for `lazy_epochs` epochs of the node's own
   training recipe on one seeded batch Z_j of `lazy_batch` samples of its train split,
   and publishes it as kind "lazy" beside its model. Node i fetches every lazy blob and
   scores I(i,j) = Σ_{z ∈ val_i} [L(z, θ_0) − L(z, θ̃_j)] (Eq. 1; self included), splits
   the scores by 2-means (seeded, n_init = 10) and keeps the higher-mean cluster, plus
   itself, as its group. It fetches every model in this round and averages its group's.
   With `split: harm` (the default) a peer of the lower cluster joins the group too
   unless its lazy model, mixed into the average of the group's lazy models at the share
   an equal average would give it, does harm by the evidence screening asks for: the val
   loss up by evidence.HARM_BOUND paired standard errors, or most val samples worse by
   as many (evidence.sign_z). 2-means always cuts the scores in two, and where the peers'
   data are alike (iid shards) or mildly skewed the cut falls through noise and leaves
   out peers who would help. Judged alone, a lazy model of a mildly skewed shard forgets
   the node's other labels; in the group's average it adds its data, while a lazy model
   of another cluster is worse, mixed in, on most of the node's samples.
   `split: 2-means` is the paper's rule.
3. Rounds > W+1: FedAvg over the group only (groups may be asymmetric). Only the group's
   models are downloaded.

Peers that arrive late. From round W+1 on every node keeps announcing its lazy model
(kind "lazy") and its anchor θ_0 (kind "anchor") every round: an announcement is a
digest, and a blob travels only when someone asks for it, so this costs announces, not
bytes. A node that has never scored a peer asks for that peer's lazy blob, scores it
against its own θ_0 and puts it in its group when the score is nearer the beneficial
2-means center than the other one (or, with `split: harm`, when its lazy model does no
harm mixed into the group's): clustering is not redone, the newcomer is placed on
the existing split. A newcomer (or any node without θ_0, e.g. one that joined during the
lazy round) fetches every anchor in its first round, takes their average as θ_0 (over a
full mesh the anchors are bit-identical), trains its own lazy model from it, scores
every lazy blob on offer and fits its own split. In that first round it cannot have a
lazy model or an anchor yet, but it must still announce both kinds (peers wait for
every kind they publish); it announces a one-number placeholder ("not ready"), which
peers skip and ask for again next round. So a newcomer is in its own group after its
first round and is scored by everybody one round later.

Ground truth (diagnostics and the Oracle). A simulated `clusters:<k>` node knows its own
generating cluster (data.info["true_cluster"]) and nothing about anyone else's. Every
node therefore publishes that number as a tiny blob of kind "truth" (-1 when its data has
none) every round; each peer fetches it once per peer. This works for joiners and for
any naming, unlike guessing the cluster from a name like "node7" and the partition rule.
With it each node records the precision and recall of its group against its true
cluster, and `oracle: true` replaces the lazy phase by the true clusters: from round W+1
a node's group is the peers that reported its own true cluster. The warm-up is kept so
that the Oracle differs from pFedLIA only in how the groups are found.

Behind screening (algorithms/screening.py) a node averages only the group's peers that
screening admits; the group it reports (`diagnostics.group`, with its precision and
recall) is those: whom it learns from. Its split itself is kept as fitted.

Equal tensors. Two nodes of the same true cluster publish the same "truth", all anchors
are bit-identical after a full-mesh warm-up, and a lazy model republished next round is
the same bytes. They stay distinct blobs all the same: the mesh names a blob by its
origin's signed record (origin, round, kind and the tensors' digest), not by its tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch.nn import functional

from .base import (
    MODEL,
    Aggregate,
    Context,
    Layout,
    NoParams,
    PeerAlgorithm,
    PeerModel,
    ReceivedModels,
    State,
    cloned,
    draw_seed,
    weighted_average,
)
from .baselines import FedAvg
from .evidence import HARM_BOUND, NEGLIGIBLE_LOSS, harm_z, sign_z
from .params import PARAMS, Flag, at_least, rule

LAZY, ANCHOR, TRUTH = "lazy", "anchor", "truth"
NOT_READY_KEY = "pfedlia.not_ready"  # the placeholder a node announces before it has θ_0
TRUTH_KEY = "true_cluster"
UNKNOWN_CLUSTER = -1
KMEANS_RESTARTS = 10


PAPER_WARMUP = 20  # the paper's W


# W of a pFedLIA rule; left out (None), fitted to the run's rounds.
Warmup = Annotated[int, rule("an integer >= 0, or null (fitted to rounds)", ge=0)]


def fitted_warmup(rounds: int, after_warmup: int) -> int:
    """W when the config leaves it out: half the run, at most the paper's 20, and short
    enough that the `after_warmup` rounds the rule needs after it still fit (0 at least).
    Half, so that a short run has both an anchor worth scoring from and rounds left to
    learn in the groups."""
    return max(0, min(PAPER_WARMUP, rounds // 2, rounds - after_warmup))


def warmup_for_rounds(
    warmup: int | None, warmup_only: bool, rounds: int, after_warmup: int, phase: str
) -> int:
    """W for a run of `rounds` rounds (`warmup` None: fitted to it), or ValueError when
    `phase`, which needs `after_warmup` rounds after the warm-up, never comes, unless
    `warmup_only` says so on purpose (then the whole run may be warm-up, and must be)."""
    latest = rounds - after_warmup  # the longest warm-up that leaves room for the phase
    if warmup_only:
        if warmup is None:
            return rounds
        if warmup < rounds:
            raise ValueError(
                f"warmup_only: got true, but rounds {rounds} run past warmup "
                f"{warmup}; allowed: false, or algorithm.warmup >= rounds "
                f"({rounds})"
            )
        return warmup
    told = "left out" if warmup is None else f"got {warmup}"
    if warmup is None:
        warmup = fitted_warmup(rounds, after_warmup)
    if warmup > latest:
        shorter = f"warmup 0 to {latest} for rounds {rounds}, " if latest >= 0 else ""
        raise ValueError(
            f"warmup: {told}, but with rounds {rounds} {phase} never "
            f"comes; allowed: {shorter}rounds >= {warmup + after_warmup}, or "
            "algorithm.warmup_only=true to run only the warm-up"
        )
    return warmup


def require_fitted_warmup(warmup: int | None) -> None:
    """A rule cannot run an unknown W: the node's config fits it to `rounds` first."""
    if warmup is None:
        raise ValueError(
            "algorithm.warmup: not fitted to the run's rounds; parse the "
            "parameters with parse_params(name, params, rounds)"
        )


@dataclass(frozen=True)
class PFedLIAParams:
    __pydantic_config__ = PARAMS

    # W: FedAvg rounds over the whole mesh before the lazy phase (round W+1). Paper: 20.
    # Left out (None): rounds // 2, at most 20, at most rounds - 1 (`fitted_warmup`).
    warmup: Warmup | None = None
    lazy_epochs: Annotated[int, at_least(1)] = 5  # k: epochs over Z_j that turn θ_0 into θ̃_j
    lazy_batch: Annotated[int, at_least(1)] = 100  # |Z_j|
    oracle: Flag = False  # group by the true clusters instead of lazy influence
    # True: the run is the warm-up alone, on purpose (FedAvg; no lazy phase, no groups).
    warmup_only: Flag = False
    # "harm": the lower 2-means cluster's peers stay in the group unless their lazy models,
    # mixed into the group's, do harm; "2-means": the paper's split as it falls.
    split: Annotated[Literal["harm", "2-means"], Field(description="harm or 2-means")] = "harm"

    def for_rounds(self, rounds: int) -> PFedLIAParams:
        """These parameters with W fitted to a run of `rounds` rounds (see parse_params)."""
        return replace(
            self,
            warmup=warmup_for_rounds(
                self.warmup,
                self.warmup_only,
                rounds,
                1,
                "the lazy round that finds the groups (round warmup + 1)",
            ),
        )


# --------------------------------------------------------------------------- lazy influence


def validation_losses(
    model: torch.nn.Module, state: State, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> torch.Tensor:
    """L(z, state) for every z of (x, y): the per-sample cross-entropy, as float64."""
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return torch.cat(
            [
                functional.cross_entropy(
                    model(x[start : start + batch_size]),
                    y[start : start + batch_size],
                    reduction="none",
                ).double()
                for start in range(0, len(y), batch_size)
            ]
            or [torch.zeros(0, dtype=torch.float64)]
        )


def validation_loss_sum(
    model: torch.nn.Module, state: State, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> float:
    """Σ_z L(z, state) over (x, y): cross-entropy summed, not averaged, as in Eq. 1."""
    return float(validation_losses(model, state, x, y, batch_size).sum())


def lazy_validation_losses(
    model: torch.nn.Module,
    lazy_models: Mapping[str, State],
    x_val: torch.Tensor,
    y_val: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Each lazy model θ̃_j's per-sample val losses L(z, θ̃_j)."""
    return {
        peer: validation_losses(model, state, x_val, y_val)
        for peer, state in sorted(lazy_models.items())
    }


def lazy_influence_scores(
    model: torch.nn.Module,
    anchor: State,
    lazy_models: Mapping[str, State],
    x_val: torch.Tensor,
    y_val: torch.Tensor,
) -> dict[str, float]:
    """I(i,j) = Σ_{z∈val_i} [L(z,θ_0) − L(z,θ̃_j)] for every lazy model θ̃_j given: positive
    when j's few steps from θ_0 lowered i's validation loss."""
    anchor_loss = validation_loss_sum(model, anchor, x_val, y_val)
    return influence_scores(anchor_loss, lazy_validation_losses(model, lazy_models, x_val, y_val))


def influence_scores(anchor_loss: float, losses: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Eq. 1 from the anchor's summed val loss and each lazy model's per-sample losses."""
    return {peer: anchor_loss - float(loss.sum()) for peer, loss in losses.items()}


@dataclass(frozen=True)
class LazyGroup:
    """The average of a group's lazy models (`members` of them) and its per-sample val
    losses: what `split: harm` mixes a peer of the lower cluster into."""

    state: State
    members: int
    losses: torch.Tensor

    def mixed_with(self, peer: State) -> State:
        """The group's lazy average with `peer` as one more member, at an equal share."""
        share = 1 / (self.members + 1)
        return weighted_average(
            {"group": self.state, "peer": peer}, {"group": 1 - share, "peer": share}
        )

    def admits(self, peer: State, losses_of: Callable[[State], torch.Tensor]) -> bool:
        """Whether `peer`'s lazy model, mixed in at its share, does no harm beyond the
        noise (`harmless_beside`); `losses_of` gives a state's per-sample val losses."""
        return harmless_beside(losses_of(self.mixed_with(peer)), self.losses)


def harmless_beside(losses: torch.Tensor, reference: torch.Tensor) -> bool:
    """Whether per-sample val losses show no evidence of harm against the `reference`
    ones: neither their mean above it by HARM_BOUND paired standard errors, nor worse on
    most samples by HARM_BOUND (`sign_z`). A lazy model of another cluster, mixed in at
    a small share, is worse a little on nearly every sample. A change too small to
    matter is none (evidence.NEGLIGIBLE_LOSS), but small is measured against the loss
    there is to lose: where the group's lazy model is near certain on the val split (one
    label per node: 0.001 nats a sample), a tenth of another label's model moves its
    losses by less than the floor, and on every sample the same way."""
    differences = losses - reference
    negligible = NEGLIGIBLE_LOSS * min(1.0, float(reference.mean()))
    evidence = max(harm_z(differences, negligible), sign_z(differences, negligible))
    return evidence <= HARM_BOUND


def train_lazy_model(
    model: torch.nn.Module,
    anchor: State,
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    epochs: int,
    train: Any,
    seed: int,
) -> State:
    """θ̃: `epochs` epochs of the node's training recipe `train`, from θ_0, on one seeded
    draw Z of `batch` training samples (all of them when the split is smaller)."""
    chosen = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:batch]
    model.load_state_dict(anchor)
    train(model, x[chosen], y[chosen], epochs, seed=seed)
    return cloned(model.state_dict())


# --------------------------------------------------------------------------- 2-means


@dataclass(frozen=True)
class Split:
    """The two 1-D 2-means centers a node fitted once; later peers go to the nearer one."""

    beneficial_center: float
    other_center: float

    def is_beneficial(self, score: float) -> bool:
        if not math.isfinite(score):
            return False
        # Ties go to the beneficial side: equal distance means no evidence of harm.
        return abs(score - self.beneficial_center) <= abs(score - self.other_center)


def two_means_split(scores: Mapping[str, float], seed: int) -> tuple[set[str], Split]:
    """2-means on the 1-D scores; returns the cluster with the higher mean and the centers.

    A non-finite score (a lazy model whose loss blew up) is left out of the fit and is
    never beneficial. With fewer than two distinct finite scores there is nothing to
    split: every finite score counts as beneficial.
    """
    # scikit-learn is slow to import and only this needs it. One thread: for a score per
    # peer OpenMP's thread start-up costs more than the fit, and the cores belong to the
    # mesh's node processes (threadpoolctl comes with scikit-learn).
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    finite = {peer: score for peer, score in scores.items() if math.isfinite(score)}
    if len(set(finite.values())) < 2:
        center = next(iter(finite.values()), 0.0)
        return set(finite), Split(center, -math.inf)
    peers = sorted(finite)
    values = np.array([[finite[peer]] for peer in peers], dtype=np.float64)
    with threadpool_limits(limits=1):
        kmeans = KMeans(n_clusters=2, n_init=KMEANS_RESTARTS, random_state=seed).fit(values)
    centers = kmeans.cluster_centers_.ravel()
    best = int(np.argmax(centers))
    beneficial = {peer for peer, label in zip(peers, kmeans.labels_, strict=True) if label == best}
    return beneficial, Split(float(centers[best]), float(centers[1 - best]))


# --------------------------------------------------------------------------- ground truth


def precision_recall(
    node: str, group: Iterable[str], truths: Mapping[str, int]
) -> dict[str, float | None]:
    """The group's peers (self left out: it is in both by construction) against the
    known peers with the node's true cluster. None where a denominator is empty."""
    own = truths[node]
    chosen = {peer for peer in group if peer != node and peer in truths}
    relevant = {peer for peer, cluster in truths.items() if peer != node and cluster == own}
    hits = len(chosen & relevant)
    return {
        "precision": hits / len(chosen) if chosen else None,
        "recall": hits / len(relevant) if relevant else None,
    }


def groups_ari(groups: Mapping[str, Iterable[str]], truth: Mapping[str, int]) -> float:
    """Adjusted Rand index of the groups against the true clusters, over the nodes that
    have both (1: every node chose exactly its true cluster; about 0: chance).

    Groups may be asymmetric, so they are not turned into one partition (any such
    labelling hides choices: with each node's group as its label, or with components
    of mutual membership, a node that wrongly takes in peers who do not take it back
    still scores 1). Instead every ordered pair (i, j), i ≠ j, counts as "together"
    when j is in i's group, and the ARI is evaluated on those pair counts by its
    pair-counting form 2(tp·tn − fn·fp) / ((tp+fn)(fn+tn) + (tp+fp)(fp+tn)), which
    is the formula behind sklearn's adjusted_rand_score. When the groups do form a
    partition the two agree exactly.
    """
    nodes = sorted(node for node in groups if node in truth)
    if not nodes:
        raise ValueError("groups_ari: no node has both a group and a true cluster")
    members = {node: set(groups[node]) for node in nodes}
    tp = fp = fn = tn = 0
    for node in nodes:
        for peer in nodes:
            if peer == node:
                continue
            together, truly = peer in members[node], truth[peer] == truth[node]
            tp += together and truly
            fp += together and not truly
            fn += truly and not together
            tn += not truly and not together
    if fn == 0 and fp == 0:
        return 1.0  # also every case where the denominator below is 0
    return 2.0 * (tp * tn - fn * fp) / ((tp + fn) * (fn + tn) + (tp + fp) * (fp + tn))


# --------------------------------------------------------------------------- the rule


def lazy_seed(seed: int, node: str) -> int:
    """The seed of node `node`'s draw Z and lazy training: its own, the same on every run."""
    return draw_seed(seed, node, 0, "lazy")


def contents(blob: PeerModel) -> State | None:
    """A received blob's tensors; None for a "not ready" placeholder."""
    if NOT_READY_KEY in blob.state:
        return None
    return blob.state


NOT_READY: State = {NOT_READY_KEY: torch.zeros(1)}
NOT_READY_LAYOUT: Layout = ((NOT_READY_KEY, "float32", (1,)),)
TRUTH_LAYOUT: Layout = ((TRUTH_KEY, "int64", (1,)),)


class PFedLIA(PeerAlgorithm):
    """Warm-up FedAvg, one lazy-influence clustering per node, then FedAvg in the group."""

    name = "pfedlia"
    Params = PFedLIAParams

    def __init__(self, params: PFedLIAParams, context: Context) -> None:
        require_fitted_warmup(params.warmup)
        super().__init__(params, context)
        info = getattr(context.data, "info", None) or {}
        own_cluster = int(info.get(TRUTH_KEY, UNKNOWN_CLUSTER))
        if params.oracle and own_cluster == UNKNOWN_CLUSTER:
            raise ValueError(
                "algorithm.oracle: got true; allowed: true only with a partition "
                "that has true clusters (clusters:<k>), and this node has none"
            )
        self.truths: dict[str, int] = {context.node: own_cluster}
        self.anchor: State | None = None  # θ_0
        self.lazy_model: State | None = None  # θ̃ of this node
        self.scores: dict[str, float] = {}  # I(self, peer), self included
        self.split: Split | None = None
        # The lazy models of the group 2-means chose, averaged: `split: harm` mixes a
        # peer of the lower cluster into it.
        self.lazy_group: LazyGroup | None = None
        self.group: set[str] | None = None  # None until this node has clustered
        self._fedavg = FedAvg(NoParams(), context)
        self._newly_scored: list[str] = []
        self._kept_out: set[str] = set()  # this round's, by screening: not learned from

    @property
    def node(self) -> str:
        return self.context.node

    def _after_warmup(self, round_no: int) -> bool:
        return round_no > self.params.warmup

    # --- publish and pull ---------------------------------------------------

    def publish(self, round_no: int, state: State, data: Any) -> dict[str, State]:
        extras = {TRUTH: {TRUTH_KEY: torch.tensor([self.truths[self.node]])}}
        if self._after_warmup(round_no) and not self.params.oracle:
            if self.anchor is None and self.params.warmup == 0:
                self.anchor = self._initial_state()
            self._ensure_lazy_model(data)
            extras[LAZY] = self.lazy_model if self.lazy_model is not None else NOT_READY
            extras[ANCHOR] = self.anchor if self.anchor is not None else NOT_READY
        return {MODEL: state, **extras}

    def layouts(self, kind: str) -> tuple[Layout, ...]:
        model = self.context.layout
        return {
            MODEL: (model,),
            LAZY: (model, NOT_READY_LAYOUT),
            ANCHOR: (model, NOT_READY_LAYOUT),
            TRUTH: (TRUTH_LAYOUT,),
        }.get(kind, ())

    def wanted(self, round_no: int, offered: dict[str, list[str]]) -> dict[str, list[str]]:
        models = offered.get(MODEL, [])
        if self._after_warmup(round_no) and self.group is not None:
            models = [peer for peer in models if peer in self.group]
        pulls = {
            MODEL: list(models),
            TRUTH: [peer for peer in offered.get(TRUTH, []) if peer not in self.truths],
        }
        if self._after_warmup(round_no) and not self.params.oracle:
            pulls[LAZY] = [peer for peer in offered.get(LAZY, []) if peer not in self.scores]
            if self.anchor is None:
                pulls[ANCHOR] = list(offered.get(ANCHOR, []))
        return pulls

    # --- aggregate ----------------------------------------------------------

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        self._learn_truths(received.get(TRUTH, {}))
        if not self._after_warmup(round_no):
            outcome = self._fedavg.aggregate(round_no, own, received, data)
            if round_no == self.params.warmup:
                self.anchor = {key: value.clone() for key, value in outcome.state.items()}
            outcome.diagnostics = {"phase": "warmup"}
            return outcome
        phase = self._update_group(received, data)
        models = received.get(MODEL, {})
        if self.group is not None:
            models = {peer: model for peer, model in models.items() if peer in self.group}
        outcome = self._fedavg.aggregate(round_no, own, {MODEL: models}, data)
        outcome.diagnostics = self._diagnostics(phase)
        return outcome

    def kept_out(self, peers: set[str]) -> None:
        self._kept_out = peers

    def shuns(self, peer: str) -> bool:
        """A peer scored and placed outside the group: its lazy influence says it is of
        another cluster, so a bounded mesh's node makes room for peers not yet scored."""
        return self.split is not None and peer in self.scores and peer not in (self.group or ())

    def _update_group(self, received: ReceivedModels, data: Any) -> str:
        """Refresh the group from what arrived this round; return the phase it is in."""
        if self.params.oracle:
            own = self.truths[self.node]
            self.group = {peer for peer, cluster in self.truths.items() if cluster == own}
            return "oracle"
        if self.anchor is None:
            self.anchor = self._agreed_anchor(received.get(ANCHOR, {}))
            if self.anchor is None:
                return "pending"  # no anchor arrived: average everyone, try next round
        self._ensure_lazy_model(data)
        if self.split is not None:
            self._score(received.get(LAZY, {}), data)
            return "grouped"
        self._score(received.get(LAZY, {}), data)
        return "clustered" if self.split is not None else "alone"

    def _score(self, lazy_blobs: Mapping[str, PeerModel], data: Any) -> None:
        """Score the lazy models not scored before; fit the split the first time there
        are scores, else place the new peers on the existing split."""
        unscored = {
            peer: state
            for peer, blob in lazy_blobs.items()
            if peer not in self.scores and (state := contents(blob)) is not None
        }
        if self.node not in self.scores and self.lazy_model is not None:
            unscored[self.node] = self.lazy_model
        assert self.anchor is not None, "scoring starts once the anchor is agreed"
        model = self.scratch_model()
        losses = lazy_validation_losses(model, unscored, data.x_val, data.y_val)
        anchor_loss = validation_loss_sum(model, self.anchor, data.x_val, data.y_val)
        new_scores = influence_scores(anchor_loss, losses)
        self.scores = {**self.scores, **new_scores}
        self._newly_scored = sorted(new_scores)
        if self.split is None and len(self.scores) >= 2:
            beneficial, split = two_means_split(self.scores, self.context.seed)
            # The group first: `shuns`, read from the worker thread, takes a split
            # without its group for a node that shuns every peer it scored.
            self.group = beneficial | {self.node}
            self.split = split
            known = dict(unscored)
            if self.lazy_model is not None:  # it may have scored itself in an earlier round
                known[self.node] = self.lazy_model
            self.lazy_group = self._lazy_group(
                {peer: known[peer] for peer in sorted(self.group) if peer in known}, data
            )
        elif self.split is not None:
            self.group = (self.group or {self.node}) | {
                peer for peer, score in new_scores.items() if self.split.is_beneficial(score)
            }
        else:
            self.group = {self.node}  # alone so far: the split waits for a second score
            return
        self.group = self.group | {
            peer
            for peer, state in unscored.items()
            if peer not in self.group and self._harmless(state, data)
        }

    def _lazy_group(self, lazy_models: Mapping[str, State], data: Any) -> LazyGroup | None:
        """The group's lazy models averaged, with its val losses (`split: harm` only)."""
        if self.params.split != "harm" or not lazy_models:
            return None
        state = weighted_average(
            dict(lazy_models), dict.fromkeys(lazy_models, 1 / len(lazy_models))
        )
        losses = validation_losses(self.scratch_model(), state, data.x_val, data.y_val)
        return LazyGroup(state, len(lazy_models), losses)

    def _harmless(self, lazy_model: State, data: Any) -> bool:
        """`split: harm`: a peer whose lazy model, mixed into the group's lazy average at
        its share, does no harm beyond the noise belongs to the group wherever 2-means
        put it."""
        if self.lazy_group is None:
            return False
        model = self.scratch_model()
        return self.lazy_group.admits(
            lazy_model, lambda state: validation_losses(model, state, data.x_val, data.y_val)
        )

    def _agreed_anchor(self, anchors: Mapping[str, PeerModel]) -> State | None:
        """θ_0 for a node that missed the warm-up's end: the average of the anchors that
        arrived (identical over a full mesh; their consensus otherwise)."""
        ready = {
            peer: state for peer, blob in anchors.items() if (state := contents(blob)) is not None
        }
        if not ready:
            return None
        return weighted_average(ready, {peer: 1 / len(ready) for peer in ready})

    def _ensure_lazy_model(self, data: Any) -> None:
        if self.lazy_model is not None or self.anchor is None:
            return
        assert self.context.train is not None, "the node provides its training recipe"
        self.lazy_model = train_lazy_model(
            self.scratch_model(),  # it starts from the anchor it loads
            self.anchor,
            data.x_train,
            data.y_train,
            self.params.lazy_batch,
            self.params.lazy_epochs,
            self.context.train,
            lazy_seed(self.context.seed, self.node),
        )

    def _learn_truths(self, blobs: Mapping[str, PeerModel]) -> None:
        self.truths = {
            **self.truths,
            **{peer: int(blob.state[TRUTH_KEY].reshape(-1)[0]) for peer, blob in blobs.items()},
        }

    def _initial_state(self) -> State:
        """θ_0 without a warm-up: the architecture's own seeded initialisation, from a new
        instance (the kept scratch model holds whatever was loaded last)."""
        assert self.context.new_model is not None, "the node provides its architecture"
        return cloned(self.context.new_model().state_dict())

    def _diagnostics(self, phase: str) -> dict[str, Any]:
        diagnostics: dict[str, Any] = {"phase": phase}
        if not self.params.oracle:
            diagnostics["lazy_scores"] = dict(sorted(self.scores.items()))
            diagnostics["newly_scored"] = self._newly_scored
            self._newly_scored = []
        if self.group is not None:
            learns_from = self.group - self._kept_out
            diagnostics["group"] = sorted(learns_from)
            if self.truths[self.node] != UNKNOWN_CLUSTER:
                known = {peer: c for peer, c in self.truths.items() if c != UNKNOWN_CLUSTER}
                diagnostics.update(precision_recall(self.node, learns_from, known))
        return diagnostics

    # --- checkpoint ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        split = (
            None if self.split is None else [self.split.beneficial_center, self.split.other_center]
        )
        return {
            "anchor": self.anchor,
            "lazy_model": self.lazy_model,
            "scores": self.scores,
            "lazy_group": None if self.lazy_group is None else vars(self.lazy_group),
            "split": split,
            "group": None if self.group is None else sorted(self.group),
            "truths": self.truths,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor, self.lazy_model = state["anchor"], state["lazy_model"]
        self.scores = dict(state["scores"])
        group = state.get("lazy_group")  # absent from a version that judged peers alone
        self.lazy_group = None if group is None else LazyGroup(**group)
        self.split = None if state["split"] is None else Split(*state["split"])
        self.group = None if state["group"] is None else set(state["group"])
        self.truths = {**state["truths"], **self.truths}  # this run's own data wins
