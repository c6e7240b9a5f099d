"""The checks validation screening chains (screening.py says which step each one is and
why): pure functions of models and val scores, each returning its verdict, and the
typed verdicts and report a round of screening records. pFedSV's val guard is the
guard's check here too."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch.nn import functional

from .base import State, model_distance
from .evidence import HARM_BOUND, coin_flip_z, harm_z, sign_z

N_CLAIM_FACTOR = 4
# Step 3: a model this many times the round's median distance from the own model is kept
# out. An honest model of the task stays within about twice the median (in the tables of
# docs/defences.md, at most 2 of 9,000 honest models were ever further than three
# times); a scaled update of s is about s times its honest distance, noise of the
# model's scale far more.
DISTANCE_FACTOR = 3.0


def worse_beyond_noise(
    own_losses: torch.Tensor, other_losses: torch.Tensor, by_signs: bool = False
) -> bool:
    """Whether another model's per-sample val losses show harm against the own model's
    beyond HARM_BOUND (evidence.py): in their mean difference, in standard errors of at
    least NEGLIGIBLE_LOSS each, as a peer with no record is judged; with `by_signs`,
    also in how many samples it worsens against how many it betters (`sign_z`); or they
    are not finite where the own model's are. One-sided tests at about 2%, whose power
    grows with the split: on 30 samples they forgive what 300 would not. At one standard
    error the mean's test refused too much on small shards (mild skew: 1.7 points under
    FedAvg unscreened; Dirichlet(0.3): the worst node 2.6 points under Local's, against
    0.3 at two)."""
    if not torch.isfinite(other_losses).all():
        return True
    if not torch.isfinite(own_losses).all():  # the own model is the broken one
        return False
    differences = other_losses - own_losses
    signs = sign_z(differences) if by_signs else 0.0
    return max(harm_z(differences), signs) > HARM_BOUND


def guard_verdict(
    own: ValScores, aggregate: ValScores, far: bool = False
) -> tuple[bool, dict[str, float]]:
    """Whether the guard takes an aggregate over the own model, with the figures it
    judged by: no evidence of harm, in val loss or in val errors, beyond the noise of
    the split; for an aggregate `far` from the own model (`a_far_jump`), no harm on most
    samples either. Where the aggregate makes fewer val errors, neither the loss's test
    alone nor the signs' refuses it: its loss counts only added to its errors
    (`errors_and_loss_beyond_noise`, which refuses a loss not finite whatever the
    errors). An average of models
    that trained on other skews is often less sure and more often right, and refusing
    it on the loss alone kept FedC²I's default 1.4 points under its paper rule on USPS
    Dirichlet(0.5) (docs/defences.md). With no val split there is nothing to judge by,
    and the aggregate stands."""
    if len(own.losses) == 0:
        return True, {}
    figures = {
        "val_loss_own": float(own.losses.mean()),
        "val_loss_aggregate": float(aggregate.losses.mean()),
        "val_errors_own": int(own.errors.sum()),
        "val_errors_aggregate": int(aggregate.errors.sum()),
    }
    more_often_right = errors_z(own.errors, aggregate.errors) < 0
    harmed = not more_often_right and worse_beyond_noise(own.losses, aggregate.losses, by_signs=far)
    return not harmed and not errors_and_loss_beyond_noise(own, aggregate), figures


def a_far_jump(aggregate: State, own: State, start: State) -> bool:
    """Whether the aggregate lies further from the own model than DISTANCE_FACTOR times
    what the round's own training moved it (from the round start). An aggregate of a
    mesh that trains together lies about one round's training away (the median over
    MNIST Dirichlet(1) small shards: 0.9); where nodes have gone their own ways for
    rounds, the average of everyone's models lies many rounds away (USPS Dirichlet(0.5):
    a median of 4.5 by round 6, 8.6 by round 10) and is a model of nobody's training.
    On a 30-sample split the mean's test let such averages in where they were worse on
    26 samples of 30 and better on the few the own model got confidently wrong, and
    they cost 24 test points; the signs show that harm."""
    return model_distance(aggregate, own) > DISTANCE_FACTOR * model_distance(own, start)


def inflated_claims(own_n: int, claims: dict[str, int]) -> set[str]:
    """Peers claiming more than N_CLAIM_FACTOR times the median of all counts."""
    bound = N_CLAIM_FACTOR * statistics.median([own_n, *claims.values()])
    return {peer for peer, n in claims.items() if n > bound}


def far_models(reference: State, states: Mapping[str, State]) -> set[str]:
    """Models further from `reference` than DISTANCE_FACTOR times the median distance of
    `states` from it (step 3); not finite counts as far. It takes three models for a far
    one to show against the median: of one or two, none is ever far."""
    distances = {name: model_distance(reference, state) for name, state in states.items()}
    finite = [value for value in distances.values() if math.isfinite(value)]
    bound = DISTANCE_FACTOR * statistics.median(finite) if finite else 0.0
    return {name for name, value in distances.items() if not value <= bound}


def errors_and_loss_beyond_noise(own: ValScores, other: ValScores) -> bool:
    """Whether another model is worse than the own model beyond noise, in val errors and
    val loss together: its extra errors in standard deviations (`errors_z`) plus its
    loss's excess in paired standard errors (`harm_z`, where that points to harm) above
    HARM_BOUND. So errors the loss does not confirm count from two deviations on (an
    over-confident own model), fewer where the loss leans the same way; and a loss
    beyond HARM_BOUND counts with no extra errors at all, as in `worse_beyond_noise`
    (for the spike check: a round whose val loss rose beyond noise). Two fixed bounds,
    one deviation of errors wherever the loss was higher at all and two elsewhere, let
    noise refuse aggregates of a mesh that trains together, and let in on small skewed
    shards an aggregate 0.5 nats higher in loss, just short of the loss's own test
    (docs/defences.md, "Where collaboration pays"). A loss not finite is harm whatever
    the errors: its evidence, capped, could be outweighed by errors fewer enough."""
    if not torch.isfinite(other.losses).all():
        return True
    if torch.isfinite(own.losses).all():
        loss_z = max(harm_z(other.losses - own.losses), 0.0)
    else:  # the own model is the broken one: its losses say nothing of the other's
        loss_z = 0.0
    return errors_z(own.errors, other.errors) + loss_z > HARM_BOUND


def errors_z(own: torch.Tensor, other: torch.Tensor) -> float:
    """How many more 0/1 errors another model makes than the own model, in standard
    deviations: of the samples on which the two differ, the other gets w wrong and b
    right (`coin_flip_z`, as `sign_z` counts the samples worse and better in loss). (The
    paired standard error of `worse_beyond_noise` ties exactly with one extra error,
    where rounding alone would decide.)"""
    worse = int(((other > 0) & (own == 0)).sum())
    better = int(((own > 0) & (other == 0)).sum())
    return coin_flip_z(worse, better)


def batched_logits(
    forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int = 1024
) -> torch.Tensor:
    """`forward` over `x` in batches and without gradients: a large val split never
    has to pass through the model at once."""
    with torch.no_grad():
        if len(x) == 0:  # no batches to concatenate: one empty pass gives the shape
            return forward(x)
        return torch.cat([forward(batch) for batch in x.split(batch_size)])


class Trial(NamedTuple):
    """A trial path's model as of round `round_no`: made then (the rule's aggregate of the
    own model, or of the path's last model, with the peers the val check kept out let
    in), to be trained and judged the next round; or, once trained and lost, the model
    that round's aggregate starts from. The path began in round `began`; `shares` is
    each model's share in it, over the path's rounds."""

    round_no: int
    began: int
    state: State
    shares: dict[str, float]


def path_shares(
    before: Mapping[str, float], weights: Mapping[str, float], me: str
) -> dict[str, float]:
    """Each model's share in a trial path after one more aggregate of it: the shares so
    far pass on at the weight the aggregate gave the path's own model (`me`), and each
    peer's weight this round adds to its share."""
    kept = weights.get(me, 0.0)
    shares = {model: share * kept for model, share in before.items()}
    for peer, weight in weights.items():
        if peer != me:
            shares[peer] = shares.get(peer, 0.0) + weight
    return shares


