"""What the data settings of a config may be: dataset names, partition specs, the shard
cap and the split, each checked here without loading torch.

The config's field rules (node/config/declarations.py) call these checks, so a command
answers a mistake in its config before it loads anything heavy; the data modules
(datasets.py, partitions.py, splits.py) use them too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from meshfl.protocol.errors import UserError


class DataError(UserError, ValueError):
    """A user mistake about data: message is one clear line naming what is wrong and what is
    allowed."""


DATASETS: tuple[str, ...] = (
    "digits",
    "mnist",
    "fmnist",
    "usps",
    "cifar10",
    "mnistm",
    "femnist",
    "office",
    "synthetic",
    "digit5",
)
NPZ_PREFIX = "npz:"


def check_dataset_name(name: str) -> None:
    """Raise DataError unless `name` is a known dataset or `npz:PATH`."""
    if name in DATASETS:
        return
    if name.startswith(NPZ_PREFIX) and name[len(NPZ_PREFIX) :].strip():
        return
    raise DataError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)} or npz:PATH")


PARTITION_FORMS = (
    "iid, dirichlet:<alpha > 0>, pathological:<labels per node >= 1>, "
    "groups:<iid share s in [0, 1]>, clusters:<k >= 1>, clusters:<k>:noisy, domains"
)


@dataclass(frozen=True)
class Partition:
    """A parsed partition spec; `param` is alpha, labels per node, iid share or k."""

    kind: str
    param: float | int | None = None
    noisy: bool = False


def check_partition(spec: str) -> None:
    """Raise DataError unless `spec` is one of PARTITION_FORMS."""
    parse_partition(spec)


def parse_partition(spec: str) -> Partition:
    kind, _, rest = spec.strip().partition(":")
    args = rest.split(":") if rest else []

    def bad(why: str) -> DataError:
        return DataError(f"partition {spec!r} is not valid ({why}); allowed: {PARTITION_FORMS}")

    if kind in ("iid", "domains"):
        if args:
            raise bad(f"'{kind}' takes no parameter")
        return Partition(kind)
    if kind == "dirichlet" and len(args) == 1:
        alpha = _parse_number(args[0], float, bad)
        if not alpha > 0:
            raise bad("alpha must be > 0")
        return Partition(kind, alpha)
    if kind == "pathological" and len(args) == 1:
        labels = _parse_number(args[0], int, bad)
        if labels < 1:
            raise bad("labels per node must be >= 1")
        return Partition(kind, labels)
    if kind == "groups" and len(args) == 1:
        share = _parse_number(args[0], float, bad)
        if not 0 <= share <= 1:
            raise bad("the iid share s must be in [0, 1]")
        return Partition(kind, share)
    if kind == "clusters" and len(args) in (1, 2):
        if len(args) == 2 and args[1] != "noisy":
            raise bad("the only option after k is 'noisy'")
        clusters = _parse_number(args[0], int, bad)
        if clusters < 1:
            raise bad("k must be >= 1")
        return Partition(kind, clusters, noisy=len(args) == 2)
    known = ("iid", "domains", "dirichlet", "pathological", "groups", "clusters")
    raise bad("wrong number of parameters" if kind in known else f"unknown form {kind!r}")


def _parse_number(text: str, kind: type, bad: Callable[[str], DataError]) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise bad(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value):
        raise bad(f"{text!r} is not finite")
    return value


# One sample each for train, validation and test at least; every rule scores on the
# validation split and every report on the test split, so neither may be empty.
MIN_SAMPLES_PER_NODE = 3
SPLIT_TOLERANCE = 1e-6


def check_samples_per_node(value: int | None) -> None:
    """Raise DataError unless `value` is unset or an integer >= MIN_SAMPLES_PER_NODE."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < MIN_SAMPLES_PER_NODE
    ):
        raise DataError(f"got {value!r}; allowed: an integer >= {MIN_SAMPLES_PER_NODE} or null")


def check_split(split: tuple[float, ...]) -> None:
    """Raise DataError unless `split` is three fractions > 0 (train, validation, test)
    that sum to 1."""
    parts_ok = len(split) == 3 and all(
        isinstance(part, (int, float)) and math.isfinite(part) and part > 0 for part in split
    )
    if not parts_ok or abs(sum(split) - 1) > SPLIT_TOLERANCE:
        raise DataError(
            f"got {list(split)!r}; allowed: three numbers > 0 (train, "
            "validation, test) that sum to 1"
        )
