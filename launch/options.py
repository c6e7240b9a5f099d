"""From a command's config flags (--config, --algorithm, --set ...) to its MeshConfig."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from meshfl.node import config as cfgmod

Number = TypeVar("Number", int, float)

# The config fields that have a flag of their own (cli.py), by the flag's dest.
_FLAG_FIELDS = {
    "algorithm": "algorithm",
    "dataset": "data.dataset",
    "data_root": "data.root",
    "partition": "data.partition",
    "samples_per_node": "data.samples_per_node",
    "rounds": "rounds",
    "seed": "seed",
}


def positive(kind: type[Number]) -> Callable[[str], Number]:
    """An argparse type: a number of `kind` above zero."""

    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            value = kind(0)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected a positive number")
        return value

    return parse


def positive_list(kind: type[Number]) -> Callable[[str], list[Number]]:
    """An argparse type: comma-separated numbers of `kind` above zero, e.g. 1,10,100."""
    one = positive(kind)

    def parse(text: str) -> list[Number]:
        items = [item for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected numbers like 1,10,100")
        return [one(item) for item in items]

    return parse


def named_overrides(args: argparse.Namespace) -> list[str]:
    """The named flags given, as KEY=VALUE assignments like those of --set."""
    return [
        f"{key}={getattr(args, flag)}"
        for flag, key in _FLAG_FIELDS.items()
        if getattr(args, flag, None) is not None
    ]


def resolve_config(args: argparse.Namespace, check: bool = True) -> cfgmod.MeshConfig:
    """--config (or the built-in demo settings) with the named flags, then --set, applied;
    checked unless `check` is False."""
    cfg = cfgmod.load_config(args.config)
    cfg = cfgmod.apply_overrides(cfg, named_overrides(args) + list(args.assignments))
    if check:
        cfgmod.validate(cfg)
        # The node runs the rule parameters the check fitted to `rounds` (a warm-up).
        cfg = cfgmod.with_explicit_params(cfg)
    return cfg
