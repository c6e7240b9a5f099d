"""Rule parameters that count rounds are fitted to and checked against `rounds` when the
config is read, and the end of a run says what each rule decided (launch/decisions.py)."""

from __future__ import annotations

import pytest
import yaml

from meshfl.algorithms import ALGORITHM_NAMES
from meshfl.launch.experiment_runs import _planned_config, available, with_attack_grid
from meshfl.launch.measures import RULES, node_decisions
from meshfl.node.config import (
    AlgorithmConfig,
    ConfigError,
    MeshConfig,
    apply_overrides,
    explicit_params,
    save_config,
    validate,
    with_explicit_params,
)
from meshfl.node.mesh_identity import shared_settings
from meshfl.node.metrics import RoundRecord

COORDINATED = ["coordinator=tcp://127.0.0.1:7999"]


def checked(*assignments: str) -> MeshConfig:
    cfg = apply_overrides(MeshConfig(), [*assignments, *COORDINATED])
    validate(cfg)
    return cfg


def error_of(*assignments: str) -> str:
    with pytest.raises(ConfigError) as caught:
        checked(*assignments)
    return str(caught.value)


@pytest.mark.parametrize(
    ("rule", "rounds", "warmup"),
    [
        ("pfedlia", 1, 0),
        ("pfedlia", 2, 1),
        ("pfedlia", 10, 5),
        ("pfedlia", 41, 20),
        ("pfedlia", 100, 20),
        ("pfedlia_central", 2, 0),
        ("pfedlia_central", 3, 1),
        ("pfedlia_central", 10, 5),
        ("pfedlia_central", 100, 20),
    ],
)
def test_a_warmup_left_out_is_half_the_run_at_most_the_papers_20_and_leaves_the_phase_room(
    rule, rounds, warmup
):
    cfg = checked(f"algorithm={rule}", f"rounds={rounds}")
    assert explicit_params(cfg.algorithm, cfg.rounds)["warmup"] == warmup


def test_a_warmup_the_run_never_leaves_is_one_line_naming_both_fields_and_what_works():
    message = error_of("algorithm=pfedlia", "rounds=5", "algorithm.warmup=20")
    assert "\n" not in message
    assert message.startswith("config field 'algorithm.warmup': got 20, but with rounds 5")
    assert (
        "allowed: warmup 0 to 4 for rounds 5, rounds >= 21, or "
        "algorithm.warmup_only=true" in message
    )
    # The lazy round of a 20-round run with the paper's warm-up would be round 21.
    assert "rounds >= 21" in error_of("algorithm=pfedlia", "rounds=20", "algorithm.warmup=20")


def test_the_central_variant_needs_the_lazy_round_and_the_clustering_round_after_it():
    message = error_of("algorithm=pfedlia_central", "rounds=10", "algorithm.warmup=9")
    assert "'algorithm.warmup': got 9" in message and "warmup 0 to 8 for rounds 10" in message
    left_out = error_of("algorithm=pfedlia_central", "rounds=1")
    assert "'algorithm.warmup': left out, but with rounds 1" in left_out
    assert "allowed: rounds >= 2" in left_out


@pytest.mark.parametrize("rule", ["pfedlia", "pfedlia_central"])
def test_warmup_only_says_on_purpose_that_the_run_is_the_warmup_and_nothing_else(rule):
    cfg = checked(
        f"algorithm={rule}", "rounds=5", "algorithm.warmup=20", "algorithm.warmup_only=true"
    )
    assert explicit_params(cfg.algorithm, cfg.rounds)["warmup"] == 20
    whole_run = checked(f"algorithm={rule}", "rounds=7", "algorithm.warmup_only=true")
    assert explicit_params(whole_run.algorithm, whole_run.rounds)["warmup"] == 7
    message = error_of(
        f"algorithm={rule}", "rounds=10", "algorithm.warmup=3", "algorithm.warmup_only=true"
    )
    assert "'algorithm.warmup_only': got true, but rounds 10 run past warmup 3" in message


