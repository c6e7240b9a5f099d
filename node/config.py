"""The mesh configuration: typed dataclasses loaded from peers.yaml plus `--set` overrides.

Each field states its type, default and bounds once, in its annotation; pydantic checks
them when a file or an override is read and again in `validate`, and `config_schema`
turns them into the JSON Schema that editors use to complete and check peers.yaml.
`validate` adds what one field cannot say alone: names against the registries of the
other packages, fields that depend on each other, the peer table. Every user mistake
becomes one `ConfigError` line that names the field, the bad value and what is allowed,
so the command can print it instead of a traceback.

The dataclasses are plain (stdlib) ones, so building one in code checks nothing:
`dataclasses.replace` stays cheap, and a config assembled in code gets its checks from
`validate`, like one loaded from a file.

This module must stay importable without torch: the registries it validates names
against are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import re
import sys
import types
import typing
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
)

from meshfl.protocol.addresses import TCP_ENDPOINT_FORM, TCP_ENDPOINT_PATTERN, tcp_endpoint
from meshfl.protocol.identity import is_usable_public_key
from meshfl.protocol.membership import PEER_NAME
from meshfl.protocol.views import ViewSettings

DEFAULT_LOCAL_PEERS = 4
DEFAULT_HOST = "127.0.0.1"
DEFAULT_BASE_PORT = 7700

# Peer and mesh names become file names (keys, metrics folders), hence the narrow alphabet.
_NAME_ALLOWED = "1-64 characters from A-Z a-z 0-9 _ . - starting with a letter or digit"
# Also a pattern of the JSON Schema, hence no named groups: editors speak ECMAScript regex.
_LISTEN_ALLOWED = TCP_ENDPOINT_FORM
# PyYAML follows YAML 1.1, which reads `1e-3` (no dot) as a string; numbers are meant.
_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")
_MAX_SEED = 2**32 - 1  # numpy's seeding accepts no more
DEVICE_PATTERN = r"auto|cpu|mps|cuda(:[0-9]+)?"  # node/devices.py finds what it names
DEVICE_ALLOWED = "auto, cpu, cuda, cuda:N or mps"
_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


class ConfigError(ValueError):
    """A mistake in the configuration; `str()` is one line fit to show the user."""

    def __init__(self, message: str) -> None:
        # Messages wrapped from other modules must not break the one-line promise.
        super().__init__(re.sub(r"\s*\n\s*", " ", message.strip()))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field_error(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field {path!r}: got {_shown(value)}; allowed: {allowed}")


# --------------------------------------------------------------------------- field rules


def _rule(allowed: str, **bounds: Any) -> Any:
    """A field's rule: its type taken strictly (YAML's `true` is no integer and "3" no
    number), `bounds` in pydantic's terms, and `allowed`, the rule in the user's words,
    which an error names and the JSON Schema gives editors as the field's description."""
    return Field(strict=True, description=allowed, **bounds)


def _finite(allowed: str, **bounds: Any) -> Any:
    """`_rule` for a number, which must also be finite."""
    return _rule(allowed, allow_inf_nan=False, **bounds)


def _number_from_text(value: Any) -> Any:
    return float(value) if isinstance(value, str) and _NUMBER.fullmatch(value.strip()) else value


def _checked_listen(listen: str | None) -> str | None:
    if listen is not None and tcp_endpoint(listen) is None:
        raise ValueError(f"allowed: {_LISTEN_ALLOWED}")
    return listen


def _data_rule(checker: str) -> AfterValidator:
    """The rest of a data field's rule, which node/data_rules.py owns: its check, imported
    when first used, raises a DataError that says what is allowed. That module loads no
    torch, so a command answers a wrong config before it loads anything heavy."""

    def check(value: Any) -> Any:
        if value is not None:
            getattr(importlib.import_module("meshfl.node.data_rules"), checker)(value)
        return value

    return AfterValidator(check)


# A YAML 1.1 number such as `1e-3`, read as text, is a number; placed after the number's
# rule, so that the rule's bounds reach the JSON Schema as its standard keywords.
_FROM_TEXT = BeforeValidator(_number_from_text)
_LISTEN_CHECK = AfterValidator(_checked_listen)  # the port range and the host's spelling

