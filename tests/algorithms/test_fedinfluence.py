"""Fed-Influence: the batched recursion against explicit matrix products, the
combinatorial term, LWET's one-way flags, the client's gradient sets, the schedule
(leave-one-out, cleansing), malformed uploads and checkpoints, all on tiny models."""

from __future__ import annotations

import pytest
import torch

from meshfl.algorithms import Context, Upload, parse_params
from meshfl.algorithms.base import weighted_average
from meshfl.algorithms.fedinfluence import (
    FedInfluence,
    RoundInputs,
    clients_to_cleanse,
    combinatorial_terms,
    mixing_weights,
    per_sample_gradients,
    pick_clients,
    propagate,
    update_client_flags,
    update_tensor_flag,
)
from meshfl.node.models import body_keys, build_model, head_keys
from meshfl.node.splits import NodeData
from tests.algorithms.config_lines import params_error

FEATURES, CLASSES = 3, 2
CLIENTS = ["a", "b", "c", "d"]
SAMPLES = {"a": 5, "b": 9, "c": 4, "d": 7}


def new_model() -> torch.nn.Module:
    return build_model("logreg", (FEATURES,), CLASSES, seed=0)  # p = 2x3 weight + 2 bias


def tiny_data(seed: int = 0, count: int = 12) -> NodeData:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (count,), generator=generator)
    return NodeData(x, y, x[:2], y[:2], x[:4], y[:4], CLASSES, (FEATURES,), {})


def make_rule(node: str = "coordinator", data: NodeData | None = None, **params) -> FedInfluence:
    model = new_model()
    context = Context(
        node,
        seed=3,
        num_classes=CLASSES,
        body_keys=tuple(body_keys(model)),
        head_keys=tuple(head_keys(model)),
        batch_size=4,
        new_model=new_model,
        data=data,
    )
    defaults = {"lr": 0.1, "local_steps": 2, "samples_per_step": 3, "clients_per_round": 3}
    return FedInfluence(parse_params("fedinfluence", {**defaults, **params}), context)


def random_upload(rule: FedInfluence, name: str, seed: int, scale: float = 1.0) -> Upload:
    """A trained-looking model and gradient sets of the right shapes."""
    generator = torch.Generator().manual_seed(seed)
    state = {
        k: v + 0.3 * torch.randn(v.shape, generator=generator)
        for k, v in new_model().state_dict().items()
    }
    extras = {
        key: scale
        * torch.randn(
            rule.params.local_steps,
            rule.params.samples_per_step,
            value.numel(),
            generator=generator,
        )
        for key, value in state.items()
    }
    return Upload(state, SAMPLES[name], extras)


def explicit_step_product(gradient_sets: torch.Tensor, lr: float) -> torch.Tensor:
    """Π_i (I − η H̃_i), H̃_i = GᵢᵀGᵢ / s, the first step applied first."""
    p = gradient_sets.shape[2]
    product = torch.eye(p, dtype=torch.float64)
    for gradients in gradient_sets:
        hessian = gradients.T @ gradients / gradients.shape[0]
        product = (torch.eye(p, dtype=torch.float64) - lr * hessian) @ product
    return product


# --------------------------------------------------------------------------- the recursion


def test_batched_recursion_equals_the_explicit_product_of_step_matrices():
    generator = torch.Generator().manual_seed(0)
    gradient_sets = torch.randn(4, 6, 5, generator=generator, dtype=torch.float64)
    fip = torch.randn(7, 5, generator=generator, dtype=torch.float64)  # 7 clients at once
    expected = fip @ explicit_step_product(gradient_sets, 0.05).T
    assert torch.allclose(propagate(fip, gradient_sets, 0.05), expected, atol=1e-12)


