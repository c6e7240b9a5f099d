"""Partitions: how a mesh's sample pool is dealt out to its nodes.

A simulated node never receives data from anyone: it rebuilds the whole mesh's
partition from (dataset, partition, num_nodes, seed, samples_per_node) and keeps its own
shard, so every node process arrives at the same disjoint assignment on its own.
`assign_shards` deals pool indices to nodes by the partition rule, one of
PARTITION_FORMS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .data_rules import PARTITION_FORMS, DataError, Partition, check_partition, parse_partition
from .datasets import CAP_STREAM, PARTITION_STREAM, Pool

__all__ = [
    "PARTITION_FORMS",
    "Partition",
    "Shard",
    "assign_shards",
    "check_partition",
    "parse_partition",
]

FEDREMA_GROUPS = 5
FEDREMA_LABELS_PER_GROUP = 3
DIRICHLET_MIN_SAMPLES = 10
DIRICHLET_TRIES = 100


# --------------------------------------------------------------------------- dealing shards


@dataclass
class Shard:
    """One node's pool indices and the facts that define them (group, cluster, domain)."""

    indices: np.ndarray
    info: dict = field(default_factory=dict)


def assign_shards(
    pool: Pool,
    partition: str | Partition,
    num_nodes: int,
    seed: int,
    samples_per_node: int | None = None,
) -> list[Shard]:
    """Deal pool indices to `num_nodes` nodes; shards are disjoint by construction.

    `samples_per_node` caps each shard (its size before the train/val/test split). Where a
    partition fixes per-class quotas, the quotas are drawn at that size directly, so a
    capped MNIST mesh never deals out all 60,000 samples first.
    """
    spec = parse_partition(partition) if isinstance(partition, str) else partition
    rng = np.random.default_rng((seed, PARTITION_STREAM))
    cap = samples_per_node
    deal = {
        "iid": _iid_shards,
        "dirichlet": _dirichlet_shards,
        "pathological": _pathological_shards,
        "groups": _group_shards,
        "clusters": _cluster_shards,
        "domains": _domain_shards,
    }[spec.kind]
    shards = deal(pool, spec, num_nodes, rng, cap)
    if cap is not None:
        # Partitions that deal whole classes first (dirichlet, femnist writers) are cut to
        # size here; a random subset keeps the shard's label mix.
        trim = np.random.default_rng((seed, CAP_STREAM))
        for shard in shards:
            if len(shard.indices) > cap:
                shard.indices = np.sort(trim.choice(shard.indices, size=cap, replace=False))
    return shards


def _iid_shards(
    pool: Pool, _spec: Partition, num_nodes: int, rng: np.random.Generator, cap: int | None
) -> list[Shard]:
    order = rng.permutation(len(pool.labels))
    if cap is not None:
        order = order[: cap * num_nodes]
    return [Shard(np.sort(part)) for part in np.array_split(order, num_nodes)]