# Every section refuses unknown keys and is checked again when handed over as a dataclass
# (a config built in code).
_SECTION = ConfigDict(extra="forbid", revalidate_instances="always")

_Name = Annotated[str, _rule(_NAME_ALLOWED, pattern=f"^{PEER_NAME.pattern}$")]
_Listen = Annotated[str, _rule(_LISTEN_ALLOWED, pattern=f"^{TCP_ENDPOINT_PATTERN}$"), _LISTEN_CHECK]
_Count = Annotated[int, _rule("an integer >= 1", ge=1)]
_Seconds = Annotated[float, _finite("seconds, finite and > 0", gt=0), _FROM_TEXT]


def _section_from_name(value: Any) -> Any:
    """`model: lenet` names the model and keeps the section's other defaults."""
    return {"name": value} if isinstance(value, str) else value


def _algorithm_from_yaml(value: Any) -> Any:
    """The algorithm section as written: its name, or its name with the algorithm's
    parameters flat beside it."""
    if isinstance(value, dict):
        params = dict(value)
        name = params.pop("name", AlgorithmConfig.name)
        return {"name": name, "params": params}
    return _section_from_name(value)


# --------------------------------------------------------------------------- the dataclasses


@dataclass(frozen=True)
class AlgorithmConfig:
    """An aggregation rule by name; `params` are its parameters (validated by the rule)."""

    __pydantic_config__ = _SECTION

    name: Annotated[str, _rule("an algorithm name")] = "fedavg"
    params: dict[Annotated[str, _rule("a parameter name, as text")], Any] = field(
        default_factory=dict
    )


@dataclass(frozen=True)
class ModelConfig:
    __pydantic_config__ = _SECTION

    name: Annotated[str, _rule("a model name")] = "mlp"
    # Which layers form the classifier head.
    head: Annotated[str, _rule("a head: last (the last layer) or fc (the dense block)")] = "last"


_Dataset = Annotated[str, _rule("a dataset name or npz:PATH"), _data_rule("check_dataset_name")]
_Root = Annotated[str, _rule("a folder path or null", min_length=1)]
_Partition = Annotated[
    str,
    _rule("a partition form, e.g. iid or dirichlet:0.5"),
    _data_rule("check_partition"),
]
_ShardSize = Annotated[
    int,
    _rule("an integer sample count, or null for the whole shard"),
    _data_rule("check_samples_per_node"),
]
_Split = Annotated[
    tuple[Annotated[float, _finite("a number"), _FROM_TEXT], ...],
    Field(description="a list of numbers: the train, validation and test shares"),
    _data_rule("check_split"),
]


@dataclass(frozen=True)
class DataConfig:
    __pydantic_config__ = _SECTION

    dataset: _Dataset = "digits"
    root: _Root | None = None  # folder of the standard layouts; its existence is the node's check
    partition: _Partition = "iid"
    samples_per_node: _ShardSize | None = None  # None: the whole shard
    split: _Split = (0.6, 0.2, 0.2)  # train, validation, test
    # The mesh's number of classes, for labels 0..classes-1; null: the dataset's own (an
    # npz file's: its largest label + 1, every label below it present). One value for
    # the whole mesh: a peer's entry cannot change it.
    classes: (
        Annotated[int, _rule("an integer >= 2, or null for the dataset's own", ge=2)] | None
    ) = None


@dataclass(frozen=True)
class DataOverride:
    """One peer's changes to the mesh-wide data settings; None keeps the mesh-wide value.

    A separate type rather than a second DataConfig, because a full DataConfig could
    not tell a field the peer set from a default, and a mesh-wide `--set data.X=...`
    must still reach the fields a peer did not set.
    """

    __pydantic_config__ = _SECTION

    dataset: _Dataset | None = None
    root: _Root | None = None
    partition: _Partition | None = None
    samples_per_node: _ShardSize | None = None
    split: _Split | None = None