def test_a_round_of_the_rule_equals_explicit_matrices_built_from_the_same_gradients():
    """Two rounds, so the second starts from a non-zero ε: for every client c,
    ε_t = Σ_{k∈C_t∖c} n_k/N(C_t∖c) Π(I − ηH̃_k) ε_{t−1} + w_t(C_t∖c) − w_t, per tensor."""
    rule = make_rule(lwet="off")
    rule.clients_for_round(1, CLIENTS)
    rule.aggregate_uploads(1, {n: random_upload(rule, n, i) for i, n in enumerate("abc")})
    previous = {c: rule.fip_of(c) for c in CLIENTS}
    uploads = {n: random_upload(rule, n, 10 + i) for i, n in enumerate("bcd")}
    rule.aggregate_uploads(2, uploads)
    new_global = rule.global_state
    for c in CLIENTS:
        others = [k for k in uploads if k != c]
        total = sum(SAMPLES[k] for k in others)
        without_c = weighted_average(
            {k: uploads[k].state for k in others}, {k: SAMPLES[k] / total for k in others}
        )
        for key, eps in previous[c].items():
            flat = eps.reshape(-1)
            sequential = sum(
                SAMPLES[k]
                / total
                * explicit_step_product(uploads[k].extras[key].double(), rule.params.lr)
                @ flat
                for k in others
            )
            combinatorial = (
                (without_c[key] - new_global[key]).double().reshape(-1)
                if c in uploads
                else torch.zeros_like(flat)
            )
            got = rule.fip_of(c)[key].reshape(-1)
            assert torch.allclose(got, sequential + combinatorial, atol=1e-6), (c, key)


def test_combinatorial_term_is_zero_for_non_participants_and_the_leave_out_average_else():
    rule = make_rule()
    uploads = {n: random_upload(rule, n, i) for i, n in enumerate("abc")}
    rule.clients_for_round(1, CLIENTS)
    rule.aggregate_uploads(1, uploads)  # ε_0 = 0, so ε_1 = κ
    assert all(float(v.abs().max()) == 0.0 for v in rule.fip_of("d").values())
    for c in "abc":
        others = [k for k in "abc" if k != c]
        total = sum(SAMPLES[k] for k in others)
        without_c = weighted_average(
            {k: uploads[k].state for k in others}, {k: SAMPLES[k] / total for k in others}
        )
        for key, value in rule.fip_of(c).items():
            expected = (without_c[key] - rule.global_state[key]).double()
            assert torch.allclose(value, expected, atol=1e-6)


def test_mixing_weights_leave_each_client_out_of_its_own_row():
    mix = mixing_weights([2, 3, 5], rows=[0, 2, 3], num_clients=4)
    assert torch.allclose(mix[1], torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64))
    assert torch.allclose(mix[0], torch.tensor([0.0, 3 / 8, 5 / 8], dtype=torch.float64))
    assert torch.allclose(mix[3], torch.tensor([0.4, 0.6, 0.0], dtype=torch.float64))
    alone = combinatorial_terms(
        torch.ones(1, 2, dtype=torch.float64),
        [4],
        torch.ones(2, dtype=torch.float64),
        torch.zeros(2, dtype=torch.float64),
    )
    assert alone.tolist() == [[-1.0, -1.0]], "sole uploader: the round would not have moved w"


# --------------------------------------------------------------------------- LWET


def lwet_inputs(
    scale: float, seed: int = 0, clients: int = 5, uploaders: int = 3, p: int = 4
) -> RoundInputs:
    generator = torch.Generator().manual_seed(seed)
    grads = [
        scale * torch.randn(2, 6, p, generator=generator, dtype=torch.float64)
        for _ in range(uploaders)
    ]
    rows = list(range(uploaders))
    return RoundInputs(
        fip=torch.randn(clients, p, generator=generator, dtype=torch.float64),
        gradients=grads,
        mix=mixing_weights([3, 4, 5][:uploaders], rows, clients),
        kappa=torch.randn(clients, p, generator=generator, dtype=torch.float64),
        lr=0.05,
    )


@pytest.mark.parametrize("scale", [0.1, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0])
def test_tensor_flag_drops_exactly_when_some_sigma_outgrows_the_previous_fip(scale):
    inputs = lwet_inputs(scale, seed=int(scale * 10))
    sigma = sum(
        inputs.mix[:, k : k + 1] * propagate(inputs.fip, g, inputs.lr)
        for k, g in enumerate(inputs.gradients)
    )
    grows = bool((sigma.norm(dim=1) > inputs.fip.norm(dim=1)).any())
    fip, flag = update_tensor_flag(inputs, True)
    assert flag == (not grows)
    assert torch.allclose(fip, inputs.kappa if grows else sigma + inputs.kappa)


def test_tensor_flag_never_comes_back_up():
    contracting = lwet_inputs(0.1)
    assert update_tensor_flag(contracting, True)[1] is True, "small steps contract"
    fip, flag = update_tensor_flag(contracting, False)
    assert flag is False and torch.equal(fip, contracting.kappa)