def _dirichlet_shards(
    pool: Pool, spec: Partition, num_nodes: int, rng: np.random.Generator, _cap: int | None
) -> list[Shard]:
    """Label skew: each class is split over the nodes by proportions drawn from Dir(alpha).

    Draws are repeated until every node holds a few samples; a very small alpha may never
    get there, and then the smallest shards are topped up from the largest.
    """
    assert spec.param is not None, "a dirichlet partition has alpha"
    alpha = float(spec.param)
    min_size = min(DIRICHLET_MIN_SAMPLES, len(pool.labels) // num_nodes)
    by_class = [np.flatnonzero(pool.labels == c) for c in range(pool.num_classes)]
    for _ in range(DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_nodes)]
        for members in by_class:
            shares = rng.dirichlet(np.full(num_nodes, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for node, piece in enumerate(np.split(rng.permutation(members), cuts)):
                parts[node].append(piece)
        shards = [np.concatenate(pieces) for pieces in parts]
        if min(len(s) for s in shards) >= min_size:
            break
    else:
        shards = _top_up(shards, min_size, rng)
    return [Shard(np.sort(s)) for s in shards]


def _top_up(shards: list[np.ndarray], min_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Move random samples from the largest shard to each one below `min_size`."""
    shards = list(shards)
    for node in range(len(shards)):
        while len(shards[node]) < min_size:
            donor = int(np.argmax([len(s) for s in shards]))
            donated = shards[donor][rng.permutation(len(shards[donor]))]
            need = min(min_size - len(shards[node]), len(donated) - min_size)
            shards[node] = np.concatenate([shards[node], donated[:need]])
            shards[donor] = donated[need:]
    return shards


def _pathological_shards(
    pool: Pool, spec: Partition, num_nodes: int, rng: np.random.Generator, cap: int | None
) -> list[Shard]:
    """Each node holds exactly L labels: the next L slots of a stream that runs through a
    seeded label order again and again, so every label is used once num_nodes * L >=
    num_classes. Each pass starts one label later than the one before, so that later
    nodes mostly get new label sets rather than copies of the first nodes' sets. A label's
    samples are split evenly between the nodes that hold it."""
    assert spec.param is not None, "a pathological partition has labels per node"
    per_node = int(spec.param)
    if per_node > pool.num_classes:
        raise DataError(
            f"partition 'pathological:{per_node}' needs at most "
            f"{pool.num_classes} labels per node for this dataset"
        )
    label_order = rng.permutation(pool.num_classes)
    slots = [node * per_node + np.arange(per_node) for node in range(num_nodes)]
    label_sets = [label_order[(s + s // pool.num_classes) % pool.num_classes] for s in slots]
    shards = _deal_by_class(pool, label_sets, [None] * num_nodes, cap, rng)
    for shard, labels in zip(shards, label_sets, strict=True):
        shard.info["assigned_labels"] = sorted(int(c) for c in labels)
    return shards


def _group_shards(
    pool: Pool, spec: Partition, num_nodes: int, rng: np.random.Generator, cap: int | None
) -> list[Shard]:
    """FedReMa's label imbalance: node i is in group g = i % 5, whose dominant labels are
    {2g, 2g+1, 2g+2} mod num_classes: a ring over the ten labels in which neighbouring
    groups share one label, as FedReMa's own code lays them out (3g would make groups 3
    and 4 repeat two labels of groups 0 and 1, and "same group" would stop meaning "same
    data"). A share s of a node's samples is drawn IID from the pool (so it also hits
    dominant labels), the rest evenly from the dominant labels. All nodes get the same
    size: the cap, or an equal share of the pool."""
    assert spec.param is not None, "a groups partition has the iid share"
    iid_share = float(spec.param)
    size = cap if cap is not None else len(pool.labels) // num_nodes
    prior = np.bincount(pool.labels, minlength=pool.num_classes) / len(pool.labels)
    demand = np.zeros((num_nodes, pool.num_classes))
    infos = []
    for node in range(num_nodes):
        group = node % FEDREMA_GROUPS
        dominant = sorted(
            {
                ((FEDREMA_LABELS_PER_GROUP - 1) * group + j) % pool.num_classes
                for j in range(FEDREMA_LABELS_PER_GROUP)
            }
        )
        demand[node] = iid_share * size * prior
        demand[node, dominant] += (1 - iid_share) * size / len(dominant)
        infos.append({"group": group, "dominant_labels": dominant})
    quota = _integer_quota(demand, np.bincount(pool.labels, minlength=pool.num_classes), fill=False)
    shards = _deal_quota(pool.labels, quota, rng)
    for shard, info in zip(shards, infos, strict=True):
        shard.info.update(info)
    return shards


def _cluster_shards(
    pool: Pool, spec: Partition, num_nodes: int, rng: np.random.Generator, cap: int | None
) -> list[Shard]:
    """pFedLIA's clusters: node i is in cluster i % k; the labels are cut into k contiguous,
    near-equal blocks, one per cluster. `noisy`: with probability 0.5 a node also holds one
    label from outside its cluster (drawn per node, in node order, from the mesh seed)."""
    assert spec.param is not None, "a clusters partition has k"
    clusters = int(spec.param)
    if clusters > pool.num_classes:
        raise DataError(
            f"partition 'clusters:{clusters}' needs k <= {pool.num_classes}, the "
            "number of labels, so that every cluster owns a label"
        )
    cluster_labels = np.array_split(np.arange(pool.num_classes), clusters)
    label_sets, infos = [], []
    for node in range(num_nodes):
        cluster = node % clusters
        own = cluster_labels[cluster]
        extra = None
        if spec.noisy:
            outside = np.setdiff1d(np.arange(pool.num_classes), own)
            if rng.random() < 0.5 and len(outside):
                extra = int(rng.choice(outside))
        label_sets.append(own if extra is None else np.append(own, extra))
        infos.append({"true_cluster": cluster, "extra_label": extra})
    shards = _deal_by_class(pool, label_sets, [None] * num_nodes, cap, rng)
    for shard, info in zip(shards, infos, strict=True):
        shard.info.update(info)
    return shards


def _domain_shards(
    pool: Pool, _spec: Partition, num_nodes: int, rng: np.random.Generator, cap: int | None
) -> list[Shard]:
    """One domain per node: node i gets domain i % (number of domains), nodes that share a
    domain split it evenly; FEMNIST's writers are never shared (node i is writer i)."""
    if pool.domains is None:
        raise DataError(
            "partition 'domains' needs a dataset with domains (digit5, office, femnist, synthetic)"
        )
    num_domains = len(pool.domain_names)
    if pool.one_node_per_domain:
        if num_nodes > num_domains:
            raise DataError(
                f"partition 'domains' gives one writer per node, but this dataset "
                f"has {num_domains} writers for {num_nodes} nodes"
            )
        return [
            Shard(np.flatnonzero(pool.domains == node), {"domain": pool.domain_names[node]})
            for node in range(num_nodes)
        ]
    node_domains = [node % num_domains for node in range(num_nodes)]
    shards = _deal_by_class(
        pool,
        [np.arange(pool.num_classes)] * num_nodes,
        node_domains,
        cap,
        rng,
        balanced=pool.balanced_per_class,
    )
    for shard, domain in zip(shards, node_domains, strict=True):
        shard.info["domain"] = pool.domain_names[domain]
    return shards


def _deal_by_class(
    pool: Pool,
    label_sets: list[np.ndarray],
    node_domains: Sequence[int | None],
    cap: int | None,
    rng: np.random.Generator,
    balanced: bool = True,
) -> list[Shard]:
    """Give each node samples of its labels (from its domain, if it has one).

    Without a cap, every (domain, label) stratum is shared evenly by the nodes that want it,
    and nothing is left over. With a cap, a node asks for `cap` samples: the same number per
    label if `balanced`, else in the proportions of its domain; a stratum asked for more
    than it has is shared in proportion to the asks.
    """
    by_domain = any(domain is not None for domain in node_domains)
    offsets: np.ndarray | int = 0
    if by_domain:
        assert pool.domains is not None, "a node has a domain only in a pool with domains"
        offsets = pool.domains * pool.num_classes
    strata = pool.labels + offsets
    num_domains = len(pool.domain_names) if by_domain else 1
    available = np.bincount(strata, minlength=num_domains * pool.num_classes)
    demand = np.zeros((len(label_sets), len(available)))
    for node, (labels, domain) in enumerate(zip(label_sets, node_domains, strict=True)):
        columns = (domain or 0) * pool.num_classes + np.asarray(labels)
        if cap is None:
            demand[node, columns] = 1.0
        elif balanced:
            demand[node, columns] = _even_counts(cap, len(columns))
        else:
            demand[node, columns] = cap * available[columns] / max(available[columns].sum(), 1)
    quota = _integer_quota(demand, available, fill=cap is None)
    return _deal_quota(strata, quota, rng)


def _even_counts(total: int, parts: int) -> np.ndarray:
    """`total` split into `parts` integers that differ by at most one."""
    return np.array([len(chunk) for chunk in np.array_split(np.arange(total), parts)])


def _integer_quota(demand: np.ndarray, available: np.ndarray, fill: bool) -> np.ndarray:
    """Whole sample counts per (node, stratum) from real-valued demands.

    A stratum's demand is scaled down to what it holds, or, with `fill`, up to all of it.
    Rounding is by largest remainder, so no stratum is over-dealt and, with `fill`, none
    keeps leftovers.
    """
    wanted = demand.sum(axis=0)
    scale = np.divide(available, wanted, out=np.zeros(len(available)), where=wanted > 0)
    exact = demand * (scale if fill else np.minimum(scale, 1.0))
    quota = np.floor(exact + 1e-9).astype(np.int64)
    targets = np.minimum(np.round(exact.sum(axis=0)).astype(np.int64), available)
    for stratum in np.flatnonzero(targets > quota.sum(axis=0)):
        short = targets[stratum] - quota[:, stratum].sum()
        remainders = exact[:, stratum] - quota[:, stratum]
        quota[np.argsort(-remainders, kind="stable")[:short], stratum] += 1
    return quota


def _deal_quota(strata: np.ndarray, quota: np.ndarray, rng: np.random.Generator) -> list[Shard]:
    """Shuffle each stratum once and cut it into consecutive runs of the quota's sizes, so
    no index can reach two nodes."""
    pieces: list[list[np.ndarray]] = [[] for _ in range(len(quota))]
    for stratum in np.flatnonzero(quota.sum(axis=0)):
        members = rng.permutation(np.flatnonzero(strata == stratum))
        cuts = np.cumsum(quota[:, stratum])
        for node, piece in enumerate(np.split(members[: cuts[-1]], cuts[:-1])):
            pieces[node].append(piece)
    return [Shard(np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64)) for p in pieces]
