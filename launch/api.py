"""meshfl from Python: the commands as functions that return what the run reached.

    from meshfl import launch

    summary = launch(nodes=4, algorithm="fedc2i", task="task.py", rounds=20)
    print(summary["mean_test_acc"])

`launch(...)` (the `meshfl.launch` package itself is callable, a shortcut for
`meshfl.launch.run`) runs a mesh as `meshfl launch` does and returns its summary, the
content of summary.json. `run_node(...)` runs one peer of a peers.yaml inside the
calling program, as `meshfl node` does, and returns its last round's record. A
mistake the user can fix raises UserError (whichever layer found it: every such error
derives from it) with the line the command would print.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshfl.protocol.errors import UserError

from .mesh import LaunchOptions, run_launch
from .options import FLAG_FIELDS, ConfigSource, ProcessOptions

__all__ = ["UserError", "run", "run_node"]


def run(
    config: str | Path | None = None,
    *,
    nodes: int | None = None,
    algorithm: str | None = None,
    task: str | Path | None = None,
    dataset: str | None = None,
    data_root: str | Path | None = None,
    partition: str | None = None,
    samples_per_node: int | None = None,
    rounds: int | None = None,
    seed: int | None = None,
    settings: Mapping[str, Any] | None = None,
    out: str | Path | None = None,
    hosts: int | None = None,
    ray: str | None = None,
    quiet: bool = True,
    restarts: int = 0,
) -> dict[str, Any]:
    """Run a mesh of local nodes to its end, as `meshfl launch` with the same options
    does (`settings` are its `--set KEY=VALUE`s, values as Python values), and return
    its summary: `mean_test_acc`, and per node in `nodes` its `status`, `round`,
    `test_acc`, `decision`... (docs/commands-and-configuration.md). Progress lines are
    printed unless `quiet`; the result table is not. A node that failed is a node
    whose `status` is not `finished`, not an exception."""
    named = {
        "algorithm": algorithm,
        "task": task,
        "dataset": dataset,
        "data_root": data_root,
        "partition": partition,
        "samples_per_node": samples_per_node,
        "rounds": rounds,
        "seed": seed,
    }
    options = LaunchOptions(
        _config_source(config, named, settings),
        nodes=nodes,
        out=Path(out) if out is not None else None,
        hosts=hosts,
        ray=ray,
        quiet=quiet,
        restarts=restarts,
    )
    summary, _ = run_launch(options)
    return summary


def run_node(
    config: str | Path,
    name: str,
    *,
    out: str | Path = "runs/node",
    key: str | Path | None = None,
    task: str | Path | None = None,
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Run peer `name` of the peers.yaml `config` in this program, as `meshfl node` does
    (its metrics and checkpoint under `out`/`name`; a rerun resumes from it), until its
    last round; return that round's record (`round`, `test_acc`, `val_acc`, `received`...)
    or None if it ran none. It blocks the calling thread; Ctrl-C (KeyboardInterrupt)
    stops it with a `bye` to its peers. The program's signal handlers stay its own."""
    from meshfl.node.coordinator import make_node

    from .entry import named_node_options
    from .options import resolve_config
    from .run_folder import last_record

    process = ProcessOptions(_config_source(config, {"task": task}, settings), Path(out))
    own_key = str(key) if key is not None else None
    options = named_node_options(resolve_config(process.config), name, process.out, own_key)
    make_node(options, "peer").run()
    record = last_record(options.out_dir)
    return None if record is None else record.to_json()


def _config_source(
    config: str | Path | None, named: Mapping[str, Any], settings: Mapping[str, Any] | None
) -> ConfigSource:
    """The config the flags would give: `config`, then the named options given, then
    `settings`, as overrides in that order (values written as JSON, which YAML reads)."""
    given = {FLAG_FIELDS[flag]: value for flag, value in named.items() if value is not None}
    changes = {**given, **(settings or {})}
    overrides = tuple(f"{key}={_as_yaml(value)}" for key, value in changes.items())
    return ConfigSource(str(config) if config is not None else None, overrides)


def _as_yaml(value: Any) -> str:
    return json.dumps(str(value) if isinstance(value, Path) else value)
