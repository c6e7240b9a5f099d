"""pFedSV (paper 004, ALGORITHMS.md): every peer scores the peers it downloads by their
Shapley value in a coalition game played on its own validation split.

A round at node i:

1. `wanted`: pull the blobs of the top-k peers by the relevance vector ρ (ties broken
   at random, seeded; a peer never scored has ρ = 0, so it ranks above peers that
   proved harmful). Nothing else is downloaded.
2. `aggregate`: S = {i} ∪ the peers whose blobs arrived. v(X) = accuracy on i's val
   split of the uniform average of the models in X, v(∅) = 0, cached per subset.
   Shapley values are exact for |S| <= 8, else Monte Carlo over 3|S| permutations.
   ρ_j ← α ρ_j + (1 − α) SV_j for the peers in S; weights w_j = max(SV_j, 0) / d_j,
   d_j = ‖θ_i − θ_j‖ (self: the smallest peer distance in S), normalized; when no
   weight is positive the node keeps its own model. Then the val guard (on by default,
   not in the paper; `val_guard=false` is the paper's rule): the node adopts the
   weighted average unless the val split gives evidence that it harms the node: its val
   loss above the own model's beyond two paired standard errors, or more val errors
   beyond noise (the screening guard). A peer's Shapley
   value credits what it scores alone, so a peer that knows half of the node's labels
   earns weight even where averaging it in hurts (README, pFedSV results). (With a
   shared body, "own model" is the own head on the mesh body: the guard weighs heads
   only, as the game does.)
3. Dynamic k for the next round. The scores have *settled* when every peer on offer
   has been scored at least once and the set of peers with ρ > 0 came out of this
   update unchanged; then k = #peers with ρ > 0, clamped to [k_min, k_max]. Until
   then (first rounds, a newcomer, a relevant peer turning negative) k = the start k,
   so the node keeps exploring (`scores_settled`, `dynamic_k`). That rule fails both
   ways on small shards (docs/defences.md, "Where collaboration pays"): where every
   peer helps, the first k stay positive, the rest rank at 0 below them and are never
   downloaded, so the scores never settle and k never leaves its start (five of nine
   peers: 1.2 to 1.4 points under FedAvg on iid shards); under mild skew, once k has
   shrunk to the positive peers, a helpful peer that one noisy round put below 0 is
   never downloaded again (a peer's ρ moves only when it is downloaded). So by default
   (`explore`, not in the paper) k is one more than the peers with ρ > 0 from the first
   round: the spare download is the best of the rest (a peer never scored before one
   that scored below 0), weighted only where its value is positive, and k grows by one
   a round while the spare helps, up to k_max = 8 (the paper's 5), a bounded view's
   neighbours.

Behind screening (screening.py) the game is played among the peers screening admits
only. A peer it keeps out (`kept_out`) has hurt this node's val loss, so the rule counts
it as scored and not relevant that round: ρ_j ← min(ρ_j, 0). Without that a kept-out
peer would never be scored, the scores would never settle and k would stay at the start
k, downloading peers that screening then throws away. Screening off, nobody is kept out
and the rule is the paper's.

Shared body (paper §5.1): every node publishes its body and its head as two blobs,
pulls every body and only the top-k heads. Bodies are sample-weighted averaged over
the mesh; the heads are the players, each one scored on top of that averaged body.
Bytes: a node downloads (n−1)·|body| + k·|head|, against k·(|body| + |head|) for
whole-model pFedSV and (n−1)·(|body| + |head|) for FedAvg. Without a server that
averages the bodies (the paper's setting, where one global body is downloaded), the
option therefore saves (n−1−k)·|head| against FedAvg but costs (n−1−k)·|body| more
than whole-model pFedSV; it pays off against FedAvg only when heads are large.
All players share one body, so the game computes its features once and runs only
the averaged heads per coalition.

DP (paper §5.2): the published update relative to the start-of-round model is clipped
to norm C = dp_clip, and N(0, σ²C²) noise (σ = dp_sigma) is added to every coordinate
before publishing. The node's own, unnoised model stays local and takes part in its
own coalition game.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, cast

import numpy as np
import torch

from .base import (
    MODEL,
    Aggregate,
    Context,
    Layout,
    PeerAlgorithm,
    PeerModel,
    ReceivedModels,
    State,
    draw_seed,
    model_distance,
    sample_weights,
    state_part,
    weighted_average,
)
from .params import PARAMS, Flag, at_least, finite
from .verdicts import batched_logits, guard_verdict, scores_of_logits

BODY, HEAD = "body", "head"
EXACT_SHAPLEY_MAX_PLAYERS = 8  # 2^8 utilities cost less than sampling 3|S| permutations
PERMUTATIONS_PER_PLAYER = 3  # the paper's R = 3|S|

# Distinct random streams per purpose, so that e.g. a change in selection draws does
# not shift the Monte Carlo permutations of the same round.
_STREAM_SELECT, _STREAM_SHAPLEY, _STREAM_DP = 1, 2, 3

Coalition = frozenset[str]
Utility = Callable[[Coalition], float]


@dataclass(frozen=True)
class PFedSVParams:
    __pydantic_config__ = PARAMS

    # EMA factor of the relevance vector (the paper leaves it open).
    alpha: Annotated[float, finite("a number >= 0 and < 1", ge=0, lt=1)] = 0.5
    # Downloads in the first round (the paper: until the scores settle).
    k: Annotated[int, at_least(1)] = 5
    k_min: Annotated[int, at_least(1)] = 1
    k_max: Annotated[int, at_least(1)] = 8  # the paper's is 5 (see the module's docstring, step 3)
    # Not in the paper: from the first round k is one more than the peers with a positive
    # score, so the best of the rest is downloaded and scored too (module docstring,
    # step 3). False: the paper's dynamic k.
    explore: Flag = True
    distance: Flag = True  # divide Shapley values by the model distance (Eq. 6)
    # Not in the paper: keep the own model where the Shapley-weighted one harms it on the
    # val split beyond noise (screening.py's guard; README, pFedSV results). False: the paper.
    val_guard: Flag = True
    shared_body: Flag = False
    # C: the norm bound of the published update; None: no DP.
    dp_clip: Annotated[float, finite("a finite number > 0, or null (no DP)", gt=0)] | None = None
    # σ: the noise's std is σ·C.
    dp_sigma: Annotated[float, finite("a finite number >= 0", ge=0)] = 0.0

    def __post_init__(self) -> None:  # the checks across fields
        if self.k_max < self.k_min:
            raise ValueError(
                f"k_max: got {self.k_max!r}; allowed: an integer >= k_min ({self.k_min})"
            )
        if not self.k_min <= self.k <= self.k_max:
            raise ValueError(
                f"k: got {self.k!r}; allowed: k_min <= k <= k_max ({self.k_min}..{self.k_max})"
            )
        if self.dp_sigma > 0 and self.dp_clip is None:
            raise ValueError(
                f"dp_sigma: got {self.dp_sigma!r}; allowed: 0 unless dp_clip is "
                "set (the noise scale is dp_sigma * dp_clip)"
            )


# --------------------------------------------------------------------------- Shapley values


def cached_utility(utility: Utility) -> Utility:
    """`utility` evaluated once per coalition, with v(∅) = 0 by definition."""
    cache: dict[Coalition, float] = {frozenset(): 0.0}

    def value(coalition: Coalition) -> float:
        if coalition not in cache:
            cache[coalition] = float(utility(coalition))
        return cache[coalition]

    return value


def exact_shapley(players: Sequence[str], utility: Utility) -> dict[str, float]:
    """φ_p = Σ_{X ⊆ N∖{p}} |X|!(n−|X|−1)!/n! · (v(X ∪ {p}) − v(X)), over all subsets."""
    n = len(players)
    factor = [
        math.factorial(size) * math.factorial(n - size - 1) / math.factorial(n) for size in range(n)
    ]
    values = {player: 0.0 for player in players}
    for player in players:
        others = [other for other in players if other != player]
        for size in range(n):
            for subset in itertools.combinations(others, size):
                without = frozenset(subset)
                gain = utility(without | {player}) - utility(without)
                values[player] += factor[size] * gain
    return values


def monte_carlo_shapley(
    players: Sequence[str], utility: Utility, rounds: int, rng: np.random.Generator
) -> dict[str, float]:
    """The mean marginal contribution of each player over `rounds` random orders
    (paper Algorithm 2); unbiased, and exact in the limit."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    totals = {player: 0.0 for player in players}
    for _ in range(rounds):
        coalition: Coalition = frozenset()
        before = utility(coalition)
        for index in rng.permutation(len(players)):
            coalition = coalition | {players[index]}
            after = utility(coalition)
            totals[players[index]] += after - before
            before = after
    return {player: total / rounds for player, total in totals.items()}


