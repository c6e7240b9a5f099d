"""What a run of each rule reports beyond accuracy: one registry, `RULES`.

A rule's entry names its scores (numbers in summary.json and rows of the experiment
tables: how well it found who shares data, why it helped or hurt), the phrase of what it
decided for each node (the `decision` column, launch/decisions.py) and the
who-learns-from-whom matrices `meshfl report` draws (by their key in launch/report.py).
Adding a rule means its own module plus one entry here; a rule without an entry (the
baselines) reports the scores of `EVERY_RULE`, no decision of its own (behind screening,
what screening did) and the weights matrix.

Each score is a small function of a `RunRecords` (run_folder.py), the nodes' metrics
records with the data facts their partition wrote: it returns the keys it could
compute, {} where the run recorded nothing to score (a rule phase not reached, a
partition without the truth).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshfl.algorithms.fedrema import own_group_fraction
from meshfl.algorithms.pfedlia import groups_ari
from meshfl.node.metrics import CoordinatorRecord, RoundRecord

from . import decisions
from .run_folder import History, RunRecords


@dataclass(frozen=True)
class TableRow:
    """How an experiment table shows a score: its row title and how seeds pool it."""

    title: str
    pool: Callable[[list[Any]], float] = statistics.fmean
    form: str = "{:.3f}"


@dataclass(frozen=True)
class Scores:
    """A function of a run's records giving some scores (key -> value), and the table
    rows of those that an experiment table shows."""

    compute: Callable[[RunRecords], dict[str, Any]]
    rows: dict[str, TableRow] = field(default_factory=dict)


@dataclass(frozen=True)
class RuleMeasures:
    """What a run of one rule reports."""

    scores: tuple[Scores, ...] = ()
    decide: decisions.Decide | None = None
    matrices: tuple[str, ...] = ("weights",)  # launch/report.py's MATRIX_MEASURES keys


def _pooled(pool: Callable[[list[Any]], float], **samples: list[Any]) -> dict[str, float]:
    """{name: pool(values)} for every name that has values."""
    return {name: pool(values) for name, values in samples.items() if values}


def _mean_row(title: str) -> TableRow:
    return TableRow(f"{title} (mean over seeds)")


# --------------------------------------------------------------------------- every rule


def attacker_weight(run: RunRecords) -> dict[str, float]:
    """The attackers' share of the honest nodes' aggregation weights: the weight on
    attackers summed per round, averaged over honest nodes and rounds. A round whose
    node carried on from a screening trial (algorithms/screening.py, step 7) counts the
    attackers' share of that trial too, times the weight the round gave the node's own
    model."""
    shares = [
        _attackers_share(record.weights, run.attackers)
        + record.weights.get(name, 0.0) * _attackers_share(_trial_weights(record), run.attackers)
        for name, record in run.node_rounds()
        if name not in run.attackers
    ]
    return {"attacker_weight": statistics.fmean(shares)} if run.attackers and shares else {}


def _attackers_share(weights: dict[str, float], attackers: frozenset[str]) -> float:
    return sum(weight for peer, weight in weights.items() if peer in attackers)


def _trial_weights(record: RoundRecord) -> dict[str, float]:
    """Each model's share in the screening trial path a round's node carried on from
    (over the path's rounds); {} if none."""
    trial = record.diagnostics.get("screening", {}).get("trial", {})
    return dict(trial.get("weights", {})) if trial.get("won") else {}


def round_costs(run: RunRecords) -> dict[str, float]:
    """Medians over every node's rounds: MB (10^6 bytes) received, the aggregation's
    seconds (the rule with its screening, if any) and, where the rule plays a Shapley game
    (pFedSV), its seconds, each over the round's training seconds."""
    received, shapley_share, aggregate_share = [], [], []
    for _, record in run.node_rounds():
        if record.bytes_in is not None:
            received.append(record.bytes_in / 1e6)
        train = record.seconds.get("train")
        aggregate = record.seconds.get("aggregate")
        if aggregate is not None and train:
            aggregate_share.append(aggregate / train)
        shapley = record.diagnostics.get("shapley_seconds")
        if shapley is not None and train:
            shapley_share.append(shapley / train)
    return _pooled(
        statistics.median,
        mb_in_per_round=received,
        shapley_to_train=shapley_share,
        aggregate_to_train=aggregate_share,
    )


def neighbours_in_own_cluster(run: RunRecords) -> dict[str, float]:
    """A bounded mesh with true clusters: the share of a node's neighbours from its own
    cluster in its first and its last round, averaged over nodes (chance: the cluster's
    share of the mesh). How far choosing neighbours by benefit made the graph follow
    the data."""
    truth = run.fact("true_cluster")
    first: list[float] = []
    last: list[float] = []
    for name, rounds in run.history.items():
        with_views = [r for r in rounds if r.neighbours and name in truth]
        for record, shares in ((with_views[:1], first), (with_views[-1:], last)):
            for r in record:
                same = sum(truth.get(peer) == truth[name] for peer in r.neighbours or [])
                shares.append(same / len(r.neighbours or [1]))
    return _pooled(
        statistics.fmean,
        neighbours_own_cluster_first=first,
        neighbours_own_cluster_last=last,
    )


def attackers_in_views(run: RunRecords) -> dict[str, float]:
    """A bounded mesh with attackers: the most rounds one honest node began with the
    same attacker among its neighbours (how long it took to drop one), and the share
    of honest nodes that began their last round with one (an attacker it had not met
    yet: attackers keep greeting nodes)."""
    if not run.attackers:
        return {}
    longest, at_the_end = 0, []
    for name, rounds in run.history.items():
        if name in run.attackers or not any(r.neighbours is not None for r in rounds):
            continue
        kept = Counter(a for r in rounds for a in run.attackers & set(r.neighbours or []))
        longest = max([longest, *kept.values()])
        at_the_end.append(bool(rounds and run.attackers & set(rounds[-1].neighbours or [])))
    if not at_the_end:
        return {}
    return {
        "attacker_neighbour_rounds": float(longest),
        "honest_with_attacker_neighbour_at_end": statistics.fmean(at_the_end),
    }


def screening_trials(run: RunRecords) -> dict[str, float]:
    """Screened rules: the share of node-rounds that trained a trial (a trial path's
    model: the rule's aggregate with the peers the val check kept out let in,
    algorithms/screening.py step 7), and the share of those that beat the own model, each
    round of a path counted once. What trials cost (a second local training each) and
    what they gave."""
    screenings = [
        record.diagnostics["screening"]
        for name, record in run.node_rounds()
        if name not in run.attackers and "screening" in record.diagnostics
    ]
    judged = [screening["trial"]["won"] for screening in screenings if "trial" in screening]
    if not judged:  # no trials (off, or none started): no rows
        return {}
    return {"trial_rounds": len(judged) / len(screenings), "trials_won": statistics.fmean(judged)}


EVERY_RULE = (
    Scores(attacker_weight),  # the robustness table shows it, no score row
    Scores(attackers_in_views),  # the robustness table's lines under it
    Scores(
        neighbours_in_own_cluster,
        {
            "neighbours_own_cluster_first": _mean_row(
                "share of neighbours from the own cluster, first round"
            ),
            "neighbours_own_cluster_last": _mean_row(
                "share of neighbours from the own cluster, last round"
            ),
        },
    ),
    Scores(
        screening_trials,
        {
            "trial_rounds": _mean_row("share of screened node-rounds that trained a trial"),
            "trials_won": _mean_row("share of trials that beat the own model"),
        },
    ),
)
# What a round cost: summary.json's "cost", each a median over the seeds in a table.
ROUND_COSTS = Scores(
    round_costs,
    {
        "mb_in_per_round": TableRow(
            "MB received per node and round (median)", statistics.median, "{:.2f}"
        ),
        "shapley_to_train": TableRow(
            "Shapley seconds per training second (median)", statistics.median
        ),
        "aggregate_to_train": TableRow(
            "aggregation seconds (screening included) per training second (median)",
            statistics.median,
        ),
    },
)


# --------------------------------------------------------------------------- grouping rules


def _groups_ari(groups: dict[str, list[str]], run: RunRecords) -> dict[str, float]:
    truth = run.fact("true_cluster")
    return {"ari": groups_ari(groups, truth)} if groups.keys() & truth.keys() else {}


def peer_groups_ari(run: RunRecords) -> dict[str, float]:
    """pFedLIA: the ARI of the groups the peers were in at their last round against the
    true clusters."""
    groups = {
        name: rounds[-1].diagnostics["group"]
        for name, rounds in run.history.items()
        if rounds and rounds[-1].diagnostics.get("group") is not None
    }
    return _groups_ari(groups, run)


def coordinator_groups_ari(run: RunRecords) -> dict[str, float]:
    """pFedLIA central: the ARI of the last groups the coordinator formed."""
    last: dict[str, list[str]] = next(
        (
            record.diagnostics["groups"]
            for record in reversed(run.coordinator)
            if record.diagnostics.get("groups")
        ),
        {},
    )
    return _groups_ari(last, run)


def own_group_share(run: RunRecords) -> dict[str, Any]:
    """FedReMa: the share of the relevant-set members from the client's own group, per
    round of the critical co-learning period (CCP), its mean and its lowest."""
    group_of = run.fact("group")
    shares = {
        str(record.round): share
        for record in run.coordinator
        if (share := _ccp_own_group_share(record, group_of)) is not None
    }
    if not shares:
        return {}
    return {
        "own_group_share": shares,
        "own_group_share_ccp": statistics.fmean(shares.values()),
        "own_group_share_lowest": min(shares.values()),
    }


def _ccp_own_group_share(record: CoordinatorRecord, group_of: dict[str, Any]) -> float | None:
    """The own-group share of a round's relevant sets; None outside the CCP, which the
    score is about, or where the partition records no groups."""
    relevant = record.diagnostics.get("relevant_sets")
    if not (group_of and relevant and record.diagnostics.get("ccp")):
        return None
    return own_group_fraction(relevant, group_of)


GROUPS_ARI_ROW = {"ari": _mean_row("ARI of the groups")}


# --------------------------------------------------------------------------- pFedSV


def top_k_precision(run: RunRecords) -> dict[str, float]:
    """The mean over nodes of the share of a node's final top-k (the peers it chose in
    its last round) that holds one of its labels: its relevance against the truth
    "shares a label"."""
    labels, precisions = run.labels(), []
    for name, rounds in run.history.items():
        chosen = rounds[-1].diagnostics.get("selected") if rounds else None
        if chosen and name in labels and all(peer in labels for peer in chosen):
            precisions.append(
                statistics.fmean(bool(labels[peer] & labels[name]) for peer in chosen)
            )
    return {"top_k_precision": statistics.fmean(precisions)} if precisions else {}


def shapley_by_label_overlap(run: RunRecords) -> dict[str, float]:
    """The mean Shapley value of a peer that shares one of the node's labels and of one
    that shares none, over every node and round, and the weight the label-sharing peers
    got per round (why the rule helps or hurts a node)."""
    labels = run.labels()
    sharing: list[float] = []
    disjoint: list[float] = []
    shared_weight, rounds = 0.0, 0
    for name, record in run.node_rounds():
        shapley = record.diagnostics.get("shapley")
        if shapley is None or name not in labels:
            continue
        rounds += 1
        shares = {
            peer: bool(labels[peer] & labels[name])
            for peer in shapley
            if peer != name and peer in labels
        }
        for peer, shares_a_label in shares.items():
            (sharing if shares_a_label else disjoint).append(shapley[peer])
        shared_weight += sum(weight for peer, weight in record.weights.items() if shares.get(peer))
    scores = _pooled(
        statistics.fmean, shapley_sharing_a_label=sharing, shapley_sharing_no_label=disjoint
    )
    if rounds:
        scores["weight_on_label_sharing_peers"] = shared_weight / rounds
    return scores


def own_versus_average(run: RunRecords) -> dict[str, float]:
    """Over every node-round that records v({i}), the own model's val accuracy: how often
    the weighted average scored a lower val accuracy than that (without the guard the
    average is what the node evaluated, val_acc; with it, the average the guard judged,
    v_aggregate), and how often the node adopted an average rather than its own model."""
    below, adopted = [], []
    for name, record in run.node_rounds():
        diagnostics = record.diagnostics
        if "v_own" not in diagnostics:
            continue
        adopted.append(record.weights != {name: 1.0})
        average = diagnostics.get("v_aggregate", record.val_acc)
        if average is not None:
            below.append(average < diagnostics["v_own"])
    return _pooled(statistics.fmean, average_below_own=below, average_adopted=adopted)


# --------------------------------------------------------------------------- FedC²I


def influence_shape(run: RunRecords) -> dict[str, float]:
    """Over every node and round: the share of the body the influence vector λ gives the
    node's own model, and the largest weight per class of the influence matrix Λ as a
    multiple of the uniform 1/K (1.0: the class level weighs every model alike)."""
    own_share, peak = [], []
    for name, record in run.node_rounds():
        vector = record.diagnostics.get("influence_vector", {})
        matrix = record.diagnostics.get("influence_matrix", {})
        if len(vector) > 1 and name in vector:  # alone, a node's share is 1 by definition
            own_share.append(vector[name])
        if len(matrix) > 1:
            for column in zip(*matrix.values(), strict=True):  # a class over the models
                peak.append(max(column) * len(matrix))
    return _pooled(statistics.fmean, influence_own_share=own_share, class_influence_peak=peak)


# --------------------------------------------------------------------------- the registry


RULES: dict[str, RuleMeasures] = {
    "pfedlia": RuleMeasures(
        scores=(Scores(peer_groups_ari, GROUPS_ARI_ROW),),
        decide=decisions.pfedlia,
        matrices=("lazy_scores", "group", "weights"),
    ),
    "pfedlia_central": RuleMeasures(
        scores=(Scores(coordinator_groups_ari, GROUPS_ARI_ROW),), decide=decisions.pfedlia_central
    ),
    "fedrema": RuleMeasures(
        scores=(
            Scores(
                own_group_share,
                {
                    "own_group_share_ccp": _mean_row("own-group share of relevant sets in the CCP"),
                    "own_group_share_lowest": TableRow(
                        "own-group share of relevant sets, lowest CCP round (lowest over seeds)",
                        min,
                    ),
                },
            ),
        ),
        decide=decisions.fedrema,
        matrices=("relevant_sets", "weights"),
    ),
    "pfedsv": RuleMeasures(
        scores=(
            Scores(
                top_k_precision,
                {
                    "top_k_precision": _mean_row(
                        'precision of the final top-k against "shares a label"'
                    )
                },
            ),
            Scores(
                shapley_by_label_overlap,
                {
                    "shapley_sharing_a_label": _mean_row("Shapley value of a peer sharing a label"),
                    "shapley_sharing_no_label": _mean_row(
                        "Shapley value of a peer sharing no label"
                    ),
                    "weight_on_label_sharing_peers": _mean_row(
                        "weight on label-sharing peers per round"
                    ),
                },
            ),
            Scores(
                own_versus_average,
                {
                    "average_below_own": _mean_row(
                        "share of rounds the average's val accuracy was below the own model's"
                    ),
                    "average_adopted": _mean_row(
                        "share of rounds the node adopted the weighted average"
                    ),
                },
            ),
        ),
        decide=decisions.pfedsv,
        matrices=("shapley", "weights"),
    ),
    "fedc2i": RuleMeasures(
        scores=(
            Scores(
                influence_shape,
                {
                    "influence_own_share": _mean_row("influence vector's share for the own model"),
                    "class_influence_peak": _mean_row("largest class-level weight, times uniform"),
                },
            ),
        ),
        decide=decisions.fedc2i,
        matrices=("influence_vector",),
    ),
    "fedinfluence": RuleMeasures(decide=decisions.fedinfluence),
}
NO_MEASURES = RuleMeasures()  # the baselines, and a rule this version does not know


def measures_of(rule: str) -> RuleMeasures:
    return RULES.get(rule, NO_MEASURES)


def rule_scores(rule: str, run: RunRecords) -> dict[str, Any]:
    """Every score a run of `rule` reports, those of every rule first."""
    scores: dict[str, Any] = {}
    for measure in (*EVERY_RULE, *measures_of(rule).scores):
        scores.update(measure.compute(run))
    return scores


def node_decisions(
    rule: str, history: History, coordinator: list[CoordinatorRecord]
) -> dict[str, str]:
    """node -> what `rule` decided for it, and what screening did where it ran ({} for a
    rule that decides nothing to show, unscreened)."""
    return decisions.decided_by(measures_of(rule).decide, history, coordinator)


def score_rows() -> dict[str, TableRow]:
    """The table row of every score some rule reports, in registry order (a score two
    rules report, like the ARI, has one row)."""
    measures = (*EVERY_RULE, *(measure for rule in RULES.values() for measure in rule.scores))
    return {key: row for measure in measures for key, row in measure.rows.items()}