def test_rule_drops_a_tensor_flag_for_good_in_the_round_the_test_fails():
    rule = make_rule(lr=0.1)
    rule.clients_for_round(1, CLIENTS)
    history = []
    for round_no, scale in enumerate([0.1, 0.1, 20.0, 0.1, 0.1], start=1):
        uploads = {n: random_upload(rule, n, 7 * round_no + i, scale) for i, n in enumerate("abc")}
        history.append(rule.aggregate_uploads(round_no, uploads)["lwet_flags"])
    assert all(flags == {"head.weight": 1, "head.bias": 1} for flags in history[:2])
    assert history[2]["head.weight"] == 0, "huge curvature: (I - ηH) expands"
    assert all(flags["head.weight"] == 0 for flags in history[3:]), "never back up"


def test_client_flags_leave_out_only_the_uploader_whose_sigma_grows():
    inputs = lwet_inputs(0.1)
    inputs.gradients[1] = inputs.gradients[1] * 200  # uploader 1 expands
    fip, kept = update_client_flags(inputs, [True, True, True])
    assert kept == [True, False, True]
    expected = sum(
        inputs.mix[:, k : k + 1] * propagate(inputs.fip, inputs.gradients[k], inputs.lr)
        for k in (0, 2)
    )
    assert torch.allclose(fip, expected + inputs.kappa)
    again, kept_again = update_client_flags(lwet_inputs(0.1), kept)
    assert kept_again == [True, False, True], "a dropped flag stays down"


# --------------------------------------------------------------------------- client side


def test_client_update_uploads_one_gradient_set_per_step_and_trains_as_plain_sgd():
    data = tiny_data()
    rule = make_rule("a", local_steps=3, samples_per_step=5)
    model = new_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    _, extras = rule.client_update(4, model, data)
    assert set(extras) == {"head.weight", "head.bias"}
    assert extras["head.weight"].shape == (3, 5, FEATURES * CLASSES)
    assert extras["head.weight"].dtype == torch.float32
    # The first gradient set is taken at the starting weights: each row is one sample's
    # gradient, so their mean is the gradient of the mean loss over those samples.
    assert not torch.equal(model.state_dict()["head.weight"], start["head.weight"])
    off = make_rule("a", local_steps=3, samples_per_step=5, estimator=False)
    plain = new_model()
    assert off.client_update(4, plain, data)[1] == {}
    assert torch.equal(plain.state_dict()["head.weight"], model.state_dict()["head.weight"]), (
        "recording gradients draws from its own stream: training is unchanged"
    )


def test_recorded_gradients_are_per_sample_gradients_at_the_step_weights():
    data = tiny_data(count=5)  # samples_per_step >= n: every sample, in a seeded order
    rule = make_rule("a", local_steps=1, samples_per_step=5, lr=0.5)
    model = new_model()
    reference = new_model()
    _, extras = rule.client_update(1, model, data)
    total = torch.zeros(CLASSES, FEATURES)
    for index in range(5):
        reference.zero_grad()
        torch.nn.functional.cross_entropy(
            reference(data.x_train[index : index + 1]), data.y_train[index : index + 1]
        ).backward()
        total += reference.head.weight.grad
    assert torch.allclose(extras["head.weight"][0].sum(dim=0), total.reshape(-1), atol=1e-5)


def test_float16_gradients_travel_as_float16():
    rule = make_rule("a", gradient_dtype="float16")
    _, extras = rule.client_update(1, new_model(), tiny_data())
    assert all(value.dtype == torch.float16 for value in extras.values())


# --------------------------------------------------------------------------- schedule


def test_leave_out_removes_one_client_from_the_same_schedule():
    names = [f"node{i}" for i in range(12)]
    full, loo = make_rule(clients_per_round=4), make_rule(clients_per_round=4, leave_out="node5")
    for round_no in range(1, 30):
        chosen = full.clients_for_round(round_no, names)
        assert len(chosen) == 4
        assert loo.clients_for_round(round_no, names) == [n for n in chosen if n != "node5"]
    assert pick_clients(names, 4, 3, 7) == pick_clients(list(reversed(names)), 4, 3, 7)


def test_cleansing_picks_the_lowest_highest_or_random_share():
    fil = {"a": 0.3, "b": -0.2, "c": 0.1, "d": -0.5, "e": 0.0}
    assert clients_to_cleanse(fil, 0.4, "lowest", 0) == ["b", "d"]
    assert clients_to_cleanse(fil, 0.4, "highest", 0) == ["a", "c"]
    drawn = clients_to_cleanse(fil, 0.4, "random", 0)
    assert len(drawn) == 2 and drawn == clients_to_cleanse(fil, 0.4, "random", 0)