def shapley_values(
    players: Sequence[str], utility: Utility, rng: np.random.Generator
) -> dict[str, float]:
    """Exact for small coalitions, Monte Carlo with R = 3|S| permutations above."""
    if len(players) <= EXACT_SHAPLEY_MAX_PLAYERS:
        return exact_shapley(players, utility)
    return monte_carlo_shapley(players, utility, PERMUTATIONS_PER_PLAYER * len(players), rng)


# --------------------------------------------------------------------------- weights


def shapley_weights(
    shapley: dict[str, float], own: str, distances: dict[str, float] | None = None
) -> dict[str, float]:
    """Normalized w_j ∝ max(SV_j, 0) / d_j (Eq. 6 and 7); {} when no weight is positive.

    `distances` holds d_j = ‖θ_own − θ_j‖ for the peers; None drops the division. The
    own model is at distance 0 from itself, which would swamp every peer, so it takes
    the smallest peer distance instead (ALGORITHMS.md's interpretation). A zero
    distance (an identical model) is floored so that it wins without dividing by zero.
    """
    raw = {}
    for player, value in shapley.items():
        if value <= 0:
            continue
        if distances is None:
            raw[player] = value
        else:
            raw[player] = value / max(_distance_of(player, own, distances), 1e-12)
    total = sum(raw.values())
    if not raw or not total > 0:
        return {}
    return {player: weight / total for player, weight in raw.items()}


