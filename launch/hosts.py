"""`meshfl host`: run several named peers of a config in one process (node/host.py).

`meshfl launch` starts about one host per core and splits the mesh's nodes among them;
a host can also be started by hand, like `meshfl node`, for the peers it names.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import Any

from meshfl.node.coordinator import make_node
from meshfl.node.host import FAILED, FINISHED, NodeEnd, NodeHost, raise_open_files_limit
from meshfl.node.joining import JOINING_DIR, LaunchGate

from .entry import named_node_options, say_finished
from .errors import EXIT_NODE_FAILED, STOP_SIGNALS, Stopped, UserError
from .lifeline import watch_launcher
from .options import ProcessOptions, resolve_config


def hosted_names(text: str) -> list[str]:
    """--names: the peer names it lists, comma-separated, each once."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or len(set(names)) != len(names):
        raise UserError(
            f"--names: got {text!r}; allowed: peer names of --config, comma-separated, each once"
        )
    return names


def run_host(
    process: ProcessOptions, names: list[str], restarts: int = 0, join_with: int = 0
) -> int:
    """`meshfl host`: run the peers `names` of the config in this process until each has
    ended, starting one that fails again at once, up to `restarts` times (node/host.py);
    EXIT_NODE_FAILED when one failed for good. `join_with`: how many hosts of one launch,
    this one included, join the mesh together once each has built its nodes (under
    --out, node/joining.py); 0 or 1: this host joins as soon as its nodes are built."""
    cfg = resolve_config(process.config)
    options = [
        replace(
            named_node_options(cfg, name, process.out, local_nodes=process.local_nodes),
            host_nodes=len(names),
        )
        for name in names
    ]
    if restarts < 0:
        raise UserError(f"--restarts: got {restarts}; allowed: 0 or more")
    if join_with < 0:
        raise UserError(f"--join-with: got {join_with}; allowed: 0 or more")
    gate = LaunchGate(process.out / JOINING_DIR, names[0], join_with) if join_with > 1 else None
    raise_open_files_limit()
    host = NodeHost(options, make_node, restarts=restarts, gate=gate)

    def stop(signum: int, frame: Any) -> None:
        host.stop()
        raise Stopped(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    if process.launcher_fd is not None:
        watch_launcher(process.launcher_fd, f"host of {','.join(names)}")
    try:
        ends = host.run()
    except KeyboardInterrupt:
        host.stop()  # Ctrl-C: every node says bye; their last rounds are checkpointed
        raise
    for each in options:
        if ends.get(each.name, NodeEnd(FAILED)).status == FINISHED:  # the others said why
            say_finished(each)
    # A host whose nodes did not all finish fails as a launch does (node.log says why).
    return EXIT_NODE_FAILED if any(end.status == FAILED for end in ends.values()) else 0
