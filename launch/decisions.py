"""What each rule decided by the end of a run, one short phrase per node: the `decision`
column of the result table of `meshfl launch`, of summary.json and of report.md.

Every phrase is read from the diagnostics a rule writes into metrics.jsonl (each rule's
module lists them): a peer-to-peer rule's from the node's own records, a server-centric
rule's from the coordinator's. Each key is taken at its latest value over the records,
so a key a rule writes only in some rounds (Fed-Influence's FIL, every
`evaluate_every` rounds) still counts. A rule without an entry here (the baselines)
decides nothing a column could show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Diagnostics = dict[str, Any]
# (node, its latest diagnostics, the coordinator's latest) -> the phrase, or None
Decide = Callable[[str, Diagnostics, Diagnostics], str | None]


def latest_diagnostics(records: Iterable[dict[str, Any]]) -> Diagnostics:
    """Every diagnostics key of `records` (in round order) at its latest value."""
    latest: Diagnostics = {}
    for record in records:
        latest.update(record.get("diagnostics") or {})
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


def _pfedlia(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    return _group(own.get("group"), own.get("phase"))


def _pfedlia_central(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    return _group((coordinator.get("groups") or {}).get(node), coordinator.get("phase"))


def _pfedsv(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    selected = own.get("selected")
    return None if selected is None else f"top-{len(selected)} {_names(selected)}"


def _fedc2i(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    influence = {peer: value for peer, value in (own.get("influence_vector") or {}).items()
                 if peer != node}
    if not influence:
        return "no peer arrived" if "influence_vector" in own else None
    peer = max(sorted(influence), key=influence.__getitem__)
    return f"most influential {peer} (λ {influence[peer]:.2f})"


def _fedrema(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    weights = (coordinator.get("head_weights") or {}).get(node)
    if weights is None:
        return None
    # `ccp_continues` is written in every CCP round; once false, the CCP never restarts.
    period = "CCP ended" if coordinator.get("ccp_continues") is False else "CCP on"
    return f"{period}; matched {_names(sorted(peer for peer in weights if peer != node))}"


def _fedinfluence(node: str, own: Diagnostics, coordinator: Diagnostics) -> str | None:
    fil = coordinator.get("fil") or {}
    if node not in fil:
        return None
    # Positive FIL: leaving the client out would raise the loss, so it helps the most.
    most = max(sorted(fil), key=fil.__getitem__)
    return ("most influential, " if node == most else "") + f"FIL {fil[node]:+.3g}"


DECISIONS: dict[str, Decide] = {
    "pfedlia": _pfedlia,
    "pfedlia_central": _pfedlia_central,
    "pfedsv": _pfedsv,
    "fedc2i": _fedc2i,
    "fedrema": _fedrema,
    "fedinfluence": _fedinfluence,
}


def node_decisions(algorithm: str, history: dict[str, list[dict[str, Any]]],
                   coordinator: list[dict[str, Any]]) -> dict[str, str]:
    """node -> what `algorithm` decided for it, from each node's metrics records
    (`history`) and the coordinator's; {} for a rule that decides nothing to show."""
    decide = DECISIONS.get(algorithm)
    if decide is None:
        return {}
    shared = latest_diagnostics(coordinator)
    phrases = {node: decide(node, latest_diagnostics(records), shared)
               for node, records in history.items()}
    return {node: phrase for node, phrase in phrases.items() if phrase}
