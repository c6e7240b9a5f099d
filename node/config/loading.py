"""Reading a configuration: peers.yaml (a strict YAML loader), `--set` overrides, the
translation of pydantic's errors into one `ConfigError` line that names the field, and
writing a config back as YAML that reads back equal."""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Hashable
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import TypeAdapter, ValidationError

from .declarations import (
    AlgorithmConfig,
    ConfigError,
    DataOverride,
    MeshConfig,
    field_error,
    nearest,
    shown,
)


class _StrictLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys, which PyYAML would silently overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges may legitimately repeat keys
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str, origin: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # safe: a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{origin}: YAML syntax error{where}: {err.problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{origin}: YAML syntax error: {err}") from None


def load_config(path: str | Path | None) -> MeshConfig:
    """The config in the YAML file at `path` (None: the defaults); keys left out keep
    their defaults. Checks each field; call `validate` after any overrides."""
    if path is None:
        return MeshConfig()
    origin = f"config file '{path}'"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{origin}: cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{origin}: cannot read: not UTF-8 text") from None
    return config_from_text(text, origin)


def config_from_text(text: str, origin: str) -> MeshConfig:
    """The config in YAML `text` (from `origin`, named in errors); as `load_config`."""
    raw = _parse_yaml(text, origin)
    if raw is None:  # an empty file
        return MeshConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: expected a mapping of settings, got {type(raw).__name__}")
    try:
        return checked(raw)
    except ConfigError as err:  # a field of this file: say where it is
        named = FIELD_NAMED.match(str(err))
        line = _line_of(text, named.group(1).split(".")) if named else None
        raise ConfigError(f"{origin}{f', line {line}' if line else ''}: {err}") from None


FIELD_NAMED = re.compile(r"config field '([^']+)'")  # how every field's error begins


def _line_of(text: str, path: list[str]) -> int | None:
    """The line of `text` (YAML that parsed) where the setting at `path` (keys and list
    indices) is written; None where it is not written there."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    for part in path:
        if isinstance(node, yaml.MappingNode):
            node = next((value for key, value in node.value if key.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
        else:
            return None
        if node is None:
            return None
    return node.start_mark.line + 1


@functools.cache
def adapter() -> TypeAdapter[MeshConfig]:
    return TypeAdapter(MeshConfig)


def checked(value: dict[str, Any] | MeshConfig) -> MeshConfig:
    """A MeshConfig from plain YAML values, or a MeshConfig's fields checked again; the
    first broken field rule raises ConfigError."""
    try:
        return adapter().validate_python(value)
    except ValidationError as err:
        raise first_problem(err) from None


def first_problem(
    err: ValidationError,
    declared: Any = MeshConfig,
    at: tuple[str, ...] = (),
    also: tuple[str, ...] = (),
) -> ConfigError:
    """The first broken rule of `err`, raised by validating the dataclass `declared`
    (the config, or a section of it found at the field path `at`, such as a rule's
    parameters under `algorithm`, beside which the keys `also` are allowed), as one
    line that names the field."""
    problem = err.errors()[0]
    location = problem["loc"]
    path = _path(at + location)
    if problem["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        section = fields(_bare(_hint_at(location[:-1], declared)))
        names = [*(f.name for f in section), *also]
        allowed = ", ".join(names) or "none"
        hint = nearest(location[-1], names)
        return ConfigError(f"config field {path!r}: unknown key; allowed: {allowed}{hint}")
    if problem["type"] == "value_error":  # a check whose message says what is allowed
        section = _bare(_hint_at(location, declared))
        return _checker_error(path, problem["input"], problem["ctx"]["error"], section)
    allowed = _describe(_hint_at(location, declared))
    if problem["type"] in ("missing", "missing_argument"):
        return ConfigError(f"config field {path!r}: missing; allowed: {allowed}")
    return field_error(path, problem["input"], allowed)


def _checker_error(path: str, value: Any, error: Exception, section: Any) -> ConfigError:
    """A check's own message; one across the fields of a section starts with the field
    it blames ("k: got 9; allowed: ..."), which joins the path."""
    problem = str(error)
    blamed, separator, rest = problem.partition(": ")
    if separator and dataclasses.is_dataclass(section):
        if blamed in {f.name for f in fields(section)}:
            return ConfigError(f"config field {'.'.join(filter(None, (path, blamed)))!r}: {rest}")
    if not problem.startswith("got ") and repr(value) not in problem and str(value) not in problem:
        problem = f"got {shown(value)}; {problem}"
    return ConfigError(f"config field {path!r}: {problem}")


def _path(location: tuple[int | str, ...]) -> str:
    """The dotted field path of pydantic's error location, as the YAML spells it: an
    algorithm's parameters sit beside its name, not under `params`."""
    parts = [str(part) for part in location if part != "[key]"]
    if parts[:2] == ["algorithm", "params"]:
        del parts[1]
    return ".".join(parts)


