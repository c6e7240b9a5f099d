"""The JSON Schema of peers.yaml (`meshfl config schema`), made from the field rules."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .declarations import AlgorithmConfig, ConfigError
from .loading import adapter

_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def config_schema() -> dict[str, Any]:
    """The JSON Schema of peers.yaml: the field rules above, the names that the other
    packages' registries allow (so that editors complete them), and the short forms of
    the sections named by a string (`algorithm: local`, `model: cnn`)."""
    from meshfl.algorithms import ALGORITHM_NAMES
    from meshfl.node.data_rules import DATASETS, NPZ_PREFIX
    from meshfl.node.models import HEADS, MODELS
    from meshfl.node.trainer import OPTIMIZERS

    schema = adapter().json_schema()
    top, sections = schema["properties"], schema["$defs"]
    del sections["AlgorithmConfig"]
    by_rule = {"anyOf": [_algorithm_mapping(name) for name in ALGORITHM_NAMES]}
    top["algorithm"] = _named_or(top["algorithm"], ALGORITHM_NAMES, by_rule)
    top["model"] = _named_or(top["model"], MODELS, {"$ref": "#/$defs/ModelConfig"})
    model = sections["ModelConfig"]["properties"]
    _narrow(model["name"], {"enum": list(MODELS)})
    _narrow(model["head"], {"enum": list(HEADS)})
    _narrow(top["optimizer"], {"enum": list(OPTIMIZERS)})
    dataset = {"anyOf": [{"enum": list(DATASETS)}, {"pattern": f"^{NPZ_PREFIX}.+"}]}
    for data in ("DataConfig", "DataOverride"):
        _narrow(sections[data]["properties"]["dataset"], dataset)
    for section in [schema, *sections.values()]:
        section.pop("description", None)  # a docstring, written for programmers
        for prop in section["properties"].values():
            _describe_nullable(prop)
    return {
        "$schema": _SCHEMA_DIALECT,
        **schema,
        "title": "meshfl peers.yaml",
        "description": "The settings and peers of a meshfl mesh (`meshfl config schema`).",
    }


def _algorithm_mapping(name: str) -> dict[str, Any]:
    """The algorithm section naming rule `name`: the parameters it declares sit flat
    beside the name, with screening's where the rule takes them. The name may be left
    out for the default rule."""
    from meshfl.algorithms import ALGORITHMS, SCREEN_KEY, TRIALS_KEY
    from meshfl.algorithms.params import Flag
    from meshfl.algorithms.params import adapter as params_adapter

    rule = ALGORITHMS[name]
    params = params_adapter(rule.Params).json_schema()
    properties = {"name": {"const": name}, **params.get("properties", {})}
    if rule.screenable:
        flag = params_adapter(Flag).json_schema()
        properties.update({SCREEN_KEY: flag, TRIALS_KEY: flag})
    mapping = {"type": "object", "properties": properties, "additionalProperties": False}
    return mapping if name == AlgorithmConfig.name else {**mapping, "required": ["name"]}


def _named_or(generated: dict[str, Any], names: Iterable[str], mapping: Any) -> dict[str, Any]:
    """A section's schema that also takes the section's name alone."""
    kept: dict[str, Any] = {
        key: generated[key] for key in ("description", "title") if key in generated
    }
    return {**kept, "anyOf": [{"type": "string", "enum": list(names)}, mapping]}


def _narrow(prop: dict[str, Any], names: dict[str, Any]) -> None:
    """Add `names` to the string branch of the property `prop`, nullable or not."""
    branches = prop.get("anyOf", [prop])
    next(branch for branch in branches if branch.get("type") == "string").update(names)


def _describe_nullable(prop: dict[str, Any]) -> None:
    """Lift the description of a nullable property's value up to the property, where
    editors show it."""
    described = [branch for branch in prop.get("anyOf", ()) if "description" in branch]
    if len(described) == 1 and "description" not in prop:
        prop["description"] = described[0].pop("description")


def write_schema(out: str | Path | None) -> None:
    """Write `config_schema()` as JSON to the file `out`, or to stdout when None."""
    text = json.dumps(config_schema(), indent=2) + "\n"
    if out is None:
        sys.stdout.write(text)
        return
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"schema file '{out}': cannot write: {err.strerror or err}") from None