def _distance_of(player: str, own: str, distances: dict[str, float]) -> float:
    if player != own:
        return distances[player]
    peer_distances = [d for peer, d in distances.items() if peer != own]
    return min(peer_distances) if peer_distances else 1.0  # alone: any constant will do


# --------------------------------------------------------------------------- top-k and k


def select_top_k(
    scores: dict[str, float], candidates: Sequence[str], k: int, rng: np.random.Generator
) -> list[str]:
    """The `k` candidates with the highest score, best first; equal scores in random
    order. A candidate without a score counts 0: above every peer that proved harmful."""
    ordered = sorted(candidates)  # the draw must not depend on the caller's order
    tie_breaks = dict(zip(ordered, rng.random(len(ordered)), strict=True))
    ranked = sorted(ordered, key=lambda peer: (-scores.get(peer, 0.0), tie_breaks[peer]))
    return ranked[: max(k, 0)]


def positive_peers(scores: dict[str, float]) -> frozenset[str]:
    return frozenset(peer for peer, score in scores.items() if score > 0)


def scores_settled(
    candidates: Iterable[str],
    explored: Iterable[str],
    positive_now: frozenset[str],
    positive_before: frozenset[str],
) -> bool:
    """The scores have settled when every peer on offer has been scored at least once
    (no unknown 0 left that could still turn out relevant) and the set of peers with a
    positive score came out of the last update unchanged."""
    return set(candidates) <= set(explored) and positive_now == positive_before


def dynamic_k(scores: dict[str, float], settled: bool, start_k: int, k_min: int, k_max: int) -> int:
    """Once settled, k = #peers with a positive score, clamped to [k_min, k_max]; until
    then (first rounds, a newcomer, a relevant peer turning negative) the start k, so
    the node explores."""
    if not settled:
        return start_k
    return clamped(len(positive_peers(scores)), k_min, k_max)


def clamped(k: int, k_min: int, k_max: int) -> int:
    return min(max(k, k_min), k_max)


# --------------------------------------------------------------------------- helpers


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Share of the samples whose largest logit is their label; 0 for none."""
    return float((logits.argmax(dim=1) == y).float().mean()) if len(y) else 0.0


def _guard_verdict(
    own_logits: torch.Tensor, average_logits: torch.Tensor, y_val: torch.Tensor
) -> tuple[bool, dict[str, float]]:
    """Whether the val guard adopts the Shapley-weighted average (the screening guard:
    no harm to val loss or val errors beyond noise), with the figures it judged by."""
    adopt, figures = guard_verdict(
        scores_of_logits(own_logits, y_val), scores_of_logits(average_logits, y_val)
    )
    return adopt, {"v_aggregate": accuracy(average_logits, y_val), "adopted": adopt, **figures}


def uniform_average(states: Sequence[State]) -> State:
    named = {str(index): state for index, state in enumerate(states)}
    return weighted_average(named, {name: 1 / len(named) for name in named})


def state_bytes(state: State) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def clip_and_noise(
    state: State, reference: State, clip: float, sigma: float, generator: torch.Generator
) -> tuple[State, float]:
    """reference + clip(state − reference, C) + N(0, σ²C²) per float coordinate; returns
    the noised state and the update's norm before clipping."""
    float_keys = [key for key, tensor in state.items() if tensor.is_floating_point()]
    update = {key: state[key] - reference[key] for key in float_keys}
    norm = math.sqrt(sum(float(delta.double().pow(2).sum()) for delta in update.values()))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    noised = dict(state)
    for key in float_keys:
        noise = torch.randn(update[key].shape, generator=generator, dtype=update[key].dtype)
        noised[key] = reference[key] + update[key] * scale + noise * (sigma * clip)
    return noised, norm


