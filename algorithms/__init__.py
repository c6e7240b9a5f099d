"""Aggregation rules, one module per paper plus the baselines; no networking inside.

Every module of this package that defines a `PeerAlgorithm` subclass with a `name`
contributes that rule: adding a file adds a rule, with no list to keep in step.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from .base import (
    MODEL,
    Aggregate,
    Context,
    CoordinatorAlgorithm,
    PeerAlgorithm,
    PeerModel,
    Received,
    Upload,
)
from .base import parse_params as _parse_into


def _discover() -> dict[str, type[PeerAlgorithm]]:
    rules: dict[str, type[PeerAlgorithm]] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, PeerAlgorithm)
                    and value.__module__ == module.__name__ and value.name != "base"):
                # PeerAlgorithm subclasses include the coordinator rules.
                rules[value.name] = value
    return rules


ALGORITHMS: dict[str, type[PeerAlgorithm]] = _discover()
ALGORITHM_NAMES: tuple[str, ...] = tuple(sorted(ALGORITHMS))


def is_coordinated(name: str) -> bool:
    """True for server-centric rules, which need the mesh's coordinator node. An unknown
    name is not coordinated: config validation reports it with the allowed names."""
    return name in ALGORITHMS and issubclass(ALGORITHMS[name], CoordinatorAlgorithm)


def algorithm_class(name: str) -> type[PeerAlgorithm]:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is unknown; allowed: {', '.join(ALGORITHM_NAMES)}")
    return ALGORITHMS[name]


def parse_params(name: str, params: dict[str, Any]) -> Any:
    """Validated parameters of algorithm `name`; ValueError('algorithm.<key>: ...') if bad."""
    return _parse_into(algorithm_class(name).Params, params)


__all__ = [
    "ALGORITHMS", "ALGORITHM_NAMES", "MODEL", "Aggregate", "Context", "CoordinatorAlgorithm",
    "PeerAlgorithm", "PeerModel", "Received", "Upload", "algorithm_class", "is_coordinated",
    "parse_params",
]
