"""`meshfl launch`: a mesh in a few processes, on this machine or a Ray cluster.

The peers run in node hosts (`meshfl host`, node/host.py), about one per core, each
host a process holding a share of the peers (placement.py); `--hosts N` gives every
peer a process of its own (`meshfl node`). A coordinator runs alone (`meshfl
coordinator`). `run_mesh` (local_mesh.py) runs them on this machine and
`run_mesh_on_ray` (ray_hosts.py) on the machines of a Ray cluster; both write under the
run folder and leave starting, watching and restarting the processes to supervise.py.
Launch shows their progress, stops them all on Ctrl-C or a stop signal (and says how
to resume), and ends with the run's summary (summary.py).

A run folder that holds a config.yaml is resumed with that config: its nodes go on
from their checkpoints. The config and the flags are read and checked here before
either runner's module is imported, so that a mistake in them answers before torch
loads.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from meshfl.node import config as cfgmod

from .errors import EXIT_NODE_FAILED, UserError
from .options import ConfigSource, resolve_config

RUN_CONFIG = "config.yaml"  # a run folder's config, as its runner wrote it


@dataclass(frozen=True)
class LaunchOptions:
    """`meshfl launch`'s flags: the config, how many local nodes (None: the config's
    peers, else 4 demo nodes), the run folder (None: runs/<time>-<rule>-<dataset>), the
    node hosts (None: about one per core), the Ray cluster's address (None: this
    machine), no live progress, and how often a failed node may be restarted."""

    config: ConfigSource
    nodes: int | None = None
    out: Path | None = None
    hosts: int | None = None
    ray: str | None = None
    quiet: bool = False
    restarts: int = 0


def launch(options: LaunchOptions) -> int:
    """`meshfl launch`: run the mesh, print its table; EXIT_NODE_FAILED when a node failed."""
    summary, out = run_launch(options)
    from .summary import failed_nodes, print_table  # torch: once the config read well

    print_table(summary)
    failed = failed_nodes(summary)
    if failed:
        print(
            f"meshfl: {len(failed)} of {len(summary['nodes'])} nodes failed: "
            f"{', '.join(failed)} (see {out / 'summary.json'})",
            file=sys.stderr,
        )
        return EXIT_NODE_FAILED
    return 0


def run_launch(options: LaunchOptions) -> tuple[dict[str, Any], Path]:
    """Run the mesh `options` describe to its end: its summary (summary.json's content)
    and its run folder. UserError for a mistake in the flags or the config."""
    saved = _saved_config(options.out)
    options = _resumed(options, saved)
    cfg = resolve_config(options.config, check=False)  # the runner checks it with its addresses
    if saved is not None:  # its nodes resume from their checkpoints, with this config or not
        check_resumable(saved, cfg, options.out)
    _check_flags(options, cfg)
    # Imported once the flags and the config are known to be good: the runners load torch.
    from .local_mesh import run_mesh, with_local_peers

    if options.nodes is not None or options.config.path is None:
        cfg = with_local_peers(cfg, options.nodes if options.nodes is not None else len(cfg.peers))
    out = options.out or Path(_default_run_dir(cfg))
    _make_run_folder(out)
    run = run_mesh
    if options.ray is not None:
        from .ray_hosts import run_mesh_on_ray  # the only module that imports Ray

        run = partial(run_mesh_on_ray, address=options.ray)
    try:
        summary = run(cfg, out, quiet=options.quiet, restarts=options.restarts, hosts=options.hosts)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: the nodes are stopped by now
        print(f"meshfl: stopped; resume with: {resume_command(options, out)}", file=sys.stderr)
        raise
    return summary, out


def _saved_config(out: Path | None) -> cfgmod.MeshConfig | None:
    """The config a run folder holds, where it holds one: the run's nodes resume there."""
    if out is None or not (out / RUN_CONFIG).is_file():
        return None
    return cfgmod.load_config(out / RUN_CONFIG)


def _resumed(options: LaunchOptions, saved: cfgmod.MeshConfig | None) -> LaunchOptions:
    """A launch into a run folder that holds its config (`saved`), without --config,
    resumes that run: its config.yaml is the base and the flags given change it
    (--rounds 40 extends it); its peers stay, so --nodes may only repeat their number.
    An explicit --config is the user's choice and is taken as given (what the run's
    checkpoints hold must still match it: `check_resumable`)."""
    if saved is None or options.out is None or options.config.path is not None:
        return options
    run_config = options.out / RUN_CONFIG
    peers = len(saved.peers)
    if options.nodes is not None and options.nodes != peers:
        raise UserError(
            f"--nodes: got {options.nodes}; the run in {options.out} has {peers} nodes, "
            "which it resumes with: leave --nodes out, or start afresh with another --out"
        )
    print(f"meshfl: resuming {options.out} with its {RUN_CONFIG}", flush=True)
    return replace(options, config=replace(options.config, path=str(run_config)), nodes=None)


# What a run's checkpoints hold the outcome of: its nodes' models, rules and shards. A
# resumed run that changed one of them would load what its nodes saved into another
# model or rule (a crash in every node) or train it on other shards (a silent mix).
# Where the data are read from (`data.root`) and whether screening runs trials may change.
CHECKPOINTED = ("mesh", "algorithm", "model", "task", "data", "seed", "local_batchnorm")
MAY_CHANGE = {"data.root", "algorithm.trials"}


def check_resumable(saved: cfgmod.MeshConfig, cfg: cfgmod.MeshConfig, out: Path | None) -> None:
    """UserError, before anything is written, for a flag that changes what the resumed
    run's checkpoints hold (`CHECKPOINTED`). Both configs with the rule's parameters
    written out, as the saved one is: a peers.yaml that leaves a default out asks for
    what the run has."""
    before, after = (cfgmod.to_dict(cfgmod.with_explicit_params(c)) for c in (saved, cfg))
    for key in CHECKPOINTED:
        changed = _first_change(key, before.get(key), after.get(key))
        if changed is not None:
            field, was, now = changed
            raise UserError(
                f"{field}: got {now!r}; the run in {out} has {was!r}, and its nodes' "
                "checkpoints hold what they learned so: leave it as it was to resume, or "
                "start afresh with another --out"
            )


def _first_change(field: str, was: Any, now: Any) -> tuple[str, Any, Any] | None:
    """The first setting under `field` that differs, as (its dotted name, was, now)."""
    if field in MAY_CHANGE or was == now:
        return None
    if isinstance(was, dict) and isinstance(now, dict):
        # A section's name first: another rule's parameters differ because its name does.
        for key in sorted(set(was) | set(now), key=lambda key: (key != "name", key)):
            changed = _first_change(f"{field}.{key}", was.get(key), now.get(key))
            if changed is not None:
                return changed
        return None
    return field, was, now


def _make_run_folder(out: Path) -> None:
    """The run folder, made before any node starts; UserError where it cannot be."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} is a file; name a folder for the run (made if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(
            f"--out: cannot make the run folder {out} ({err.strerror}); name a folder "
            "this user may write in"
        ) from None


def _check_flags(options: LaunchOptions, cfg: cfgmod.MeshConfig) -> None:
    """UserError for the first flag out of its range (--nodes counts the config's peers
    when not given)."""
    nodes = options.nodes if options.nodes is not None else len(cfg.peers)
    if nodes < 1:
        raise UserError(f"--nodes: got {nodes}; allowed: 1 or more")
    if options.restarts < 0:
        raise UserError(f"--restarts: got {options.restarts}; allowed: 0 or more")
    if options.hosts is not None and not 1 <= options.hosts <= nodes:
        raise UserError(
            f"--hosts: got {options.hosts}; allowed: 1 to the number of nodes "
            f"({nodes}), which gives every node a process of its own"
        )


def resume_command(options: LaunchOptions, out: Path) -> str:
    """The command that resumes the run in `out`: its folder (and cluster) alone once it
    holds the run's config; until then, the config flags too."""
    flags = ["--out", str(out)]
    if options.ray is not None:
        flags += ["--ray", options.ray]
    if not (out / RUN_CONFIG).is_file():
        nodes = ["--nodes", str(options.nodes)] if options.nodes is not None else []
        flags += [*options.config.argv(), *nodes]
    return shlex.join(["meshfl", "launch", *flags])


def _default_run_dir(cfg: cfgmod.MeshConfig) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{stamp}-{cfg.algorithm.name}-{cfgmod.learns_from(cfg)}")