def test_cleansed_clients_are_never_picked_again():
    rule = make_rule(
        data=tiny_data(),
        clients_per_round=0,
        cleanse_at=2,
        cleanse_fraction=0.25,
        cleanse_mode="highest",
    )
    diagnostics = {}
    for round_no in (1, 2):
        chosen = rule.clients_for_round(round_no, CLIENTS)
        uploads = {n: random_upload(rule, n, 3 * round_no + i) for i, n in enumerate(chosen)}
        diagnostics = rule.aggregate_uploads(round_no, uploads)
    top = max(diagnostics["fil"], key=diagnostics["fil"].get)
    assert diagnostics["cleansed"] == [top]
    assert all(top not in rule.clients_for_round(r, CLIENTS) for r in range(3, 10))


def test_fil_and_fia_score_the_shifted_model_on_the_coordinators_data():
    data = tiny_data(seed=5, count=40)
    rule = make_rule(data=data)
    rule.clients_for_round(1, CLIENTS)
    diagnostics = rule.aggregate_uploads(
        1, {n: random_upload(rule, n, i) for i, n in enumerate("abc")}
    )
    assert set(diagnostics["fil"]) == set(CLIENTS) == set(diagnostics["fip_norm"])
    assert diagnostics["fil"]["d"] == 0.0 and diagnostics["fia"]["d"] == 0.0
    model = new_model()
    model.load_state_dict(
        {
            k: (rule.global_state[k].double() + rule.fip_of("a")[k]).float()
            for k in rule.global_state
        }
    )
    x, y = rule.evaluation_set()
    loss = torch.nn.functional.cross_entropy(model(x), y).item()
    assert diagnostics["fil"]["a"] == pytest.approx(loss - diagnostics["test_loss"], abs=1e-5)
    assert set(diagnostics["seconds"]) == {"average", "fip", "evaluate"}


# --------------------------------------------------------------------------- robustness


def test_malformed_gradients_cost_the_sender_its_round_not_the_run():
    rule = make_rule()
    rule.clients_for_round(1, CLIENTS)
    good = {n: random_upload(rule, n, i) for i, n in enumerate("ab")}
    bad = random_upload(rule, "c", 9)
    wrong_shape = Upload(bad.state, 4, {**bad.extras, "head.bias": torch.zeros(2, 3, 7)})
    not_finite = Upload(
        bad.state, 4, {**bad.extras, "head.bias": torch.full((2, 3, 2), float("nan"))}
    )
    missing = Upload(bad.state, 4, {"head.weight": bad.extras["head.weight"]})
    diagnostics = rule.aggregate_uploads(1, {**good, "c": wrong_shape, "d": not_finite})
    assert set(diagnostics["rejected"]) == {"c", "d"}
    assert set(diagnostics["weights"]) == {"a", "b"}
    assert "no gradients" in rule.aggregate_uploads(2, {"c": missing})["rejected"]["c"]


def test_bad_parameters_name_the_field():
    assert "'algorithm.lwet'" in params_error("fedinfluence", {"lwet": "layer"})
    assert "'algorithm.local_steps'" in params_error("fedinfluence", {"local_steps": 0})
    assert "'algorithm.cleanse_fraction'" in params_error("fedinfluence", {"cleanse_fraction": 1.5})


def test_checkpoint_round_trip_continues_identically():
    rule, copy = make_rule(lwet="client"), make_rule(lwet="client")
    rule.clients_for_round(1, CLIENTS)
    rule.aggregate_uploads(1, {n: random_upload(rule, n, i) for i, n in enumerate("abc")})
    copy.load_state_dict(rule.state_dict())
    uploads = {n: random_upload(rule, n, 20 + i) for i, n in enumerate("abd")}
    rule.aggregate_uploads(2, uploads)
    copy.aggregate_uploads(2, uploads)
    for client in CLIENTS:
        for key, value in rule.fip_of(client).items():
            assert torch.equal(value, copy.fip_of(client)[key])
    assert rule.client_flags == copy.client_flags


def test_per_sample_gradients_of_a_model_with_batch_normalization():
    """A batch of one has no statistics of its own: each sample's gradient is taken on
    the running ones (eval mode), and the model is left in the mode it was in."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 3)
    )
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    gradients = per_sample_gradients(model, x, y)
    assert model.training, "left as it came"
    model.eval()
    for i in range(len(y)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, param in model.named_parameters():
            assert torch.allclose(gradients[name][i], param.grad, atol=1e-6), (name, i)
