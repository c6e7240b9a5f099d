"""The JSON Schema of peers.yaml (`meshfl config schema`), made from the field rules."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .declarations import ConfigError
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
    # The parameters sit flat beside the name; each rule checks its own.
    del sections["AlgorithmConfig"]
    flat_algorithm = {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": list(ALGORITHM_NAMES)}},
        "additionalProperties": True,
    }
    top["algorithm"] = _named_or(top["algorithm"], ALGORITHM_NAMES, flat_algorithm)
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