@dataclass(frozen=True)
class AttackConfig:
    """Mesh members that turn malicious while signing correctly (node/attacks.py), to
    measure what the rules withstand. Not in the mesh id: an attacker looks like any
    member, and honest nodes need not know who attacks."""

    __pydantic_config__ = _SECTION

    nodes: Annotated[
        list[Annotated[str, _rule("a peer name")]], Field(description="a list of peer names")
    ] = field(default_factory=list)
    # Empty: nobody attacks.
    kind: Annotated[str, _rule("an attack, e.g. labelflip or scale:10; empty for none")] = ""


# Up to this many nodes a mesh is a full mesh unless asked otherwise; past it, each node
# keeps DEFAULT_NEIGHBOURS neighbours (WIRE.md 7.7), so its work per round stops growing
# with the mesh.
FULL_MESH_UP_TO = 32
DEFAULT_NEIGHBOURS = 8
_NEIGHBOURS_ALLOWED = "an integer >= 1, 'all' (a full mesh) or 'auto'"


def _neighbours_rule(value: Any) -> Any:
    if value in ("all", "auto") or (
        isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ):
        return value
    if isinstance(value, str) and value.strip().isdigit() and int(value) >= 1:
        return int(value)  # `--set topology.neighbours=8` arrives as text
    raise ValueError(f"allowed: {_NEIGHBOURS_ALLOWED}")


@dataclass(frozen=True)
class TopologyConfig:
    """Whom each node exchanges models with. Not in the mesh id: nodes with other view
    sizes still read each other's blobs.

    `neighbours`: how many neighbours each node keeps (its active view, WIRE.md 7.7);
    `all`, every other node (a full mesh); `auto`, a full mesh up to 32 nodes and 8
    neighbours past that. `select`: how a node of a bounded mesh changes its
    neighbours after each round: `benefit` drops the one that did least for its own
    validation split, `random` a random one (gossip learning); either way a candidate
    from the passive view takes its place, so exploring never stops. `group_by`: how a
    bounded view groups addresses to limit the places one group holds (a quarter of
    the neighbours, an eighth of the candidates): `auto` by /24 or /48 network for
    global addresses and not at all for loopback, private and link-local ones (one
    machine, a LAN); `network`, `ip` or `port` for every address."""

    __pydantic_config__ = _SECTION

    neighbours: Annotated[
        int | str, BeforeValidator(_neighbours_rule), Field(description=_NEIGHBOURS_ALLOWED)
    ] = "auto"
    select: Annotated[Literal["benefit", "random"], Field(description="benefit or random")] = (
        "benefit"
    )
    group_by: Annotated[
        Literal["auto", "network", "ip", "port"], Field(description="auto, network, ip or port")
    ] = "auto"

    def views(self, mesh_size: int) -> ViewSettings | None:
        """The views of each node of a `mesh_size`-node mesh; None: a full mesh."""
        if self.neighbours == "all" or (self.neighbours == "auto" and mesh_size <= FULL_MESH_UP_TO):
            return None
        size = DEFAULT_NEIGHBOURS if self.neighbours == "auto" else int(self.neighbours)
        return ViewSettings.keeping(
            size, friends_first=self.select == "benefit", group_by=self.group_by
        )

    def connections(self, mesh_size: int) -> int:
        """The most peers each node of a `mesh_size`-node mesh holds connections to."""
        views = self.views(mesh_size)
        return mesh_size - 1 if views is None else min(mesh_size - 1, views.connections())


def _usable_key(public_key: str) -> str:
    if not is_usable_public_key(bytes.fromhex(public_key)):
        raise ValueError("allowed: a key a node can hold; this one is of small order (WIRE.md 2)")
    return public_key


_PublicKey = Annotated[
    str,
    _rule(
        "64 hex characters (a raw 32-byte Ed25519 public key) or null", pattern="^[0-9a-fA-F]{64}$"
    ),
    AfterValidator(_usable_key),
]
_KeyFile = Annotated[str, _rule("a private key file path or null", min_length=1)]


