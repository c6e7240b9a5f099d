"""Validation screening: one mechanism around every peer rule, so that a rule learns
from a peer only where that helps this node, and an attacker's weight goes to zero.

A node's validation split is data it trusts (FLTrust's "root dataset", which every
meshfl node has). Around the rule's `aggregate`, for the whole models received
(kind "model"; a rule's other blob kinds pass as they are):

1. Sample counts: a peer claiming more than `N_CLAIM_FACTOR` times the median of the
   counts reported this round (the own one included) is screened out ("n_claim"): the
   median is honest while fewer than half lie, and FedAvg-style rules trust `n`.
2. Copies: a model within a little noise of another peer's of this round ("copy"), or
   of one received or adopted in the last `MEMORY_ROUNDS` rounds ("replay"), is nobody's
   work of this round: colluders publishing one model, a replayed model, a free rider
   handing back an aggregate unchanged, a relay adding noise to another's model
   (copies.py says how near is a copy; a peer's own earlier models count only bit for
   bit).
3. Distance: a model further from the node's own than DISTANCE_FACTOR times the median
   distance of the round's models from it ("distance") is no step of training on data
   like anyone's: a scaled update or noise. At the share of step 4 a scaled update looks
   like an honest one a little longer (it may even help the round it arrives) and does
   its harm by growing round after round; its distance shows it the round it arrives,
   where three or more models came (of one or two, none stands out from the median; the
   val check is then the only one). Its record takes the worst harm, so it is not even
   fetched next round; it is never let in on trial (step 7), being no model of the task.
4. Validation: peer j's model is mixed into the pivot at the share an equal average of
   the round's models gives it (1/(m+1) for the m models no earlier step kept out: half
   and half for one);
   d, the per-sample differences of the val loss of that mix minus the pivot's, is one
   round's evidence about j, added to j's record across rounds (evidence.py). At that
   share a peer is judged by what it does to the node's model, not by the loss barrier
   between two models trained apart: mixed half and half, an honest peer of mildly
   skewed data raised the val loss beyond the noise on small shards (every peer kept
   out, the node alone where FedAvg gained most), while at its share it helps
   (docs/defences.md).
   The peer is screened out ("val_loss") while its record shows harm beyond the noise of the val
   split: a new peer as one round's test allows, a slight harm once it repeats, while a
   peer that has been helping keeps its place through an unlucky round. The pivot is
   the own model of the round, or the model the round started from (the last round's
   outcome) where that one validates better: after a round of local training that
   went astray, every peer, a poisoned one too, would look like a help next to the own
   model.
5. Guard: the rule's aggregate is adopted unless the val split gives evidence that it
   harms the node: its val loss not finite, or above the own model's by more than
   HARM_BOUND paired standard errors, the test a peer with no record faces
   (`worse_beyond_noise`), or its val errors more than the own model's beyond noise
   (`errors_and_loss_beyond_noise`: the errors' evidence and the loss's added exceed
   HARM_BOUND), or, for an aggregate far from the own model
   (`a_far_jump`), it is worse on most val samples beyond HARM_BOUND (`sign_z`); else
   the node keeps the own model. The burden is on harm, not help: an average of models that
   trained apart fits each node's data less than its own model for the first rounds and
   pays later, from the common start it gives; a guard that asked each aggregate to
   prove on a small val split that it helps left nodes alone where FedAvg gained most
   (docs/defences.md, "Where collaboration pays"). Errors as well as loss, for loss
   alone is not enough where a model is over-confident (LeNet on Digit-5 overfits in
   loss long before accuracy): an aggregate a hair lower in loss can be far lower in
   val accuracy (docs/algorithms-and-results.md). pFedSV's val guard is this one
   (`guard_verdict`), judged on the logits its game computed.
6. Spikes: where the outcome is worse than the model the round started from beyond
   noise, in val errors and loss together (`_unless_a_spike`, the guard's
   `errors_and_loss_beyond_noise`), the node keeps that model instead: a round
   whose local training went astray (a loss spike at a high lr and momentum can cost
   an MLP most of its accuracy in one round) and that no peer mended is undone rather
   than carried on. Local training alone has no such step, so a screened rule can end
   above Local through it as well as through its peers. The round start is held in
   memory only: a node's first round here, and its first after a resume, have none, so
   they judge peers against the own model and undo nothing.
7. Trials: every check above looks at the val split now, and some help shows only
   after training: a body mixed from other domains (FedC²I on feature shift) validates
   worse the round it is mixed in, and better a few rounds of training later. So where
   the val check kept out a peer whose model alone beats a constant guess on the val
   split (`beats_a_constant_guess`: a model of the node's task, however different its
   data; a model trained on flipped labels, or noise, is not one), and the rule, given
   those peers too (every other cause still applies), weighs one of them, that
   aggregate starts a trial path. Each round the node trains the path's model as it
   trained its own (same recipe, same seed) and judges it by the guard against the own
   model: where it passes, the node carries on from it; where it does not, the trained
   model takes the own model's place in the rule's aggregate with the round's peers
   (this round's kept-out peers let in where they pass the same test) and the path
   goes on, for up to TRIAL_ROUNDS rounds. A path is judged on what the node would
   have had after the same training, so a peer let in on trial gets in only where the
   node ends up no worse on its val split by the guard's measure; the round's metrics
   name each model's share in a won path, and the experiment tables count them in the
   attackers' weight. The rule is rewound after each aggregate of a path (`Rewind`), so the
   round's own aggregate is what it would have been. Held in memory only, as the round
   start is. On by default only for a rule that says so (`trials_by_default`: FedC²I,
   whose influence vector mixes bodies across domains); `algorithm.trials` sets it
   either way. Under label skew the val check keeps out the honest peers of other
   labels as well as the attackers, and neither the records nor the size of the harm
   tells them apart; the constant guess keeps out the attackers whose models are no
   model of the task (before it, one-round trials on the robustness table gave the
   attackers up to 5% of the weight and cost FedC²I up to 2.2 points under attack).

A peer whose record shows clear harm is not fetched at all ("record"): the rule's
`wanted` is offered the other peers only. The rule then sees only the admitted peers
(and is told who was kept out, `kept_out`), so its `layouts`, `wanted` and diagnostics
are its own; the screening adds `screened_out`
({peer: reason}), `screening` and `evidence` (each received peer's record) to the
diagnostics. Screening is on by default (`algorithm.screen`); false gives the paper's
rule unchanged. Cost: one distance per received model (one pass over its tensors), one
val pass per received model and one for the aggregate (and one for the model the round
started from where the guard did not judge it); each pass gives both the per-sample
losses and the per-sample errors. With trials on, a round
where the val check kept a peer out makes one more val pass for each such peer (alone);
a round of a trial path trains once more, makes one more val pass and runs the rule's
aggregate twice.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch.nn import functional

from .base import (
    MODEL,
    Aggregate,
    PeerAlgorithm,
    PeerModel,
    ReceivedModels,
    Rewind,
    State,
    draw_seed,
    model_distance,
    weighted_average,
)
from .copies import OWN, Memory, Sketcher, copies, near_pairs, nearest_share, spread
from .evidence import HARM_BOUND, PeerRecords, coin_flip_z, harm_z, sign_z

N_CLAIM_FACTOR = 4
# Step 3: a model this many times the round's median distance from the own model is kept
# out. An honest model of the task stays within about twice the median (in the tables of
# docs/defences.md, at most 2 of 9,000 honest models were ever further than three
# times); a scaled update of s is about s times its honest distance, noise of the
# model's scale far more.
DISTANCE_FACTOR = 3.0
SCREEN_KEY = "screen"
TRIALS_KEY = "trials"  # step 7, the rule's `trials_by_default` unless set: see above
# A trial path is trained and judged for up to this many rounds before it is given up:
# a body mixed from other domains can validate worse for a few rounds of training and
# better from then on (FedC²I on Office-Caltech, seed 0: the paper rule's models pass
# the own ones in test accuracy in the fourth or fifth round of mixing).
TRIAL_ROUNDS = 5
# The sketches screening remembers (copies.py), in the node's checkpoint beside the
# rule's own state: a node that resumes still knows the models of its last rounds, and a
# replay of one.
MEMORY_KEY = "screening_memory"
RECORDS_KEY = "peer_records"  # the evidence about each peer, kept for the same reason


# --------------------------------------------------------------------------- pure checks


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
    samples either. With no val split there is nothing to judge by, and the aggregate
    stands."""
    if len(own.losses) == 0:
        return True, {}
    figures = {
        "val_loss_own": float(own.losses.mean()),
        "val_loss_aggregate": float(aggregate.losses.mean()),
        "val_errors_own": int(own.errors.sum()),
        "val_errors_aggregate": int(aggregate.errors.sum()),
    }
    harmed = worse_beyond_noise(own.losses, aggregate.losses, by_signs=far)
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
    (docs/defences.md, "Where collaboration pays")."""
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
    `far_jump` None where the rule judged it itself (pFedSV's val guard)."""

    adopted: bool
    far_jump: bool | None = None
    figures: dict[str, float] = {}


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
        for key in ("kept_round_start", "judged_against"):
            if getattr(self, key) is not None:
                record[key] = getattr(self, key)
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


