"""What each rule decided by the end of a run, one short phrase per node: the `decision`
column of the result table of `meshfl launch`, of summary.json and of report.md.

Every phrase is read from the diagnostics a rule writes into metrics.jsonl (each rule's
module lists them): a peer-to-peer rule's from the node's own records, a server-centric
rule's from the coordinator's. Each key is taken at its latest value over the records,
so a key a rule writes only in some rounds (Fed-Influence's FIL, every
`evaluate_every` rounds) still counts. Which phrase a rule shows is its entry in the
registry of launch/measures.py; a rule without one (the baselines) decides nothing a
column could show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from meshfl.node.metrics import CoordinatorRecord, RoundRecord

Diagnostics = dict[str, Any]
# (node, its latest diagnostics, the coordinator's latest) -> the phrase, or None
Decide = Callable[[str, Diagnostics, Diagnostics], str | None]


def latest_diagnostics(records: Iterable[RoundRecord | CoordinatorRecord]) -> Diagnostics:
    """Every diagnostics key of `records` (in round order) at its latest value."""
    latest: Diagnostics = {}
    for record in records:
        latest.update(record.diagnostics or {})
    return latest


def _names(peers: Iterable[str]) -> str:
    return ",".join(peers) or "none"


def _group(group: list[str] | None, phase: str | None) -> str | None:
    """pFedLIA's group, or why there is none yet."""
    if group is not None:
        return f"group {_names(group)}"
    if phase == "warmup":
        return "warm-up only, no group"
    return f"no group ({phase})" if phase else None


def pfedlia(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    return _group(own.get("group"), own.get("phase"))


def pfedlia_central(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    return _group((coordinator.get("groups") or {}).get(node), coordinator.get("phase"))


def pfedsv(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    selected = own.get("selected")
    return None if selected is None else f"top-{len(selected)} {_names(selected)}"


def fedc2i(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    influence = {
        peer: value for peer, value in (own.get("influence_vector") or {}).items() if peer != node
    }
    if not influence:
        return "no peer arrived" if "influence_vector" in own else None
    peer = max(sorted(influence), key=influence.__getitem__)
    return f"most influential {peer} (λ {influence[peer]:.2f})"


def fedrema(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    weights = (coordinator.get("head_weights") or {}).get(node)
    if weights is None:
        return None
    # `ccp_continues` is written in every CCP round; once false, the CCP never restarts.
    period = "CCP ended" if coordinator.get("ccp_continues") is False else "CCP on"
    return f"{period}; matched {_names(sorted(peer for peer in weights if peer != node))}"


def fedinfluence(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    fil = coordinator.get("fil") or {}
    if node not in fil:
        return None
    # Positive FIL: leaving the client out would raise the loss, so it helps the most.
    most = max(sorted(fil), key=fil.__getitem__)
    return ("most influential, " if node == most else "") + f"FIL {fil[node]:+.3g}"


def decided_by(
    decide: Decide, history: dict[str, list[RoundRecord]], coordinator: list[CoordinatorRecord]
) -> dict[str, str]:
    """node -> what `decide` phrases for it, from each node's metrics records (`history`)
    and the coordinator's; a node it has no phrase for is left out."""
    shared = latest_diagnostics(coordinator)
    phrases = {
        node: decide(node, latest_diagnostics(records), shared) for node, records in history.items()
    }
    return {node: phrase for node, phrase in phrases.items() if phrase}
