"""The attack harness: each kind's tampering on known tensors, and its config checks."""

from __future__ import annotations

import pytest
import torch

from meshfl.algorithms import PeerModel
from meshfl.node import config as cfgmod
from meshfl.node.attacks import Attack, attack_for, flip_labels, noise_like, parse_kind
from meshfl.node.mesh_identity import shared_settings


def state(*values):
    return {"w": torch.tensor(values, dtype=torch.float32), "steps": torch.tensor(7)}


class Model(torch.nn.Module):
    def __init__(self, values):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))


def attacked(kind, node="a", nodes=("a",), seed=0, initial=None):
    return attack_for(node, list(nodes), kind, seed, initial or (lambda: state(1.0, -1.0)))


def tampered(attack, start, trained, round_no=2, n=100):
    attack.start_round(Model(start))
    published, claimed = attack.tamper(round_no, {"model": {"w": torch.tensor(trained)}}, n)
    return published["model"]["w"].tolist(), claimed


def test_an_honest_node_publishes_what_it_trained_and_claims_its_count():
    honest = attacked("noise", node="h")
    assert not honest.active and honest.trains
    assert tampered(honest, [0.0, 0.0], [1.0, 2.0]) == ([1.0, 2.0], 100)
    assert honest.training_labels(torch.tensor([0, 9]), 10).tolist() == [0, 9]


def test_labelflip_trains_on_the_mirrored_labels_and_publishes_that_model():
    attack = attacked("labelflip")
    assert flip_labels(torch.tensor([0, 3, 9]), 10).tolist() == [9, 6, 0]
    assert attack.training_labels(torch.tensor([0, 3, 9]), 10).tolist() == [9, 6, 0]
    assert tampered(attack, [0.0, 0.0], [1.0, 2.0]) == ([1.0, 2.0], 100)


def test_scale_and_signflip_publish_the_update_times_s_and_negated():
    assert tampered(attacked("scale:10"), [1.0, 1.0], [1.5, 0.0])[0] == [6.0, -9.0]
    assert tampered(attacked("signflip"), [1.0, 1.0], [1.5, 0.0])[0] == [0.5, 2.0]


def test_noise_has_the_models_scale_and_carries_nothing_learned():
    published, _ = tampered(attacked("noise"), [0.0] * 4000, [3.0] * 4000)
    values = torch.tensor(published)
    assert values.pow(2).mean().sqrt().item() == pytest.approx(3.0, rel=0.05)
    assert abs(values.mean().item()) < 0.3, "zero-mean: the trained values are gone"
    generator = torch.Generator().manual_seed(0)
    assert noise_like(state(1.0, 2.0), generator)["steps"].item() == 7, "counters kept"


def test_inflate_n_claims_its_count_with_an_honest_model():
    assert tampered(attacked("inflate_n:1000000"), [0.0, 0.0], [1.0, 2.0]) == ([1.0, 2.0], 1000000)


def test_replay_republishes_an_honest_peers_model_of_the_round_before():
    attack = attacked("replay", nodes=("a", "b"))
    assert tampered(attack, [5.0, 5.0], [1.0, 2.0], round_no=1)[0] == [5.0, 5.0], (
        "round 1: nothing to replay, the untrained model"
    )
    attack.observe(
        {
            "model": {
                "b": PeerModel(state(8.0, 8.0), 10),
                "h2": PeerModel(state(3.0, 4.0), 10),
                "h1": PeerModel(state(1.0, 9.0), 10),
            }
        }
    )
    assert tampered(attack, [5.0, 5.0], [1.0, 2.0])[0] == [1.0, 9.0], (
        "the first honest peer by name; never a fellow attacker"
    )


def test_freeride_never_trains_and_publishes_its_model_as_it_is():
    attack = attacked("freeride")
    assert attack.active and not attack.trains
    assert tampered(attack, [4.0, 4.0], [4.0, 4.0]) == ([4.0, 4.0], 100)