def _hint_at(location: tuple[int | str, ...], declared: Any = MeshConfig) -> Any:
    """The annotation of the field at `location`, walked down from `declared`."""
    if location and location[-1] == "[key]":  # a mapping's key: (..., mapping, key, "[key]")
        return typing.get_args(_bare(_hint_at(location[:-2], declared)))[0]
    hint: Any = declared
    for part in location:
        inner = _bare(hint)
        if dataclasses.is_dataclass(inner) and isinstance(part, str):
            hint = typing.get_type_hints(inner, include_extras=True).get(part, Any)
        elif typing.get_origin(inner) in (list, tuple, dict):
            hint = typing.get_args(inner)[-1 if typing.get_origin(inner) is dict else 0]
        else:
            return Any
    return hint


def _bare(hint: Any) -> Any:
    """`hint` without Annotated's rules and without a `| None`."""
    while True:
        if typing.get_origin(hint) is Annotated:
            hint = typing.get_args(hint)[0]
        elif typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        else:
            return hint


def _describe(hint: Any) -> str:
    """What a field annotated `hint` accepts, in the user's words: its rule's own words
    where it has a rule, else its type's."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    for layer in typing.get_args(hint) if optional else (hint,):
        for rule in getattr(layer, "__metadata__", ()):
            if getattr(rule, "description", None):
                text: str = rule.description
                return text if not optional or "null" in text else text + " or null"
    bare = _bare(hint)  # a section, or an algorithm's parameters
    text = "a mapping"
    if dataclasses.is_dataclass(bare):
        text += " with keys " + ", ".join(f.name for f in fields(bare))
    return text + " or null" if optional else text


# --------------------------------------------------------------------------- overrides


def apply_overrides(cfg: MeshConfig, assignments: list[str]) -> MeshConfig:
    """A new config with each "dotted.key=value" applied in order; values are YAML.

    `algorithm.gamma=2` sets a parameter, `algorithm=NAME` (or `algorithm.name=NAME`)
    switches the algorithm and drops the old one's parameters, which would mean nothing
    to the new one. Peers are addressed by index or name: `peers.0.listen=...`,
    `peers.node1.data.partition=...`.
    """
    raw = to_dict(cfg)  # fresh plain containers, so `cfg` is never touched
    for assignment in assignments:
        keys, value = _parse_assignment(assignment)
        _assign(raw, keys, value)
    return checked(raw)


def _parse_assignment(assignment: str) -> tuple[list[str], Any]:
    key, equals, text = assignment.partition("=")
    keys = key.strip().split(".")
    if not equals or not all(keys):
        raise ConfigError(f"override {assignment!r}: expected dotted.key=value, e.g. lr=0.1")
    return keys, _parse_yaml(text, f"override {assignment!r}")


def _assign(raw: dict[str, Any], keys: list[str], value: Any) -> None:
    if keys[0] == "algorithm" and keys[1:] in ([], ["name"]) and isinstance(value, str):
        current = raw["algorithm"]
        if not (isinstance(current, dict) and current.get("name") == value):
            raw["algorithm"] = {"name": value}
        return
    container: Any = raw
    for depth in range(1, len(keys)):
        container = _section_at(container, keys[depth - 1], keys[:depth], ".".join(keys))
    if isinstance(container, list):
        container[_list_index(container, keys[-1], ".".join(keys))] = value
    else:
        container[keys[-1]] = value  # an unknown key is reported when the config is rebuilt


def _section_at(
    container: dict[str, Any] | list[Any], key: str, walked: list[str], path: str
) -> Any:
    """The section at `key` inside `container`, reached by the keys `walked` of `path`;
    a section left null (a peer's data) becomes an empty one to fill in."""
    if isinstance(container, list):
        return container[_list_index(container, key, ".".join(walked))]
    if key not in container:
        parent = ".".join(walked[:-1])
        where = f"under {parent!r}" if parent else "at the top level"
        allowed = ", ".join(container) or "none"
        raise ConfigError(f"config field {path!r}: unknown; allowed {where}: {allowed}")
    if container[key] is None:
        container[key] = {}
    if not isinstance(container[key], (dict, list)):
        raise ConfigError(f"config field {path!r}: unknown; {'.'.join(walked)!r} is a value")
    return container[key]


def _list_index(peers: list[Any], key: str, path: str) -> int:
    """The index of a peer given by position or by name."""
    if key.isdigit() and int(key) < len(peers):
        return int(key)
    for index, peer in enumerate(peers):
        if isinstance(peer, dict) and peer.get("name") == key:
            return index
    names = [str(peer.get("name")) for peer in peers if isinstance(peer, dict)]
    allowed = f"an index 0-{len(peers) - 1} or a name: {', '.join(names)}" if peers else "none"
    raise field_error(path, key, allowed)


def to_dict(cfg: MeshConfig) -> dict[str, Any]:
    """Plain dicts, lists and scalars in the layout of peers.yaml."""
    return plain(cfg)


def plain(value: Any) -> Any:
    if isinstance(value, AlgorithmConfig):
        return {"name": value.name, **plain(value.params)}
    if isinstance(value, DataOverride):  # only what the peer changed
        return {
            f.name: plain(getattr(value, f.name))
            for f in fields(value)
            if getattr(value, f.name) is not None
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def save_config(cfg: MeshConfig, path: str | Path) -> None:
    """Write the resolved config as YAML that `load_config` reads back to an equal config."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)
    Path(path).write_text("# resolved meshfl configuration\n" + text, encoding="utf-8")
