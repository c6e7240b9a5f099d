"""Validation screening: one mechanism around every peer rule, so that a rule learns
from a peer only where that helps this node, and an attacker's weight goes to zero.

A node's validation split is data it trusts (FLTrust's "root dataset", which every
meshfl node has). Around the rule's `aggregate`, for the whole models received
(kind "model"; a rule's other blob kinds pass as they are):

1. Sample counts: a peer claiming more than `N_CLAIM_FACTOR` times the median of the
   counts reported this round (the own one included) is screened out ("n_claim"): the
   median is honest while fewer than half lie, and FedAvg-style rules trust `n`.
2. Copies: a model bit-identical to another peer's of this round ("copy"), or to one
   received or adopted in the last `MEMORY_ROUNDS` rounds ("replay"), is nobody's work
   of this round: colluders publishing one model, a replayed model, a free rider
   handing back an aggregate unchanged.
3. Validation: peer j's model is averaged half and half with the pivot; with d the
   per-sample differences of the val loss of that pair minus the pivot's, the peer is
   screened out ("val_loss") when mean(d) exceeds one standard error of d: it makes the
   node's model worse beyond the noise of the val split. The pivot is the own model of
   the round, or the model the round started from (the last round's outcome) where that
   one validates better: after a round of local training that went astray, every
   peer, a poisoned one too, would look like a help next to the own model.
4. Guard: the rule's aggregate is adopted only when its val loss is finite and at most
   the own model's; else the node keeps the own model (pFedSV's val guard, the same
   rule, shared through `adopts`).

The rule then sees only the admitted peers, so its `layouts`, `wanted` and diagnostics
are its own; the screening adds `screened_out` ({peer: reason}) and `screening` to the
diagnostics. Screening is on by default (`algorithm.screen`); false gives the paper's
rule unchanged. Cost: one val pass per received model and one for the aggregate (and
one for the model the round started from where the guard did not judge it).
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from typing import Any

import torch
from torch.nn import functional

from .base import (
    MODEL,
    Aggregate,
    PeerAlgorithm,
    PeerModel,
    ReceivedModels,
    State,
    weighted_average,
)

N_CLAIM_FACTOR = 4
MEMORY_ROUNDS = 3
SCREEN_KEY = "screen"
# The digests screening remembers, in the node's checkpoint beside the rule's own state:
# a node that resumes still knows the models of its last rounds, and a replay of one.
MEMORY_KEY = "screening_memory"


# --------------------------------------------------------------------------- pure checks


def adopts(own_loss: float, aggregate_loss: float) -> bool:
    """Whether a node takes an aggregate over its own model, judged on its val split:
    only when the aggregate's loss is finite and at most the own model's. Loss, not
    accuracy: on a small val split accuracies tie where cross-entropy still differs."""
    return math.isfinite(aggregate_loss) and aggregate_loss <= own_loss


def inflated_claims(own_n: int, claims: dict[str, int]) -> set[str]:
    """Peers claiming more than N_CLAIM_FACTOR times the median of all counts."""
    bound = N_CLAIM_FACTOR * statistics.median([own_n, *claims.values()])
    return {peer for peer, n in claims.items() if n > bound}


def state_digest(state: State) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().contiguous().cpu().numpy().tobytes())
    return digest.digest()


def copies(digests: dict[str, bytes], seen_before: set[bytes]) -> dict[str, str]:
    """Peers whose model equals another peer's this round ("copy") or one seen in an
    earlier round ("replay")."""
    holders: dict[bytes, int] = {}
    for digest in digests.values():
        holders[digest] = holders.get(digest, 0) + 1
    found = {peer: "replay" for peer, digest in digests.items() if digest in seen_before}
    found.update(
        {
            peer: "copy"
            for peer, digest in digests.items()
            if holders[digest] > 1 and peer not in found
        }
    )
    return found


def worse_beyond_noise(own_losses: torch.Tensor, other_losses: torch.Tensor) -> bool:
    """Whether per-sample losses are higher than the own model's by more than one
    standard error of the paired differences (or not finite)."""
    differences = (other_losses - own_losses).double()
    if not torch.isfinite(differences).all():
        return True
    if len(differences) < 2:
        return bool(differences.sum() > 0)
    noise = float(differences.std()) / math.sqrt(len(differences))
    return float(differences.mean()) > noise


def per_sample_losses(
    model: torch.nn.Module, state: State, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512
) -> torch.Tensor:
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return torch.cat(
            [
                functional.cross_entropy(
                    model(x[i : i + batch_size]), y[i : i + batch_size].long(), reduction="none"
                )
                for i in range(0, len(x), batch_size)
            ]
        )


# --------------------------------------------------------------------------- the wrapper


class Screened(PeerAlgorithm):
    """A peer rule behind validation screening; everything but `aggregate` is the rule's."""

    def __init__(self, rule: PeerAlgorithm) -> None:
        super().__init__(rule.params, rule.context)
        self.rule = rule
        self.name = rule.name
        self.ranks_offers = rule.ranks_offers
        self._seen: dict[int, set[bytes]] = {}  # round -> digests received or adopted
        # The outcomes of this round and the last, with their val losses where known.
        self._adopted: dict[int, tuple[State, torch.Tensor | None]] = {}

    def scratch_model(self) -> torch.nn.Module:
        """The wrapped rule's: one spare model per node; every user loads a state first."""
        return self.rule.scratch_model()

    def __getattr__(self, name: str) -> Any:  # the rule's own state (groups, scores...)
        if "rule" not in self.__dict__:  # half-built (a copy being made)
            raise AttributeError(name)
        return getattr(self.__dict__["rule"], name)

    def publish(self, round_no: int, state: State, data: Any) -> dict[str, State]:
        return self.rule.publish(round_no, state, data)

    def wanted(self, round_no: int, offered: dict[str, list[str]]) -> dict[str, list[str]]:
        return self.rule.wanted(round_no, offered)

    def layouts(self, kind: str) -> tuple[Any, ...]:
        return self.rule.layouts(kind)

    def state_dict(self) -> dict[str, Any]:
        memory = {round_no: sorted(d.hex() for d in seen) for round_no, seen in self._seen.items()}
        return {**self.rule.state_dict(), MEMORY_KEY: memory}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        memory = state.get(MEMORY_KEY, {})  # absent in a checkpoint of an older version
        self._seen = {int(r): {bytes.fromhex(d) for d in seen} for r, seen in memory.items()}
        self.rule.load_state_dict({key: value for key, value in state.items() if key != MEMORY_KEY})

    def aggregate(
        self, round_no: int, own: PeerModel, received: ReceivedModels, data: Any
    ) -> Aggregate:
        clock = time.perf_counter()
        me, models = self.context.node, received.get(MODEL, {})
        judged = len(data.y_val) > 0
        own_losses = self._losses(own.state, data) if judged else None
        pivot = self._pivot(round_no, own.state, own_losses, data)
        reasons = self._screen(round_no, own, models, data, pivot)
        admitted = {**received, MODEL: {p: m for p, m in models.items() if p not in reasons}}
        if MODEL not in received:
            admitted.pop(MODEL)
        outcome = self.rule.aggregate(round_no, own, admitted, data)
        report: dict[str, Any] = {"judged": judged}
        guarded = judged and not self.rule.guards_aggregate and outcome.weights != {me: 1.0}
        outcome_losses = None  # the outcome's per-sample val losses, where known here
        if guarded:
            assert own_losses is not None
            own_loss = float(own_losses.mean())
            outcome_losses = self._losses(outcome.state, data)
            aggregate_loss = float(outcome_losses.mean())
            report.update(
                val_loss_own=own_loss,
                val_loss_aggregate=aggregate_loss,
                adopted=adopts(own_loss, aggregate_loss),
            )
            if not report["adopted"]:
                outcome, outcome_losses = (
                    Aggregate(own.state, {me: 1.0}, outcome.diagnostics),
                    own_losses,
                )
        self._remember(round_no, [state_digest(outcome.state)])
        kept = {key: value.detach().clone() for key, value in outcome.state.items()}
        self._adopted = {
            round_no: (kept, outcome_losses),
            **{r: each for r, each in self._adopted.items() if r == round_no - 1},
        }
        if pivot is not None:
            report["judged_against"] = "own" if pivot[0] is own.state else "round_start"
        report["seconds"] = time.perf_counter() - clock
        outcome.diagnostics = {
            **outcome.diagnostics,
            "screened_out": dict(sorted(reasons.items())),
            "screening": report,
        }
        return outcome

    def _pivot(
        self, round_no: int, own_state: State, own_losses: torch.Tensor | None, data: Any
    ) -> tuple[State, torch.Tensor] | None:
        """The model peers are judged against, with its per-sample val losses: the own
        model of this round, or the one this round started from (the last round's
        outcome) where that one validates better. A round of local training that went
        astray would otherwise make every peer, an attacker too, look like a help."""
        if own_losses is None:
            return None  # no val split: nothing to judge by
        if round_no - 1 in self._adopted:
            start, start_losses = self._adopted[round_no - 1]
            if start_losses is None:  # the guard did not judge it: judge it now
                start_losses = self._losses(start, data)
            if float(start_losses.mean()) < float(own_losses.mean()):
                return start, start_losses
        return own_state, own_losses

    def _screen(
        self,
        round_no: int,
        own: PeerModel,
        models: dict[str, PeerModel],
        data: Any,
        pivot: tuple[State, torch.Tensor] | None,
    ) -> dict[str, str]:
        """{peer: reason} for the received whole models kept out of the rule."""
        reasons = {
            peer: "n_claim"
            for peer in inflated_claims(
                own.n_samples, {peer: model.n_samples for peer, model in models.items()}
            )
        }
        digests = {peer: state_digest(model.state) for peer, model in models.items()}
        reasons.update(
            {
                peer: why
                for peer, why in copies(digests, self._seen_before(round_no)).items()
                if peer not in reasons
            }
        )
        self._remember(round_no, digests.values())
        if pivot is None:
            return reasons
        pivot_state, pivot_losses = pivot
        for peer in sorted(set(models) - set(reasons)):
            pair = weighted_average(
                {"pivot": pivot_state, peer: models[peer].state}, {"pivot": 0.5, peer: 0.5}
            )
            if worse_beyond_noise(pivot_losses, self._losses(pair, data)):
                reasons[peer] = "val_loss"
        return reasons

    def _losses(self, state: State, data: Any) -> torch.Tensor:
        return per_sample_losses(self.scratch_model(), state, data.x_val, data.y_val)

    def _seen_before(self, round_no: int) -> set[bytes]:
        """Digests of earlier rounds only: a step the node re-runs (node/containment.py)
        must not find this round's own models there."""
        return set().union(
            *(digests for seen_round, digests in self._seen.items() if seen_round < round_no)
        )

    def _remember(self, round_no: int, digests: Any) -> None:
        self._seen.setdefault(round_no, set()).update(digests)
        for old in [r for r in self._seen if r <= round_no - MEMORY_ROUNDS]:
            del self._seen[old]


def with_screening(rule: PeerAlgorithm, screen: bool) -> PeerAlgorithm:
    return Screened(rule) if screen and rule.screenable else rule
