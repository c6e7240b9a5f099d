"""The mesh configuration: loading, overrides, validation messages, round trips."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

import meshfl.algorithms
from meshfl.node.config import (
    AlgorithmConfig,
    ConfigError,
    DataConfig,
    DataOverride,
    MeshConfig,
    PeerConfig,
    apply_overrides,
    config_from_text,
    config_schema,
    data_for,
    load_config,
    local_peers,
    peer_by_name,
    save_config,
    to_dict,
    validate,
)
from meshfl.node.mesh_identity import shared_settings
from tests.spawn import run_to_end

EXAMPLE = Path(__file__).resolve().parents[2] / "peers.yaml"
EXPERIMENTS = sorted((EXAMPLE.parent / "launch" / "experiments").glob("*.yaml"))
KEY_A = "0123456789abcdef" * 4
KEY_B = "fedcba9876543210" * 4


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mesh.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def config_error(action) -> str:
    """The message of the ConfigError `action` raises, checked to be one line."""
    with pytest.raises(ConfigError) as caught:
        action()
    message = str(caught.value)
    assert "\n" not in message
    return message


def overridden(*assignments: str) -> MeshConfig:
    """The defaults with `assignments` applied, validated."""
    cfg = apply_overrides(MeshConfig(), list(assignments))
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------- defaults


def test_defaults_are_the_embedded_four_node_demo():
    cfg = MeshConfig()
    validate(cfg)
    assert load_config(None) == cfg
    assert (cfg.data.dataset, cfg.algorithm.name, cfg.model.name) == ("digits", "fedavg", "mlp")
    assert [peer.name for peer in cfg.peers] == ["node0", "node1", "node2", "node3"]


def test_example_peers_yaml_loads_and_validates():
    cfg = load_config(EXAMPLE)
    validate(cfg)
    assert cfg.mesh == "demo"
    assert (cfg.data.dataset, cfg.algorithm.name, cfg.model.name) == ("digits", "fedavg", "mlp")
    assert [(peer.name, peer.listen) for peer in cfg.peers] == [
        (f"node{index}", f"tcp://127.0.0.1:{7700 + index}") for index in range(4)
    ]


def test_empty_file_and_partial_sections_keep_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == MeshConfig()
    cfg = load_config(write(tmp_path, "data:\n  partition: dirichlet:0.5\nlr: 1e-3\n"))
    assert cfg.data == DataConfig(partition="dirichlet:0.5")
    assert cfg.lr == 0.001  # YAML 1.1 reads `1e-3` as a string; a number is meant
    assert cfg.peers == MeshConfig().peers


def test_algorithm_parameters_sit_beside_its_name(tmp_path):
    cfg = load_config(write(tmp_path, "algorithm:\n  name: fedc2i\n  gamma: 5\n"))
    assert cfg.algorithm == AlgorithmConfig(name="fedc2i", params={"gamma": 5})
    assert load_config(write(tmp_path, "algorithm: local\n")).algorithm == AlgorithmConfig("local")


# --------------------------------------------------------------------------- overrides


def test_overrides_set_params_nested_fields_and_floats_without_mutating():
    original = MeshConfig()
    before = to_dict(original)
    cfg = apply_overrides(
        original, ["algorithm.gamma=2", "data.partition=dirichlet:0.5", "lr=0.1", "rounds=3"]
    )
    assert cfg.algorithm.params == {"gamma": 2}
    assert cfg.data.partition == "dirichlet:0.5"
    assert cfg.lr == 0.1 and isinstance(cfg.lr, float)
    assert cfg.rounds == 3
    assert to_dict(original) == before
    assert original.algorithm.params == {}


def test_changing_the_algorithm_drops_the_old_parameters():
    cfg = apply_overrides(MeshConfig(), ["algorithm=fedc2i", "algorithm.gamma=2"])
    assert cfg.algorithm == AlgorithmConfig(name="fedc2i", params={"gamma": 2})
    assert apply_overrides(cfg, ["algorithm.name=fedavg"]).algorithm == AlgorithmConfig()
    # Naming the algorithm it already is keeps its parameters.
    assert apply_overrides(cfg, ["algorithm=fedc2i"]).algorithm == cfg.algorithm


def test_overrides_address_peers_by_index_or_name():
    cfg = apply_overrides(
        MeshConfig(),
        ["peers.0.listen=tcp://10.0.0.5:7700", "peers.node2.data.dataset=npz:/data/shard.npz"],
    )
    assert cfg.peers[0].listen == "tcp://10.0.0.5:7700"
    assert cfg.peers[2].data == DataOverride(dataset="npz:/data/shard.npz")
    assert MeshConfig().peers[2].data is None


def test_an_empty_value_sets_null():
    cfg = apply_overrides(MeshConfig(), ["data.root=/data", "data.samples_per_node=50"])
    assert apply_overrides(cfg, ["data.root="]).data.root is None


# --------------------------------------------------------------------------- mistakes

BAD_OVERRIDES = [
    # (assignments, the field the message names, the bad value it shows)
    (["algorithm=nosuchrule"], "'algorithm.name'", "'nosuchrule'"),
    (["data.partition=dirichlet:x"], "'data.partition'", "dirichlet:x"),
    (["data.dataset=nosuchdata"], "'data.dataset'", "nosuchdata"),
    (["lr=-0.1"], "'lr'", "-0.1"),
    (["lr=.inf"], "'lr'", "inf"),
    (["rounds=0"], "'rounds'", "0"),
    (["rounds=ten"], "'rounds'", "'ten'"),
    (["closed=1"], "'closed'", "1"),
    (["momentum=1.5"], "'momentum'", "1.5"),
    (["round_timeout=0"], "'round_timeout'", "0"),
    (["peer_timeout=0.5"], "'peer_timeout'", "0.5"),
    (["model.name=nosuchnet"], "'model.name'", "'nosuchnet'"),
    (["model.head=middle"], "'model.head'", "'middle'"),
    (["optimizer=nosuchopt"], "'optimizer'", "'nosuchopt'"),
    (["device=gpu"], "'device'", "'gpu'"),
    (["device=cuda:x"], "'device'", "'cuda:x'"),
    (["precision=fp8"], "'precision'", "'fp8'"),
    (["mesh=my mesh"], "'mesh'", "'my mesh'"),
    (["peers.0.listen=127.0.0.1:7700"], "'peers.0.listen'", "'127.0.0.1:7700'"),
    (["peers.0.listen=tcp://127.0.0.1:70000"], "'peers.0.listen'", "70000"),
    (["peers.0.listen=tcp://bad_host:7700"], "'peers.0.listen'", "bad_host"),
    (["peers.1.listen=tcp://127.0.0.1:7700"], "'peers.1.listen'", "7700"),
    (["peers.1.name=node0"], "'peers.1.name'", "'node0'"),
    (["peers.0.name=../escape"], "'peers.0.name'", "'../escape'"),
    (["data.split=[0.5, 0.2, 0.2]"], "'data.split'", "[0.5, 0.2, 0.2]"),
    (["data.split=[0.8, 0.2, 0.0]"], "'data.split'", "0.0"),
    (["data.split=[0.5, 0.5]"], "'data.split'", "[0.5, 0.5]"),
    # The data module's own bounds, checked once: three samples at least (train, val, test).
    (["data.samples_per_node=2"], "'data.samples_per_node'", "2"),
    (["data.samples_per_node=true"], "'data.samples_per_node'", "True"),
    (["peers.1.data.samples_per_node=1"], "'peers.1.data.samples_per_node'", "1"),
    (["peers.0.public_key=" + "zz" * 32], "'peers.0.public_key'", "zz"),
    (["peers.0.public_key=abc123"], "'peers.0.public_key'", "'abc123'"),
    ([f"peers.0.public_key={KEY_A}", f"peers.1.public_key={KEY_A}"], "'peers.1.public_key'", KEY_A),
    (["closed=true"], "'peers.0.public_key'", "None"),
    (["peers=[]", "closed=true"], "'closed'", "True"),
    (["peers.1.data.partition=dirichlet:x"], "'peers.1.data.partition'", "dirichlet:x"),
    (["nosuchkey=1"], "'nosuchkey'", "allowed: mesh, algorithm"),
    (["data.nosuchkey=1"], "'data.nosuchkey'", "allowed: dataset, root"),
    (["nosuch.deeper=1"], "'nosuch.deeper'", "unknown"),
    (["lr.deeper=1"], "'lr.deeper'", "unknown"),
    (["peers.9.listen=tcp://127.0.0.1:1"], "'peers.9'", "node3"),
]


@pytest.mark.parametrize("assignments, field_name, value_text", BAD_OVERRIDES)
def test_each_mistake_names_the_field_and_the_value(assignments, field_name, value_text):
    message = config_error(lambda: overridden(*assignments))
    assert f"config field {field_name}" in message
    assert value_text in message
    assert "allowed" in message or "unknown" in message


def test_a_bad_algorithm_parameter_names_it():
    message = config_error(lambda: overridden("algorithm.no_such_param=3"))
    assert "'algorithm.no_such_param'" in message


@pytest.mark.parametrize(
    "rule, allowed",
    [
        ("fedc2i", "gamma, body, head, screen, trials; did you mean gamma?"),
        ("fedavg", "screen, trials"),
    ],
)
def test_a_misspelled_algorithm_key_lists_screenings_keys_too(rule, allowed):
    cfg = apply_overrides(MeshConfig(), [f"algorithm={rule}"])
    message = config_error(lambda: validate(apply_overrides(cfg, ["algorithm.gama=2"])))
    assert message.endswith(f"unknown key; allowed: {allowed}")


def test_an_override_without_equals_sign_is_refused():
    assert "'lr'" in config_error(lambda: apply_overrides(MeshConfig(), ["lr"]))


def test_an_unknown_top_level_key_in_the_file_lists_the_allowed_ones(tmp_path):
    message = config_error(lambda: load_config(write(tmp_path, "colsed: true\n")))
    assert "'colsed'" in message and "closed" in message and "peer_timeout" in message
    assert message.endswith("; did you mean closed?")


def test_a_mistake_in_a_file_names_the_file_and_its_line(tmp_path):
    path = write(tmp_path, "lr: 0.1\npeers:\n  - name: a\n    listen: nowhere\n")
    message = config_error(lambda: load_config(path))
    assert message.startswith(f"config file '{path}', line 4: config field 'peers.0.listen'")


def test_a_misspelled_rule_name_is_answered_with_the_nearest():
    message = config_error(lambda: overridden("algorithm=fedavgg"))
    assert "'algorithm.name'" in message and message.endswith("; did you mean fedavg?")
    assert "did you mean" not in config_error(lambda: overridden("algorithm=zzz"))


def test_an_unknown_peer_key_is_named_with_its_peer(tmp_path):
    text = "peers:\n  - name: a\n    listen: tcp://127.0.0.1:7700\n    adress: x\n"
    assert "'peers.0.adress'" in config_error(lambda: load_config(write(tmp_path, text)))
    missing = "peers:\n  - name: a\n"
    assert "'peers.0.listen'" in config_error(lambda: load_config(write(tmp_path, missing)))


def test_a_yaml_syntax_error_gives_the_file_and_line(tmp_path):
    path = write(tmp_path, "mesh: demo\npeers: [\n  - name: a\n")
    message = config_error(lambda: load_config(path))
    assert str(path) in message and "line" in message


def test_a_duplicate_key_is_refused_not_overwritten(tmp_path):
    message = config_error(lambda: load_config(write(tmp_path, "lr: 0.1\nrounds: 2\nlr: 0.2\n")))
    assert "duplicate key 'lr'" in message and "line 3" in message


def test_a_missing_file_or_a_list_is_one_line(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert str(missing) in config_error(lambda: load_config(missing))
    assert "mapping" in config_error(lambda: load_config(write(tmp_path, "- a\n- b\n")))


def test_configs_built_in_code_are_type_checked():
    message = config_error(lambda: validate(MeshConfig(rounds="3")))  # type: ignore[arg-type]
    assert "'rounds'" in message and "'3'" in message
    bad_peer = PeerConfig(name="a", listen=7700)  # type: ignore[arg-type]
    assert "'peers.0.listen'" in config_error(lambda: validate(MeshConfig(peers=[bad_peer])))


# --------------------------------------------------------------------------- round trip


def rich_config() -> MeshConfig:
    """A config using every kind of field: params, a peer data override, keys, IPv6."""
    cfg = apply_overrides(
        MeshConfig(),
        [
            "mesh=lab",
            "algorithm.gamma=5",
            "algorithm.ratios=[0.5, 1.5]",
            "data.samples_per_node=120",
            "data.root=/data",
            "lr=1e-05",
            "closed=true",
            f"peers.0.public_key={KEY_A}",
            f"peers.1.public_key={KEY_B}",
            "peers.1.key=/keys/b.pem",
            "peers.1.listen=tcp://[::1]:7800",
            "peers.1.data={dataset: 'npz:/data/b.npz', split: [0.5, 0.25, 0.25]}",
        ],
    )
    return dataclasses.replace(cfg, peers=cfg.peers[:2])


def test_save_then_load_gives_an_equal_config(tmp_path):
    cfg = rich_config()
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_to_dict_is_plain_yaml_and_loads_back(tmp_path):
    cfg = rich_config()
    text = yaml.safe_dump(to_dict(cfg))  # plain types only, or safe_dump would refuse
    assert load_config(write(tmp_path, text)) == cfg
    assert to_dict(cfg)["algorithm"] == {"name": "fedavg", "gamma": 5, "ratios": [0.5, 1.5]}


# --------------------------------------------------------------------------- using a config


def test_a_peer_data_override_merges_over_the_mesh_wide_data():
    cfg = rich_config()
    assert data_for(cfg, cfg.peers[0]) == cfg.data
    own = data_for(cfg, cfg.peers[1])
    assert (own.dataset, own.split) == ("npz:/data/b.npz", (0.5, 0.25, 0.25))
    assert (own.root, own.samples_per_node) == ("/data", 120)
    # A mesh-wide change still reaches the fields the peer did not set.
    moved = apply_overrides(cfg, ["data.partition=dirichlet:0.1"])
    assert data_for(moved, moved.peers[1]).partition == "dirichlet:0.1"


def test_peer_by_name_lists_the_known_names():
    cfg = MeshConfig()
    assert peer_by_name(cfg, "node2").listen == "tcp://127.0.0.1:7702"
    message = config_error(lambda: peer_by_name(cfg, "node9"))
    assert "'node9'" in message and "node0, node1, node2, node3" in message


def test_local_peers_use_consecutive_ports():
    assert [peer.listen for peer in local_peers(2, base_port=9000)] == [
        "tcp://127.0.0.1:9000",
        "tcp://127.0.0.1:9001",
    ]
    assert local_peers(1, host="::1")[0].listen == "tcp://[::1]:7700"
    validate(MeshConfig(peers=local_peers(1, host="::1")))
    assert "0" in config_error(lambda: local_peers(0))
    assert "65535" in config_error(lambda: local_peers(2, base_port=65535))


@dataclasses.dataclass(frozen=True)
class _GammaParams:
    gamma: float = 5.0


def _parse_gamma(name: str, params: dict, rounds: int | None = None) -> _GammaParams:
    return _GammaParams(**{key: float(value) for key, value in params.items()})


def test_shared_settings_hold_what_peers_must_agree_on(monkeypatch):
    monkeypatch.setattr(meshfl.algorithms, "parse_params", _parse_gamma)
    cfg = apply_overrides(MeshConfig(), ["algorithm=rule"])
    assert shared_settings(cfg) == {
        "mesh": "demo",
        "algorithm": {"name": "rule", "params": {"gamma": 5.0}},
        "model": {"name": "mlp", "head": "last"},
    }
    # Spelling out a default does not split a mesh.
    assert shared_settings(apply_overrides(cfg, ["algorithm.gamma=5"])) == shared_settings(cfg)
    local_choices = ["rounds=3", "lr=0.5", "data.partition=dirichlet:1", "peers=[]", "seed=4"]
    assert shared_settings(apply_overrides(cfg, local_choices)) == shared_settings(cfg)
    for changed in ("mesh=other", "algorithm.gamma=2", "model.head=fc"):
        assert shared_settings(apply_overrides(cfg, [changed])) != shared_settings(cfg)


def test_a_rules_parameter_spelled_as_an_integer_or_left_out_joins_the_same_mesh():
    """A float parameter given as an integer (`gamma: 5`) is the float its rule declares,
    and equal to its default: nodes that spell it so share one mesh id."""
    default = apply_overrides(MeshConfig(), ["algorithm=fedc2i"])
    for spelled in ("algorithm.gamma=5", "algorithm.gamma=5.0"):
        settings = shared_settings(apply_overrides(default, [spelled]))
        assert settings == shared_settings(default)
        # The id hashes the value's encoding, in which 5 and 5.0 differ.
        assert type(settings["algorithm"]["params"]["gamma"]) is float
    other = shared_settings(apply_overrides(default, ["algorithm.gamma=2"]))
    assert other != shared_settings(default) and other["algorithm"]["params"]["gamma"] == 2.0


def test_screening_is_shared_and_its_trials_are_each_nodes_own():
    cfg = MeshConfig()  # FedAvg, screened
    assert shared_settings(cfg)["algorithm"]["params"] == {"screen": True}
    assert shared_settings(apply_overrides(cfg, ["algorithm.trials=true"])) == shared_settings(cfg)
    assert shared_settings(apply_overrides(cfg, ["algorithm.screen=false"])) != shared_settings(cfg)


def test_shared_settings_reject_bad_algorithm_parameters():
    cfg = apply_overrides(MeshConfig(), ["algorithm.no_such_param=1"])
    assert "'algorithm.no_such_param'" in config_error(lambda: shared_settings(cfg))


# --------------------------------------------------------------------------- the JSON Schema


def shipped_configs() -> dict[str, object]:
    """The repository's peers.yaml and the `config` section of every experiment, as YAML
    data, by file name."""
    documents = {EXAMPLE.name: yaml.safe_load(EXAMPLE.read_text())}
    for path in EXPERIMENTS:
        documents[path.name] = yaml.safe_load(path.read_text())["config"]
    return documents


BAD_DOCUMENTS = [
    {"rounds": 0},
    {"lr": 0},
    {"closed": 1},
    {"colsed": True},
    {"model": {"name": "mlp", "depth": 3}},
    {"data": {"samples_per_node": "ten"}},
    {"peers": [{"name": "a b", "listen": "tcp://127.0.0.1:7700"}]},
    {"peers": [{"name": "a", "listen": "127.0.0.1:7700"}]},
    {"peers": [{"name": "a"}]},
]


def test_the_schema_describes_every_field_and_the_configs_shipped_load():
    schema = json.loads(json.dumps(config_schema()))  # plain JSON all through
    assert list(schema["properties"]) == [f.name for f in dataclasses.fields(MeshConfig)]
    assert schema["additionalProperties"] is False
    assert len(EXPERIMENTS) > 5
    for name, document in shipped_configs().items():
        config_from_text(yaml.safe_dump(document), name)


def test_the_schema_accepts_the_configs_shipped_and_refuses_what_loading_refuses():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(config_schema())
    validator.check_schema(validator.schema)
    for name, document in shipped_configs().items():
        assert not list(validator.iter_errors(document)), name
    for document in BAD_DOCUMENTS:
        assert list(validator.iter_errors(document)), document
        config_error(lambda document=document: config_from_text(yaml.safe_dump(document), "f"))


def test_the_schema_checks_each_rules_parameters_as_the_config_does():
    """Under `algorithm`, the schema holds each rule's declared parameters: it refuses
    what the config's check refuses and accepts what it accepts."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(config_schema())

    def document(algorithm: dict) -> dict:
        return {"algorithm": algorithm, "coordinator": "tcp://127.0.0.1:7999"}

    def loaded(algorithm: dict) -> MeshConfig:
        return config_from_text(yaml.safe_dump(document(algorithm)), "f")

    for algorithm in (
        {"name": "pfedsv", "alpha": 2},  # out of its bounds
        {"name": "fedc2i", "k": 3},  # another rule's parameter
        {"name": "fedrema", "screen": True},  # a coordinated rule is not screened
        {"gamma": 2.0},  # the default rule, FedAvg, has no parameters of its own
    ):
        assert not validator.is_valid(document(algorithm)), algorithm
        assert "'algorithm." in config_error(lambda a=algorithm: validate(loaded(a)))
    for algorithm in (
        {"name": "pfedsv", "k": 3, "trials": False},
        {"name": "fedc2i", "gamma": 2},
        {"screen": False},
    ):
        assert validator.is_valid(document(algorithm)), algorithm
        validate(loaded(algorithm))