@dataclass(frozen=True)
class PeerConfig:
    __pydantic_config__ = _SECTION

    name: _Name
    listen: _Listen  # where the node binds and where the others dial it
    public_key: _PublicKey | None = None
    key: _KeyFile | None = None  # None: <key_dir>/<name>.pem
    data: DataOverride | None = None
    # To measure stragglers: seconds this peer sleeps after its local training, every
    # round. A fixed delay rather than a multiple of the measured training time, which
    # the first round's warm-up and a busy machine would blow up.
    train_delay: Annotated[float, _finite("seconds, finite and >= 0", ge=0), _FROM_TEXT] = 0.0


def local_peers(
    count: int, host: str = DEFAULT_HOST, base_port: int = DEFAULT_BASE_PORT
) -> list[PeerConfig]:
    """`count` peers node0..node{count-1} on consecutive ports of one host."""
    if count < 1:
        raise ConfigError(f"local peer count: got {count}; allowed: 1 or more")
    if not 1 <= base_port <= 65536 - count:
        raise ConfigError(
            f"local base port: got {base_port}; allowed: 1 to {65536 - count} for {count} peers"
        )
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal needs brackets before the port
    return [
        PeerConfig(name=f"node{index}", listen=f"tcp://{host}:{base_port + index}")
        for index in range(count)
    ]


