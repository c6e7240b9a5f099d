"""What one field's rule cannot say alone: names against the registries of the other
packages (imported inside the checks, so that the config loads without torch), fields
that depend on each other, the peer table, and each algorithm's parameters as its rule
resolves them."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from meshfl.protocol.addresses import tcp_endpoint

from .declarations import (
    AlgorithmConfig,
    ConfigError,
    MeshConfig,
    ModelConfig,
    PeerConfig,
    field_error,
    nearest,
)
from .loading import checked, first_problem, plain


def validate(cfg: MeshConfig) -> None:
    """Raise ConfigError for the first field that is wrong; the field rules are checked
    again so that configs built in code get the same guarantees as loaded ones."""
    checked(cfg)
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
        raise field_error(path, value, allowed)


def _check_algorithm(algorithm: AlgorithmConfig) -> None:
    from meshfl.algorithms import ALGORITHM_NAMES

    allowed = ", ".join(ALGORITHM_NAMES) + nearest(algorithm.name, ALGORITHM_NAMES)
    _require("algorithm.name", algorithm.name, algorithm.name in ALGORITHM_NAMES, allowed)
    name_param = algorithm.params.get("name")  # it would collide with the name in the YAML
    _require(
        "algorithm.name", name_param, "name" not in algorithm.params, "the algorithm's name only"
    )
    _resolved_params(algorithm)


def _resolved_params(algorithm: AlgorithmConfig, rounds: int | None = None) -> Any:
    """The algorithm's parameters with its defaults filled in, or ConfigError; given
    `rounds`, those that count rounds are fitted to the run and checked against it."""
    from meshfl.algorithms import SCREEN_KEY, TRIALS_KEY, algorithm_class, parse_params

    try:
        return parse_params(algorithm.name, algorithm.params, rounds)
    except ValidationError as err:  # a broken rule of the Params, as any config field's
        rule = algorithm_class(algorithm.name)
        screening = (SCREEN_KEY, TRIALS_KEY) if rule.screenable else ()
        raise first_problem(err, rule.Params, ("algorithm",), screening) from None
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
        raise field_error(
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


def explicit_params(algorithm: AlgorithmConfig, rounds: int) -> dict[str, Any]:
    """The algorithm's parameters with its defaults filled in and fitted to a run of
    `rounds` rounds, as plain values sorted by name, or ConfigError."""
    from meshfl.algorithms import screening_setting

    params = _resolved_params(algorithm, rounds)
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    params = {**params, **screening_setting(algorithm.name, algorithm.params)}
    return plain(dict(sorted(params.items())))


def with_explicit_params(cfg: MeshConfig) -> MeshConfig:
    """`cfg` with every parameter of its algorithm written out, as fitted to its rounds:
    a saved config then says what ran even after a default changes, and a node given
    it runs the values the config check accepted."""
    return replace(
        cfg,
        algorithm=AlgorithmConfig(cfg.algorithm.name, explicit_params(cfg.algorithm, cfg.rounds)),
    )
