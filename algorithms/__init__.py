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
    ReceivedModels,
    Upload,
)
from .params import validated
from .screening import SCREEN_KEY, TRIALS_KEY, with_screening


def _discover() -> dict[str, type[PeerAlgorithm]]:
    rules: dict[str, type[PeerAlgorithm]] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, PeerAlgorithm)
                and value.__module__ == module.__name__
                and value.name != "base"
            ):
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


def parse_params(name: str, params: dict[str, Any], rounds: int | None = None) -> Any:
    """Validated parameters of algorithm `name`, checked against its Params' declared
    rules (algorithms/params.py): pydantic's ValidationError names a broken field, and
    node/config turns it into the config's one line; the screening keys, and a setting
    the run's rounds refuse, raise ValueError('algorithm.<key>: ...').

    Given the run's `rounds`, a rule whose Params define `for_rounds(rounds)` gets the
    parameters that count rounds fitted to the run: defaults that follow `rounds` are
    filled in, and a setting under which the rule's own phase never comes is refused.
    The fitted values enter the mesh id (node/mesh_identity.py): nodes that fit them apart
    never mix.
    """
    screening_keys = (SCREEN_KEY, TRIALS_KEY)
    rule_params = {key: value for key, value in params.items() if key not in screening_keys}
    if any(key in params for key in screening_keys):
        screening_setting(name, params)  # checked here, kept out of the rule's Params
    parsed = validated(algorithm_class(name).Params, rule_params)
    fit = getattr(parsed, "for_rounds", None)
    if rounds is None or fit is None:
        return parsed
    try:
        return fit(rounds)
    except ValueError as err:
        raise ValueError(f"algorithm.{err}") from None


def screening_setting(name: str, params: dict[str, Any]) -> dict[str, bool]:
    """{"screen": on?, "trials": on?} for a rule that validation screening can wrap
    (screening on unless `params` say screen: false; its trials as the rule's
    `trials_by_default` unless they say); {} for one it cannot, which then takes
    neither. Trials follow screening where only screening is set: `screen: false` alone
    turns both off."""
    if name not in ALGORITHMS:
        return {}  # an unknown name is reported, with the allowed ones, by its own check
    screen = params.get(SCREEN_KEY, True)
    trials_default = ALGORITHMS[name].trials_by_default and screen is True
    setting = {SCREEN_KEY: screen, TRIALS_KEY: params.get(TRIALS_KEY, trials_default)}
    if not ALGORITHMS[name].screenable:
        given = [key for key in setting if key in params]
        if given:
            raise ValueError(
                f"algorithm.{given[0]}: got {params[given[0]]!r}; allowed: nothing, "
                f"{name} takes no peer models to screen"
            )
        return {}
    for key, value in setting.items():
        if not isinstance(value, bool):
            raise ValueError(f"algorithm.{key}: got {value!r}; allowed: true or false")
    if setting[TRIALS_KEY] and not setting[SCREEN_KEY]:
        raise ValueError(
            f"algorithm.{TRIALS_KEY}: got True with {SCREEN_KEY}: false; trials are a step "
            f"of validation screening, so set algorithm.{TRIALS_KEY}=false as well (a saved "
            "config lists every parameter, trials too)"
        )
    return setting


def build_rule(name: str, params: dict[str, Any], context: Context) -> PeerAlgorithm:
    """The rule `name` for a node, behind validation screening where that is on."""
    rule = algorithm_class(name)(parse_params(name, params), context)
    setting = screening_setting(name, params)
    return with_screening(rule, setting.get(SCREEN_KEY, False), setting.get(TRIALS_KEY, False))


__all__ = [
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "MODEL",
    "Aggregate",
    "Context",
    "CoordinatorAlgorithm",
    "PeerAlgorithm",
    "PeerModel",
    "ReceivedModels",
    "Upload",
    "algorithm_class",
    "build_rule",
    "is_coordinated",
    "parse_params",
    "screening_setting",
    "TRIALS_KEY",
]
