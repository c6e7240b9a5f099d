"""pFedLIA's math on hand-made cases, and the rule driven round by round without a network."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score
from torch import nn
from torch.nn import functional

from meshfl.algorithms import ALGORITHM_NAMES, Context, PeerModel, parse_params
from meshfl.algorithms.base import MODEL
from meshfl.algorithms.evidence import harm_z
from meshfl.algorithms.pfedlia import (
    ANCHOR,
    LAZY,
    NOT_READY_KEY,
    TRUTH,
    LazyGroup,
    PFedLIA,
    PFedLIAParams,
    Split,
    groups_ari,
    harmless_beside,
    lazy_influence_scores,
    precision_recall,
    two_means_split,
    validation_loss_sum,
)
from tests.algorithms.config_lines import params_error

# Two inputs, two classes. A cluster is a labelling of the inputs; the state that fits
# one cluster's labels is exactly wrong for the other's.
X = torch.eye(2)
LABELS = {0: torch.tensor([0, 1]), 1: torch.tensor([1, 0])}


def state_with(weight: list[list[float]]) -> dict[str, torch.Tensor]:
    return {"weight": torch.tensor(weight), "bias": torch.zeros(2)}


ANCHOR_STATE = state_with([[0.0, 0.0], [0.0, 0.0]])  # uniform logits: loss ln 2 per sample
FITS = {0: state_with([[2.0, 0.0], [0.0, 2.0]]), 1: state_with([[0.0, 2.0], [2.0, 0.0]])}


def zero_linear() -> nn.Module:
    model = nn.Linear(2, 2)
    model.load_state_dict(ANCHOR_STATE)
    return model


# --------------------------------------------------------------------------- lazy influence


def test_validation_loss_is_summed_over_the_split_not_averaged():
    state = FITS[0]
    expected = functional.cross_entropy(X @ state["weight"].T, LABELS[0], reduction="mean") * 2
    assert validation_loss_sum(zero_linear(), state, X, LABELS[0]) == pytest.approx(float(expected))


def test_a_lazy_model_that_lowers_the_val_loss_scores_positive_one_that_raises_it_negative():
    scores = lazy_influence_scores(
        zero_linear(), ANCHOR_STATE, {"helps": FITS[0], "hurts": FITS[1]}, X, LABELS[0]
    )
    anchor_loss = 2 * math.log(2)  # Σ over two samples of ln 2
    assert scores["helps"] == pytest.approx(anchor_loss - 2 * math.log(1 + math.exp(-2)))
    assert scores["hurts"] == pytest.approx(anchor_loss - 2 * math.log(1 + math.exp(2)))
    assert scores["helps"] > 0 > scores["hurts"]


# --------------------------------------------------------------------------- 2-means


def test_two_means_keeps_the_higher_mean_cluster_and_its_centers():
    scores = {"me": 50.0, "a": 40.0, "b": 45.0, "c": -100.0, "d": -120.0, "e": -300.0}
    beneficial, split = two_means_split(scores, seed=0)
    assert beneficial == {"me", "a", "b"}
    assert split.beneficial_center == pytest.approx(45.0)
    assert split.other_center == pytest.approx(-520.0 / 3)
    assert split.is_beneficial(-50.0) and not split.is_beneficial(-80.0)  # midpoint -64.2
    assert two_means_split(scores, seed=0) == two_means_split(scores, seed=0)


def best_contiguous_split(values: list[float]) -> set[int]:
    """Brute force: optimal 2-means in 1-D cuts the sorted values in two; try every cut
    and return the indices of the upper part of the one with the least squared error."""
    order = sorted(range(len(values)), key=values.__getitem__)

    def error(part: list[int]) -> float:
        mean = sum(values[i] for i in part) / len(part)
        return sum((values[i] - mean) ** 2 for i in part)

    cuts = range(1, len(values))
    best = min(cuts, key=lambda cut: error(order[:cut]) + error(order[cut:]))
    return set(order[best:])


def test_two_means_finds_the_optimal_split_of_random_scores():
    rng = np.random.default_rng(1)
    for _ in range(30):
        # Two well separated groups plus a long tail, like real lazy scores.
        values = [*rng.normal(100, 20, 4), *rng.normal(-300, 60, 12), *rng.normal(-900, 300, 4)]
        scores = {f"p{i}": float(v) for i, v in enumerate(values)}
        beneficial, _ = two_means_split(scores, seed=0)
        assert beneficial == {f"p{i}" for i in best_contiguous_split(values)}


def test_two_means_without_two_distinct_scores_counts_every_finite_score_beneficial():
    beneficial, split = two_means_split({"me": 3.0, "a": 3.0, "b": math.nan}, seed=0)
    assert beneficial == {"me", "a"}
    assert split.is_beneficial(-1e9) and not split.is_beneficial(math.nan)


def test_a_non_finite_score_is_left_out_of_the_fit_and_never_beneficial():
    beneficial, split = two_means_split({"me": 5.0, "a": 4.0, "b": -4.0, "c": -math.inf}, seed=0)
    assert beneficial == {"me", "a"}
    assert split == Split(4.5, -4.0)


# --------------------------------------------------------------------------- the rule, by hand


def make_node(
    name: str,
    cluster: int,
    lazy_fits: int | None = None,
    warmup: int = 1,
    oracle: bool = False,
    knows_cluster: bool = True,
) -> tuple[PFedLIA, object]:
    """A node whose data is one cluster's labelling and whose lazy training lands on the
    state that fits `lazy_fits` (its own cluster unless told otherwise)."""
    lazy = FITS[cluster if lazy_fits is None else lazy_fits]
    data = SimpleNamespace(
        x_train=X,
        y_train=LABELS[cluster],
        x_val=X,
        y_val=LABELS[cluster],
        info={"true_cluster": cluster} if knows_cluster else {},
    )

    def train(model, x, y, epochs, seed, max_steps=None):
        model.load_state_dict(lazy)
        return 0.0

    context = Context(
        name,
        seed=0,
        num_classes=2,
        body_keys=(),
        head_keys=("weight", "bias"),
        new_model=zero_linear,
        train=train,
        data=data,
    )
    return PFedLIA(PFedLIAParams(warmup=warmup, oracle=oracle), context), data


class Mesh:
    """Nodes that exchange every round in process, the way the runtime does: each node is
    offered the kinds it publishes itself, pulls what `wanted` names, then aggregates."""

    def __init__(
        self,
        nodes: dict[str, tuple[PFedLIA, object]],
        local_training: Callable[[str, dict, int], dict] | None = None,
    ) -> None:
        self.nodes = dict(nodes)
        self.states = {name: dict(ANCHOR_STATE) for name in nodes}
        self.local_training = local_training
        self.published: dict[str, dict] = {}
        self.fetched: dict[str, dict[str, list[str]]] = {}

    def add(self, name: str, node: tuple[PFedLIA, object], state: dict) -> None:
        self.nodes[name], self.states[name] = node, state

    def round(self, round_no: int) -> dict:
        for name, (rule, data) in self.nodes.items():
            if self.local_training is not None:
                self.states[name] = self.local_training(name, self.states[name], round_no)
            self.published[name] = rule.publish(round_no, self.states[name], data)
        outcomes = {}
        for name, (rule, data) in self.nodes.items():
            offered = {
                kind: sorted(
                    peer for peer, blobs in self.published.items() if peer != name and kind in blobs
                )
                for kind in self.published[name]
            }
            pulls = rule.wanted(round_no, offered)
            self.fetched[name] = {kind: sorted(peers) for kind, peers in pulls.items() if peers}
            received = {
                kind: {peer: PeerModel(self.published[peer][kind], 10) for peer in peers}
                for kind, peers in pulls.items()
            }
            own = PeerModel(self.published[name][MODEL], 10)
            outcomes[name] = rule.aggregate(round_no, own, received, data)
        for name, outcome in outcomes.items():
            self.states[name] = outcome.state
        return outcomes


def two_cluster_mesh(**options) -> Mesh:
    return Mesh(
        {
            name: make_node(name, cluster, **options)
            for name, cluster in {"a": 0, "b": 0, "c": 1, "d": 1}.items()
        }
    )


def test_after_the_warmup_each_node_groups_with_its_cluster_and_pulls_only_its_models():
    mesh = two_cluster_mesh(warmup=1)
    warm = mesh.round(1)
    assert warm["a"].diagnostics == {"phase": "warmup"}
    assert set(mesh.published["a"]) == {MODEL, TRUTH}, "no lazy model during the warm-up"
    lazy = mesh.round(2)
    assert set(mesh.published["a"]) == {MODEL, TRUTH, LAZY, ANCHOR}
    assert mesh.fetched["a"][LAZY] == ["b", "c", "d"] and mesh.fetched["a"][MODEL] == [
        "b",
        "c",
        "d",
    ], "in the lazy round every lazy model and every model is pulled"
    for name, cluster_mates in {"a": "ab", "b": "ab", "c": "cd", "d": "cd"}.items():
        diagnostics = lazy[name].diagnostics
        assert diagnostics["phase"] == "clustered"
        assert diagnostics["group"] == sorted(cluster_mates)
        assert set(lazy[name].weights) == set(cluster_mates)
        assert diagnostics["precision"] == diagnostics["recall"] == 1.0
        assert set(diagnostics["lazy_scores"]) == {"a", "b", "c", "d"}, "self included"
    after = mesh.round(3)
    assert mesh.fetched["a"] == {MODEL: ["b"]}, "only the group's models; nothing re-scored"
    assert after["a"].diagnostics["phase"] == "grouped"


def test_a_peer_scored_outside_the_group_is_shunned_one_not_yet_scored_is_not():
    mesh = two_cluster_mesh(warmup=1)
    mesh.round(1)
    rule, _ = mesh.nodes["a"]
    assert not rule.shuns("c"), "nothing is shunned before the lazy round"
    mesh.round(2)
    assert rule.shuns("c") and rule.shuns("d")
    assert not rule.shuns("b") and not rule.shuns("newcomer")


def test_a_group_member_screening_keeps_out_is_not_reported_as_learned_from():
    mesh = two_cluster_mesh(warmup=0)
    mesh.round(1)
    rule = mesh.nodes["a"][0]
    rule.group |= {"c"}  # as a 2-means split that lumped another cluster in would
    rule.kept_out({"c"})  # ...whose models screening keeps out this round
    outcome = mesh.round(2)["a"]
    assert outcome.diagnostics["group"] == ["a", "b"]
    assert outcome.diagnostics["precision"] == 1.0
    assert "c" in rule.group, "the rule's own split is unchanged"


def test_a_node_is_in_its_own_group_even_when_its_own_lazy_model_scores_harmful():
    mesh = two_cluster_mesh(warmup=0)
    mesh.add("odd", make_node("odd", cluster=0, lazy_fits=1, warmup=0), dict(ANCHOR_STATE))
    outcome = mesh.round(1)["odd"]
    rule = mesh.nodes["odd"][0]
    assert not rule.split.is_beneficial(rule.scores["odd"]), "its own score fell on the bad side"
    assert outcome.diagnostics["group"] == ["a", "b", "odd"]


def test_published_blobs_are_the_bare_tensors_even_when_equal_across_origins_and_rounds():
    # The mesh names a blob by its signed record, so equal tensors need no tag to differ.
    mesh = two_cluster_mesh(warmup=0)
    mesh.round(1)
    round_one = mesh.published["a"][LAZY]
    mesh.round(2)
    round_two = mesh.published["a"][LAZY]
    assert set(round_one) == {"weight", "bias"}
    assert all(torch.equal(round_one[key], round_two[key]) for key in round_one)
    truth_a, truth_b = mesh.published["a"][TRUTH], mesh.published["b"][TRUTH]
    assert set(truth_a) == {"true_cluster"}
    assert torch.equal(truth_a["true_cluster"], truth_b["true_cluster"])


def test_a_newcomer_after_the_lazy_phase_gets_a_group_and_is_scored_by_the_others():
    mesh = two_cluster_mesh(warmup=1)
    for round_no in (1, 2):
        mesh.round(round_no)
    # It arrives with the average of the mesh's models, as the runtime's catch-up gives it.
    mesh.add("new", make_node("new", cluster=1, warmup=1), dict(ANCHOR_STATE))
    first = mesh.round(3)
    assert NOT_READY_KEY in mesh.published["new"][LAZY], "no θ_0 yet: a placeholder"
    assert mesh.fetched["new"][ANCHOR] == ["a", "b", "c", "d"]
    assert first["new"].diagnostics["group"] == ["c", "d", "new"]
    assert "new" not in first["c"].diagnostics["lazy_scores"], "a placeholder is not scored"
    second = mesh.round(4)
    assert mesh.fetched["c"][LAZY] == ["new"], "asked again, and only for the newcomer"
    assert ANCHOR not in mesh.fetched["new"], "the newcomer has its θ_0 now"
    assert "new" in second["c"].diagnostics["group"] and "new" in second["d"].diagnostics["group"]
    assert "new" not in second["a"].diagnostics["group"]
    assert second["a"].diagnostics["newly_scored"] == ["new"]
    mesh.round(5)
    assert "new" in mesh.fetched["c"][MODEL]


def test_oracle_groups_by_the_true_clusters_and_publishes_no_lazy_models():
    mesh = two_cluster_mesh(warmup=1, oracle=True)
    mesh.round(1)
    outcomes = mesh.round(2)
    assert set(mesh.published["a"]) == {MODEL, TRUTH}
    assert outcomes["a"].diagnostics["group"] == ["a", "b"]
    assert outcomes["c"].diagnostics["group"] == ["c", "d"]
    assert set(outcomes["c"].weights) == {"c", "d"}
    assert "lazy_scores" not in outcomes["a"].diagnostics
    mesh.round(3)
    assert mesh.fetched["a"] == {MODEL: ["b"]}, "the truths are known: nothing but models"


def test_oracle_without_a_true_cluster_is_refused_with_the_parameter_named():
    with pytest.raises(ValueError, match=r"algorithm\.oracle: got true"):
        make_node("a", 0, oracle=True, knows_cluster=False)


def test_a_node_without_a_true_cluster_records_no_precision_or_recall():
    mesh = Mesh(
        {
            name: make_node(name, cluster, knows_cluster=False)
            for name, cluster in {"a": 0, "b": 0, "c": 1}.items()
        }
    )
    mesh.round(1)
    diagnostics = mesh.round(2)["a"].diagnostics
    assert diagnostics["group"] == ["a", "b"]
    assert "precision" not in diagnostics and "recall" not in diagnostics


def test_the_checkpointed_state_restores_anchor_scores_split_and_group():
    mesh = two_cluster_mesh(warmup=1)
    mesh.round(1)
    mesh.round(2)
    rule = mesh.nodes["a"][0]
    buffer = io.BytesIO()
    torch.save(rule.state_dict(), buffer)
    buffer.seek(0)
    restored, _ = make_node("a", 0, warmup=1)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.scores == rule.scores and restored.group == rule.group
    assert restored.split == rule.split and restored.lazy_group is not None
    assert torch.equal(restored.lazy_group.losses, rule.lazy_group.losses)
    assert torch.equal(restored.anchor["weight"], rule.anchor["weight"])
    offered = {MODEL: ["b", "c", "d"], LAZY: ["b", "c", "d"], ANCHOR: ["b", "c", "d"]}
    assert restored.wanted(3, offered) == rule.wanted(3, offered)


def digits_mesh(partition: str, **params) -> tuple[Mesh, dict]:
    """Six pFedLIA nodes on real digits, `partition` of them, each trained by the mesh's
    recipe between rounds; and their data by name."""
    from meshfl.node.models import build_model
    from meshfl.node.splits import load_node_data
    from meshfl.node.trainer import train_local

    names = [f"node{i}" for i in range(6)]
    datas = {
        name: load_node_data("digits", None, partition, 6, i, 0) for i, name in enumerate(names)
    }

    def new_model() -> nn.Module:
        return build_model("mlp", (1, 8, 8), 10, seed=0)

    def train(model, x, y, epochs, seed, max_steps=None):
        return train_local(
            model, x, y, epochs or 1, 32, "sgd", 0.05, seed=seed, max_steps=max_steps
        )

    def local_training(name: str, state: dict, round_no: int) -> dict:
        model = new_model()
        model.load_state_dict(state)
        train(model, datas[name].x_train, datas[name].y_train, 2, seed=round_no)
        return {key: value.detach().clone() for key, value in model.state_dict().items()}

    nodes = {
        name: (
            PFedLIA(
                PFedLIAParams(warmup=2, **params),
                Context(name, 0, 10, (), (), new_model=new_model, train=train, data=datas[name]),
            ),
            datas[name],
        )
        for name in names
    }
    mesh = Mesh(nodes, local_training)
    mesh.states = {name: new_model().state_dict() for name in names}
    return mesh, datas


def groups_after_three_rounds(mesh: Mesh) -> dict[str, list[str]]:
    for round_no in (1, 2, 3):
        outcomes = mesh.round(round_no)
    return {name: outcome.diagnostics["group"] for name, outcome in outcomes.items()}


@pytest.mark.parametrize("split", ["harm", "2-means"])
def test_on_real_digits_every_node_groups_with_exactly_its_true_cluster(one_torch_thread, split):
    mesh, datas = digits_mesh("clusters:2", split=split)
    groups = groups_after_three_rounds(mesh)
    names = sorted(groups)
    truth = {name: datas[name].info["true_cluster"] for name in names}
    for name in names:
        assert groups[name] == sorted(peer for peer in names if truth[peer] == truth[name])
    assert groups_ari(groups, truth) == 1.0


def test_on_alike_shards_the_default_keeps_the_peers_the_papers_split_leaves_out(
    one_torch_thread,
):
    # 2-means always cuts the scores in two; on iid shards the cut falls through noise.
    paper = groups_after_three_rounds(digits_mesh("iid", split="2-means")[0])
    default = groups_after_three_rounds(digits_mesh("iid")[0])
    everyone = sorted(paper)
    assert any(group != everyone for group in paper.values())
    assert all(group == everyone for group in default.values())


def test_a_peer_is_mixed_into_the_group_at_the_share_an_equal_average_gives_it():
    group = LazyGroup({"w": torch.tensor([3.0])}, members=3, losses=torch.zeros(2))
    assert torch.equal(group.mixed_with({"w": torch.tensor([7.0])})["w"], torch.tensor([4.0]))


def test_a_peer_harmful_alone_joins_where_mixed_in_at_its_share_it_does_no_harm():
    # A one-weight model whose loss on val sample z is |w - z|: the group's lazy models
    # average to w = 0, a mildly skewed peer's lands at w = 2.
    val = torch.linspace(-3.0, 3.0, 30)

    def losses_of(state):
        return (state["w"] - val).abs()

    group = LazyGroup({"w": torch.tensor(0.0)}, members=4, losses=losses_of({"w": 0.0}))
    peer = {"w": torch.tensor(2.0)}
    assert not harmless_beside(losses_of(peer), group.losses), "judged alone, it is out"
    assert group.admits(peer, losses_of), "at a fifth of the group's average, it is in"
    assert not group.admits({"w": torch.tensor(20.0)}, losses_of), "another kind is out"


def test_a_lazy_model_is_harmless_beside_the_reference_unless_worse_beyond_the_noise():
    reference = torch.tensor([0.5, 1.0, 0.2, 0.8, 0.4, 0.6])
    noise = torch.tensor([0.1, -0.1, 0.05, -0.05, 0.1, -0.1])
    assert harmless_beside(reference + noise, reference)
    assert harmless_beside(reference - 1.0, reference), "better is never harm"
    assert not harmless_beside(reference + 1.0 + noise, reference)
    assert not harmless_beside(reference + math.inf, reference)


def test_a_change_too_small_to_matter_is_measured_against_the_loss_there_is_to_lose():
    # One label per node: the group's lazy model is near certain, and a tenth of another
    # label's model moves every loss the same way, by far less than 0.01 nats.
    jitter = torch.linspace(0.0, 1e-5, 30)
    near_certain = torch.full((30,), 0.001) + jitter
    assert not harmless_beside(near_certain + 0.0005 + jitter, near_certain)
    unsure = torch.full((30,), 2.0) + jitter
    assert harmless_beside(unsure + 0.0005 + jitter, unsure), "0.0005 of 2 nats is noise"


def test_a_lazy_model_worse_on_nearly_every_sample_is_harmful_though_one_sample_hides_it():
    reference = torch.full((30,), 0.5)
    losses = reference + torch.tensor([0.05] * 29 + [-1.0])
    assert harm_z(losses - reference) < 1, "the mean's test alone lets it through"
    assert not harmless_beside(losses, reference)


# --------------------------------------------------------------------------- ground truth


def test_precision_and_recall_count_the_peers_and_leave_self_out():
    truths = {"me": 0, "a": 0, "b": 0, "c": 1}
    assert precision_recall("me", ["me", "a", "c"], truths) == {"precision": 0.5, "recall": 0.5}
    assert precision_recall("me", ["me"], truths) == {"precision": None, "recall": 0.0}
    assert precision_recall("c", ["c"], truths) == {"precision": None, "recall": None}


def test_ari_of_groups_that_are_exactly_the_true_clusters_is_one():
    groups = {"a": ["a", "b"], "b": ["a", "b"], "c": ["c", "d"], "d": ["c", "d"]}
    assert groups_ari(groups, {"a": 0, "b": 0, "c": 1, "d": 1}) == 1.0


def test_ari_of_groups_forming_a_partition_equals_sklearns_ari_of_that_partition():
    rng = np.random.default_rng(0)
    for _ in range(100):
        size = int(rng.integers(2, 12))
        predicted, true = rng.integers(0, 4, size), rng.integers(0, 3, size)
        names = [f"n{i}" for i in range(size)]
        groups = {
            names[i]: [names[j] for j in range(size) if predicted[j] == predicted[i]]
            for i in range(size)
        }
        truth = dict(zip(names, true.tolist(), strict=True))
        assert groups_ari(groups, truth) == pytest.approx(adjusted_rand_score(true, predicted))


def test_ari_counts_a_one_sided_wrong_choice_that_a_partition_would_hide():
    # a takes in c, which does not take a back: 4 right pairs together, 1 wrong, 7 apart.
    groups = {"a": ["a", "b", "c"], "b": ["a", "b"], "c": ["c", "d"], "d": ["c", "d"]}
    truth = {"a": 0, "b": 0, "c": 1, "d": 1}
    tp, fp, fn, tn = 4, 1, 0, 7
    expected = 2 * (tp * tn - fn * fp) / ((tp + fn) * (fn + tn) + (tp + fp) * (fp + tn))
    assert groups_ari(groups, truth) == pytest.approx(expected) == pytest.approx(56 / 68)


def test_ari_uses_only_nodes_with_both_a_group_and_a_truth():
    groups = {"a": ["a", "b", "x"], "b": ["a", "b"], "x": ["a", "x"]}
    assert groups_ari(groups, {"a": 0, "b": 0}) == 1.0
    with pytest.raises(ValueError, match="no node"):
        groups_ari(groups, {"y": 0})


# --------------------------------------------------------------------------- parameters


def test_the_rule_is_discovered_under_its_name():
    assert "pfedlia" in ALGORITHM_NAMES
    assert parse_params("pfedlia", {}) == PFedLIAParams()


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("warmup", -1, "an integer >= 0"),
        ("lazy_epochs", 0, "an integer >= 1"),
        ("lazy_batch", 0, "an integer >= 1"),
    ],
)
def test_bad_parameters_name_the_field_the_value_and_what_is_allowed(field, value, allowed):
    expected = f"config field 'algorithm.{field}': got {value}; allowed: {allowed}"
    assert params_error("pfedlia", {field: value}).startswith(expected)


def test_oracle_must_be_a_boolean():
    assert params_error("pfedlia", {"oracle": "yes"}) == (
        "config field 'algorithm.oracle': got 'yes'; allowed: true or false"
    )
