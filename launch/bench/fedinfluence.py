"""`meshfl bench fedinfluence WHAT`: Fed-Influence's estimate checked against the truth.

The rule's whole schedule runs in this one process: the coordinator's side and every
client's `client_update` are the rule's own code, exactly as the mesh runs them; only
the wire between them is left out (an upload carries the same tensors either way).
That makes the hundreds of exact leave-one-out reruns affordable, each one the same
seeded schedule with `leave_out` set and the estimator off (which changes no random
draw of training).

    convex    synthetic LEAF-style data, logistic regression: Pearson correlation of
              the estimated FIL with the exact leave-one-out FIL over every client,
              with the gradients uploaded as float32 and as float16
    femnist   the same check on FEMNIST writers with a CNN (non-convex)
    cleanse   some clients' training labels shifted; at a round, drop 10% of the
              clients with the lowest FIL, at random, or with the highest; final test
              accuracy, mean over seeds
    overhead  coordinator seconds per round of the estimator against the plain
              FedAvg average, and upload bytes per client per round on the wire

The coordinator's test set here is the union of the clients' test splits (the paper's
D_test), which no client trains on; on a mesh it is the coordinator's own held-out
shard instead.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshfl.algorithms import Context, Upload, parse_params
from meshfl.algorithms.fedinfluence import FedInfluence, loss_and_accuracy
from meshfl.node.models import body_keys, build_model, head_keys
from meshfl.node.splits import NodeData, load_node_data
from meshfl.node.streamed import whole_inputs
from meshfl.node.trainer import state_to_arrays
from meshfl.protocol.identity import Identity
from meshfl.protocol.wire import make_blob

from .flags import add_data_root, add_rounds, add_threads, bench_parser


@dataclass(frozen=True)
class Setting:
    """A federation to simulate: data, model, schedule and the rule's parameters."""

    title: str
    dataset: str
    partition: str
    model: str
    clients: int
    rounds: int
    batch_size: int
    params: dict[str, Any]
    samples_per_node: int | None = None
    split: tuple[float, float, float] = (0.6, 0.2, 0.2)
    shifted_clients: float = 0.0  # share of clients whose training labels are shifted by 1
    caps: str = ""
    seeds: tuple[int, ...] = (0,)

    def with_params(self, **params: Any) -> Setting:
        return dataclasses.replace(self, params={**self.params, **params})


SETTINGS = {
    "convex": Setting(
        title="Fed-Influence, convex: synthetic (60 features, 5 classes), logistic regression",
        dataset="synthetic",
        partition="domains",
        model="logreg",
        clients=100,
        rounds=300,
        batch_size=10_000,
        samples_per_node=1000,
        params={
            "lr": 0.01,
            "local_steps": 5,
            "samples_per_step": 50,
            "clients_per_round": 10,
            "evaluate_every": 300,
        },
        caps="100 clients (paper: 1000), 300 rounds (paper: 1000), lr 0.01 (paper: 0.003), "
        "local steps on the whole train split (at most 600 samples: 1000 per client "
        "before the 60/20/20 split), one seed; K = 10, m = 5, N_s = 50 as in the paper. "
        "Exact FIL of every client by 100 leave-one-out reruns.",
    ),
    "femnist": Setting(
        title="Fed-Influence, non-convex: FEMNIST writers, CNN",
        dataset="femnist",
        partition="domains",
        model="cnn",
        clients=20,
        rounds=100,
        batch_size=10,
        samples_per_node=120,
        params={
            "lr": 0.1,
            "local_steps": 2,
            "samples_per_step": 50,
            "clients_per_round": 5,
            "lwet": "client",
            "evaluate_every": 100,
        },
        caps="the 20 largest writers, 120 samples each (72 to train; paper: 100 writers), "
        "100 rounds (paper: 2000), K = 5 (paper: 10), the mesh's small CNN (two 3x3 "
        "conv layers and one dense layer, 158k parameters: LEAF's 6.6M-parameter CNN "
        "would upload 2.6 GB of gradients per client and round; the paper shrank it "
        "too), batch 10, lr 0.1, m = 2, N_s = 50, LWET per (client, tensor) as the "
        "paper's setting 3; one seed.",
    ),
    "cleanse": Setting(
        title="Client cleansing: synthetic (one shared labelling model, unbalanced), "
        "logistic regression, 20% of clients with shifted labels",
        dataset="synthetic",
        partition="iid",
        model="logreg",
        clients=100,
        rounds=300,
        batch_size=10_000,
        samples_per_node=1000,
        shifted_clients=0.2,
        params={
            "lr": 0.1,
            "local_steps": 5,
            "samples_per_step": 50,
            "clients_per_round": 10,
            "evaluate_every": 300,
            "cleanse_at": 100,
            "cleanse_fraction": 0.1,
        },
        seeds=(0, 1, 2),
        caps="100 clients, 300 rounds, K = 10, m = 5 full-batch steps, lr 0.1, N_s = 50; "
        "cleansing after round 100 of 10% of the clients (paper: round 700 of 1000, "
        "30%); the synthetic data's IID form (one labelling model for all, still "
        "unbalanced), with 20 clients training on labels shifted by one class "
        "(y+1 mod 5); test set: the clients' clean test splits; 3 seeds.",
    ),
}


