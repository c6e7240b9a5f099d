"""The mesh configuration: typed dataclasses loaded from peers.yaml plus `--set` overrides.

Loading checks the shape of the file (known keys, value types); `validate` checks
everything else (ranges, names against the registries of the other packages, the
peer table). Every user mistake becomes one `ConfigError` line that names the field,
the bad value and what is allowed, so the command can print it instead of a traceback.

This module must stay importable without torch: the registries it validates names
against are imported inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import types
import typing
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from meshfl.protocol.membership import PEER_NAME

DEFAULT_LOCAL_PEERS = 4
DEFAULT_HOST = "127.0.0.1"
DEFAULT_BASE_PORT = 7700

# Peer and mesh names become file names (keys, metrics folders), hence the narrow alphabet.
_NAME = PEER_NAME
_NAME_ALLOWED = "1-64 characters from A-Z a-z 0-9 _ . - starting with a letter or digit"
_LISTEN = re.compile(r"tcp://(?P<host>\[[^\]]*\]|[^:/\[\]]+):(?P<port>[0-9]{1,5})")
_LISTEN_ALLOWED = "tcp://HOST:PORT, HOST a hostname, IPv4 or [IPv6] address, 1 <= PORT <= 65535"
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*")
_PUBLIC_KEY = re.compile(r"[0-9a-fA-F]{64}")
# PyYAML follows YAML 1.1, which reads `1e-3` (no dot) as a string; numbers are meant.
_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")
_MAX_SEED = 2**32 - 1  # numpy's seeding accepts no more


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


# --------------------------------------------------------------------------- the dataclasses


@dataclass(frozen=True)
class AlgorithmConfig:
    """An aggregation rule by name; `params` are its parameters (validated by the rule)."""

    name: str = "fedavg"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"
    head: str = "last"  # which layers form the classifier head (`last` or `fc`)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "digits"
    root: str | None = None  # folder of the standard layouts; its existence is the node's check
    partition: str = "iid"
    samples_per_node: int | None = None  # None: the whole shard
    split: tuple[float, ...] = (0.6, 0.2, 0.2)  # train, validation, test


@dataclass(frozen=True)
class DataOverride:
    """One peer's changes to the mesh-wide data settings; None keeps the mesh-wide value.

    A separate type rather than a second DataConfig, because a full DataConfig could
    not tell a field the peer set from a default, and a mesh-wide `--set data.X=...`
    must still reach the fields a peer did not set.
    """

    dataset: str | None = None
    root: str | None = None
    partition: str | None = None
    samples_per_node: int | None = None
    split: tuple[float, ...] | None = None


@dataclass(frozen=True)
class AttackConfig:
    """Mesh members that turn malicious while signing correctly (node/attacks.py), to
    measure what the rules withstand. Not in the mesh id: an attacker looks like any
    member, and honest nodes need not know who attacks."""

    nodes: list[str] = field(default_factory=list)  # peer names
    kind: str = ""  # e.g. labelflip, scale:10; empty: nobody attacks


@dataclass(frozen=True)
class PeerConfig:
    name: str
    listen: str  # tcp://HOST:PORT, where the node binds and where the others dial it
    public_key: str | None = None  # hex of the raw 32-byte Ed25519 key
    key: str | None = None  # private key PEM path; None: <key_dir>/<name>.pem
    data: DataOverride | None = None
    # To measure stragglers: seconds this peer sleeps after its local training, every
    # round. A fixed delay rather than a multiple of the measured training time, which
    # the first round's warm-up and a busy machine would blow up.
    train_delay: float = 0.0


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

    mesh: str = "demo"
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rounds: int = 10
    local_epochs: int = 4
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    round_timeout: float = 30.0
    # The share of the live peers whose models a round waits for (rounded up); 1.0 waits
    # for every one, less lets a round go on without the slowest (README: stragglers).
    round_quorum: float = 1.0
    heartbeat_interval: float = 1.0
    peer_timeout: float = 5.0
    closed: bool = False
    # ZeroMQ CURVE on every connection (WIRE.md 1.1); false only to measure without it.
    # Not part of the mesh id: a node that does not encrypt cannot connect at all.
    encrypt: bool = True
    # Listen address of the coordinator node; server-centric rules (FedReMa,
    # Fed-Influence) need one, and `meshfl launch` sets it for a local mesh.
    coordinator: str | None = None
    attack: AttackConfig = field(default_factory=AttackConfig)
    peers: list[PeerConfig] = field(default_factory=lambda: local_peers(DEFAULT_LOCAL_PEERS))


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
    their defaults. Checks the file's shape; call `validate` after any overrides."""
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
    return _coerce(raw, MeshConfig, "")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _describe(hint: Any) -> str:
    """What a field of type `hint` accepts, in the user's words."""
    optional, hint = _unwrap_optional(hint)
    if dataclasses.is_dataclass(hint):
        text = "a mapping with keys " + ", ".join(f.name for f in fields(hint))
    elif typing.get_origin(hint) is list:
        text = "a list of names" if typing.get_args(hint) == (str,) else "a list of peers"
    elif typing.get_origin(hint) is tuple:
        text = "a list of numbers"
    else:
        words = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
        text = words.get(hint, "a mapping")
    return text + " or null" if optional else text