def test_relay_publishes_a_received_honest_model_with_a_little_noise_and_never_trains():
    attack = attacked("relay:0.001", nodes=("a", "b"))
    assert attack.active and not attack.trains
    assert tampered(attack, [5.0, 5.0], [5.0, 5.0], round_no=1)[0] == [5.0, 5.0], (
        "round 1: nothing to relay, the untrained model"
    )
    honest = {"h1": [100.0] * 500, "h2": [-100.0] * 500}
    attack.observe(
        {
            "model": {
                "b": PeerModel(state(*[1e6] * 500), 10),
                **{name: PeerModel(state(*values), 10) for name, values in honest.items()},
            }
        }
    )
    sources = set()
    for round_no in range(2, 12):
        relayed = torch.tensor(tampered(attack, [0.0] * 500, [0.0] * 500, round_no)[0])
        source = "h1" if relayed.mean() > 0 else "h2"
        sources.add(source)
        copy = torch.tensor(honest[source])
        assert not torch.equal(relayed, copy), "not a bit-for-bit copy"
        assert (relayed - copy).pow(2).mean().sqrt().item() == pytest.approx(0.1, rel=0.2), (
            "noise of 0.001 times the tensor's scale"
        )
    assert sources == {"h1", "h2"}, "the source is drawn afresh each round, never an attacker"


def test_colluders_publish_one_identical_model_and_the_others_their_own_noise():
    nodes = ("a", "b", "c")
    models = [
        tampered(attacked("collude:2", node=name, nodes=nodes), [0.0, 0.0], [float(i), 1.0])[0]
        for i, name in enumerate(nodes)
    ]
    assert models[0] == models[1], "the first k attackers agree bit for bit"
    assert models[2] != models[0]
    assert (
        tampered(attacked("collude:2", node="a", nodes=nodes), [0.0, 0.0], [1.0, 1.0], round_no=3)[
            0
        ]
        != models[0]
    ), "a fresh poison every round"


def test_only_the_whole_model_is_tampered_with():
    attack = attacked("scale:10")
    attack.start_round(Model([0.0]))
    published, _ = attack.tamper(1, {"lazy": {"w": torch.tensor([1.0])}}, 5)
    assert published["lazy"]["w"].tolist() == [1.0]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("bogus", "allowed: labelflip"),
        ("scale", "scale:<float>"),
        ("scale:x", "scale:<float>"),
        ("noise:3", "takes no value"),
        ("inflate_n:0", "1 to 2**53"),
        ("collude:1", "k >= 2"),
        ("scale:inf", "finite"),
        ("relay", "relay:<float>"),
        ("relay:-1", "finite number >= 0"),
    ],
)
def test_a_bad_kind_says_what_is_allowed(text, problem):
    with pytest.raises(ValueError, match=problem.replace("*", r"\*")):
        parse_kind(text)


def validated(*assignments):
    cfg = cfgmod.apply_overrides(cfgmod.MeshConfig(), list(assignments))
    cfgmod.validate(cfg)
    return cfg


def test_the_command_line_makes_nodes_attackers_without_changing_the_honest_mesh_id():
    plain = validated()
    attacked_cfg = validated("attack.nodes=[node3]", "attack.kind=labelflip")
    assert attacked_cfg.attack == cfgmod.AttackConfig(["node3"], "labelflip")
    assert shared_settings(attacked_cfg) == shared_settings(plain)


@pytest.mark.parametrize(
    ("assignments", "field"),
    [
        (["attack.nodes=[node9]", "attack.kind=noise"], "attack.nodes.0"),
        (["attack.nodes=[node1, node1]", "attack.kind=noise"], "attack.nodes.1"),
        (["attack.kind=noise"], "attack.nodes"),
        (["attack.nodes=[node1]"], "attack.kind"),
        (["attack.nodes=[node1]", "attack.kind=bogus"], "attack.kind"),
        (["attack.nodes=[node1]", "attack.kind=collude:3"], "attack.kind"),
        (["attack.nodes=node1", "attack.kind=noise"], "attack.nodes"),
        (
            [
                "attack.nodes=[node1]",
                "attack.kind=noise",
                "algorithm=fedavg_server",
                "coordinator=tcp://127.0.0.1:7799",
            ],
            "attack.nodes",
        ),
    ],
)
def test_a_bad_attack_section_names_its_field(assignments, field):
    with pytest.raises(cfgmod.ConfigError, match=f"config field '{field}'"):
        validated(*assignments)


def test_an_attack_object_is_honest_by_default():
    assert not Attack().active
