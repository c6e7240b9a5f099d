"""node/datasets.py, partitions.py and splits.py on the real dataset files: loaders,
partitions, splits, errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from meshfl.node.datasets import (
    DATASETS,
    DataError,
    Pool,
    _digits_pool,
    check_dataset_name,
    load_pool,
)
from meshfl.node.partitions import assign_shards, check_partition
from meshfl.node.splits import NodeData, load_node_data, stratified_split

# --------------------------------------------------------------------------- helpers


def _all_indices(shards) -> np.ndarray:
    return np.concatenate([shard.indices for shard in shards])


def _assert_disjoint(shards) -> None:
    indices = _all_indices(shards)
    assert len(np.unique(indices)) == len(indices), "a pool index reached two nodes"


def _labels_of(pool: Pool, shard) -> set[int]:
    return set(np.unique(pool.labels[shard.indices]).tolist())


def _mean_label_entropy(pool: Pool, shards) -> float:
    entropies = []
    for shard in shards:
        counts = np.bincount(pool.labels[shard.indices], minlength=pool.num_classes)
        share = counts[counts > 0] / counts.sum()
        entropies.append(float(-(share * np.log(share)).sum()))
    return float(np.mean(entropies))


def _assert_one_line_error(error: pytest.ExceptionInfo, *words: str) -> None:
    message = str(error.value)
    assert "\n" not in message and message.strip() == message
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"


# --------------------------------------------------------------------------- loaders

# dataset, partition, nodes, samples per node, input shape, classes
LOADER_CASES = [
    ("digits", "iid", 4, None, (1, 8, 8), 10),
    ("mnist", "iid", 10, 200, (1, 28, 28), 10),
    ("fmnist", "iid", 10, 200, (1, 28, 28), 10),
    ("usps", "iid", 10, 200, (1, 16, 16), 10),
    ("cifar10", "iid", 10, 200, (3, 32, 32), 10),
    ("mnistm", "iid", 10, 200, (3, 32, 32), 10),
    ("femnist", "domains", 10, None, (1, 28, 28), 62),
    ("office", "domains", 4, None, (800,), 10),
    ("digit5", "domains", 5, 200, (3, 32, 32), 10),
    ("synthetic", "domains", 10, 300, (60,), 5),
]


@pytest.mark.parametrize(
    ("dataset", "partition", "nodes", "cap", "shape", "classes"),
    LOADER_CASES,
    ids=[case[0] for case in LOADER_CASES],
)
def test_loader_reads_real_files(
    data_root: Path, dataset, partition, nodes, cap, shape, classes
) -> None:
    data = load_node_data(
        dataset, str(data_root), partition, nodes, 1, seed=0, samples_per_node=cap
    )
    assert data.input_shape == shape and data.num_classes == classes
    parts = [(data.x_train, data.y_train), (data.x_val, data.y_val), (data.x_test, data.y_test)]
    for x, y in parts:
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert tuple(x.shape[1:]) == shape and len(x) == len(y) > 0
        assert torch.isfinite(x).all()
        assert 0 <= int(y.min()) and int(y.max()) < classes
    total = sum(len(y) for _, y in parts)
    if cap is not None and dataset != "synthetic":
        assert total == cap
    assert data.info["n_train"] == len(data.y_train)
    assert data.info["labels"] == sorted(set(data.y_train.tolist()))
    json.dumps(data.info)  # the node writes it into its metrics


def test_image_scaling_is_minus_one_to_one(data_root: Path) -> None:
    data = load_node_data("mnist", str(data_root), "iid", 10, 0, seed=0, samples_per_node=100)
    assert float(data.x_train.min()) == -1.0 and float(data.x_train.max()) == 1.0


def test_digits_is_embedded_and_ignores_root() -> None:
    data = load_node_data("digits", "/nonexistent", "iid", 1, 0, seed=0)
    assert data.info["n_train"] + data.info["n_val"] + data.info["n_test"] == 1797
    assert 0.0 <= float(data.x_train.min()) and float(data.x_train.max()) <= 1.0


def test_digits_are_scikit_learns_sample_for_sample(monkeypatch) -> None:
    """Read from scikit-learn's file without importing it, and through `load_digits`
    where the file cannot be found: the same pixels and labels either way."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    expected = (digits.images / 16.0).astype(np.float32)[:, None]
    every = np.arange(len(digits.target))
    for find_spec in (importlib.util.find_spec, lambda name: None):
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        pool = _digits_pool(None)  # not the process's cached pool
        assert np.array_equal(pool.features(every), expected)
        assert np.array_equal(pool.labels, digits.target) and pool.labels.dtype == np.int64