@dataclass
class Federation:
    """Every client's data, the coordinator's test set and the model builder."""

    setting: Setting
    seed: int
    clients: dict[str, NodeData]
    test_x: torch.Tensor
    test_y: torch.Tensor
    shifted: list[str] = field(default_factory=list)

    def new_model(self) -> torch.nn.Module:
        first = next(iter(self.clients.values()))
        return build_model(self.setting.model, first.input_shape, first.num_classes, seed=self.seed)

    def context(self, node: str, with_test_set: bool = False) -> Context:
        model = self.new_model()
        first = next(iter(self.clients.values()))
        data = None
        if with_test_set:
            empty_x, empty_y = self.test_x[:0], self.test_y[:0]
            data = NodeData(
                empty_x,
                empty_y,
                empty_x,
                empty_y,
                self.test_x,
                self.test_y,
                first.num_classes,
                first.input_shape,
                {"role": "test set"},
            )
        return Context(
            node,
            self.seed,
            first.num_classes,
            tuple(body_keys(model)),
            tuple(head_keys(model)),
            batch_size=self.setting.batch_size,
            new_model=self.new_model,
            data=data,
        )


def load_federation(setting: Setting, seed: int, root: str | None) -> Federation:
    names = [f"node{index}" for index in range(setting.clients)]
    clients = {
        name: load_node_data(
            setting.dataset,
            root,
            setting.partition,
            setting.clients,
            index,
            seed,
            setting.samples_per_node,
            setting.split,
        )
        for index, name in enumerate(names)
    }
    test_x = torch.cat([whole_inputs(data.x_test) for data in clients.values()])
    test_y = torch.cat([data.y_test for data in clients.values()])
    shifted = _shift_labels(clients, setting.shifted_clients, seed)
    return Federation(setting, seed, clients, test_x, test_y, shifted)


def _shift_labels(clients: dict[str, NodeData], share: float, seed: int) -> list[str]:
    """Shift the training labels (y → y+1 mod classes) of a seeded share of the clients:
    the harmful clients cleansing should find. Their test splits stay clean."""
    if share <= 0:
        return []
    names = sorted(clients)
    rng = np.random.default_rng((seed, 99))
    chosen = sorted(
        names[i] for i in rng.choice(len(names), round(share * len(names)), replace=False)
    )
    for name in chosen:
        data = clients[name]
        data.y_train = (data.y_train + 1) % data.num_classes
    return chosen


class Simulation:
    """The rule's seeded schedule in-process: coordinator and clients are FedInfluence."""

    def __init__(self, federation: Federation, params: dict[str, Any]) -> None:
        self.federation = federation
        parsed = parse_params(FedInfluence.name, params)
        self.coordinator = FedInfluence(parsed, federation.context("coordinator", True))
        self.client_rules = {
            name: FedInfluence(parsed, federation.context(name)) for name in federation.clients
        }
        self.initial = federation.new_model().state_dict()
        self.scratch = federation.new_model()  # reloaded for each client's round
        self.records: list[dict[str, Any]] = []
        self.upload_arrays: dict[str, np.ndarray] = {}

    def run(self, first: int = 1, last: int | None = None) -> FedInfluence:
        names = sorted(self.federation.clients)
        for round_no in range(first, (last or self.federation.setting.rounds) + 1):
            chosen = self.coordinator.clients_for_round(round_no, names)
            uploads = {name: self._client_round(round_no, name) for name in chosen}
            self.records.append(self.coordinator.aggregate_uploads(round_no, uploads))
        return self.coordinator

    def fork(self, params: dict[str, Any]) -> Simulation:
        """A run that goes on from this one's coordinator state under other parameters,
        as a coordinator restarted from its checkpoint would. The two share the state's
        values: a rule never changes one in place (algorithms/base.py `Rewind`)."""
        other = Simulation(self.federation, params)
        other.coordinator.load_state_dict(self.coordinator.state_dict())
        return other

    def _client_round(self, round_no: int, name: str) -> Upload:
        model = self.scratch
        model.load_state_dict(self.coordinator.model_for(round_no, name, self.initial))
        data = self.federation.clients[name]
        _, extras = self.client_rules[name].client_update(round_no, model, data)
        state = {key: value.detach().clone() for key, value in model.state_dict().items()}
        if not self.upload_arrays:  # what the client would put on the wire, once
            self.upload_arrays = {
                **state_to_arrays(state),
                **{"extra/" + k: v.numpy() for k, v in extras.items()},
            }
        return Upload(state, len(data.y_train), extras)

    def final_loss(self) -> tuple[float, float]:
        assert self.coordinator.global_state is not None, "run() came first"
        model = self.federation.new_model()
        model.load_state_dict(self.coordinator.global_state)
        return loss_and_accuracy(model, self.federation.test_x, self.federation.test_y)