# --------------------------------------------------------------------------- the rule


class PFedSV(PeerAlgorithm):
    """Shapley-value coalitions with dynamic top-k downloads, computed by every peer."""

    name = "pfedsv"

    @classmethod
    def reads_head(cls, params: Any) -> bool:
        return bool(params.shared_body)  # it then downloads and scores heads alone

    Params = PFedSVParams
    ranks_offers = True  # top-k of the round's offers: asked once, over the whole listing

    @property
    def guards_aggregate(self) -> bool:  # type: ignore[override]  # the base's is only read
        # Its val guard is screening's guard, not run twice.
        return self.params.val_guard

    def __init__(self, params: PFedSVParams, context: Context) -> None:
        super().__init__(params, context)
        self.relevance: dict[str, float] = {}
        self.k = params.k
        self.explored: set[str] = set()
        self.positive_before: frozenset[str] = frozenset()
        self._offered: list[str] = []  # the scored kind's offers of the current round
        self._selected: list[str] = []
        self._kept_out: set[str] = set()  # this round's, by screening: scored as irrelevant
        self._round_start: State | None = None  # DP reference: the model a round starts from
        self._dp_update_norm: float | None = None

    @property
    def scored_kind(self) -> str:
        return HEAD if self.params.shared_body else MODEL

    def _rng(self, round_no: int, stream: int) -> np.random.Generator:
        return np.random.default_rng(
            draw_seed(self.context.seed, self.context.node, round_no, f"pfedsv/{stream}")
        )

    # --- publish and pull ---------------------------------------------------

    def publish(self, round_no: int, state: State, data: Any) -> dict[str, State]:
        if self.params.dp_clip is not None:
            state = self._privatized(round_no, state)
        if not self.params.shared_body:
            return {MODEL: state}
        return {
            BODY: state_part(state, self.context.body_keys),
            HEAD: state_part(state, self.context.head_keys),
        }

    def adopted(self, state: State) -> None:
        if self.params.dp_clip is not None:
            self._round_start = state

    def _privatized(self, round_no: int, state: State) -> State:
        reference = self._round_start
        if reference is None:
            # Round 1 starts from the seeded initial model every peer can rebuild. A late
            # joiner's true start (the average it caught up from) is unknown here, so its
            # first update is measured from that initial model: larger, hence more
            # clipped, never leaky.
            assert self.context.new_model is not None, "the node passes Context.new_model"
            reference = self.context.new_model().state_dict()
        generator = torch.Generator().manual_seed(
            int(self._rng(round_no, _STREAM_DP).integers(2**63))
        )
        noised, self._dp_update_norm = clip_and_noise(
            state, reference, self.params.dp_clip, self.params.dp_sigma, generator
        )
        return noised

    def layouts(self, kind: str) -> tuple[Layout, ...]:
        context = self.context
        if not self.params.shared_body:
            return super().layouts(kind)
        parts = {
            BODY: context.model_part(context.body_keys),
            HEAD: context.model_part(context.head_keys),
        }
        return (parts[kind],) if kind in parts else ()

    def wanted(self, round_no: int, offered: dict[str, list[str]]) -> dict[str, list[str]]:
        self._offered = list(offered.get(self.scored_kind, []))
        self._selected = select_top_k(
            self.relevance, self._offered, self.k, self._rng(round_no, _STREAM_SELECT)
        )
        pulls = {self.scored_kind: self._selected}
        if self.params.shared_body:
            pulls[BODY] = list(offered.get(BODY, []))  # the body is averaged over the mesh
        return pulls

    # --- aggregate ----------------------------------------------------------

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        me = self.context.node
        players_states, base = self._players(own, received)
        logits_of = self._val_logits(players_states, data)
        # Each player's own model passes over the val split once a round: the game scores
        # it as a coalition of one, and the guard reuses the node's.
        player_logits = functools.cache(lambda player: logits_of(players_states[player]))
        game = self._play(round_no, players_states, logits_of, player_logits, data.y_val)
        self._update_relevance(game["shapley"])
        self._count_as_irrelevant(self._kept_out)
        self._kept_out = set()  # told afresh before each aggregate; none when not screened
        weights, state = self._combine(game["shapley"], players_states)
        # When the rule itself keeps the own model there is nothing to guard (and no
        # v_aggregate or val_loss_* to record).
        if self.params.val_guard and weights != {me: 1.0}:
            adopt, verdict = _guard_verdict(player_logits(me), logits_of(state), data.y_val)
            game.update(verdict)
            if not adopt:
                weights, state = {me: 1.0}, players_states[me]
        state = {**state, **base}  # shared body: the mesh-averaged body under the new head
        k_used, self.k = self.k, self._next_k()
        if self.params.dp_clip is not None:
            self._round_start = state
        diagnostics = {
            **game,
            "relevance": dict(sorted(self.relevance.items())),
            "k": k_used,
            "k_next": self.k,
            "selected": list(self._selected),
            "downloaded": sorted(received.get(self.scored_kind, {})),
            "bytes_downloaded": sum(
                state_bytes(peer.state)
                for by_peer in received.values()
                for peer in by_peer.values()
            ),
            **self._mode_diagnostics(received),
        }
        return Aggregate(
            state=state, weights=dict(sorted(weights.items())), diagnostics=diagnostics
        )

    def _play(
        self,
        round_no: int,
        players_states: dict[str, State],
        logits_of: Callable[[State], torch.Tensor],
        player_logits: Callable[[str], torch.Tensor],
        y_val: torch.Tensor,
    ) -> dict[str, Any]:
        """Shapley values of the coalition game on the own val split, with its cost and
        v({i}), v(S) (whether the coalition beats the own model at all)."""
        me = self.context.node
        players = [me, *sorted(name for name in players_states if name != me)]
        evaluations = 0

        def coalition_accuracy(coalition: Coalition) -> float:
            nonlocal evaluations
            evaluations += 1
            if len(coalition) == 1:  # a player's own model: nothing to average
                return accuracy(player_logits(next(iter(coalition))), y_val)
            average = uniform_average([players_states[p] for p in sorted(coalition)])
            return accuracy(logits_of(average), y_val)

        clock = time.perf_counter()
        utility = cached_utility(coalition_accuracy)
        shapley = shapley_values(players, utility, self._rng(round_no, _STREAM_SHAPLEY))
        return {
            "shapley": shapley,
            "shapley_seconds": time.perf_counter() - clock,
            "utility_evaluations": evaluations,
            "v_own": utility(frozenset([me])),
            "v_coalition": utility(frozenset(players)),
        }

    def _val_logits(
        self, players_states: dict[str, State], data: Any
    ) -> Callable[[State], torch.Tensor]:
        """state -> its logits on the own val split. With a shared body every player has
        the same body, so its features are computed once and each coalition only runs its
        averaged head: the same logits at a fraction of the cost."""
        model = self.scratch_model()
        model.eval()
        x_val = data.x_val
        split = self.params.shared_body and hasattr(model, "body") and hasattr(model, "head")
        if not split or len(x_val) == 0:

            def whole_model(state: State) -> torch.Tensor:
                model.load_state_dict(state)
                return batched_logits(model, x_val)

            return whole_model
        model.load_state_dict(players_states[self.context.node])  # any player: one body
        body, head = cast(torch.nn.Module, model.body), cast(torch.nn.Module, model.head)
        features = batched_logits(body, x_val)
        # head_keys are the state keys under the head module: `head.` for a model split
        # as node/models.py splits them; a task's model says where its head lies.
        prefix = str(getattr(model, "head_prefix", "head."))

        def head_only(state: State) -> torch.Tensor:
            head.load_state_dict(
                {key.removeprefix(prefix): state[key] for key in self.context.head_keys}
            )
            return batched_logits(head, features)

        return head_only

    def _combine(
        self, shapley: dict[str, float], players_states: dict[str, State]
    ) -> tuple[dict[str, float], State]:
        """The normalized Shapley weights and the weighted average of the snapshot; the own
        model alone when no weight is positive."""
        me = self.context.node
        distances = None
        if self.params.distance:
            distances = {
                peer: model_distance(players_states[me], players_states[peer])
                for peer in players_states
                if peer != me
            }
        weights = shapley_weights(shapley, me, distances)
        if not weights:
            return {me: 1.0}, players_states[me]
        return weights, weighted_average({p: players_states[p] for p in weights}, weights)

    def _players(self, own: PeerModel, received: ReceivedModels) -> tuple[dict[str, State], State]:
        """Each player's model as the coalition game sees it, and the part of the new
        state that does not depend on the game (shared body: the averaged body)."""
        me = self.context.node
        if not self.params.shared_body:
            return {me: own.state, **{p: m.state for p, m in received.get(MODEL, {}).items()}}, {}
        body = self._mesh_body(own, received.get(BODY, {}))
        heads = {
            me: state_part(own.state, self.context.head_keys),
            **{peer: blob.state for peer, blob in received.get(HEAD, {}).items()},
        }
        return {player: {**body, **head} for player, head in heads.items()}, body

    def _mesh_body(self, own: PeerModel, bodies: dict[str, PeerModel]) -> State:
        """Sample-weighted average of the own body and every body received (FedAvg)."""
        me = self.context.node
        parts = dict(
            sorted(
                {
                    me: PeerModel(state_part(own.state, self.context.body_keys), own.n_samples),
                    **bodies,
                }.items()
            )
        )
        return weighted_average(
            {name: part.state for name, part in parts.items()}, sample_weights(parts)
        )

    def _update_relevance(self, shapley: dict[str, float]) -> None:
        alpha = self.params.alpha
        # A node never downloads itself: its own score would go unused.
        scored = {peer: value for peer, value in shapley.items() if peer != self.context.node}
        self.relevance = {
            **self.relevance,
            **{
                peer: alpha * self.relevance.get(peer, 0.0) + (1 - alpha) * value
                for peer, value in scored.items()
            },
        }
        self.explored = self.explored | set(scored)

    def kept_out(self, peers: set[str]) -> None:
        self._kept_out = set(peers)

    def _count_as_irrelevant(self, peers: Iterable[str]) -> None:
        """Peers that screening kept out of the game count as scored, with a score of at
        most 0: averaging their models in hurt this node, so they are not among the
        peers k counts, and an unscored 0 no longer holds the scores unsettled. A score
        below 0 stands, so they rank as the game last left them."""
        others = [peer for peer in peers if peer != self.context.node]
        self.relevance = {
            **self.relevance,
            **{peer: min(self.relevance.get(peer, 0.0), 0.0) for peer in others},
        }
        self.explored = self.explored | set(others)

    def _next_k(self) -> int:
        if self.params.explore:  # the peers that help and one more, from the first round
            helping = len(positive_peers(self.relevance))
            return clamped(helping + 1, self.params.k_min, self.params.k_max)
        positive_now = positive_peers(self.relevance)
        settled = scores_settled(self._offered, self.explored, positive_now, self.positive_before)
        self.positive_before = positive_now
        return dynamic_k(
            self.relevance, settled, self.params.k, self.params.k_min, self.params.k_max
        )

    def _mode_diagnostics(self, received: ReceivedModels) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.params.shared_body:
            extra["bodies"] = sorted(received.get(BODY, {}))
        if self.params.dp_clip is not None:
            extra["dp"] = {
                "clip": self.params.dp_clip,
                "sigma": self.params.dp_sigma,
                "update_norm": self._dp_update_norm,
            }
        return extra

    # --- checkpoint ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain values (JSON-able), plus under DP the round-start model that the next
        published update is measured from, so a resumed node clips the true update."""
        state: dict[str, Any] = {
            "relevance": dict(sorted(self.relevance.items())),
            "k": self.k,
            "explored": sorted(self.explored),
            "positive_before": sorted(self.positive_before),
        }
        if self._round_start is not None:
            state["dp_round_start"] = self._round_start
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.relevance = {
            str(peer): float(score) for peer, score in state.get("relevance", {}).items()
        }
        self.k = int(state.get("k", self.params.k))
        self.explored = set(state.get("explored", []))
        self.positive_before = frozenset(state.get("positive_before", []))
        self._round_start = state.get("dp_round_start")