def test_digit5_gives_node_i_domain_i_mod_5_balanced_per_class(data_root: Path) -> None:
    pool = load_pool("digit5", str(data_root))
    shards = assign_shards(pool, "domains", 10, seed=0, samples_per_node=1000)
    _assert_disjoint(shards)
    for node, shard in enumerate(shards):
        assert shard.info["domain"] == pool.domain_names[node % 5]
        assert set(pool.domains[shard.indices]) == {node % 5}
        assert np.bincount(pool.labels[shard.indices], minlength=10).tolist() == [100] * 10


def test_digit5_domains_look_different(data_root: Path) -> None:
    means = [
        load_node_data(
            "digit5", str(data_root), "domains", 5, node, seed=0, samples_per_node=50
        ).x_train.mean(dim=(0, 2, 3))
        for node in range(5)
    ]
    mnist, _, _, mnist_inv, _ = means
    assert torch.allclose(mnist, -mnist_inv, atol=0.15)  # inverted intensity, other samples
    assert all(
        not torch.allclose(means[i], means[j], atol=0.02)
        for i in range(5)
        for j in range(i + 1, 5)
        if {i, j} != {0, 3}
    )


def test_femnist_domains_give_one_writer_per_node(data_root: Path) -> None:
    pool = load_pool("femnist", str(data_root))
    shards = assign_shards(pool, "domains", 30, seed=0)
    _assert_disjoint(shards)
    writers = [shard.info["domain"] for shard in shards]
    assert len(set(writers)) == 30
    for shard in shards:
        assert len(set(pool.domains[shard.indices])) == 1
    sizes = [len(shard.indices) for shard in shards]
    assert sizes == sorted(sizes, reverse=True)  # largest writers first
    with pytest.raises(DataError) as error:
        assign_shards(pool, "domains", len(pool.domain_names) + 1, seed=0)
    _assert_one_line_error(error, "writers")


def test_office_uses_surf_features_standardized_per_domain(data_root: Path) -> None:
    pool = load_pool("office", str(data_root))
    assert pool.domain_names == ("amazon", "caltech", "dslr", "webcam")
    assert np.bincount(pool.domains).tolist() == [958, 1123, 157, 295]
    for domain in range(4):
        features = pool.features(np.flatnonzero(pool.domains == domain))
        assert np.allclose(features.mean(axis=0), 0.0, atol=1e-4)