def _unwrap_optional(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return True, others[0]
    return False, hint


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """`value` as the type `hint`: raw YAML is converted, a dataclass instance is checked
    field by field, and a wrong type raises ConfigError naming `path`."""
    optional, hint = _unwrap_optional(hint)
    if value is None:
        if optional:
            return None
        raise _field_error(path, value, _describe(hint))
    if hint is AlgorithmConfig:
        return _algorithm(value, path)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _section(hint, value, path)
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _field_error(path, value, _describe(hint))
        item_hint = typing.get_args(hint)[0]
        items = [_coerce(item, item_hint, _join(path, i)) for i, item in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
            raise _field_error(path, value, "a mapping with string keys")
        return dict(value)
    return _scalar(value, hint, path)


def _scalar(value: Any, hint: type, path: str) -> Any:
    # bool is an int to Python, but `rounds: true` or `closed: 1` is a mistake.
    if isinstance(value, bool) == (hint is bool):
        if hint is float and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
        if hint is float and isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, hint):
            return value
    raise _field_error(path, value, _describe(hint))


def _section(cls: type, value: Any, path: str) -> Any:
    names = [f.name for f in fields(cls)]
    if isinstance(value, cls):
        value = {name: getattr(value, name) for name in names}
    elif isinstance(value, str) and "name" in names:
        value = {"name": value}  # `model: lenet` names the model and keeps the defaults
    if not isinstance(value, dict):
        raise _field_error(path, value, _describe(cls))
    for key in value:
        if key not in names:
            raise ConfigError(
                f"config field {_join(path, key)!r}: unknown key; allowed: {', '.join(names)}"
            )
    for required in fields(cls):
        no_default = required.default is dataclasses.MISSING
        if no_default and required.default_factory is dataclasses.MISSING:
            if required.name not in value:
                raise ConfigError(f"config field {_join(path, required.name)!r}: missing")
    hints = typing.get_type_hints(cls)
    return cls(**{key: _coerce(item, hints[key], _join(path, key)) for key, item in value.items()})


def _algorithm(value: Any, path: str) -> AlgorithmConfig:
    """The algorithm section: its name plus, flat beside it, the algorithm's parameters."""
    if isinstance(value, AlgorithmConfig):
        name, params = value.name, value.params
    elif isinstance(value, str):
        name, params = value, {}
    elif isinstance(value, dict):
        params = dict(value)
        name = params.pop("name", AlgorithmConfig.name)
    else:
        raise _field_error(path, value, "an algorithm name or a mapping with name and parameters")
    name = _scalar(name, str, _join(path, "name"))
    params = _coerce(params, dict[str, Any], path)
    if "name" in params:  # it would collide with the algorithm's name in the YAML
        raise _field_error(_join(path, "name"), params["name"], "the algorithm's name only")
    return AlgorithmConfig(name=name, params=params)


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
    return _coerce(raw, MeshConfig, "")


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
    """Raise ConfigError for the first field that is wrong; the file's shape is checked
    again so that configs built in code get the same guarantees as loaded ones."""
    _coerce(cfg, MeshConfig, "")
    _check_name("mesh", cfg.mesh)
    _check_algorithm(cfg.algorithm)
    _check_model(cfg.model, cfg.algorithm.name)
    _check_data(cfg.data, "data", [f.name for f in fields(DataConfig)])
    _check_training(cfg)
    _check_rule_schedule(cfg)
    _check_timing(cfg)
    _check_peers(cfg)
    _check_coordinator(cfg)
    _check_attack(cfg)


def _require(path: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise _field_error(path, value, allowed)


def _check_name(path: str, name: str) -> None:
    _require(path, name, bool(_NAME.fullmatch(name)), _NAME_ALLOWED)


def _check_algorithm(algorithm: AlgorithmConfig) -> None:
    from meshfl.algorithms import ALGORITHM_NAMES

    allowed = ", ".join(ALGORITHM_NAMES)
    _require("algorithm.name", algorithm.name, algorithm.name in ALGORITHM_NAMES, allowed)
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


def _check_data(data: DataConfig, prefix: str, names: Iterable[str]) -> None:
    """Check the fields `names` of `data`, reporting them under `prefix`."""
    from meshfl.node.datasets import check_dataset_name
    from meshfl.node.partitions import check_partition
    from meshfl.node.splits import check_samples_per_node, check_split

    # The data modules own the bounds of these fields, checked here once with the field named.
    checkers: dict[str, typing.Callable[[Any], None]] = {
        "dataset": check_dataset_name,
        "partition": check_partition,
        "samples_per_node": check_samples_per_node,
        "split": check_split,
    }
    for name in names:
        path, value = f"{prefix}.{name}", getattr(data, name)
        if name in checkers:
            _check_with(checkers[name], path, value)
        elif name == "root":
            _require(path, value, value is None or bool(value), "a folder path or null")


def _check_with(checker: typing.Callable[[Any], Any], path: str, value: Any) -> None:
    """Run a data module check, whose DataError message already says what is allowed."""
    try:
        checker(value)
    except ValueError as err:
        problem = str(err)
        if repr(value) not in problem and str(value) not in problem:
            problem = f"got {_shown(value)}; {problem}"
        raise ConfigError(f"config field {path!r}: {problem}") from None


def _check_training(cfg: MeshConfig) -> None:
    from meshfl.node.trainer import OPTIMIZERS

    _require("rounds", cfg.rounds, cfg.rounds >= 1, "an integer >= 1")
    _require("local_epochs", cfg.local_epochs, cfg.local_epochs >= 1, "an integer >= 1")
    _require("batch_size", cfg.batch_size, cfg.batch_size >= 1, "an integer >= 1")
    _require("optimizer", cfg.optimizer, cfg.optimizer in OPTIMIZERS, ", ".join(OPTIMIZERS))
    _require("lr", cfg.lr, math.isfinite(cfg.lr) and cfg.lr > 0, "a finite number > 0")
    _require("momentum", cfg.momentum, 0 <= cfg.momentum < 1, "a number >= 0 and < 1")
    decay_ok = math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0
    _require("weight_decay", cfg.weight_decay, decay_ok, "a finite number >= 0")
    _require("seed", cfg.seed, 0 <= cfg.seed <= _MAX_SEED, f"an integer 0 to {_MAX_SEED}")


def _check_timing(cfg: MeshConfig) -> None:
    for name in ("round_timeout", "heartbeat_interval", "peer_timeout"):
        seconds = getattr(cfg, name)
        _require(name, seconds, math.isfinite(seconds) and seconds > 0, "seconds, finite and > 0")
    # A peer must get a chance to be heard before it is declared down.
    _require(
        "peer_timeout",
        cfg.peer_timeout,
        cfg.peer_timeout > cfg.heartbeat_interval,
        f"more than heartbeat_interval ({cfg.heartbeat_interval})",
    )
    _require(
        "round_quorum",
        cfg.round_quorum,
        0 < cfg.round_quorum <= 1,
        "a share of the live peers, > 0 and <= 1",
    )


def _check_coordinator(cfg: MeshConfig) -> None:
    from meshfl.algorithms import is_coordinated

    if cfg.coordinator is not None:
        _require(
            "coordinator",
            cfg.coordinator,
            _listen_identity(cfg.coordinator) is not None,
            _LISTEN_ALLOWED,
        )
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
    for index, peer in enumerate(cfg.peers):
        _check_peer(cfg, f"peers.{index}", peer)
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


def _check_peer(cfg: MeshConfig, path: str, peer: PeerConfig) -> None:
    _check_name(f"{path}.name", peer.name)
    _require(
        f"{path}.listen", peer.listen, _listen_identity(peer.listen) is not None, _LISTEN_ALLOWED
    )
    key_ok = peer.public_key is None or bool(_PUBLIC_KEY.fullmatch(peer.public_key))
    _require(
        f"{path}.public_key",
        peer.public_key,
        key_ok,
        "64 hex characters (a raw 32-byte Ed25519 public key) or null",
    )
    _require(
        f"{path}.key",
        peer.key,
        peer.key is None or bool(peer.key),
        "a private key file path or null",
    )
    _require(
        f"{path}.train_delay",
        peer.train_delay,
        math.isfinite(peer.train_delay) and peer.train_delay >= 0,
        "seconds, finite and >= 0",
    )
    if peer.data is not None:
        overridden = [f.name for f in fields(peer.data) if getattr(peer.data, f.name) is not None]
        _check_data(data_for(cfg, peer), f"{path}.data", overridden)


def _listen_identity(listen: str) -> tuple[str, int] | None:
    """(host, port) of a valid listen address, to spot two peers on one socket; else None."""
    match = _LISTEN.fullmatch(listen)
    if not match or not 1 <= int(match["port"]) <= 65535:
        return None
    host = match["host"]
    try:
        if host.startswith("["):
            host = f"[{ipaddress.IPv6Address(host[1:-1])}]"
        elif host.replace(".", "").isdigit():
            host = str(ipaddress.IPv4Address(host))
        elif not _HOSTNAME.fullmatch(host):
            return None
    except ValueError:
        return None
    if host.lower() == "localhost":  # the loopback's name: the same socket as 127.0.0.1
        host = "127.0.0.1"
    return host.lower(), int(match["port"])


def _check_unique(peers: list[PeerConfig]) -> None:
    """Names, sockets and keys each identify one peer, so none may repeat."""
    first_index: dict[tuple[str, Any], int] = {}
    for index, peer in enumerate(peers):
        identities = {
            "name": peer.name,
            "listen": _listen_identity(peer.listen),
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
    (judged on the receiver's clock) and the peer table (members join and leave).
    """
    return {
        "mesh": cfg.mesh,
        "algorithm": {
            "name": cfg.algorithm.name,
            "params": explicit_params(cfg.algorithm, cfg.rounds),
        },
        "model": {"name": cfg.model.name, "head": cfg.model.head},
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


def data_for(cfg: MeshConfig, peer: PeerConfig) -> DataConfig:
    """The data settings of `peer`: its own overrides on top of the mesh-wide ones."""
    if peer.data is None:
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
    "data_for",
    "load_config",
    "local_peers",
    "peer_by_name",
    "save_config",
    "shared_settings",
    "to_dict",
    "validate",
]
