"""Aggregation rules, one module per paper plus the baselines; no networking inside."""

from __future__ import annotations

from typing import Any

from .base import Aggregate, Context, PeerAlgorithm, PeerModel
from .base import parse_params as _parse_into
from .baselines import FedAvg, Local

ALGORITHMS: dict[str, type[PeerAlgorithm]] = {cls.name: cls for cls in (Local, FedAvg)}
ALGORITHM_NAMES: tuple[str, ...] = tuple(ALGORITHMS)


def algorithm_class(name: str) -> type[PeerAlgorithm]:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is unknown; allowed: {', '.join(ALGORITHM_NAMES)}")
    return ALGORITHMS[name]


def parse_params(name: str, params: dict[str, Any]) -> Any:
    """Validated parameters of algorithm `name`; ValueError('algorithm.<key>: ...') if bad."""
    return _parse_into(algorithm_class(name).Params, params)


__all__ = [
    "ALGORITHMS", "ALGORITHM_NAMES", "Aggregate", "Context", "PeerAlgorithm", "PeerModel",
    "algorithm_class", "parse_params",
]
