"""What a node process is told: where its MeshConfig comes from, and where it runs.

The command line (cli.py) turns a command's config flags (--config, --algorithm, --set
...) into a `ConfigSource`, and a node process's other flags into `ProcessOptions`;
`meshfl launch` builds the same options for the processes it forks, and
`ProcessOptions.argv` gives them back as flags for a fresh interpreter.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from meshfl.node import config as cfgmod

# The config fields that have a flag of their own (cli.py), by the flag's dest.
FLAG_FIELDS = {
    "algorithm": "algorithm",
    "task": "task",
    "dataset": "data.dataset",
    "data_root": "data.root",
    "partition": "data.partition",
    "samples_per_node": "data.samples_per_node",
    "rounds": "rounds",
    "seed": "seed",
}


@dataclass(frozen=True)
class ConfigSource:
    """A MeshConfig as the flags give it: the peers.yaml at `path` (None: the built-in
    demo settings) with `overrides` (KEY=VALUE, as --set takes them) applied in order."""

    path: str | None = None
    overrides: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        config = ["--config", self.path] if self.path is not None else []
        return config + [flag for each in self.overrides for flag in ("--set", each)]


@dataclass(frozen=True)
class ProcessOptions:
    """What every node process takes (`meshfl node`, `host`, `coordinator`, `join`): its
    config, the run folder it writes under, how many nodes share this machine's cores
    (for their torch threads), and the lifeline of the launcher that started it, if one
    did (lifeline.py)."""

    config: ConfigSource
    out: Path
    local_nodes: int = 1
    launcher_fd: int | None = None

    def argv(self) -> list[str]:
        """These options as the flags of a `meshfl` command line."""
        lifeline = ["--launcher-fd", str(self.launcher_fd)] if self.launcher_fd is not None else []
        return [
            *self.config.argv(),
            *("--out", str(self.out), "--local-nodes", str(self.local_nodes)),
            *lifeline,
        ]


def add_assignments(parser: argparse.ArgumentParser, help: str) -> None:
    """--set KEY=VALUE, repeatable: config changes, read as `args.assignments`."""
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="assignments", help=help
    )


def config_source(args: argparse.Namespace) -> ConfigSource:
    """A command's config flags: --config, then the named flags given and --set, as
    overrides in that order."""
    named = [
        f"{key}={getattr(args, flag)}"
        for flag, key in FLAG_FIELDS.items()
        if getattr(args, flag, None) is not None
    ]
    return ConfigSource(args.config, (*named, *args.assignments))


def process_options(args: argparse.Namespace) -> ProcessOptions:
    """A node process's flags: its config flags, --out, --local-nodes, --launcher-fd."""
    return ProcessOptions(
        config_source(args), Path(args.out), args.local_nodes, getattr(args, "launcher_fd", None)
    )


def joiner_out(name: str | None) -> Path:
    """`meshfl join`'s folder without --out: runs/join-NAME for the name it joins as (a
    rejoin under that name finds its key and checkpoint again), else a new
    runs/join-<time>-<pid>. Either way two joiners on one machine never share a folder:
    its key and checkpoint are the joiner's own."""
    if name is not None:
        return Path("runs", f"join-{name}")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs", f"join-{stamp}-{os.getpid()}")


def _task_from(cfg: cfgmod.MeshConfig, folder: Path) -> cfgmod.MeshConfig:
    """`cfg` with its task file's path made absolute from `folder`: the file the
    command means, wherever the nodes it starts (or a rerun) stand. A module name, or a
    path already absolute, stays as it is."""
    if cfg.task is None or not cfg.task.endswith(".py"):
        return cfg
    return replace(cfg, task=str((folder / Path(cfg.task).expanduser()).resolve()))


def resolve_config(source: ConfigSource, check: bool = True) -> cfgmod.MeshConfig:
    """The config `source` names with its overrides applied; checked unless `check` is
    False."""
    cfg = cfgmod.load_config(source.path)
    if source.path is not None:  # a task file a peers.yaml names lies beside it
        cfg = _task_from(cfg, Path(source.path).parent)
    cfg = _task_from(cfgmod.apply_overrides(cfg, list(source.overrides)), Path.cwd())
    if check:
        cfgmod.validate(cfg)
        # The node runs the rule parameters the check fitted to `rounds` (a warm-up).
        cfg = cfgmod.with_explicit_params(cfg)
    return cfg
