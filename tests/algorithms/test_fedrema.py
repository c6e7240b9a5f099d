"""FedReMa: MDS on hand-made rows, the CCP switch, G, snapshot aggregation, one temperature,
the head=fc split, checkpoints, and a coordinated run on real processes."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch

from meshfl.algorithms import Context, Upload, parse_params
from meshfl.algorithms.base import weighted_average
from meshfl.algorithms.fedrema import (
    FedReMa,
    aggregate_heads,
    ccp_still_on,
    dependency_weights,
    draw_probe,
    own_group_fraction,
    probe_similarity,
    relevant_set,
)
from meshfl.node.models import body_keys, build_model, head_keys
from tests.algorithms.config_lines import params_error
from tests.nodes import free_ports, records, run_coordinated_mesh, write_config

CLASSES = 10
GROUP_LABELS = {"a": [0, 1, 2], "b": [3, 4, 5], "c": [6, 7, 8]}
# Two clients per group, so every client has one true partner; sample counts all differ.
CLIENTS = {"a1": "a", "a2": "a", "b1": "b", "b2": "b", "c1": "c", "c2": "c"}
SAMPLES = {name: 40 + 7 * index for index, name in enumerate(CLIENTS)}


def new_model() -> torch.nn.Module:
    # FedReMa's CNN on 8x8 inputs: head=fc makes the head two linear layers (fc1, out).
    return build_model("fedrema_cnn", (1, 8, 8), CLASSES, head="fc", seed=0)


INITIAL = new_model().state_dict()


def make_rule(**params: float) -> FedReMa:
    model = new_model()
    context = Context(
        "coordinator",
        seed=7,
        num_classes=CLASSES,
        body_keys=tuple(body_keys(model)),
        head_keys=tuple(head_keys(model)),
        new_model=new_model,
    )
    return FedReMa(parse_params("fedrema", params), context)


def trained_like(group: str | None, seed: int) -> dict[str, torch.Tensor]:
    """A model whose head favours its group's labels on any feature (the prediction bias
    FedReMa reads): a strong bias on those labels, small output weights. group None: no
    favourite."""
    generator = torch.Generator().manual_seed(seed)
    state = {
        key: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
        for key, tensor in INITIAL.items()
    }
    state["head.out.weight"] = state["head.out.weight"] * 0.01
    bias = torch.zeros(CLASSES)
    if group is not None:
        bias[GROUP_LABELS[group]] = 3.0
    state["head.out.bias"] = bias
    return state


def uploads_for(clients: dict[str, str | None] = CLIENTS, seed: int = 0) -> dict[str, Upload]:
    return {
        name: Upload(trained_like(group, seed + 100 * index + 1), SAMPLES.get(name, 50))
        for index, (name, group) in enumerate(clients.items())
    }


def heads_of(uploads: dict[str, Upload], rule: FedReMa) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: up.state[k] for k in rule.context.head_keys} for name, up in uploads.items()}


# --------------------------------------------------------------------------- MDS


def test_mds_cuts_at_the_largest_gap_below_the_top_one():
    # ascending: 0.2 (d) 0.3 (c) | 0.9 (b) 0.95 (a) 1.0 (self); gaps .1 .6 .05 | .05
    members, gap = relevant_set([1.0, 0.95, 0.9, 0.3, 0.2], self_index=0)
    assert members == [0, 1, 2]
    assert gap == pytest.approx(0.6)


def test_mds_ignores_the_gap_between_self_and_its_best_peer():
    # The top gap (0.3 -> 1.0) is by far the largest; cutting there would leave self alone.
    members, gap = relevant_set([0.1, 0.12, 1.0, 0.3], self_index=2)
    assert members == [2, 3]
    assert gap == pytest.approx(0.18)


def test_mds_keeps_self_on_top_when_a_peer_ties_or_rounds_above_it():
    assert 1 in relevant_set([1.0000001, 1.0, 0.2, 0.1], self_index=1)[0]
    assert 3 in relevant_set([0.1, 1.0, 0.2, 1.0], self_index=3)[0]


def test_mds_with_too_few_clients_to_choose_takes_everyone():
    assert relevant_set([1.0, 0.3], self_index=0) == ([0, 1], 0.0)
    assert relevant_set([1.0], self_index=0) == ([0], 0.0)


def test_mds_on_random_rows_is_the_top_of_the_order_cut_at_the_largest_lower_gap():
    rng = random.Random(5)
    for _ in range(300):
        size = rng.randint(3, 9)
        row = [1.0] + [rng.random() for _ in range(size - 1)]
        me = rng.randrange(size)
        row[0], row[me] = row[me], row[0]
        members, gap = relevant_set(row, me)
        assert me in members and len(members) >= 2, "self plus at least one peer"
        ranked = sorted(range(size), key=lambda i: (row[i], i == me))
        assert sorted(ranked[size - len(members) :]) == members, "the top of the order"
        ascending = [row[i] for i in ranked]
        lower_gaps = [b - a for a, b in zip(ascending, ascending[1:-1], strict=False)]
        assert gap == pytest.approx(max(lower_gaps))
        assert ascending[size - len(members)] - ascending[size - len(members) - 1] == pytest.approx(
            gap
        ), "the cut sits at that gap"


# --------------------------------------------------------------------------- similarity


def test_one_temperature_for_self_and_peers():
    same = torch.tensor([[2.0, -1.0, 0.5], [2.0, -1.0, 0.5], [0.0, 3.0, 0.0]])
    row = probe_similarity(same, self_index=0, temperature=0.5)
    assert row[1].item() == pytest.approx(1.0, abs=1e-12), "identical heads: similarity 1"

    def soft(logits, temperature):
        return torch.softmax(logits.double() / temperature, dim=0)

    expected = torch.nn.functional.cosine_similarity(soft(same[0], 0.5), soft(same[2], 0.5), dim=0)
    assert row[2].item() == pytest.approx(expected.item())
    # The official code's 0.5 for self and 1.0 for peers would call identical heads different:
    official = torch.nn.functional.cosine_similarity(soft(same[0], 0.5), soft(same[1], 1.0), dim=0)
    assert official.item() < 0.99


def test_identical_heads_are_fully_similar_in_the_rule():
    rule = make_rule()
    twins = uploads_for({"a1": "a", "a2": "b", "b1": "c"})
    twins["a2"] = Upload(twins["a1"].state, 60)
    diagnostics = rule.aggregate_uploads(1, twins)
    order = diagnostics["clients"]
    similarity = diagnostics["similarity"]
    assert similarity[order.index("a1")][order.index("a2")] == pytest.approx(1.0, abs=1e-12)
    assert all(similarity[i][i] == 1.0 for i in range(len(order)))


def test_probes_are_seeded_fresh_per_client_and_round_and_in_range():
    probe = draw_probe(64, 0.5, seed=3, round_no=2, client="node1")
    assert torch.equal(probe, draw_probe(64, 0.5, seed=3, round_no=2, client="node1"))
    assert not torch.equal(probe, draw_probe(64, 0.5, seed=3, round_no=2, client="node2"))
    assert not torch.equal(probe, draw_probe(64, 0.5, seed=3, round_no=3, client="node1"))
    assert probe.shape == (64,) and 0 <= probe.min() and probe.max() < 0.5


# --------------------------------------------------------------------------- the rule


def test_relevant_sets_find_the_group_partners_and_g_counts_them():
    rule = make_rule()
    expected_counts: dict[str, dict[str, int]] = {}
    for round_no in (1, 2):
        diagnostics = rule.aggregate_uploads(round_no, uploads_for(seed=round_no))
        assert diagnostics["ccp"] is True
        sets = diagnostics["relevant_sets"]
        assert own_group_fraction(sets, CLIENTS) == 1.0
        for client, members in sets.items():
            assert members == sorted(n for n in CLIENTS if CLIENTS[n] == CLIENTS[client])
            for member in members:
                row = expected_counts.setdefault(client, {})
                row[member] = row.get(member, 0) + 1
        assert diagnostics["dependency"] == expected_counts, "G[k, i] += 1, self included"
        gaps = diagnostics["max_gaps"]
        assert diagnostics["mean_max_gap"] == pytest.approx(sum(gaps.values()) / len(gaps))
    assert expected_counts["a1"] == {"a1": 2, "a2": 2}


def test_ccp_test_of_eq_9():
    assert ccp_still_on([], 0.5)
    assert ccp_still_on([0.8], 0.5), "the first round is its own peak"
    assert ccp_still_on([0.4, 1.0, 0.6], 0.5)
    assert not ccp_still_on([0.4, 1.0, 0.5], 0.5), "strictly above delta"
    assert not ccp_still_on([0.4, 1.0, 0.45], 0.5), "against the peak, not the last round"
    assert ccp_still_on([0.0, 0.0], 0.5), "nothing separated yet: no decline to measure"


def test_ccp_ends_when_the_gaps_collapse_and_never_comes_back():
    rule = make_rule()
    first = rule.aggregate_uploads(1, uploads_for(seed=1))
    assert first["ccp"] and first["ccp_continues"]
    # Heads without a favourite label: no gap stands out, Δs̄ collapses.
    alike = {name: None for name in CLIENTS}
    second = rule.aggregate_uploads(2, uploads_for(alike, seed=2))
    assert second["ccp"] is True and second["ccp_continues"] is False
    assert second["mean_max_gap"] < 0.5 * first["mean_max_gap"]
    dependency = second["dependency"]
    for round_no in (3, 4):
        later = rule.aggregate_uploads(round_no, uploads_for(seed=round_no))  # gaps are back
        assert later["ccp"] is False and "relevant_sets" not in later
        assert later["dependency"] == dependency, "G stops counting after the CCP"
        for client in CLIENTS:
            total = sum(dependency[client].values())
            expected = {peer: count / total for peer, count in dependency[client].items()}
            assert rule.weights_for(client) == pytest.approx(expected), "Eq. 10"


def test_heads_are_aggregated_from_a_snapshot_in_any_order():
    uploads = uploads_for()
    copies = {n: {k: t.clone() for k, t in up.state.items()} for n, up in uploads.items()}
    forward, backward = make_rule(), make_rule()
    forward.aggregate_uploads(1, uploads)
    backward.aggregate_uploads(1, dict(reversed(list(uploads.items()))))
    for name, upload in uploads.items():
        assert all(torch.equal(upload.state[k], copies[name][k]) for k in copies[name]), (
            "uploads untouched"
        )
        one, other = forward.model_for(2, name, INITIAL), backward.model_for(2, name, INITIAL)
        assert all(torch.equal(one[k], other[k]) for k in one), "order does not matter"
    # a1 and a2 are in each other's relevant set: both heads come from the uploaded pair.
    rule, heads = forward, heads_of(uploads, forward)
    pair = {"a1": SAMPLES["a1"], "a2": SAMPLES["a2"]}
    expected = weighted_average(
        {n: heads[n] for n in pair}, {n: c / sum(pair.values()) for n, c in pair.items()}
    )
    for name in pair:
        got = rule.model_for(2, name, INITIAL)
        assert all(torch.allclose(got[k], expected[k]) for k in expected)
    # The official code's in-place update reads a1's new head when it does a2: another answer.
    in_place = {n: dict(h) for n, h in heads.items()}
    for name in ("a1", "a2"):
        in_place[name] = weighted_average(
            {n: in_place[n] for n in pair}, {n: c / sum(pair.values()) for n, c in pair.items()}
        )
    assert not torch.allclose(in_place["a2"]["head.fc1.weight"], expected["head.fc1.weight"])


def test_aggregate_heads_writes_new_tensors():
    heads = {"x": {"w": torch.ones(2)}, "y": {"w": torch.zeros(2)}}
    out = aggregate_heads(heads, {"x": {"x": 0.25, "y": 0.75}, "y": {"y": 1.0}})
    assert torch.equal(out["x"]["w"], torch.full((2,), 0.25))
    out["y"]["w"].add_(5)
    assert torch.equal(heads["y"]["w"], torch.zeros(2)), "never an alias of an input"


def test_head_fc_split_body_over_everyone_heads_over_the_relevant_set():
    rule = make_rule()
    assert {"head.fc1.weight", "head.out.weight"} <= set(rule.context.head_keys)
    uploads = uploads_for()
    rule.aggregate_uploads(1, uploads)
    total = sum(SAMPLES.values())
    everyone = weighted_average(
        {n: up.state for n, up in uploads.items()}, {n: SAMPLES[n] / total for n in uploads}
    )
    for name in CLIENTS:
        model = rule.model_for(2, name, INITIAL)
        assert list(model) == list(INITIAL)
        for key in rule.context.body_keys:
            assert torch.allclose(model[key], everyone[key]), "Eq. 6 over all clients"
        weights = rule.weights_for(name)
        assert set(weights) == {n for n in CLIENTS if CLIENTS[n] == CLIENTS[name]}
        assert sum(weights.values()) == pytest.approx(1.0)
        for key in rule.context.head_keys:  # fc1 too: the whole fc stack is personal
            assert not torch.allclose(model[key], everyone[key]), "not the everyone-average"


def test_absent_clients_keep_their_head_and_new_ones_start_from_the_initial_head():
    rule, initial = make_rule(), INITIAL
    rule.aggregate_uploads(1, uploads_for())
    before = rule.model_for(2, "c2", initial)
    weights_before = rule.weights_for("c2")
    rule.aggregate_uploads(2, uploads_for({n: g for n, g in CLIENTS.items() if n != "c2"}, 5))
    after, newcomer = rule.model_for(3, "c2", initial), rule.model_for(3, "d1", initial)
    shared = rule.model_for(3, "a1", initial)
    for key in rule.context.head_keys:
        assert torch.equal(after[key], before[key])
        assert torch.equal(newcomer[key], initial[key])
    for key in rule.context.body_keys:
        assert torch.equal(after[key], shared[key]) and torch.equal(newcomer[key], shared[key])
    assert rule.weights_for("c2") == weights_before
    assert rule.weights_for("d1") == {"d1": 1.0}


def test_dependency_weights_fall_back_to_the_own_head():
    assert dependency_weights("k", {"k": 1, "i": 3}, ["k", "i", "j"]) == {"i": 0.75, "k": 0.25}
    assert dependency_weights("new", {}, ["new", "i"]) == {"new": 1.0}


def test_checkpoint_round_trip_continues_bit_for_bit():
    rule = make_rule()
    rule.aggregate_uploads(1, uploads_for(seed=1))
    buffer = io.BytesIO()
    torch.save(rule.state_dict(), buffer)
    buffer.seek(0)
    resumed = make_rule()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.aggregate_uploads(2, uploads_for(seed=2)) == rule.aggregate_uploads(
        2, uploads_for(seed=2)
    )
    for name in CLIENTS:
        one, other = rule.model_for(3, name, INITIAL), resumed.model_for(3, name, INITIAL)
        assert all(torch.equal(one[k], other[k]) for k in one)


def test_params_are_validated_with_the_field_named():
    assert "'algorithm.delta': got 1.5; allowed" in params_error("fedrema", {"delta": 1.5})
    assert "'algorithm.temperature': got 0; allowed" in params_error("fedrema", {"temperature": 0})
    assert "'algorithm.probe_high'" in params_error("fedrema", {"probe_high": -1})
    assert parse_params("fedrema", {}).delta == 0.5


def test_own_group_fraction_pools_peers_and_leaves_self_out():
    groups = {"a1": 0, "a2": 0, "b1": 1, "b2": 1}
    sets = {"a1": ["a1", "a2", "b1"], "b1": ["b1", "b2"]}
    assert own_group_fraction(sets, groups) == pytest.approx(2 / 3)
    assert own_group_fraction({"a1": ["a1"]}, groups) is None


# --------------------------------------------------------------------------- real processes


def test_coordinated_run_writes_the_fedrema_diagnostics(tmp_path):
    nodes, rounds = 4, 3
    config = tmp_path / "peers.yaml"
    write_config(
        config,
        nodes,
        rounds=rounds,
        local_epochs=1,
        round_timeout=20.0,
        algorithm={"name": "fedrema"},
        model={"name": "mlp", "head": "fc"},
        data={"dataset": "digits", "partition": "groups:0.2"},
        coordinator=f"tcp://127.0.0.1:{free_ports(1)[0]}",
    )
    run_coordinated_mesh(config, tmp_path, nodes, timeout=60)
    names = [f"node{i}" for i in range(nodes)]
    for index, name in enumerate(names):  # the analysis maps node i to group i % 5
        assert json.loads((tmp_path / name / "info.json").read_text())["data"]["group"] == index
    coordinator = records(tmp_path, "coordinator")
    assert [row["round"] for row in coordinator] == list(range(1, rounds + 1))
    counts: dict[str, dict[str, int]] = {}
    for row in coordinator:
        found = row["diagnostics"]
        assert isinstance(found["ccp"], bool) and found["ccp"], "3 rounds stay in the CCP"
        assert found["clients"] == sorted(row["uploaded"]) == names
        similarity = found["similarity"]
        assert [similarity[i][i] for i in range(nodes)] == [1.0] * nodes
        for client, members in found["relevant_sets"].items():
            assert client in members and len(members) >= 2
            for member in members:
                counts.setdefault(client, {}).setdefault(member, 0)
                counts[client][member] += 1
        assert found["dependency"] == counts
        assert found["mean_max_gap"] == pytest.approx(sum(found["max_gaps"].values()) / nodes)
    for name in names:  # a client's line for round t carries the head weights of round t
        for row, line in zip(coordinator, records(tmp_path, name), strict=True):
            assert line["weights"] == pytest.approx(row["diagnostics"]["head_weights"][name])
            assert sum(line["weights"].values()) == pytest.approx(1.0)