def _mean_loss(scored: tuple[State, ValScores]) -> float:
    return float(scored[1].losses.mean())


# --------------------------------------------------------------------------- the wrapper


class Screened(PeerAlgorithm):
    """A peer rule behind validation screening; everything but `aggregate` is the rule's."""

    def __init__(self, rule: PeerAlgorithm, trials: bool = False) -> None:
        super().__init__(rule.params, rule.context)
        self.rule = rule
        self.trials = trials  # step 7
        self.name = rule.name
        self.ranks_offers = rule.ranks_offers
        self.sketch = Sketcher(draw_seed(rule.context.seed, rule.context.node, 0, "sketch"))
        self.memory = Memory()  # the sketches of models received or adopted lately
        # The outcomes of this round and the last, with their val scores where known.
        self._adopted: dict[int, tuple[State, ValScores | None]] = {}
        self.records = PeerRecords()  # what each peer's models did to this node, so far
        # The peers a round's `wanted` kept out by their record, and that round.
        self._passed_over: tuple[int, list[str]] = (0, [])
        self._trial: Trial | None = None  # step 7: judged the round after it is started

    def scratch_model(self) -> torch.nn.Module:
        """The wrapped rule's: one spare model per node; every user loads a state first."""
        return self.rule.scratch_model()

    def publish(self, round_no: int, state: State, data: Any) -> dict[str, State]:
        return self.rule.publish(round_no, state, data)

    def wanted(self, round_no: int, offered: dict[str, list[str]]) -> dict[str, list[str]]:
        """The rule's choice among the offers, less the models of peers whose record
        shows clear harm: those are not even fetched (evidence.py, `pass_over`)."""
        kept_out = [
            peer
            for peer in offered.get(MODEL, [])
            if self.records.not_worth_fetching(peer, round_no)
        ]
        self._passed_over = (round_no, kept_out)
        for peer in kept_out:
            self.records = self.records.pass_over(peer, round_no)
        if not kept_out:
            return self.rule.wanted(round_no, offered)
        models = [peer for peer in offered[MODEL] if peer not in kept_out]
        return self.rule.wanted(round_no, {**offered, MODEL: models})

    def layouts(self, kind: str) -> tuple[Any, ...]:
        return self.rule.layouts(kind)

    def benefits(self, peers: Iterable[str], weights: Mapping[str, float]) -> dict[str, float]:
        """The evidence of help so far, less that of harm (evidence.py): what one
        round's rule weight cannot tell apart, a peer's record does."""
        return {peer: -self.records.score(peer) for peer in peers}

    def shuns(self, peer: str) -> bool:
        """A peer whose record shows clear harm (evidence.py, `not_worth_fetching`): in
        a bounded mesh its record only changes while it is a neighbour, so it stays
        shunned here, and its place goes to peers not yet judged. Mere harm (one
        unlucky round on a small val split) only makes a neighbour the first dropped.
        And whom the rule itself shuns."""
        return self.records.not_worth_fetching(peer) or self.rule.shuns(peer)

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.rule.state_dict(),
            MEMORY_KEY: self.memory.state_dict(),
            RECORDS_KEY: self.records.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory = Memory.from_state_dict(state.get(MEMORY_KEY, {}))  # absent in older ones
        self.records = PeerRecords.from_state_dict(state.get(RECORDS_KEY, {}))
        ours = (MEMORY_KEY, RECORDS_KEY)
        self.rule.load_state_dict({key: value for key, value in state.items() if key not in ours})

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        clock = time.perf_counter()
        models = received.get(MODEL, {})
        judged = len(data.y_val) > 0
        own_scored = (own.state, self._scores(own.state, data)) if judged else None
        path = None  # the trial path carried on, where it lost but is still young
        trial = None
        if own_scored is not None and self._trial is not None:
            own, own_scored, path, trial = self._judge_trial(round_no, own, own_scored, data)
        self._trial = None
        start = self._scored_round_start(round_no, data) if judged else None
        pivot = own_scored
        if (
            start is not None
            and own_scored is not None
            and _mean_loss(start) < _mean_loss(own_scored)
        ):
            pivot = start
        copied, nearest_copy = self._copies(round_no, own, models)
        reasons = self._screen(round_no, own, models, copied, data, pivot)
        passed_round, passed_over = self._passed_over
        if passed_round == round_no:
            reasons.update({peer: "record" for peer in passed_over if peer not in models})
        worth_a_trial = path is not None or "val_loss" in reasons.values()
        on_trial = None
        if self.trials and own_scored is not None and worth_a_trial:
            on_trial = self._next_trial_model(round_no, own, path, received, reasons, data)
        rule_clock = time.perf_counter()
        outcome = self._rule_aggregate(round_no, own, received, reasons, data)
        rule_seconds = time.perf_counter() - rule_clock
        outcome, scores, guard = self._guard(outcome, own_scored, start, data)
        kept_round_start = None
        if start is not None:
            outcome, scores, kept_round_start = self._unless_a_spike(outcome, scores, start, data)
        if (sketch := self.sketch(outcome.state)) is not None:
            self.memory = self.memory.remember(round_no, {OWN: sketch})
        kept = {key: value.detach().clone() for key, value in outcome.state.items()}
        self.rule.adopted(outcome.state)
        self._adopted = {round_no: (kept, scores)}  # the next round's start: all it reads
        judged_against = None
        if pivot is not None:
            own_kind = "trial" if trial is not None and trial.won else "own"
            judged_against = own_kind if pivot is own_scored else "round_start"
        report = ScreeningReport(
            judged,
            trial,
            nearest_copy,
            on_trial,
            rule_seconds,
            guard,
            kept_round_start,
            judged_against,
            seconds=time.perf_counter() - clock,
        )
        outcome.diagnostics = {
            **outcome.diagnostics,
            "screened_out": dict(sorted(reasons.items())),
            "screening": report.as_diagnostics(),
            "evidence": {peer: round(self.records.score(peer), 3) for peer in sorted(models)},
        }
        return outcome

    def _rule_aggregate(
        self,
        round_no: int,
        own: PeerModel,
        received: ReceivedModels,
        reasons: dict[str, str],
        data: Any,
    ) -> Aggregate:
        """The rule's aggregate of what was received, less the models of `reasons`."""
        self.rule.kept_out(set(reasons))
        models = received.get(MODEL, {})
        admitted = {**received, MODEL: {p: m for p, m in models.items() if p not in reasons}}
        if MODEL not in received:
            admitted.pop(MODEL)
        return self.rule.aggregate(round_no, own, admitted, data)

    def _next_trial_model(
        self,
        round_no: int,
        own: PeerModel,
        path: Trial | None,
        received: ReceivedModels,
        reasons: dict[str, str],
        data: Any,
    ) -> list[str] | None:
        """The next model of a trial path (step 7): the rule's aggregate of the path's
        last model (or, for a new path, the own one) with the peers the val check kept
        out let in where their models alone beat a constant guess, kept where the path
        goes on or the rule gives one of them weight; returns those peers (None where no
        path goes on). The rule is rewound after it, so the round's own aggregate is
        what it would have been."""
        me = self.context.node
        models = received.get(MODEL, {})
        kept_out = sorted(peer for peer, why in reasons.items() if why == "val_loss")
        on_trial = [peer for peer in kept_out if self._models_the_task(models[peer], data)]
        if path is None and not on_trial:
            return None
        for_cause = {peer: why for peer, why in reasons.items() if peer not in on_trial}
        base = own if path is None else PeerModel(path.state, own.n_samples)
        rewind = Rewind(self.rule)
        try:
            trial = self._rule_aggregate(round_no, base, received, for_cause, data)
        finally:
            rewind()
        if path is None and not any(trial.weights.get(peer, 0.0) > 0 for peer in on_trial):
            return None
        began, shares = (round_no, {me: 1.0}) if path is None else (path.began, path.shares)
        shares = path_shares(shares, trial.weights, me)
        self._trial = Trial(round_no, began, trial.state, shares)
        return on_trial

    def _models_the_task(self, model: PeerModel, data: Any) -> bool:
        """Whether a peer's model alone beats a constant guess on the val split: only
        such a model is let in on trial (one trained on flipped labels, or noise, is
        not)."""
        return beats_a_constant_guess(self._scores(model.state, data).errors, data.y_val)

    def _judge_trial(
        self,
        round_no: int,
        own: PeerModel,
        own_scored: tuple[State, ValScores],
        data: Any,
    ) -> tuple[PeerModel, tuple[State, ValScores], Trial | None, TrialVerdict | None]:
        """The own model of the round, or last round's trial trained as the own model
        was (the same recipe and seed), where that one passes the guard against it
        (step 7); the trained trial as the path to go on with, where it lost and its
        path is younger than TRIAL_ROUNDS; and the verdict. A trial of an earlier round
        (the node missed one) is dropped unjudged."""
        trial = self._trial
        assert trial is not None, "judged only where one is pending"
        if trial.round_no != round_no - 1:
            return own, own_scored, None, None
        model = self.scratch_model()
        model.load_state_dict(trial.state)
        assert self.context.train is not None, "the node provides its training recipe"
        seed = draw_seed(self.context.seed, self.context.node, round_no, "train")
        self.context.train(model, data.x_train, data.y_train, None, seed=seed)
        trained = {key: value.detach().clone() for key, value in model.state_dict().items()}
        scores = self._scores(trained, data)
        won, figures = guard_verdict(own_scored[1], scores)
        path_rounds = round_no - trial.began
        if not won:
            young = path_rounds < TRIAL_ROUNDS
            path = trial._replace(round_no=round_no, state=trained) if young else None
            return own, own_scored, path, TrialVerdict(False, path_rounds, figures, None)
        # Whose models the node now carries on from, for its metrics (attacker weight).
        verdict = TrialVerdict(True, path_rounds, figures, trial.shares)
        return PeerModel(trained, own.n_samples), (trained, scores), None, verdict

    def _guard(
        self,
        outcome: Aggregate,
        own_scored: tuple[State, ValScores] | None,
        start: tuple[State, ValScores] | None,
        data: Any,
    ) -> tuple[Aggregate, ValScores | None, GuardVerdict | None]:
        """The rule's outcome, or the own model where the guard refuses the aggregate,
        with its val scores where known and the verdict where one was given; `start`,
        the round start where known."""
        me = self.context.node
        if own_scored is None:
            return outcome, None, None
        own_state, own_scores = own_scored
        if outcome.weights == {me: 1.0}:  # the own model (or a rule's variant of it)
            return outcome, own_scores if outcome.state is own_state else None, None
        if self.rule.guards_aggregate:  # judged by the rule itself (pFedSV's val guard)
            if "adopted" not in outcome.diagnostics:  # its verdict, where it judged one
                return outcome, None, None
            return outcome, None, GuardVerdict(outcome.diagnostics["adopted"])
        scores = self._scores(outcome.state, data)
        far = start is not None and a_far_jump(outcome.state, own_state, start[0])
        adopted, figures = guard_verdict(own_scores, scores, far)
        verdict = GuardVerdict(adopted, far, figures)
        if adopted:
            return outcome, scores, verdict
        return Aggregate(own_state, {me: 1.0}, outcome.diagnostics), own_scores, verdict

    def _unless_a_spike(
        self,
        outcome: Aggregate,
        scores: ValScores | None,
        start: tuple[State, ValScores],
        data: Any,
    ) -> tuple[Aggregate, ValScores, bool]:
        """The round's outcome, or the model the round started from where the outcome
        is worse than that one beyond noise, in val errors and loss together
        (`errors_and_loss_beyond_noise`), with its val scores and whether it was undone:
        a round whose local training went astray, with no peer's help to mend it, is
        undone rather than kept. One deviation of errors alone undid the mesh's average
        by noise (docs/defences.md, "Where collaboration pays")."""
        scores = scores if scores is not None else self._scores(outcome.state, data)
        if errors_and_loss_beyond_noise(start[1], scores):
            undone = Aggregate(start[0], {self.context.node: 1.0}, outcome.diagnostics)
            return undone, start[1], True
        return outcome, scores, False

    def _scored_round_start(self, round_no: int, data: Any) -> tuple[State, ValScores] | None:
        """The model this round started from (the last round's outcome), with its val
        scores; None in a node's first round here."""
        if round_no - 1 not in self._adopted:
            return None
        state, scores = self._adopted[round_no - 1]
        return state, scores if scores is not None else self._scores(state, data)

    def _copies(
        self, round_no: int, own: PeerModel, models: dict[str, PeerModel]
    ) -> tuple[dict[str, str], float | None]:
        """Step 2's {peer: "copy" or "replay"}, and how near the nearest of the others
        came to being called one (copies.py); none for a model without floats."""
        # The round's start is the outcome remembered last round; in a node's first
        # round here, its own model.
        began_with = self.memory.rounds.get(round_no - 1, {}).get(OWN)
        if began_with is None:
            began_with = self.sketch(own.state)
        if began_with is None:
            return {}, None
        sketches = {
            peer: sketch
            for peer, model in models.items()
            if (sketch := self.sketch(model.state)) is not None
        }
        nearest = near_pairs(sketches, self.memory.before(round_no), spread(began_with, sketches))
        self.memory = self.memory.remember(round_no, sketches)
        copied = copies(nearest)
        return copied, nearest_share(nearest, copied)

    def _screen(
        self,
        round_no: int,
        own: PeerModel,
        models: dict[str, PeerModel],
        copied: dict[str, str],
        data: Any,
        pivot: tuple[State, ValScores] | None,
    ) -> dict[str, str]:
        """{peer: reason} for the received whole models kept out of the rule."""
        reasons = {
            peer: "n_claim"
            for peer in inflated_claims(
                own.n_samples, {peer: model.n_samples for peer, model in models.items()}
            )
        }
        reasons.update({peer: why for peer, why in copied.items() if peer not in reasons})
        not_yet_out = {peer: models[peer].state for peer in models if peer not in reasons}
        for peer in far_models(own.state, not_yet_out):
            reasons[peer] = "distance"
            # Clear harm: not fetched next round.
            self.records = self.records.convict(peer, round_no)
        if pivot is None:
            return reasons
        pivot_state, pivot_scores = pivot
        judged = sorted(set(models) - set(reasons))
        # Each one's share in an equal average of the own model and the models judged: a
        # copy or a junk model does not shrink it (many of them would hide a subtle harm).
        share = 1.0 / (1 + len(judged))
        for peer in judged:
            mix = weighted_average(
                {"pivot": pivot_state, peer: models[peer].state}, {"pivot": 1 - share, peer: share}
            )
            differences = self._scores(mix, data).losses - pivot_scores.losses
            self.records = self.records.observe(peer, round_no, differences)
            if self.records.harmful(peer):
                reasons[peer] = "val_loss"
        return reasons

    def _scores(self, state: State, data: Any) -> ValScores:
        return val_scores(self.scratch_model(), state, data.x_val, data.y_val)


def with_screening(rule: PeerAlgorithm, screen: bool, trials: bool = False) -> PeerAlgorithm:
    return Screened(rule, trials) if screen and rule.screenable else rule