@dataclass(frozen=True)
class MeshConfig:
    """Everything one node needs to know; `MeshConfig()` is the embedded 4-node demo."""

    __pydantic_config__ = _SECTION

    mesh: _Name = "demo"
    algorithm: Annotated[
        AlgorithmConfig,
        BeforeValidator(_algorithm_from_yaml),
        Field(description="an algorithm name, or a mapping of its name and parameters"),
    ] = field(default_factory=AlgorithmConfig)
    model: Annotated[
        ModelConfig,
        BeforeValidator(_section_from_name),
        Field(description="a model name, or a mapping with keys name, head"),
    ] = field(default_factory=ModelConfig)
    # A task file (path/to/task.py) or module (package.module) with the mesh's model and
    # each node's data (node/task.py); null: the built-in `model` on the `data` dataset.
    task: (
        Annotated[str, _rule("a task file (.py) or module name, or null", min_length=1)] | None
    ) = None
    data: DataConfig = field(default_factory=DataConfig)
    rounds: _Count = 10
    local_epochs: _Count = 4
    batch_size: _Count = 32
    optimizer: Annotated[str, _rule("an optimizer name")] = "sgd"
    lr: Annotated[float, _finite("a finite number > 0", gt=0), _FROM_TEXT] = 0.05
    momentum: Annotated[float, _finite("a number >= 0 and < 1", ge=0, lt=1), _FROM_TEXT] = 0.5
    weight_decay: Annotated[float, _finite("a finite number >= 0", ge=0), _FROM_TEXT] = 0.0
    seed: Annotated[int, _rule(f"an integer 0 to {_MAX_SEED}", ge=0, le=_MAX_SEED)] = 0
    # FedBN: each node keeps its own BatchNorm layers (weights and running statistics),
    # reading every peer's as its own (node/runtime.py). A node's own affair, not the
    # mesh's: peers that differ in it still exchange the same blobs.
    local_batchnorm: Annotated[bool, _rule("true or false")] = False
    # Where this node trains and evaluates its model, and at what precision
    # (node/devices.py). A node's own affair: auto takes this machine's GPU where it has
    # one, so the peers of a LAN may each use what their machine has.
    device: Annotated[str, _rule(DEVICE_ALLOWED, pattern=f"^({DEVICE_PATTERN})$")] = "auto"
    precision: Annotated[
        Literal["fp32", "bf16", "fp16"], Field(description="fp32, bf16 or fp16")
    ] = "fp32"
    # How this node's blobs travel (protocol/codecs.py; topk: node/deltas.py). A node's
    # own affair: each blob names its codec in its signed record and a receiver decodes
    # whatever it is sent.
    compression: Annotated[
        Literal["none", "fp16", "bf16", "int8", "topk"],
        Field(description="none, fp16, bf16, int8 or topk"),
    ] = "none"
    # How long a round waits for the models it wants; a node host of more than 10 nodes
    # stretches it as it does liveness (node/runtime.py, `Node.model_wait`).
    round_timeout: _Seconds = 30.0
    # The share of the live peers whose models a round waits for (rounded up); 1.0 waits
    # for every one, less lets a round go on without the slowest (README: stragglers).
    round_quorum: Annotated[
        float, _finite("a share of the live peers, > 0 and <= 1", gt=0, le=1), _FROM_TEXT
    ] = 1.0
    heartbeat_interval: _Seconds = 1.0
    peer_timeout: _Seconds = 5.0
    closed: Annotated[bool, _rule("true or false")] = False
    # ZeroMQ CURVE on every connection (WIRE.md 1.1); false only to measure without it.
    # Not part of the mesh id: a node that does not encrypt cannot connect at all.
    encrypt: Annotated[bool, _rule("true or false")] = True
    # Listen address of the coordinator node; server-centric rules (FedReMa,
    # Fed-Influence) need one, and `meshfl launch` sets it for a local mesh.
    coordinator: _Listen | None = None
    attack: AttackConfig = field(default_factory=AttackConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    peers: Annotated[list[PeerConfig], Field(description="a list of peers")] = field(
        default_factory=lambda: local_peers(DEFAULT_LOCAL_PEERS)
    )


# --------------------------------------------------------------------------- loading


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
    return _checked(raw)


@functools.cache
def _adapter() -> TypeAdapter[MeshConfig]:
    return TypeAdapter(MeshConfig)


def _checked(value: dict[str, Any] | MeshConfig) -> MeshConfig:
    """A MeshConfig from plain YAML values, or a MeshConfig's fields checked again; the
    first broken field rule raises ConfigError."""
    try:
        return _adapter().validate_python(value)
    except ValidationError as err:
        raise _first_problem(err) from None


def _first_problem(err: ValidationError) -> ConfigError:
    problem = err.errors()[0]
    location = problem["loc"]
    path = _path(location)
    if problem["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        names = ", ".join(f.name for f in fields(_bare(_hint_at(location[:-1]))))
        return ConfigError(f"config field {path!r}: unknown key; allowed: {names}")
    if problem["type"] == "value_error":  # a check whose message says what is allowed
        return _checker_error(path, problem["input"], problem["ctx"]["error"])
    allowed = _describe(_hint_at(location))
    if problem["type"] in ("missing", "missing_argument"):
        return ConfigError(f"config field {path!r}: missing; allowed: {allowed}")
    return _field_error(path, problem["input"], allowed)


def _checker_error(path: str, value: Any, error: Exception) -> ConfigError:
    problem = str(error)
    if not problem.startswith("got ") and repr(value) not in problem and str(value) not in problem:
        problem = f"got {_shown(value)}; {problem}"
    return ConfigError(f"config field {path!r}: {problem}")


def _path(location: tuple[int | str, ...]) -> str:
    """The dotted field path of pydantic's error location, as the YAML spells it: an
    algorithm's parameters sit beside its name, not under `params`."""
    parts = [str(part) for part in location if part != "[key]"]
    if parts[:2] == ["algorithm", "params"]:
        del parts[1]
    return ".".join(parts)


def _hint_at(location: tuple[int | str, ...]) -> Any:
    """The annotation of the field at `location`, walked down from MeshConfig."""
    if location and location[-1] == "[key]":  # a mapping's key: (..., mapping, key, "[key]")
        return typing.get_args(_bare(_hint_at(location[:-2])))[0]
    hint: Any = MeshConfig
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
    return _checked(raw)


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
    raise _field_error(path, key, allowed)


# --------------------------------------------------------------------------- validation


def validate(cfg: MeshConfig) -> None:
    """Raise ConfigError for the first field that is wrong; the field rules are checked
    again so that configs built in code get the same guarantees as loaded ones."""
    _checked(cfg)
    _check_algorithm(cfg.algorithm)
    _check_model(cfg.model, cfg.algorithm.name)
    _check_task(cfg)
    _check_optimizer(cfg.optimizer)
    _check_rule_schedule(cfg)
    _check_timing(cfg)
    _check_peers(cfg)
    _check_coordinator(cfg)
    _check_attack(cfg)


def _require(path: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise _field_error(path, value, allowed)


def _check_algorithm(algorithm: AlgorithmConfig) -> None:
    from meshfl.algorithms import ALGORITHM_NAMES

    allowed = ", ".join(ALGORITHM_NAMES)
    _require("algorithm.name", algorithm.name, algorithm.name in ALGORITHM_NAMES, allowed)
    name_param = algorithm.params.get("name")  # it would collide with the name in the YAML
    _require(
        "algorithm.name", name_param, "name" not in algorithm.params, "the algorithm's name only"
    )
    _resolved_params(algorithm)


def _resolved_params(algorithm: AlgorithmConfig, rounds: int | None = None) -> Any:
    """The algorithm's parameters with its defaults filled in, or ConfigError; given
    `rounds`, those that count rounds are fitted to the run and checked against it."""
    from meshfl.algorithms import parse_params

    try:
        return parse_params(algorithm.name, algorithm.params, rounds)
    except ValueError as err:
        # The algorithms report "algorithm.<key>: <problem>"; keep their field name.
        field_name, separator, problem = str(err).partition(": ")
        if not (separator and field_name.startswith("algorithm")):
            field_name, problem = "algorithm", str(err)
        raise ConfigError(f"config field {field_name!r}: {problem}") from None


def _check_rule_schedule(cfg: MeshConfig) -> None:
    """A rule parameter that counts rounds must leave the rule's own phase inside the
    run (pFedLIA's lazy round after its warm-up, Fed-Influence's cleansing round...);
    the error names the parameter, `rounds` and the values that would work."""
    _resolved_params(cfg.algorithm, cfg.rounds)


def _check_model(model: ModelConfig, algorithm: str) -> None:
    from meshfl.algorithms import ALGORITHMS
    from meshfl.node.models import HEADS, MODELS

    _require("model.name", model.name, model.name in MODELS, ", ".join(MODELS))
    _require("model.head", model.head, model.head in HEADS, ", ".join(HEADS))
    heads = ALGORITHMS[algorithm].heads  # the algorithm name was checked before
    _require(
        "model.head",
        model.head,
        heads is None or model.head in heads,
        f"{', '.join(heads or ())} with algorithm {algorithm}",
    )


def _check_task(cfg: MeshConfig) -> None:
    """A task's model decides the number of classes (the width of its logits): a
    data.classes beside it would be a setting that does nothing."""
    if cfg.task is not None and cfg.data.classes is not None:
        raise _field_error(
            "data.classes",
            cfg.data.classes,
            "null with a task: the task's model gives the number of classes (its logits)",
        )


def _check_optimizer(optimizer: str) -> None:
    from meshfl.node.trainer import OPTIMIZERS

    _require("optimizer", optimizer, optimizer in OPTIMIZERS, ", ".join(OPTIMIZERS))


def _check_timing(cfg: MeshConfig) -> None:
    # A peer must get a chance to be heard before it is declared down.
    _require(
        "peer_timeout",
        cfg.peer_timeout,
        cfg.peer_timeout > cfg.heartbeat_interval,
        f"more than heartbeat_interval ({cfg.heartbeat_interval})",
    )


def _check_coordinator(cfg: MeshConfig) -> None:
    from meshfl.algorithms import is_coordinated

    if cfg.coordinator is not None:
        clashes = [p.name for p in cfg.peers if p.listen == cfg.coordinator]
        _require(
            "coordinator",
            cfg.coordinator,
            not clashes,
            f"an address no peer listens on (peer {', '.join(clashes)} does)",
        )
    elif is_coordinated(cfg.algorithm.name):
        _require(
            "coordinator",
            None,
            False,
            f"the coordinator's tcp://HOST:PORT: algorithm {cfg.algorithm.name} runs "
            "on a coordinator node",
        )


def _check_attack(cfg: MeshConfig) -> None:
    from meshfl.algorithms import is_coordinated
    from meshfl.node.attacks import KINDS_ALLOWED, parse_kind

    attack, names = cfg.attack, [peer.name for peer in cfg.peers]
    if not attack.nodes and not attack.kind:
        return
    _require(
        "attack.kind",
        attack.kind,
        bool(attack.kind),
        f"{KINDS_ALLOWED} (attack.nodes names attackers)",
    )
    _require(
        "attack.nodes",
        attack.nodes,
        bool(attack.nodes),
        "a list of peer names (attack.kind is set)",
    )
    for index, node in enumerate(attack.nodes):
        _require(
            f"attack.nodes.{index}",
            node,
            node in names,
            f"a name listed under peers: {', '.join(names)}",
        )
        _require(
            f"attack.nodes.{index}",
            node,
            attack.nodes.index(node) == index,
            "a name not listed twice",
        )
    try:
        spec = parse_kind(attack.kind)
    except ValueError as err:
        raise ConfigError(f"config field 'attack.kind': {err}") from None
    if spec.kind == "collude":
        _require(
            "attack.kind",
            attack.kind,
            int(spec.value or 0) <= len(attack.nodes),
            f"collude:<k> with k at most the {len(attack.nodes)} attack.nodes",
        )
    _require(
        "attack.nodes",
        attack.nodes,
        not is_coordinated(cfg.algorithm.name),
        "an empty list: attacks are measured on peer rules, and "
        f"{cfg.algorithm.name} runs on a coordinator",
    )


def _check_peers(cfg: MeshConfig) -> None:
    _check_unique(cfg.peers)
    if cfg.closed:
        _require("closed", cfg.closed, bool(cfg.peers), "false unless peers lists the members")
        for index, peer in enumerate(cfg.peers):
            _require(
                f"peers.{index}.public_key",
                peer.public_key,
                peer.public_key is not None,
                "64 hex characters; every peer needs one when closed is true",
            )


def _check_unique(peers: list[PeerConfig]) -> None:
    """Names, sockets and keys each identify one peer, so none may repeat."""
    first_index: dict[tuple[str, Any], int] = {}
    for index, peer in enumerate(peers):
        identities = {
            "name": peer.name,
            "listen": tcp_endpoint(peer.listen),
            "public_key": peer.public_key.lower() if peer.public_key else None,
        }
        for name, identity in identities.items():
            if identity is None:
                continue
            earlier = first_index.setdefault((name, identity), index)
            _require(
                f"peers.{index}.{name}",
                getattr(peer, name),
                earlier == index,
                f"a value no other peer has (peers.{earlier} has it)",
            )


# --------------------------------------------------------------------------- the JSON Schema


def config_schema() -> dict[str, Any]:
    """The JSON Schema of peers.yaml: the field rules above, the names that the other
    packages' registries allow (so that editors complete them), and the short forms of
    the sections named by a string (`algorithm: local`, `model: cnn`)."""
    from meshfl.algorithms import ALGORITHM_NAMES
    from meshfl.node.data_rules import DATASETS, NPZ_PREFIX
    from meshfl.node.models import HEADS, MODELS
    from meshfl.node.trainer import OPTIMIZERS

    schema = _adapter().json_schema()
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


# --------------------------------------------------------------------------- using a config


def to_dict(cfg: MeshConfig) -> dict[str, Any]:
    """Plain dicts, lists and scalars in the layout of peers.yaml."""
    return _plain(cfg)


def _plain(value: Any) -> Any:
    if isinstance(value, AlgorithmConfig):
        return {"name": value.name, **_plain(value.params)}
    if isinstance(value, DataOverride):  # only what the peer changed
        return {
            f.name: _plain(getattr(value, f.name))
            for f in fields(value)
            if getattr(value, f.name) is not None
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def save_config(cfg: MeshConfig, path: str | Path) -> None:
    """Write the resolved config as YAML that `load_config` reads back to an equal config."""
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)
    Path(path).write_text("# resolved meshfl configuration\n" + text, encoding="utf-8")


def shared_settings(cfg: MeshConfig) -> dict[str, Any]:
    """The settings every peer of a mesh must agree on; the node hashes them, with the
    model schema, into the mesh id, so peers that disagree never exchange blobs.

    In: the mesh name (two meshes may share a LAN), the algorithm and its parameters
    with defaults filled in (so `gamma: 5` and a default of 5 agree) and fitted to
    `rounds` (pFedLIA's warm-up: peers on another schedule would wait for blobs never
    sent), and the model with its head split (what a blob's tensors mean). Out, because
    peers may differ in them without misreading each other's blobs: rounds itself, where
    the fitted parameters agree (a peer that stops early just leaves),
    local training (personalization allows it), data (each peer has its own), timeouts
    (judged on the receiver's clock), the peer table (members join and leave) and
    whether a node's screening runs trials (what a node adopts is its own affair).
    """
    from meshfl.algorithms import TRIALS_KEY

    params = explicit_params(cfg.algorithm, cfg.rounds)
    return {
        "mesh": cfg.mesh,
        "algorithm": {
            "name": cfg.algorithm.name,
            "params": {key: value for key, value in params.items() if key != TRIALS_KEY},
        },
        # A task's model is known by its tensor layout (the schema beside these
        # settings), not by where its file lies on each machine.
        "model": "task" if cfg.task else {"name": cfg.model.name, "head": cfg.model.head},
    }


def explicit_params(algorithm: AlgorithmConfig, rounds: int) -> dict[str, Any]:
    """The algorithm's parameters with its defaults filled in and fitted to a run of
    `rounds` rounds, as plain values sorted by name, or ConfigError."""
    from meshfl.algorithms import screening_setting

    params = _resolved_params(algorithm, rounds)
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    params = {**params, **screening_setting(algorithm.name, algorithm.params)}
    return _plain(dict(sorted(params.items())))


def with_explicit_params(cfg: MeshConfig) -> MeshConfig:
    """`cfg` with every parameter of its algorithm written out, as fitted to its rounds:
    a saved config then says what ran even after a default changes, and a node given
    it runs the values the config check accepted."""
    return replace(
        cfg,
        algorithm=AlgorithmConfig(cfg.algorithm.name, explicit_params(cfg.algorithm, cfg.rounds)),
    )


def peer_by_name(cfg: MeshConfig, name: str) -> PeerConfig:
    for peer in cfg.peers:
        if peer.name == name:
            return peer
    known = ", ".join(peer.name for peer in cfg.peers) or "none (peers is empty)"
    raise ConfigError(f"peer name: got {name!r}; allowed: a name listed under peers: {known}")


def learns_from(cfg: MeshConfig) -> str:
    """What a mesh learns on, in a word for progress lines and folder names: the task's
    file (or module), else the dataset."""
    if cfg.task is None:
        return cfg.data.dataset
    return Path(cfg.task).stem if cfg.task.endswith(".py") else cfg.task.rsplit(".", 1)[-1]


def learning(cfg: MeshConfig) -> str:
    """What a mesh learns on, for a progress line: `task NAME`, or the dataset with its
    partition."""
    if cfg.task is not None:
        return f"task {learns_from(cfg)}"
    return f"{cfg.data.dataset} ({cfg.data.partition})"


def listed_peer(cfg: MeshConfig, name: str) -> PeerConfig | None:
    """The entry of node `name` in the peer list; None for a node not listed there (a
    joiner from outside the list, the coordinator)."""
    return next((peer for peer in cfg.peers if peer.name == name), None)


def data_for(cfg: MeshConfig, peer: PeerConfig | None) -> DataConfig:
    """The data settings of `peer`: its own overrides on top of the mesh-wide ones (for
    no peer, the mesh-wide ones)."""
    if peer is None or peer.data is None:
        return cfg.data
    changed = {f.name: getattr(peer.data, f.name) for f in fields(peer.data)}
    return replace(cfg.data, **{name: new for name, new in changed.items() if new is not None})


__all__ = [
    "AlgorithmConfig",
    "AttackConfig",
    "ConfigError",
    "DataConfig",
    "DataOverride",
    "MeshConfig",
    "ModelConfig",
    "PeerConfig",
    "apply_overrides",
    "config_schema",
    "data_for",
    "learning",
    "learns_from",
    "listed_peer",
    "load_config",
    "local_peers",
    "peer_by_name",
    "save_config",
    "shared_settings",
    "to_dict",
    "validate",
    "write_schema",
]
