"""`meshfl bench fedc2i`: what FedC²I's influence measurement costs a node per round,
as a share of the round's local training.

The setting is the paper's Digit-5 node: LeNet on 3x32x32 images, 1,000 samples (600 to
train after the 60/20/20 split), K = 5 models (the own one and four peers'), an
influence batch B of 32, and one round of local training of 2 epochs at batch 32 with
Adam (lr 1e-3). With `--data-root` the node is digit5's node 0; without, random
tensors of the same shapes stand in (the cost does not depend on pixel values).

Per repetition, in turn (so that a noisy neighbour hurts every figure alike):

training            `train_local`, 2 epochs over the train split
influence           `measure_influence`: K leave-one-out bodies scored under the own head
                    (λ) plus one feature pass and the batched K·C class losses (Λ)
influence, naive    the same with the class losses from `class_losses_naive`, which builds
                    each of the K·C modified heads and scores it
aggregate           the whole `FedC2I.aggregate`: the influence plus Eq. 6 and Eq. 10

and the client- and class-level parts alone. Each figure is the median over the
repetitions, after one warm-up. Torch runs on `--threads` threads (default 1, what each
node of a 5-node local mesh gets on a 2-core machine); the ratios barely depend on it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from meshfl.algorithms import Context, PeerModel
from meshfl.algorithms.fedc2i import FedC2I, influence_batch, measure_influence
from meshfl.node.models import body_keys, build_model, head_keys
from meshfl.node.splits import NodeData, load_node_data
from meshfl.node.streamed import whole_inputs
from meshfl.node.trainer import train_local

from .flags import add_data_root, add_repeats, add_threads, bench_parser

PEERS = 5
SAMPLES = 1000
SPLIT = (0.6, 0.2, 0.2)
INPUT_SHAPE = (3, 32, 32)
CLASSES = 10
BATCH = 32
EPOCHS = 2
GAMMA = 5.0
GOAL = 0.1  # influence seconds per round / training seconds per round


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser("fedc2i", __doc__, preformatted=True)
    add_data_root(parser, "digit5 data (default: random)")
    add_repeats(parser, 5, "timed repetitions")
    add_threads(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = _node_data(args.data_root)
    timers = _timers(data)
    medians = _medians(timers, args.repeats)
    _report(medians, data, args)
    return 0


def _node_data(root: str | None) -> NodeData:
    if root:
        return load_node_data("digit5", root, "domains", PEERS, 0, 0, SAMPLES, SPLIT)
    generator = torch.Generator().manual_seed(0)
    sizes = [round(SAMPLES * part) for part in SPLIT]
    xs = [torch.rand(size, *INPUT_SHAPE, generator=generator) * 2 - 1 for size in sizes]
    ys = [torch.arange(size) % CLASSES for size in sizes]
    return NodeData(
        xs[0], ys[0], xs[1], ys[1], xs[2], ys[2], CLASSES, INPUT_SHAPE, {"domain": "random"}
    )


def _timers(data: NodeData) -> dict[str, Callable[[], object]]:
    """What to time, by label; every call starts from the same weights."""

    def new_model() -> torch.nn.Module:
        return build_model("lenet", INPUT_SHAPE, CLASSES, seed=0)

    scratch = new_model()
    states = [
        _state(build_model("lenet", INPUT_SHAPE, CLASSES, seed=seed)) for seed in range(PEERS)
    ]
    float_body = [key for key in body_keys(scratch) if states[0][key].is_floating_point()]
    x, y = influence_batch(whole_inputs(data.x_train), data.y_train, BATCH, seed=1)
    names = [f"node{index}" for index in range(PEERS)]
    rule = FedC2I(
        FedC2I.Params(gamma=GAMMA),
        Context(
            names[0],
            0,
            CLASSES,
            tuple(body_keys(scratch)),
            tuple(head_keys(scratch)),
            batch_size=BATCH,
            new_model=new_model,
        ),
    )
    received = {
        "model": {
            name: PeerModel(state, len(data.y_train))
            for name, state in zip(names[1:], states[1:], strict=True)
        }
    }
    own = PeerModel(states[0], len(data.y_train))

    def influence(**parts: bool) -> object:
        return measure_influence(
            scratch, states, 0, float_body, "head.weight", "head.bias", x, y, GAMMA, **parts
        )

    def training() -> object:
        model = new_model()
        return train_local(model, data.x_train, data.y_train, EPOCHS, BATCH, "adam", 1e-3, seed=0)

    return {
        "training": training,
        "influence": influence,
        "influence, naive": lambda: influence(naive=True),
        "client level": lambda: influence(matrix=False),
        "class level": lambda: influence(vector=False),
        "class level, naive": lambda: influence(vector=False, naive=True),
        "aggregate": lambda: rule.aggregate(1, own, received, data),
    }


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}


def _medians(timers: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    seconds: dict[str, list[float]] = {label: [] for label in timers}
    for repetition in range(repeats + 1):
        for label, work in timers.items():
            started = time.perf_counter()
            work()
            if repetition > 0:  # the first round warms caches and allocators
                seconds[label].append(time.perf_counter() - started)
    return {label: statistics.median(values) for label, values in seconds.items()}


def _report(medians: dict[str, float], data: NodeData, args: argparse.Namespace) -> None:
    training = medians["training"]
    source = f"digit5 node 0 from {args.data_root}" if args.data_root else "random tensors"
    print(
        f"FedC²I influence overhead: lenet on {source}, {len(data.y_train)} train samples, "
        f"K={PEERS} models, batch {BATCH}, {args.threads} torch thread(s); medians of "
        f"{args.repeats} repetitions"
    )
    rows = [
        ("local training, 2 epochs", "training"),
        ("influence (vectorized)", "influence"),
        ("  client level: K body passes", "client level"),
        ("  class level: one pass + batched", "class level"),
        ("influence (naive class loop)", "influence, naive"),
        ("  class level: K·C heads", "class level, naive"),
        ("whole aggregate (vectorized)", "aggregate"),
    ]
    for text, label in rows:
        ratio = "" if label == "training" else f"   {medians[label] / training:7.4f} x training"
        print(f"  {text:<36}{medians[label] * 1000:9.2f} ms{ratio}")
    share = medians["influence"] / training
    verdict = "met" if share < GOAL else "NOT met"
    print(
        f"goal: influence below {GOAL:g} x training per round: {verdict} ({share:.4f}); "
        f"class level {medians['class level, naive'] / medians['class level']:.1f}x faster "
        "than the naive loop"
    )


if __name__ == "__main__":
    raise SystemExit(main())
