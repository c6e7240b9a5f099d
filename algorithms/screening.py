"""Validation screening: one mechanism around every peer rule, so that a rule learns
from a peer only where that helps this node, and an attacker's weight goes to zero.
Here the chain of steps below; each step's check, a pure function returning its
verdict, is in verdicts.py.

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
   val check is then the only one). Its record takes the worst harm, so once it repeats
   it is not even fetched the round after; it is never let in on trial (step 7), being
   no model of the task.
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
   the node keeps the own model. The loss's and the signs' tests stand alone only where
   the aggregate makes no fewer val errors: one more often right is judged by its
   errors and its loss added. The burden is on harm, not help: an average of models that
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

A peer whose record shows clear harm that repeats is not fetched at all ("record"):
the rule's `wanted` is offered the other peers only, however often the node asks as
offers arrive. The rule then sees only the admitted peers
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

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .base import (
    MODEL,
    Aggregate,
    PeerAlgorithm,
    PeerModel,
    ReceivedModels,
    Rewind,
    State,
    cloned,
    draw_seed,
    weighted_average,
)
from .copies import OWN, Memory, Sketcher, copies, near_pairs, nearest_share, spread
from .evidence import PeerRecords
from .verdicts import (
    GuardVerdict,
    ScreeningReport,
    Trial,
    TrialVerdict,
    ValScores,
    a_far_jump,
    beats_a_constant_guess,
    errors_and_loss_beyond_noise,
    far_models,
    guard_verdict,
    inflated_claims,
    path_shares,
    val_scores,
)

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


def _mean_loss(scored: tuple[State, ValScores]) -> float:
    return float(scored[1].losses.mean())


# --------------------------------------------------------------------------- the wrapper


class Screened(PeerAlgorithm):
    """A peer rule behind validation screening: `aggregate`, `wanted`, `benefits`,
    `shuns` and the checkpoint are screening's around the rule's; the rest is the rule's.
    The rule's own state is read as such (`screened.rule`)."""

    def __init__(self, rule: PeerAlgorithm, trials: bool = False) -> None:
        super().__init__(rule.params, rule.context)
        self.rule = rule
        self.trials = trials  # step 7
        self.name = rule.name
        self.ranks_offers = rule.ranks_offers
        self.sketch = Sketcher(draw_seed(rule.context.seed, rule.context.node, 0, "sketch"))
        self.memory = Memory()  # the sketches of models received or adopted lately
        # The last round's outcome, set aside (`Context.set_aside`), with its val scores
        # where known.
        self._adopted: dict[int, tuple[Callable[[], State], ValScores | None]] = {}
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
        shows clear harm that repeats: those are not even fetched (evidence.py,
        `pass_over`). The node asks again each time more offers arrive; a peer passed
        over stays so for the round (its pass-over faded its record), and the others
        are judged as they stood at the round's start."""
        passed_round, passed = self._passed_over
        already = set(passed) if passed_round == round_no else set()
        offers = offered.get(MODEL, [])
        newly = [p for p in offers if p not in already and self.records.not_worth_fetching(p)]
        for peer in newly:
            self.records = self.records.pass_over(peer, round_no)
        # Kept for the round even where an offer drops out of a later ask and comes back.
        self._passed_over = (round_no, sorted(already | set(newly)))
        models = [peer for peer in offers if peer not in already and peer not in newly]
        if len(models) == len(offers):
            return self.rule.wanted(round_no, offered)
        return self.rule.wanted(round_no, {**offered, MODEL: models})

    def layouts(self, kind: str) -> tuple[Any, ...]:
        return self.rule.layouts(kind)

    def benefits(self, peers: Iterable[str], weights: Mapping[str, float]) -> dict[str, float]:
        """The evidence of help so far, less that of harm (evidence.py): what one
        round's rule weight cannot tell apart, a peer's record does."""
        return {peer: -self.records.score(peer) for peer in peers}

    def shuns(self, peer: str) -> bool:
        """A peer whose record shows clear harm that repeats, the harm that saves a
        download too (evidence.py, `not_worth_fetching`): in a bounded mesh its record
        only changes while it is a neighbour, so it stays shunned here, and its place
        goes to peers not yet judged. One round of harm, however clear, only makes a
        neighbour the first dropped, and it may be met again: a node still catching up
        with its cluster lies far from its cluster-mates for a round, and when one such
        round shunned them, the nodes of 10 Fashion-MNIST clusters lost 0.87 of their 9
        cluster-mates each for good (docs/big-meshes.md). And whom the rule shuns."""
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
        trial_verdict = None
        if own_scored is not None and self._trial is not None:
            judged_trial = self._judge_trial(round_no, own, own_scored, data)
            own, own_scored, path, trial_verdict = judged_trial
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
        kept = self.context.set_aside(outcome.state)
        self.rule.adopted(outcome.state)
        self._adopted = {round_no: (kept, scores)}  # the next round's start: all it reads
        judged_against = None
        if pivot is not None:
            own_kind = "trial" if trial_verdict is not None and trial_verdict.won else "own"
            judged_against = own_kind if pivot is own_scored else "round_start"
        report = ScreeningReport(
            judged=judged,
            trial=trial_verdict,
            nearest_copy=nearest_copy,
            on_trial=on_trial,
            rule_seconds=rule_seconds,
            guard=guard,
            kept_round_start=kept_round_start,
            judged_against=judged_against,
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
        trained = cloned(model.state_dict())
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
            return outcome, None, GuardVerdict(outcome.diagnostics["adopted"], None, {})
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
        kept, scores = self._adopted[round_no - 1]
        state = kept()
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
            # Clear harm: once it repeats, not fetched the round after.
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