def test_fedinfluence_must_reach_its_cleansing_round_and_measure_fil_in_some_round():
    assert "'algorithm.cleanse_at': got 11, but with rounds 10" in error_of(
        "algorithm=fedinfluence", "rounds=10", "algorithm.cleanse_at=11"
    )
    message = error_of("algorithm=fedinfluence", "rounds=10", "algorithm.evaluate_every=11")
    assert "'algorithm.evaluate_every': got 11, but with rounds 10" in message
    assert "algorithm.estimator=false" in message
    # FIL is also measured in the cleansing round; without the estimator there is none.
    checked(
        "algorithm=fedinfluence",
        "rounds=10",
        "algorithm.evaluate_every=11",
        "algorithm.cleanse_at=10",
    )
    checked(
        "algorithm=fedinfluence",
        "rounds=10",
        "algorithm.evaluate_every=11",
        "algorithm.estimator=false",
    )


def test_the_fitted_warmup_enters_the_mesh_id_and_a_saved_config_keeps_it(tmp_path):
    default = checked("algorithm=pfedlia", "rounds=10")
    spelled_out = checked("algorithm=pfedlia", "rounds=10", "algorithm.warmup=5")
    assert shared_settings(default) == shared_settings(spelled_out)
    # Another schedule is another mesh: its peers would wait for lazy blobs never sent.
    assert shared_settings(checked("algorithm=pfedlia", "rounds=12")) != shared_settings(default)
    # What `meshfl launch` writes for its nodes and joiners keeps the fitted value.
    save_config(with_explicit_params(default), tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["algorithm"]["warmup"] == 5
    joiner = apply_overrides(MeshConfig(), ["algorithm=pfedlia", "algorithm.warmup=5", "rounds=30"])
    assert shared_settings(joiner) == shared_settings(default)


def test_every_variant_of_every_experiment_passes_the_check_with_the_values_it_names(tmp_path):
    for name, path in available().items():
        spec = with_attack_grid(yaml.safe_load(path.read_text()))
        base = tmp_path / f"{name}.yaml"
        base.write_text(yaml.safe_dump(spec["config"]))
        for variant, assignments in spec["variants"].items():
            cfg = _planned_config(base, [*assignments, *COORDINATED], spec["nodes"])
            validate(cfg)
            set_warmup = [a for a in assignments if a.startswith("algorithm.warmup=")]
            if set_warmup:  # the pFedLIA tables name their warm-up; it is what runs
                warmup = int(set_warmup[0].partition("=")[2])
                assert cfg.algorithm.params["warmup"] == warmup, (name, variant)


# --------------------------------------------------------------------------- decisions


def test_every_rule_but_the_baselines_has_a_decision():
    baselines = {"local", "fedavg", "fedavg_server", "median", "trimmed_mean", "krum", "multikrum"}
    decided = {rule for rule, measures in RULES.items() if measures.decide}
    assert decided == set(ALGORITHM_NAMES) - baselines


def rounds_of(*diagnostics: dict, weights: dict[str, float] | None = None) -> list[RoundRecord]:
    """Records of these diagnostics, the last round's with `weights`."""
    records = [
        RoundRecord(round=index + 1, diagnostics=found) for index, found in enumerate(diagnostics)
    ]
    records[-1].weights = weights or {}
    return records


def test_peer_rules_decide_from_the_nodes_own_latest_diagnostics():
    both = {"a": 0.5, "c": 0.5}
    grouped = {
        "a": rounds_of(
            {"phase": "warmup"}, {"phase": "clustered", "group": ["a", "c"]}, weights=both
        ),
        "b": rounds_of({"phase": "warmup"}),
    }
    assert node_decisions("pfedlia", grouped, []) == {
        "a": "group a,c",
        "b": "warm-up only, no group",
    }
    influence = {
        "a": rounds_of({"influence_vector": {"a": 0.5, "b": 0.2, "c": 0.3}}, weights=both),
        "b": rounds_of({"influence_vector": {"b": 1.0}}, weights={"b": 1.0}),
    }
    assert node_decisions("fedc2i", influence, []) == {
        "a": "most influential c (λ 0.30)",
        "b": "own model only",
    }
    top_k = {"a": rounds_of({"selected": ["b", "c", "d"]}, {"selected": ["c"]}, weights=both)}
    assert node_decisions("pfedsv", top_k, []) == {"a": "top-1 c"}
    assert node_decisions("fedavg", top_k, []) == {}


def test_a_decision_names_only_peers_that_got_weight():
    """A peer the rule ranked first, or grouped with the node, but that screening kept
    out (or the guard refused) taught the node nothing: the phrase must not name it."""
    alone = {"a": 1.0}
    influence = {"a": rounds_of({"influence_vector": {"a": 0.4, "b": 0.6}}, weights=alone)}
    assert node_decisions("fedc2i", influence, []) == {"a": "own model only"}
    top_k = {"a": rounds_of({"selected": ["b", "c"]}, weights={"a": 0.5, "c": 0.5})}
    assert node_decisions("pfedsv", top_k, []) == {"a": "top-1 c"}
    grouped = {"a": rounds_of({"phase": "clustered", "group": ["a", "b", "c"]}, weights=alone)}
    assert node_decisions("pfedlia", grouped, []) == {"a": "group a"}


def test_a_screened_run_says_what_screening_did_to_each_nodes_peers():
    def screened(reasons: dict[str, str], adopted: bool | None) -> RoundRecord:
        verdict = {} if adopted is None else {"adopted": adopted}
        return RoundRecord(
            round=1,
            diagnostics={"screened_out": reasons, "screening": {"judged": True, **verdict}},
            received=["b", "c", "d"],
        )

    history = {
        "a": [
            screened({"b": "val_loss", "c": "val_loss"}, adopted=False),
            screened({"b": "val_loss"}, adopted=True),
            screened({"b": "record", "c": "n_claim", "d": "copy"}, adopted=None),
        ]
    }
    assert node_decisions("fedavg", history, []) == {
        "a": "screening let in 3 of 9 peer-models (kept out: copy 1, n_claim 1, record 1, "
        "val_loss 3; 2 of 3 peers let in at least once), refused 1 of 2 aggregates judged"
    }
    history["a"][2].weights = {"a": 1.0}
    history["a"][2].diagnostics["influence_vector"] = {"a": 0.1, "b": 0.9}
    assert node_decisions("fedc2i", history, [])["a"].startswith(
        "own model only; screening let in 3 of 9 peer-models"
    )


def test_server_rules_decide_from_the_coordinators_latest_diagnostics():
    clients = {"a": rounds_of({}), "b": rounds_of({}), "c": rounds_of({})}
    rema = rounds_of(
        {"ccp": True, "ccp_continues": True, "head_weights": {"a": {"a": 0.5, "b": 0.5}}},
        {
            "ccp": True,
            "ccp_continues": False,
            "head_weights": {"a": {"a": 0.4, "c": 0.6}, "b": {"b": 1.0}},
        },
        {"ccp": False, "head_weights": {"a": {"a": 0.5, "b": 0.2, "c": 0.3}}},
    )
    assert node_decisions("fedrema", clients, rema) == {"a": "CCP ended; matched b,c"}
    # FIL comes every `evaluate_every` rounds: the latest one counts.
    influence = rounds_of({"fil": {"a": 0.02, "b": -0.01, "c": 0.005}}, {"weights": {}})
    assert node_decisions("fedinfluence", clients, influence) == {
        "a": "most influential, FIL +0.02",
        "b": "FIL -0.01",
        "c": "FIL +0.005",
    }
    central = rounds_of(
        {"phase": "warmup"}, {"phase": "clustered", "groups": {"a": ["a", "c"], "c": ["a", "c"]}}
    )
    assert node_decisions("pfedlia_central", clients, central) == {
        "a": "group a,c",
        "b": "no group (clustered)",
        "c": "group a,c",
    }


def test_the_shortest_default_runs_the_check_allows():
    # pfedlia_central needs its lazy round and its clustering round; the others one round.
    assert {rule: fewest_rounds(rule) for rule in RULES} == {
        "pfedlia": 1,
        "pfedlia_central": 2,
        "pfedsv": 1,
        "fedc2i": 1,
        "fedrema": 1,
        "fedinfluence": 1,
    }


def fewest_rounds(rule: str) -> int:
    """The shortest run the config check allows for `rule` at its defaults."""
    for rounds in range(1, 100):
        try:
            explicit_params(AlgorithmConfig(rule), rounds)
        except ConfigError:
            continue
        return rounds
    raise AssertionError(f"no run of under 100 rounds passes the check for {rule}")