def test_npz_dataset_reads_x_and_y(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "mine.npz"
    np.savez(
        path, x=rng.integers(0, 256, (90, 5, 5), dtype=np.uint8), y=np.repeat(np.arange(3), 30)
    )
    data = load_node_data(f"npz:{path}", None, "iid", 1, 0, seed=0)
    assert data.input_shape == (5, 5) and data.num_classes == 3
    assert len(data.y_train) + len(data.y_val) + len(data.y_test) == 90
    assert 0.0 <= float(data.x_train.min()) and float(data.x_train.max()) <= 1.0
    np.savez(tmp_path / "bad.npz", features=np.zeros((3, 2)))
    with pytest.raises(DataError) as error:
        load_node_data(f"npz:{tmp_path / 'bad.npz'}", None, "iid", 1, 0, seed=0)
    _assert_one_line_error(error, "x and y")


def test_synthetic_users_are_non_iid_and_unbalanced() -> None:
    users = [load_node_data("synthetic", None, "domains", 30, node, seed=0) for node in range(30)]
    sizes = [data.info["n_train"] + data.info["n_val"] + data.info["n_test"] for data in users]
    assert min(sizes) >= 50 and max(sizes) > 4 * min(sizes)
    means = torch.stack([data.x_train.mean(dim=0) for data in users])
    assert float(means[:, 0].std()) > 0.5  # every user has its own feature mean
    shared = [load_node_data("synthetic", None, "iid", 30, node, seed=0) for node in range(30)]
    shared_means = torch.stack([data.x_train.mean(dim=0) for data in shared])
    assert float(shared_means[:, 0].std()) < float(means[:, 0].std()) / 2


# --------------------------------------------------------------------------- partitions


def test_iid_shards_are_disjoint_and_cover_the_pool(data_root: Path) -> None:
    pool = load_pool("mnist", str(data_root))
    shards = assign_shards(pool, "iid", 7, seed=3)
    _assert_disjoint(shards)
    assert sorted(_all_indices(shards).tolist()) == list(range(len(pool.labels)))
    sizes = [len(shard.indices) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    capped = assign_shards(pool, "iid", 7, seed=3, samples_per_node=600)
    _assert_disjoint(capped)
    assert [len(shard.indices) for shard in capped] == [600] * 7


def test_dirichlet_skew_grows_as_alpha_falls(data_root: Path) -> None:
    pool = load_pool("mnist", str(data_root))
    entropy = {}
    for alpha in (0.05, 1.0, 100.0):
        shards = assign_shards(pool, f"dirichlet:{alpha}", 10, seed=0)
        _assert_disjoint(shards)
        assert len(_all_indices(shards)) == len(pool.labels)
        assert min(len(shard.indices) for shard in shards) >= 10
        entropy[alpha] = _mean_label_entropy(pool, shards)
    assert entropy[0.05] < entropy[1.0] < entropy[100.0]
    assert entropy[100.0] > 0.95 * np.log(10)


def test_dirichlet_tiny_alpha_still_gives_every_node_samples() -> None:
    pool = load_pool("digits", None)
    shards = assign_shards(pool, "dirichlet:0.001", 40, seed=0)
    _assert_disjoint(shards)
    assert min(len(shard.indices) for shard in shards) >= 10


def test_dirichlet_cap_keeps_shards_disjoint(data_root: Path) -> None:
    pool = load_pool("mnist", str(data_root))
    shards = assign_shards(pool, "dirichlet:0.5", 10, seed=0, samples_per_node=300)
    _assert_disjoint(shards)
    assert max(len(shard.indices) for shard in shards) == 300


@pytest.mark.parametrize("cap", [None, 400])
def test_pathological_nodes_hold_exactly_their_labels(data_root: Path, cap) -> None:
    pool = load_pool("mnist", str(data_root))
    shards = assign_shards(pool, "pathological:2", 10, seed=1, samples_per_node=cap)
    _assert_disjoint(shards)
    used = set()
    for shard in shards:
        assert _labels_of(pool, shard) == set(shard.info["assigned_labels"])
        assert len(shard.info["assigned_labels"]) == 2
        used |= _labels_of(pool, shard)
    assert used == set(range(10))
    if cap is None:
        assert len(_all_indices(shards)) == len(pool.labels)
    else:
        assert all(len(shard.indices) == cap for shard in shards)


@pytest.mark.parametrize("iid_share", [0.0, 0.2, 0.5])
def test_groups_dominant_share_is_one_minus_s(data_root: Path, iid_share) -> None:
    pool = load_pool("mnist", str(data_root))
    shards = assign_shards(pool, f"groups:{iid_share}", 10, seed=0, samples_per_node=600)
    _assert_disjoint(shards)
    prior = np.bincount(pool.labels) / len(pool.labels)
    for node, shard in enumerate(shards):
        group = node % 5
        assert shard.info["group"] == group
        dominant = shard.info["dominant_labels"]
        assert dominant == sorted({(2 * group + j) % 10 for j in range(3)})  # a ring
        labels = pool.labels[shard.indices]
        share = np.isin(labels, dominant).mean()
        # The IID part is drawn from all classes, dominant ones included.
        expected = (1 - iid_share) + iid_share * prior[dominant].sum()
        assert abs(share - expected) < 0.02
        assert abs(len(labels) - 600) <= 10


@pytest.mark.parametrize("noisy", [False, True])
def test_clusters_share_exactly_their_labels(data_root: Path, noisy) -> None:
    pool = load_pool("fmnist", str(data_root))
    spec = "clusters:5:noisy" if noisy else "clusters:5"
    shards = assign_shards(pool, spec, 20, seed=0, samples_per_node=300)
    _assert_disjoint(shards)
    cluster_labels = {c: {2 * c, 2 * c + 1} for c in range(5)}
    extras = 0
    for node, shard in enumerate(shards):
        cluster = shard.info["true_cluster"]
        assert cluster == node % 5
        held = _labels_of(pool, shard)
        assert cluster_labels[cluster] <= held
        outside = held - cluster_labels[cluster]
        assert len(outside) <= (1 if noisy else 0)
        assert outside == (
            {shard.info["extra_label"]} if shard.info["extra_label"] is not None else set()
        )
        extras += len(outside)
    if noisy:
        assert 4 <= extras <= 16  # each of 20 nodes flips a fair coin


def test_domains_needs_a_dataset_with_domains(data_root: Path) -> None:
    with pytest.raises(DataError) as error:
        load_node_data("mnist", str(data_root), "domains", 4, 0, seed=0, samples_per_node=100)
    _assert_one_line_error(error, "domains", "digit5")


def test_labels_beyond_the_dataset_are_refused() -> None:
    for partition, word in (("pathological:11", "pathological"), ("clusters:11", "clusters")):
        with pytest.raises(DataError) as error:
            load_node_data("digits", None, partition, 4, 0, seed=0)
        _assert_one_line_error(error, word)


def test_too_small_shard_is_a_data_error() -> None:
    with pytest.raises(DataError) as error:
        load_node_data("digits", None, "iid", 1000, 0, seed=0)
    _assert_one_line_error(error, "node 0", "samples")


# --------------------------------------------------------------------------- splits


def test_split_is_stratified_exact_and_disjoint() -> None:
    labels = np.repeat(np.arange(5), [100, 50, 20, 7, 1])
    train, val, test = stratified_split(labels, (0.6, 0.2, 0.2), np.random.default_rng(0))
    assert (len(train), len(val), len(test)) == (106, 36, 36)  # 178 samples: round(35.6) each
    everything = np.concatenate([train, val, test])
    assert sorted(everything.tolist()) == list(range(len(labels)))
    for label, count in enumerate([100, 50, 20, 7, 1]):
        for part, fraction in ((train, 0.6), (val, 0.2), (test, 0.2)):
            held = int((labels[part] == label).sum())
            assert abs(held - fraction * count) <= 1


def test_node_split_is_stratified(data_root: Path) -> None:
    data = load_node_data("mnist", str(data_root), "iid", 10, 2, seed=0, samples_per_node=1000)
    counts = [np.bincount(y.numpy(), minlength=10) for y in (data.y_train, data.y_val, data.y_test)]
    total = sum(counts)
    assert np.all(np.abs(counts[1] - 0.2 * total) <= 1)
    assert np.all(np.abs(counts[0] - 0.6 * total) <= 1)


def test_node_splits_share_no_sample() -> None:
    # Synthetic features are continuous, so equal rows would mean the same sample.
    data = load_node_data("synthetic", None, "domains", 5, 3, seed=0, samples_per_node=500)
    rows = [tuple(row.tolist()) for x in (data.x_train, data.x_val, data.x_test) for row in x]
    assert len(set(rows)) == len(rows)


# --------------------------------------------------------------------------- determinism


def _same(a: NodeData, b: NodeData) -> bool:
    tensors = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")
    return all(torch.equal(getattr(a, t), getattr(b, t)) for t in tensors) and a.info == b.info


def test_same_seed_same_data_other_seed_other_data(data_root: Path) -> None:
    args = ("cifar10", str(data_root), "dirichlet:0.3", 10, 4)
    first = load_node_data(*args, seed=5, samples_per_node=100)
    assert _same(first, load_node_data(*args, seed=5, samples_per_node=100))
    assert not _same(first, load_node_data(*args, seed=6, samples_per_node=100))


def test_another_process_builds_the_same_shard(data_root: Path) -> None:
    script = (
        "import sys, torch\n"
        "from meshfl.node.splits import load_node_data\n"
        "d = load_node_data('usps', sys.argv[1], 'pathological:3', 6, 2, seed=9,"
        " samples_per_node=120)\n"
        "torch.save({'x': d.x_train, 'y': d.y_test}, sys.argv[2])\n"
    )
    out = data_root.parent / "usps_node2.pt"
    subprocess.run(
        [sys.executable, "-c", script, str(data_root), str(out)], check=True, timeout=120
    )
    here = load_node_data(
        "usps", str(data_root), "pathological:3", 6, 2, seed=9, samples_per_node=120
    )
    there = torch.load(out)
    assert torch.equal(there["x"], here.x_train) and torch.equal(there["y"], here.y_test)


def test_different_nodes_get_disjoint_data(data_root: Path) -> None:
    pool = load_pool("usps", str(data_root))
    for spec in ("iid", "dirichlet:0.5", "pathological:3", "groups:0.2", "clusters:5:noisy"):
        _assert_disjoint(assign_shards(pool, spec, 8, seed=2, samples_per_node=200))
    node0, node1 = (
        load_node_data("synthetic", None, "domains", 2, node, seed=0) for node in (0, 1)
    )
    assert not torch.equal(node0.x_train[:3], node1.x_train[:3])


# --------------------------------------------------------------------------- errors


def test_dataset_names() -> None:
    for name in DATASETS + ("npz:/some/file.npz",):
        check_dataset_name(name)
    for name in ("cifar100", "npz:", "MNIST", ""):
        with pytest.raises(DataError) as error:
            check_dataset_name(name)
        _assert_one_line_error(error, "mnist", "npz:PATH")


@pytest.mark.parametrize(
    "spec",
    [
        "iid",
        "dirichlet:0.1",
        "dirichlet:5",
        "pathological:2",
        "groups:0.2",
        "groups:0",
        "clusters:5",
        "clusters:5:noisy",
        "domains",
    ],
)
def test_good_partitions_parse(spec: str) -> None:
    check_partition(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "iid:3",
        "dirichlet",
        "dirichlet:0",
        "dirichlet:-1",
        "dirichlet:nan",
        "dirichlet:x",
        "pathological:0",
        "pathological:1.5",
        "groups:1.5",
        "clusters:0",
        "clusters:5:loud",
        "clusters:5:noisy:1",
        "shards:2",
        "domains:2",
    ],
)
def test_bad_partitions_are_one_line_errors(spec: str) -> None:
    with pytest.raises(DataError) as error:
        check_partition(spec)
    _assert_one_line_error(error, repr(spec), "allowed", "dirichlet:<alpha")


@pytest.mark.parametrize(
    "dataset", ["mnist", "fmnist", "usps", "cifar10", "mnistm", "femnist", "office", "digit5"]
)
def test_missing_root_names_dataset_path_and_flag(tmp_path: Path, dataset: str) -> None:
    with pytest.raises(DataError) as error:
        load_node_data(dataset, str(tmp_path), "iid", 2, 0, seed=0)
    _assert_one_line_error(error, repr(dataset), str(tmp_path), "--data-root DIR")
    with pytest.raises(DataError) as error:
        load_node_data(dataset, None, "iid", 2, 0, seed=0)
    _assert_one_line_error(error, repr(dataset), "--data-root DIR")


def test_bad_mesh_arguments_are_data_errors() -> None:
    cases = [
        dict(num_nodes=0),
        dict(node_index=4),
        dict(seed=-1),
        dict(samples_per_node=0),
        dict(split=(0.5, 0.5, 0.5)),
    ]
    for override in cases:
        args = (
            dict(dataset="digits", root=None, partition="iid", num_nodes=4, node_index=0, seed=0)
            | override
        )
        with pytest.raises(DataError) as error:
            load_node_data(**args)
        _assert_one_line_error(error)


def test_a_dataset_with_files_and_no_data_root_says_how_to_give_one(tmp_path: Path) -> None:
    with pytest.raises(DataError) as error:
        load_pool("usps", None)
    _assert_one_line_error(
        error, "none was given", "--data-root DIR", "data.root", "DIR/usps/usps.bz2"
    )
    with pytest.raises(DataError) as error:
        load_pool("usps", str(tmp_path))
    _assert_one_line_error(error, str(tmp_path / "usps" / "usps.bz2"), "not found")
