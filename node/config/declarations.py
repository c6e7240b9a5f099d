"""What a mesh configuration holds: frozen dataclasses whose annotations state each
field's type, default and bounds once, and `ConfigError`, the one-line error every check
of the package raises.

The dataclasses are plain (stdlib) ones, so building one in code checks nothing:
`dataclasses.replace` stays cheap, and a config assembled in code gets its checks from
`validate` (checks.py), like one loaded from a file (loading.py).
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field

from meshfl.protocol.addresses import TCP_ENDPOINT_FORM, TCP_ENDPOINT_PATTERN, tcp_endpoint
from meshfl.protocol.errors import UserError
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


class ConfigError(UserError, ValueError):
    """A mistake in the configuration; `str()` is one line fit to show the user."""

    def __init__(self, message: str) -> None:
        # Messages wrapped from other modules must not break the one-line promise.
        super().__init__(re.sub(r"\s*\n\s*", " ", message.strip()))


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def field_error(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config field {path!r}: got {shown(value)}; allowed: {allowed}")


def nearest(word: Any, names: Iterable[str]) -> str:
    """`; did you mean NAME?` for the one of `names` that `word` most likely misspells,
    else nothing."""
    close = difflib.get_close_matches(str(word), list(names), n=1)
    return f"; did you mean {close[0]}?" if close else ""


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
    # whatever it is sent. int8 by default: a quarter of float32's bytes and of the
    # memory a waiting round holds, at no accuracy measured (docs/measurements.md).
    compression: Annotated[
        Literal["none", "fp16", "bf16", "int8", "topk"],
        Field(description="none, fp16, bf16, int8 or topk"),
    ] = "int8"
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