# --------------------------------------------------------------------------- the checks


def exact_fil(
    federation: Federation, params: dict[str, Any], full_loss: float, clients: Sequence[str]
) -> dict[str, float]:
    """L(w_T without c in any round) − L(w_T) for each client c: one rerun each."""
    values = {}
    for index, client in enumerate(clients):
        rerun = Simulation(federation, {**params, "estimator": False, "leave_out": client})
        rerun.run()
        values[client] = rerun.final_loss()[0] - full_loss
        _progress(f"leave-one-out {index + 1}/{len(clients)}")
    return values


def correlation_check(setting: Setting, seed: int, root: str | None) -> list[str]:
    federation = load_federation(setting, seed, root)
    started = time.monotonic()
    estimates: dict[str, dict[str, float]] = {}
    last: Simulation | None = None
    for dtype in ("float32", "float16"):
        simulation = Simulation(federation, {**setting.params, "gradient_dtype": dtype})
        simulation.run()
        estimates[dtype] = simulation.records[-1]["fil"]
        last = last or simulation
        _progress(f"estimate with {dtype} gradients done")
    assert last is not None, "the loop ran"
    full_loss, full_accuracy = last.final_loss()
    names = sorted(federation.clients)
    exact = exact_fil(federation, setting.params, full_loss, names)
    flags = last.records[-1]["lwet_flags"]
    lines = [
        f"### {setting.title}",
        "",
        "| gradients | Pearson r (estimated vs exact FIL) | clients | "
        "largest FIL change from float32, relative |",
        "|---|---:|---:|---:|",
    ]
    scale = max(abs(value) for value in estimates["float32"].values())
    for dtype, estimate in estimates.items():
        r = pearson([estimate[n] for n in names], [exact[n] for n in names])
        change = max(abs(estimate[n] - estimates["float32"][n]) for n in names) / scale
        lines.append(f"| {dtype} | {r:.4f} | {len(names)} | {change:.1e} |")
    lines += [
        "",
        f"Final global model: test loss {full_loss:.4f}, accuracy "
        f"{full_accuracy * 100:.1f}%; LWET flags at the end: {_flag_summary(flags)}; "
        f"{time.monotonic() - started:.0f} s.",
        f"Caps: {setting.caps}",
    ]
    return lines


def cleanse_check(setting: Setting, root: str | None) -> list[str]:
    """Per seed: one run with the estimator up to `cleanse_at` (where FIL is measured),
    then one fork per way of cleansing; after the fork nothing reads FIP, so the forks
    run with the estimator off, which changes no random draw of training."""
    at = setting.params["cleanse_at"]
    modes = {
        "no cleansing": None,
        "lowest FIL": "lowest",
        "random": "random",
        "highest FIL": "highest",
    }
    accuracy: dict[str, list[float]] = {mode: [] for mode in modes}
    caught: dict[str, list[int]] = {mode: [] for mode in modes}
    for seed in setting.seeds:
        federation = load_federation(setting, seed, root)
        base = Simulation(federation, {**setting.params, "cleanse_at": 0, "evaluate_every": at})
        base.run(1, at)
        for mode, how in modes.items():
            fork = base.fork(
                {
                    **setting.params,
                    "estimator": False,
                    "cleanse_at": 0,
                    "cleanse_mode": how or "lowest",
                }
            )
            dropped = fork.coordinator.cleanse() if how else []
            fork.run(at + 1)
            accuracy[mode].append(fork.final_loss()[1] * 100)
            caught[mode].append(len(set(dropped) & set(federation.shifted)))
            _progress(f"seed {seed} {mode}: {accuracy[mode][-1]:.2f}%")
    lines = [
        f"### {setting.title}",
        "",
        f"| removed after round {at} | test accuracy % (mean over seeds) | per seed | "
        "shifted clients among the removed |",
        "|---|---:|---|---:|",
    ]
    for mode in modes:
        seeds = ", ".join(f"{value:.2f}" for value in accuracy[mode])
        lines.append(
            f"| {mode} | {statistics.fmean(accuracy[mode]):.2f} | {seeds} | "
            f"{statistics.fmean(caught[mode]):.1f} |"
        )
    lines += ["", f"Seeds {', '.join(map(str, setting.seeds))}. Caps: {setting.caps}"]
    return lines


