"""pFedLIA with centralized clustering: OPTICS on hand-made score rows, the group
averages, the whole schedule in process on real digits, and the launcher's ARI."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from meshfl.algorithms import ALGORITHM_NAMES, Context, Upload, is_coordinated, parse_params
from meshfl.algorithms.pfedlia import groups_ari
from meshfl.algorithms.pfedlia_central import (
    NOISE,
    PFedLIACentral,
    PFedLIACentralParams,
    group_averages,
    groups_of,
    optics_clusters,
)
from tests.algorithms.config_lines import params_error

# --------------------------------------------------------------------------- OPTICS


def block(prefix: str, count: int, high: str, columns: list[str]) -> dict[str, dict[str, float]]:
    """`count` rows that score column `high` about 10 and every other column -5."""
    return {
        f"{prefix}{i}": {c: (10.0 if c == high else -5.0) + 0.1 * i for c in columns}
        for i in range(count)
    }


COLUMNS = ["x", "y", "z"]


def test_two_obvious_blocks_of_rows_are_two_clusters():
    rows = {**block("a", 3, "x", COLUMNS), **block("b", 3, "y", COLUMNS)}
    labels = optics_clusters(rows, min_samples=2)
    assert NOISE not in labels.values()
    assert labels["a0"] == labels["a1"] == labels["a2"] != labels["b0"]
    assert labels["b0"] == labels["b1"] == labels["b2"]
    groups = groups_of(labels)
    assert groups["a1"] == ["a0", "a1", "a2"] and groups["b2"] == ["b0", "b1", "b2"]


def test_pairs_are_clusters_at_the_default_min_samples():
    rows = {**block("a", 2, "x", COLUMNS), **block("b", 2, "y", COLUMNS)}
    groups = groups_of(optics_clusters(rows, PFedLIACentralParams().min_samples))
    assert groups == {
        "a0": ["a0", "a1"],
        "a1": ["a0", "a1"],
        "b0": ["b0", "b1"],
        "b1": ["b0", "b1"],
    }


def test_a_point_optics_calls_noise_is_a_group_of_its_own():
    rows = {
        **block("a", 3, "x", COLUMNS),
        **block("b", 3, "y", COLUMNS),
        "odd": {"x": 100.0, "y": 100.0, "z": 100.0},
    }
    labels = optics_clusters(rows, min_samples=2)
    assert labels["odd"] == NOISE
    groups = groups_of(labels)
    assert groups["odd"] == ["odd"]
    assert "odd" not in groups["a0"] and "odd" not in groups["b0"]


def test_with_fewer_rows_than_min_samples_every_client_is_alone():
    rows = block("a", 3, "x", COLUMNS)
    labels = optics_clusters(rows, min_samples=4)
    assert set(labels.values()) == {NOISE}
    assert groups_of(labels) == {name: [name] for name in rows}


def test_without_a_column_every_row_scored_every_client_is_alone():
    rows = {"a": {"x": 1.0}, "b": {"y": 1.0}, "c": {"x": 1.0, "y": math.nan}}
    assert groups_of(optics_clusters(rows, 2)) == {"a": ["a"], "b": ["b"], "c": ["c"]}


def test_a_lazy_model_scored_non_finite_by_anyone_is_left_out_of_the_rows():
    rows = {**block("a", 2, "x", COLUMNS), **block("b", 2, "y", COLUMNS)}
    for row in rows.values():
        row["blown"] = -math.inf
    rows["a0"]["blown"] = math.nan
    labels = optics_clusters(rows, 2)
    assert labels == optics_clusters(
        {k: {c: v for c, v in row.items() if c != "blown"} for k, row in rows.items()}, 2
    )
    assert labels["a0"] == labels["a1"] != labels["b0"] == labels["b1"]


# --------------------------------------------------------------------------- group averages


def one_tensor(value: float, n_samples: int) -> Upload:
    return Upload({"w": torch.tensor([value])}, n_samples)


def test_a_group_model_is_the_sample_weighted_average_of_its_members_that_uploaded():
    groups = {"a": ["a", "b", "c"], "b": ["a", "b", "c"], "c": ["a", "b", "c"], "d": ["d"]}
    uploads = {"a": one_tensor(1.0, 10), "b": one_tensor(4.0, 30), "d": one_tensor(7.0, 5)}
    models, weights = group_averages(groups, uploads)
    assert weights["c"] == {"a": 0.25, "b": 0.75}, "c did not upload and still gets a model"
    assert models["a"]["w"].item() == pytest.approx(0.25 * 1.0 + 0.75 * 4.0)
    assert models["a"] is models["b"] is models["c"], "one average per group"
    assert weights["d"] == {"d": 1.0} and models["d"]["w"].item() == 7.0


def test_a_client_without_a_group_is_alone_and_a_group_without_uploads_gets_nothing():
    models, weights = group_averages(
        {"a": ["a", "b"], "b": ["a", "b"]}, {"late": one_tensor(2.0, 3)}
    )
    assert set(models) == {"late"} and weights == {"late": {"late": 1.0}}


# --------------------------------------------------------------------------- the schedule


def digits_mesh(count: int, warmup: int):
    from meshfl.node.models import build_model
    from meshfl.node.splits import load_node_data
    from meshfl.node.trainer import train_local

    def new_model() -> nn.Module:
        return build_model("mlp", (1, 8, 8), 10, seed=0)

    def train(model, x, y, epochs, seed, max_steps=None):
        return train_local(
            model, x, y, epochs or 2, 32, "sgd", 0.05, seed=seed, max_steps=max_steps
        )

    params = PFedLIACentralParams(warmup=warmup, lazy_epochs=5, lazy_batch=100)
    datas = {
        f"node{i}": load_node_data("digits", None, "clusters:2", count, i, 0) for i in range(count)
    }
    clients = {
        name: PFedLIACentral(
            params, Context(name, 0, 10, (), (), new_model=new_model, train=train, data=data)
        )
        for name, data in datas.items()
    }
    server = PFedLIACentral(params, Context("coordinator", 0, 10, (), (), new_model=new_model))
    return server, clients, datas, new_model


def coordinated_round(server, clients, datas, new_model, round_no):
    """One round the way the coordinator role runs it, without the wire."""
    initial = new_model().state_dict()
    uploads, sent = {}, {}
    for name, rule in clients.items():
        model = new_model()
        model.load_state_dict(server.model_for(round_no, name, initial))
        sent[name] = server.personal_extras(round_no, name)
        rule.receive_extras(round_no, sent[name])
        _, extras = rule.client_update(round_no, model, datas[name])
        state = {key: value.detach().clone() for key, value in model.state_dict().items()}
        uploads[name] = Upload(state, len(datas[name].y_train), extras)
    return server.aggregate_uploads(round_no, uploads), uploads, sent


def test_the_schedule_lazy_round_scoring_round_then_fedavg_within_the_clusters(one_torch_thread):
    server, clients, datas, new_model = digits_mesh(4, warmup=1)
    truth = {name: data.info["true_cluster"] for name, data in datas.items()}
    warmup, _, sent = coordinated_round(server, clients, datas, new_model, 1)
    assert warmup["phase"] == "warmup" and not any(sent.values())

    lazy, uploads, sent = coordinated_round(server, clients, datas, new_model, 2)
    assert lazy["phase"] == "lazy" and not any(sent.values())
    assert set(server.lazy_models) == set(clients)
    assert any(key.startswith("lazy/") for key in uploads["node0"].extras)

    clustered, uploads, sent = coordinated_round(server, clients, datas, new_model, 3)
    assert clustered["phase"] == "clustered"
    assert {key.split("/")[1] for key in sent["node0"] if key.startswith("lazy/")} == set(
        clients
    ), "every client received every lazy model"
    assert set(clustered["lazy_scores"]) == set(clients)
    assert all(set(row) == set(clients) for row in clustered["lazy_scores"].values())
    groups = clustered["groups"]
    for name in clients:
        assert groups[name] == sorted(p for p in clients if truth[p] == truth[name]), name
    assert groups_ari(groups, truth) == 1.0
    expected, _ = group_averages(groups, uploads)
    for key, value in expected["node0"].items():
        assert torch.equal(server.model_for(4, "node0", {})[key], value), "its group's average"

    grouped, _, sent = coordinated_round(server, clients, datas, new_model, 4)
    assert grouped["phase"] == "grouped" and grouped["groups"] == groups
    assert not any(sent.values()), "clustering happens once"
    for name in clients:
        assert set(server.weights_for(name)) == set(groups[name])
        assert sum(server.weights_for(name).values()) == pytest.approx(1.0)


def test_the_checkpointed_state_restores_groups_and_personal_models(one_torch_thread, tmp_path):
    from meshfl.node.checkpoint import load_checkpoint, save_checkpoint

    server, clients, datas, new_model = digits_mesh(4, warmup=0)
    for round_no in (1, 2):
        coordinated_round(server, clients, datas, new_model, round_no)
    save_checkpoint(tmp_path / "checkpoint.pt", {"algorithm": server.state_dict()})
    restored = PFedLIACentral(server.params, server.context)
    restored.load_state_dict(load_checkpoint(tmp_path / "checkpoint.pt")["algorithm"])
    assert restored.groups == server.groups is not None
    for name in clients:
        assert restored.weights_for(name) == server.weights_for(name)
        for key, value in server.model_for(3, name, {}).items():
            assert torch.equal(restored.model_for(3, name, {})[key], value)


# --------------------------------------------------------------------------- wiring


def test_the_rule_is_discovered_as_a_coordinator_rule():
    assert "pfedlia_central" in ALGORITHM_NAMES and is_coordinated("pfedlia_central")
    params = parse_params("pfedlia_central", {"warmup": 3, "min_samples": 3})
    assert (params.warmup, params.min_samples, params.lazy_batch) == (3, 3, 100)


@pytest.mark.parametrize(
    ("field", "value"), [("min_samples", 1), ("warmup", -1), ("lazy_epochs", 0), ("lazy_batch", 0)]
)
def test_bad_parameters_name_the_field_the_value_and_what_is_allowed(field, value):
    expected = f"config field 'algorithm.{field}': got {value}; allowed"
    assert params_error("pfedlia_central", {field: value}).startswith(expected)


def test_the_summary_scores_the_coordinators_last_groups():
    from meshfl.launch.measures import coordinator_groups_ari
    from meshfl.launch.run_folder import RunRecords
    from meshfl.node.metrics import CoordinatorRecord

    coordinator = [
        CoordinatorRecord(1, {"phase": "warmup"}),
        CoordinatorRecord(2, {"groups": {"a": ["a"], "b": ["b"], "c": ["c"]}}),
        CoordinatorRecord(3, {"groups": {"a": ["a", "b"], "b": ["a", "b"], "c": ["c"]}}),
        CoordinatorRecord(4, {}),
    ]
    truth = {name: {"true_cluster": cluster} for name, cluster in {"a": 0, "b": 0, "c": 1}.items()}
    run = RunRecords({}, coordinator, data=truth)
    assert coordinator_groups_ari(run) == {"ari": 1.0}
