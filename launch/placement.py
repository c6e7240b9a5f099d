"""How many processes a mesh's nodes share, and which nodes each runs.

Both mesh runners use it: a local launch (local_mesh.py) for this machine, a Ray launch
(ray_hosts.py) for each machine of the cluster.
"""

from __future__ import annotations

import math
import os

from meshfl.node.host import files_per_node, raise_open_files_limit


def default_hosts(peers: int, links: int) -> int:
    """About one node host per core, so each host's torch has a core of its own; more
    where the connections of nodes with `links` peers each would not fit one process's
    open-files limit."""
    per_core = min(peers, os.cpu_count() or 1)
    return max(1, per_core, min(peers, hosts_by_files(peers, links)))


def hosts_by_files(count: int, links: int) -> int:
    """The hosts `count` nodes connected to `links` peers each need so that each host's
    connections fit the open-files limit, with a fifth of it to spare."""
    return math.ceil(count * files_per_node(links) / (0.8 * raise_open_files_limit()))


def host_groups(names: list[str], hosts: int) -> list[list[str]]:
    """`names` in `hosts` runs of consecutive names, as even in size as can be."""
    size, extra = divmod(len(names), hosts)
    groups, start = [], 0
    for index in range(hosts):
        end = start + size + (index < extra)
        groups.append(names[start:end])
        start = end
    return groups


def host_label(index: int, names: list[str]) -> str:
    """What the process of `names`, the `index`-th, is called: a lone node's name, else
    host<index>."""
    return names[0] if len(names) == 1 else f"host{index}"