def overhead_check(setting: Setting, seed: int, root: str | None) -> list[str]:
    """Medians over rounds of the rule's own timers, from a shortened run of `setting`."""
    federation = load_federation(setting, seed, root)
    rows = []
    for dtype in ("float32", "float16"):
        simulation = Simulation(
            federation, {**setting.params, "gradient_dtype": dtype, "evaluate_every": 1}
        )
        simulation.run()
        seconds = [record["seconds"] for record in simulation.records[1:]]  # after warm-up
        average = statistics.median(s["average"] for s in seconds)
        fip = statistics.median(s["fip"] for s in seconds)
        evaluate = statistics.median(s["evaluate"] for s in seconds)
        wire = _wire_bytes(simulation.upload_arrays)
        plain = _wire_bytes(
            {k: v for k, v in simulation.upload_arrays.items() if not k.startswith("extra/")}
        )
        rows.append(
            f"| {setting.title.split(':')[0]}, {dtype} | {average * 1e3:.3f} | "
            f"{fip * 1e3:.2f} | {fip / average:.0f} | {evaluate * 1e3:.1f} | "
            f"{wire / 1e6:.3f} | {plain / 1e6:.4f} |"
        )
    return rows


def pearson(a: Sequence[float], b: Sequence[float]) -> float:
    return float(np.corrcoef(np.asarray(a), np.asarray(b))[0, 1])


def _wire_bytes(arrays: dict[str, np.ndarray]) -> int:
    """Bytes of an upload blob as the client sends it: its frames plus the signed record
    (the message envelope around them adds well under a kilobyte)."""
    blob = make_blob(Identity.generate(), 1, "upload", arrays, b"\0" * 32, {"round": 1, "n": 1})
    return blob.size + len(blob.record) + len(blob.signature)


def _flag_summary(flags: dict[str, Any]) -> str:
    def up(value: Any) -> str:
        if isinstance(value, dict):
            return f"{sum(value.values())}/{len(value)} uploaders up"
        return "up" if value else "down"

    return ", ".join(f"{key} {up(value)}" for key, value in flags.items())


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- command


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser("fedinfluence", __doc__, preformatted=True)
    parser.add_argument("what", choices=["convex", "femnist", "cleanse", "overhead"])
    add_data_root(parser, "dataset folder (femnist)")
    parser.add_argument("--out", metavar="FILE", help="also write the table here")
    add_rounds(parser, None, "override the setting's rounds")
    add_threads(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = run_check(args.what, args.data_root, args.rounds)
    text = (
        "\n".join(lines)
        + f"\n\nRegenerate: `meshfl bench fedinfluence {args.what}"
        + (" --data-root DIR`" if args.what in ("femnist", "overhead") else "`")
        + "\n"
    )
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def run_check(what: str, root: str | None, rounds: int | None) -> list[str]:
    def setting(name: str) -> Setting:
        chosen = SETTINGS[name]
        return dataclasses.replace(chosen, rounds=rounds) if rounds else chosen

    if what == "cleanse":
        return cleanse_check(setting("cleanse"), root)
    if what == "overhead":
        header = [
            "### Fed-Influence overhead per round (medians over rounds, 1 thread)",
            "",
            "| setting, gradients | FedAvg average ms | estimator ms | ratio | "
            "FIL/FIA ms | upload MB/client/round | plain model MB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        convex = dataclasses.replace(SETTINGS["convex"], rounds=rounds or 20)
        rows = overhead_check(convex, 0, root)
        if root:
            femnist = dataclasses.replace(SETTINGS["femnist"], rounds=rounds or 5)
            rows += overhead_check(femnist, 0, root)
        return (
            header
            + rows
            + [
                "",
                "Caps: the convex setting over 20 rounds and the FEMNIST "
                "setting over 5 (the per-round cost does not grow with t).",
            ]
        )
    return correlation_check(setting(what), 0, root)


if __name__ == "__main__":
    raise SystemExit(main())