def test_meshfl_config_schema_prints_the_schema_as_json(tmp_path):
    printed = run_to_end(["config", "schema"], timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout) == config_schema()
    out = tmp_path / "peers.schema.json"
    written = run_to_end(["config", "schema", "--out", str(out)], timeout=120)
    assert written.returncode == 0, written.stderr
    assert json.loads(out.read_text()) == config_schema()


def test_a_mesh_past_32_nodes_keeps_8_neighbours_unless_told_otherwise():
    topology = MeshConfig().topology
    assert topology.views(32) is None, "a full mesh up to 32 nodes"
    views = topology.views(33)
    assert views is not None and (views.neighbours, views.most) == (8, 10)
    assert topology.connections(1000) == views.connections() < 999
    assert topology.connections(10) == 9
    all_of_them = apply_overrides(MeshConfig(), ["topology.neighbours=all"]).topology
    assert all_of_them.views(1000) is None and all_of_them.connections(1000) == 999
    five = apply_overrides(MeshConfig(), ["topology.neighbours=5"]).topology
    assert five.views(4) is not None and five.views(4).neighbours == 5


@pytest.mark.parametrize(
    "text, error",
    [
        ("topology: {neighbours: 0}", "topology.neighbours': got 0; allowed: an integer >= 1"),
        ("topology: {neighbours: many}", "got 'many'; allowed: an integer >= 1, 'all'"),
        ("topology: {neighbours: true}", "got True; allowed"),
        ("topology: {select: best}", "topology.select': got 'best'; allowed: benefit or random"),
    ],
)
def test_a_bad_topology_names_the_field_and_what_is_allowed(text, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        config_from_text(text, "x")
