"""What each rule decided by the end of a run, one short phrase per node: the `decision`
column of the result table of `meshfl launch`, of summary.json and of report.md.

Every phrase is read from the diagnostics a rule writes into metrics.jsonl (each rule's
module lists them): a peer-to-peer rule's from the node's own records, a server-centric
rule's from the coordinator's. Each key is taken at its latest value over the records,
so a key a rule writes only in some rounds (Fed-Influence's FIL, every
`evaluate_every` rounds) still counts. Which phrase a rule shows is its entry in the
registry of launch/measures.py; a rule without one (the baselines) decides nothing a
column could show. A peer-to-peer rule's phrase names only peers the node's last round
gave weight: a peer the rule ranked first but screening kept out (or whose aggregate the
guard refused) taught the node nothing, and a node that kept its own model says so.

Where screening ran (algorithms/screening.py), the phrase ends with what it did over
the whole run, counted from every round's `screened_out` and guard verdict (pFedSV's own
val guard's included: screening's report carries it): how many of the peers' models it
let into the rule, those it kept out by reason (`record`: not even fetched), how many
peers it let in at least once, and the aggregates the guard refused. A run where
screening kept every peer out says so, rather than leaving the rule's phrase to read as
if the rule had learned from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from meshfl.node.metrics import CoordinatorRecord, RoundRecord

Diagnostics = dict[str, Any]
Weights = dict[str, float]
OWN_ONLY = "own model only"  # a node whose last round gave no peer weight
# (node, its latest diagnostics, the coordinator's latest, the weights of its last
# round) -> the phrase, or None
Decide = Callable[[str, Diagnostics, Diagnostics, Weights], str | None]


def latest_diagnostics(records: Iterable[RoundRecord | CoordinatorRecord]) -> Diagnostics:
    """Every diagnostics key of `records` (in round order) at its latest value."""
    latest: Diagnostics = {}
    for record in records:
        latest.update(record.diagnostics or {})
    return latest


def _names(peers: Iterable[str]) -> str:
    return ",".join(peers) or "none"


def _weighted(peers: Iterable[str], weights: Weights) -> list[str]:
    """`peers` that got weight in the round `weights` is of, in their order; all of them
    where the records name no weights (metrics of a version that wrote none)."""
    return [peer for peer in peers if not weights or weights.get(peer, 0.0) > 0]


def _group(group: list[str] | None, phase: str | None) -> str | None:
    """pFedLIA's group, or why there is none yet."""
    if group is not None:
        return f"group {_names(group)}"
    if phase == "warmup":
        return "warm-up only, no group"
    return f"no group ({phase})" if phase else None


def pfedlia(node: str, own: Diagnostics, coordinator: Diagnostics, weights: Weights) -> str | None:
    group = own.get("group")
    return _group(None if group is None else _weighted(group, weights), own.get("phase"))


def pfedlia_central(
    node: str, own: Diagnostics, coordinator: Diagnostics, weights: Weights
) -> str | None:
    return _group((coordinator.get("groups") or {}).get(node), coordinator.get("phase"))


def pfedsv(node: str, own: Diagnostics, coordinator: Diagnostics, weights: Weights) -> str | None:
    selected = own.get("selected")
    if selected is None:
        return None
    learned_from = _weighted(selected, weights)
    return f"top-{len(learned_from)} {_names(learned_from)}" if learned_from else OWN_ONLY


def fedc2i(node: str, own: Diagnostics, coordinator: Diagnostics, weights: Weights) -> str | None:
    if "influence_vector" not in own:
        return None
    vector = own["influence_vector"]
    influence = {peer: vector[peer] for peer in _weighted(vector, weights) if peer != node}
    if not influence:
        return OWN_ONLY
    peer = max(sorted(influence), key=influence.__getitem__)
    return f"most influential {peer} (λ {influence[peer]:.2f})"


def fedrema(node: str, own: Diagnostics, coordinator: Diagnostics, weights: Weights) -> str | None:
    head_weights = (coordinator.get("head_weights") or {}).get(node)
    if head_weights is None:
        return None
    # `ccp_continues` is written in every CCP round; once false, the CCP never restarts.
    period = "CCP ended" if coordinator.get("ccp_continues") is False else "CCP on"
    return f"{period}; matched {_names(sorted(peer for peer in head_weights if peer != node))}"


def fedinfluence(
    node: str, own: Diagnostics, coordinator: Diagnostics, weights: Weights
) -> str | None:
    fil = coordinator.get("fil") or {}
    if node not in fil:
        return None
    # Positive FIL: leaving the client out would raise the loss, so it helps the most.
    most = max(sorted(fil), key=fil.__getitem__)
    return ("most influential, " if node == most else "") + f"FIL {fil[node]:+.3g}"


def screening(records: Iterable[RoundRecord]) -> str | None:
    """What screening did to a node's peers over the run, or None where it never ran:
    `let in L of M peer-models` (M: a model of a peer each round one arrived or was passed
    over by its record; L: of those, the ones let into the rule), the others by reason,
    how many of the peers whose models arrived were let in at least once, and how many of
    the aggregates the guard judged it refused (keeping the own model). A round where
    every peer was kept out has no aggregate to judge."""
    arrived: set[str] = set()
    admitted: set[str] = set()
    models_let_in = 0
    kept_out: dict[str, int] = {}
    judged = refused = 0
    screened = False
    for record in records:
        diagnostics = record.diagnostics or {}
        if "screening" not in diagnostics:
            continue
        screened = True
        reasons = diagnostics.get("screened_out") or {}
        received = set(record.received or ())
        let_in = received - set(reasons)
        arrived |= received
        admitted |= let_in
        models_let_in += len(let_in)
        for reason in reasons.values():
            kept_out[reason] = kept_out.get(reason, 0) + 1
        verdict = diagnostics["screening"].get("adopted")  # whichever guard judged
        if verdict is not None:
            judged += 1
            refused += not verdict
    if not screened:
        return None
    models = models_let_in + sum(kept_out.values())
    phrase = f"screening let in {models_let_in} of {models} peer-models"
    if kept_out:
        why = ", ".join(f"{reason} {count}" for reason, count in sorted(kept_out.items()))
        peers = f"{len(admitted)} of {len(arrived)} peers let in at least once"
        phrase += f" (kept out: {why}; {peers})"
    return phrase + (f", refused {refused} of {judged} aggregates judged" if judged else "")


def decided_by(
    decide: Decide | None,
    history: dict[str, list[RoundRecord]],
    coordinator: list[CoordinatorRecord],
) -> dict[str, str]:
    """node -> what `decide` phrases for it (None: a rule with no phrase of its own), from
    each node's metrics records (`history`) and the coordinator's, followed by what
    screening did; a node with neither is left out."""
    shared = latest_diagnostics(coordinator)
    phrases = {}
    for node, records in history.items():
        weights = next((r.weights for r in reversed(records) if r.weights), {})
        parts = [
            decide(node, latest_diagnostics(records), shared, weights) if decide else None,
            screening(records),
        ]
        phrases[node] = "; ".join(part for part in parts if part)
    return {node: phrase for node, phrase in phrases.items() if phrase}