def beats_a_constant_guess(errors: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether a model alone gets more val samples right than the best constant guess
    (the split's most common label, always): a model of the node's task does, however
    much its data differ in kind; a model trained on flipped labels, or noise, does not."""
    if len(y) == 0:
        return True
    right = len(errors) - int(errors.sum())
    return right > int(torch.bincount(y.long()).max())


class ValScores(NamedTuple):
    """A model's per-sample cross-entropy and 0/1 errors on a val split."""

    losses: torch.Tensor
    errors: torch.Tensor


class TrialVerdict(NamedTuple):
    """Last round's trial model, trained as the own model was and judged against it by
    the guard (step 7): `shares`, whose models a won path carries on from."""

    won: bool
    path_rounds: int
    figures: dict[str, float]
    shares: dict[str, float] | None


class GuardVerdict(NamedTuple):
    """Whether the round's aggregate was adopted (step 5), with the figures judged by;
    `far_jump` None where the rule judged it itself (pFedSV's val guard, which records
    its own figures)."""

    adopted: bool
    far_jump: bool | None
    figures: dict[str, float]


class ScreeningReport(NamedTuple):
    """What screening did in a round, each step's verdict (None: the step did not run),
    as the node's metrics record it (`diagnostics["screening"]`, `as_diagnostics`)."""

    judged: bool  # the node has a val split to judge by
    trial: TrialVerdict | None
    nearest_copy: float | None
    on_trial: list[str] | None  # the peers let in on a trial path started this round
    rule_seconds: float  # of `seconds`, the rule's own aggregation
    guard: GuardVerdict | None
    kept_round_start: bool | None  # step 6 undid the round
    judged_against: str | None  # the pivot: "own", "trial" or "round_start"
    seconds: float

    def as_diagnostics(self) -> dict[str, Any]:
        record: dict[str, Any] = {"judged": self.judged}
        if self.trial is not None:
            trial = self.trial
            record["trial"] = {"won": trial.won, "path_rounds": trial.path_rounds}
            record["trial"].update(trial.figures)
            if trial.shares is not None and not self.kept_round_start:
                record["trial"]["weights"] = trial.shares  # not where step 6 undid it
        record["nearest_copy"] = self.nearest_copy
        if self.on_trial is not None:
            record["on_trial"] = self.on_trial
        record["rule_seconds"] = self.rule_seconds
        if self.guard is not None:
            record["adopted"] = self.guard.adopted
            if self.guard.far_jump is not None:
                record["far_jump"] = self.guard.far_jump
            record.update(self.guard.figures)
        if self.kept_round_start is not None:
            record["kept_round_start"] = self.kept_round_start
        if self.judged_against is not None:
            record["judged_against"] = self.judged_against
        record["seconds"] = self.seconds
        return record


def val_scores(
    model: torch.nn.Module, state: State, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> ValScores:
    """Both from one forward pass over the split."""
    model.load_state_dict(state)
    model.eval()
    return scores_of_logits(batched_logits(model, x, batch_size), y)


def scores_of_logits(logits: torch.Tensor, y: torch.Tensor) -> ValScores:
    """Per-sample cross-entropy and misclassifications of logits against labels."""
    labels = y.long()
    losses = functional.cross_entropy(logits, labels, reduction="none")
    return ValScores(losses, (logits.argmax(dim=1) != labels).double())
