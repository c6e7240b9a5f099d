"""A node's own data: its shard of the mesh's partition, split into train/val/test.

Three steps, each seeded: the dataset's pool is read (node/datasets.py), the pool is
dealt out to the nodes by the partition rule (node/partitions.py), and the node splits
its own shard into train, validation and test, stratified by class (here). A real node
names its own files (`npz:PATH`, one node, `iid`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from .data_rules import (
    MIN_SAMPLES_PER_NODE,
    NPZ_PREFIX,
    DataError,
    check_dataset_name,
    check_samples_per_node,
    check_split,
)
from .datasets import SPLIT_STREAM, SYNTHETIC_CLASSES, SYNTHETIC_FEATURES, load_pool, synthetic_node
from .partitions import assign_shards, parse_partition
from .streamed import Inputs

__all__ = [
    "MIN_SAMPLES_PER_NODE",
    "NodeData",
    "check_samples_per_node",
    "check_split",
    "load_node_data",
    "stratified_split",
]


@dataclass
class NodeData:
    x_train: Inputs  # float32 (or int64 token ids) features, int64 labels
    y_train: torch.Tensor
    x_val: torch.Tensor  # held whole: every rule reads it, several times a round
    y_val: torch.Tensor
    x_test: Inputs
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]  # per-sample shape, e.g. (1, 8, 8), (3, 32, 32), (800,)
    info: dict  # JSON-able facts: {"domain": ...}, {"true_cluster": ...}, "labels", "n_train"


def load_node_data(
    dataset: str,
    root: str | None,
    partition: str,
    num_nodes: int,
    node_index: int,
    seed: int,
    samples_per_node: int | None = None,
    split: tuple[float, ...] = (0.6, 0.2, 0.2),
    classes: int | None = None,
) -> NodeData:
    """This node's shard of the mesh's partition, split into train/val/test.

    Deterministic in its arguments; nodes with different indices get disjoint shards.
    `samples_per_node` counts the shard before its split (digit5: an equal draw per class).
    `classes`, the mesh's number of classes where set (`pool_classes`).
    """
    check_dataset_name(dataset)
    spec = parse_partition(partition)
    _check_mesh(num_nodes, node_index, seed, samples_per_node, split)
    if dataset == "synthetic":
        # Every node is one user; 'iid' switches to the shared model, other forms are moot.
        features, labels = synthetic_node(node_index, seed, spec.kind == "iid", samples_per_node)
        num_classes = SYNTHETIC_CLASSES
        input_shape: tuple[int, ...] = (SYNTHETIC_FEATURES,)
        info: dict = {"user": node_index, "partition": "iid" if spec.kind == "iid" else "natural"}
    else:
        pool = load_pool(dataset, root)
        shard = assign_shards(pool, spec, num_nodes, seed, samples_per_node)[node_index]
        if len(shard.indices) < 3:
            raise DataError(
                f"node {node_index} got {len(shard.indices)} samples under partition "
                f"{partition!r} with {num_nodes} nodes; it needs at least 3 (one per split): "
                "use fewer nodes, a milder partition or more samples per node"
            )
        features, labels = pool.features(shard.indices), pool.labels[shard.indices]
        num_classes = pool_classes(dataset, pool.labels, pool.num_classes, classes)
        input_shape, info = pool.input_shape, shard.info
    split_rng = np.random.default_rng((seed, SPLIT_STREAM, node_index))
    fractions = cast(tuple[float, float, float], split)  # _check_mesh saw three
    train, val, test = stratified_split(labels, fractions, split_rng)
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    y = torch.from_numpy(labels.astype(np.int64))
    info = {
        **info,
        "labels": sorted(int(c) for c in np.unique(labels[train])),
        "n_train": len(train),
        "n_val": len(val),
        "n_test": len(test),
    }
    return NodeData(
        x[train], y[train], x[val], y[val], x[test], y[test], num_classes, tuple(input_shape), info
    )


def pool_classes(dataset: str, labels: np.ndarray, own: int, classes: int | None) -> int:
    """The number of classes a model of this mesh predicts: `classes` where the config
    sets it (every label must lie below it), else the dataset's `own`. An npz file's own
    count is its largest label + 1, so it must hold every label below that: a file with
    labels 1..10, or one lacking a class the other nodes' files have, would otherwise
    size the model apart from its peers' (another mesh id: a node that trains alone)."""
    if classes is not None:
        if labels.max() >= classes:
            raise DataError(
                f"dataset {dataset!r}: labels run up to {int(labels.max())}, but "
                f"data.classes is {classes}: labels are class indices 0..{classes - 1}"
            )
        return classes
    missing = sorted(set(range(own)) - {int(label) for label in np.unique(labels)})
    if dataset.startswith(NPZ_PREFIX) and missing:
        raise DataError(
            f"dataset {dataset!r}: labels {int(labels.min())}..{int(labels.max())} leave "
            f"class {', '.join(map(str, missing[:5]))} with no sample; labels are class "
            "indices 0..C-1: renumber them, or set data.classes (the mesh's number of "
            "classes) where this file lacks a class that others have"
        )
    return own


def _check_mesh(
    num_nodes: int,
    node_index: int,
    seed: int,
    samples_per_node: int | None,
    split: tuple[float, ...],
) -> None:
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise DataError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
    if not isinstance(node_index, int) or not 0 <= node_index < num_nodes:
        raise DataError(f"node_index must be an integer in 0..{num_nodes - 1}, got {node_index!r}")
    if not isinstance(seed, int) or seed < 0:
        raise DataError(f"seed must be an integer >= 0, got {seed!r}")
    checks: tuple[tuple[str, Any, Callable[[Any], None]], ...] = (
        ("samples_per_node", samples_per_node, check_samples_per_node),
        ("split", split, check_split),
    )
    for name, value, check in checks:
        try:
            check(value)
        except DataError as err:
            raise DataError(f"{name}: {err}") from None


def stratified_split(
    labels: np.ndarray, fractions: tuple[float, float, float], rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions of train, val and test with exact sizes, stratified by class.

    Each class's samples get evenly spaced random keys in [0, 1) (one per 1/n_c slot), and
    the shard is cut by key. Every cut then takes each class's share within one sample,
    and a class too small to spread (1 or 2 samples) simply lands where its keys fall.
    """
    keys = np.empty(len(labels))
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        slots = rng.permutation(len(members))
        keys[members] = (slots + rng.random(len(members))) / len(members)
    order = np.argsort(keys, kind="stable")
    total = len(labels)
    n_val, n_test = (max(1, round(total * f)) if f > 0 else 0 for f in fractions[1:])
    n_val = min(n_val, total - 1)  # train keeps at least one sample
    n_test = max(0, min(n_test, total - 1 - n_val))
    n_train = total - n_val - n_test
    # Keys ascend, so train takes each class's first slots, then val, then test.
    return (
        np.sort(order[:n_train]),
        np.sort(order[n_train : n_train + n_val]),
        np.sort(order[n_train + n_val :]),
    )
