"""Questions a node or a command asks of a config: a peer's entry, its data settings,
what the mesh learns on."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from .declarations import ConfigError, DataConfig, MeshConfig, PeerConfig


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


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """`1 round`, `2 rounds`; `plural` where an s will not do (`process`)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def what_runs(cfg: MeshConfig) -> str:
    """The rule, what it learns on and for how long, for a launcher's first line."""
    return f"{cfg.algorithm.name} on {learning(cfg)}, {counted(cfg.rounds, 'round')}"


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
