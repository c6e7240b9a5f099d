"""A first run of a rule shows that rule: `meshfl launch --algorithm RULE` at the rule's
defaults, for the fewest rounds the config check allows, reaches the phase that makes
the rule what it is (seen in its diagnostics), and its result table says what the rule
decided for every node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.algorithms.test_rule_schedule import fewest_rounds
from tests.nodes import records
from tests.spawn import run_to_end

LAUNCH_TIMEOUT = 300  # seconds; a default digits mesh of 4 nodes takes well under a minute
NODES = [f"node{index}" for index in range(4)]  # `meshfl launch`'s default mesh


def launch(rule: str, rounds: int, out: Path) -> str:
    """Run `meshfl launch` to the end within LAUNCH_TIMEOUT; return its stdout."""
    args = ["launch", "--algorithm", rule, "--rounds", str(rounds), "--out", str(out)]
    result = run_to_end(args, timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, result.stderr
    return result.stdout


def last_diagnostics(out: Path, name: str) -> dict[str, Any]:
    return records(out, name)[-1]["diagnostics"]


def coordinator_rounds(out: Path) -> list[dict[str, Any]]:
    return [record["diagnostics"] for record in records(out, "coordinator")]


def pfedlia_clustered(out: Path) -> None:
    for name in NODES:
        found = last_diagnostics(out, name)
        assert found["phase"] == "clustered", "the lazy round came and found the groups"
        assert name in found["group"] and len(found["lazy_scores"]) > 1, found


def pfedlia_central_clustered(out: Path) -> None:
    phases = [found["phase"] for found in coordinator_rounds(out)]
    assert phases[-2:] == ["lazy", "clustered"]
    assert set(coordinator_rounds(out)[-1]["groups"]) == set(NODES)


def fedc2i_weighed_by_influence(out: Path) -> None:
    for name in NODES:
        found = last_diagnostics(out, name)
        assert len(found["influence_vector"]) > 1 and len(found["influence_matrix"]) > 1


def pfedsv_played_the_shapley_game(out: Path) -> None:
    for name in NODES:
        found = last_diagnostics(out, name)
        assert len(found["shapley"]) > 1 and found["selected"], found


def fedrema_matched_heads(out: Path) -> None:
    found = coordinator_rounds(out)[-1]
    assert found["ccp"] is True and set(found["relevant_sets"]) == set(NODES)


def fedinfluence_measured_fil(out: Path) -> None:
    assert set(coordinator_rounds(out)[-1]["fil"]) == set(NODES)


# rule -> (its defining phase, seen in the diagnostics; the words its decision phrase
# may begin with: a FedC²I node whose last aggregate the guard refused learned from no
# peer, and says so rather than naming the most influential)
PHASES = {
    "pfedlia": (pfedlia_clustered, ("group ",)),
    "pfedlia_central": (pfedlia_central_clustered, ("group ",)),
    "fedc2i": (fedc2i_weighed_by_influence, ("most influential ", "own model only")),
    "pfedsv": (pfedsv_played_the_shapley_game, ("top-",)),
    "fedrema": (fedrema_matched_heads, ("CCP ",)),
    "fedinfluence": (fedinfluence_measured_fil, ("FIL ", "most influential, FIL ")),
}


@pytest.mark.slow
@pytest.mark.parametrize("rule", sorted(PHASES))
def test_the_shortest_default_launch_reaches_the_rules_phase_and_shows_its_decision(tmp_path, rule):
    reached, phrases = PHASES[rule]
    rounds = fewest_rounds(rule)
    table = launch(rule, rounds, tmp_path)
    reached(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    decisions = {node["name"]: node.get("decision", "") for node in summary["nodes"]}
    assert set(decisions) == set(NODES)
    for name, decision in decisions.items():
        assert decision.startswith(phrases), (name, decision)
        row = next(line for line in table.splitlines() if line.startswith(f"{name} "))
        assert decision in row, "the table shows the decision"
    assert any(line.startswith("node ") and "decision" in line for line in table.splitlines())
