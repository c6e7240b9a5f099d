"""`meshfl host`: run several named peers of a config in one process (node/host.py).

`meshfl launch` starts about one host per core and splits the mesh's nodes among them;
a host can also be started by hand, like `meshfl node`, for the peers it names.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

from meshfl.node.coordinator import make_node
from meshfl.node.host import FAILED, FINISHED, NodeEnd, NodeHost, raise_open_files_limit

from .entry import named_node_options, say_finished
from .errors import EXIT_NODE_FAILED, STOP_SIGNALS, Stopped, UserError
from .lifeline import watch_launcher
from .options import resolve_config


def hosted_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or len(set(names)) != len(names):
        raise UserError(
            f"--names: got {text!r}; allowed: peer names of --config, comma-separated, each once"
        )
    return names


def run_host(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    out = Path(args.out)
    options = [
        named_node_options(cfg, name, out, local_nodes=args.local_nodes)
        for name in hosted_names(args.names)
    ]
    if args.restarts < 0:
        raise UserError(f"--restarts: got {args.restarts}; allowed: 0 or more")
    raise_open_files_limit()
    host = NodeHost(options, make_node, restarts=args.restarts)

    def stop(signum: int, frame: Any) -> None:
        host.stop()
        raise Stopped(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    if args.launcher_fd is not None:
        watch_launcher(args.launcher_fd, f"host of {args.names}")
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
