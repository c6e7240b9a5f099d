"""The mesh configuration: typed dataclasses loaded from peers.yaml plus `--set` overrides.

Each field states its type, default and bounds once, in its annotation
(declarations.py); pydantic checks them when a file or an override is read (loading.py)
and again in `validate` (checks.py), and `config_schema` turns them into the JSON Schema
that editors use to complete and check peers.yaml (schema.py). `validate` adds what one
field cannot say alone: names against the registries of the other packages, fields that
depend on each other, the peer table. Every user mistake becomes one `ConfigError` line
that names the field, the bad value and what is allowed, so the command can print it
instead of a traceback.

This package must stay importable without torch: the registries it validates names
against are imported inside the functions that need them.
"""

from .checks import explicit_params, validate, with_explicit_params
from .declarations import (
    DEVICE_ALLOWED,
    DEVICE_PATTERN,
    AlgorithmConfig,
    AttackConfig,
    ConfigError,
    DataConfig,
    DataOverride,
    MeshConfig,
    ModelConfig,
    PeerConfig,
    TopologyConfig,
    local_peers,
)
from .loading import apply_overrides, config_from_text, load_config, save_config, to_dict
from .lookups import (
    counted,
    data_for,
    learning,
    learns_from,
    listed_peer,
    peer_by_name,
    what_runs,
)
from .schema import config_schema, write_schema

__all__ = [
    "DEVICE_ALLOWED",
    "DEVICE_PATTERN",
    "AlgorithmConfig",
    "AttackConfig",
    "ConfigError",
    "DataConfig",
    "DataOverride",
    "MeshConfig",
    "ModelConfig",
    "PeerConfig",
    "TopologyConfig",
    "apply_overrides",
    "config_from_text",
    "config_schema",
    "counted",
    "data_for",
    "explicit_params",
    "learning",
    "learns_from",
    "listed_peer",
    "load_config",
    "local_peers",
    "peer_by_name",
    "save_config",
    "to_dict",
    "validate",
    "what_runs",
    "with_explicit_params",
    "write_schema",
]
