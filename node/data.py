"""Datasets, partitions and each node's own train/val/test split.

A simulated node never receives data from anyone: it rebuilds the whole mesh's
partition from (dataset, partition, num_nodes, seed, samples_per_node) and keeps
its own shard, so every node process arrives at the same disjoint assignment on
its own. A real node names its own files (`npz:PATH`, one node, `iid`).

Three steps, each seeded:

1. `load_pool` reads a dataset's sample pool from the user's `--data-root`:
   labels eagerly, features lazily (only the node's own samples are converted to
   float, so a CIFAR-10 node decodes its own few hundred JPEGs, not 10,000).
2. `assign_shards` deals pool indices to nodes by the partition rule.
3. The node splits its shard into train/val/test, stratified by class.

Features are float32. Images are scaled to [0, 1] and then mapped to [-1, 1] by
(x - 0.5) / 0.5, except `digits` (x / 16, in [0, 1], as scikit-learn gives it).
`office` gives standardized SURF histograms, `synthetic` raw Gaussian features, and
`npz:PATH` its x as stored (uint8 divided by 255).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch

__all__ = [
    "DATASETS",
    "PARTITION_FORMS",
    "DataError",
    "NodeData",
    "Partition",
    "Pool",
    "Shard",
    "assign_shards",
    "check_dataset_name",
    "check_partition",
    "load_node_data",
    "load_pool",
    "parse_partition",
    "stratified_split",
]


class DataError(ValueError):
    """A user mistake about data: message is one clear line naming what is wrong and what is
    allowed."""


DATASETS: tuple[str, ...] = (
    "digits",
    "mnist",
    "fmnist",
    "usps",
    "cifar10",
    "mnistm",
    "femnist",
    "office",
    "synthetic",
    "digit5",
)
NPZ_PREFIX = "npz:"
PARTITION_FORMS = (
    "iid, dirichlet:<alpha > 0>, pathological:<labels per node >= 1>, "
    "groups:<iid share s in [0, 1]>, clusters:<k >= 1>, clusters:<k>:noisy, domains"
)
DIGIT5_DOMAINS = ("mnist", "usps", "mnistm", "mnist_inv", "usps_color")
OFFICE_DOMAINS = {  # domain -> SURF file; the DeCAF6 files exist only for dslr and webcam
    "amazon": "amazon_SURF_L10.mat",
    "caltech": "Caltech10_SURF_L10.mat",
    "dslr": "dslr_SURF_L10.mat",
    "webcam": "webcam_SURF_L10.mat",
}
FEDREMA_GROUPS = 5
FEDREMA_LABELS_PER_GROUP = 3
DIRICHLET_MIN_SAMPLES = 10
DIRICHLET_TRIES = 100
SYNTHETIC_FEATURES = 60
SYNTHETIC_CLASSES = 5
SYNTHETIC_MAX_SAMPLES = 10_000  # the lognormal tail is long; bound memory without a cap

# Separate random streams, so that e.g. changing the split never changes the partition.
_PARTITION_STREAM, _CAP_STREAM, _SPLIT_STREAM, _SYNTHETIC_STREAM = 1, 2, 3, 4
# Digit-5's derived domains are part of the dataset's definition, not of a run: every run
# sees the same inverted and coloured images, whatever its seed.
_DIGIT5_BUILD_SEED = 20_240_501


# --------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Partition:
    """A parsed partition spec; `param` is alpha, labels per node, iid share or k."""

    kind: str
    param: float | int | None = None
    noisy: bool = False


def check_dataset_name(name: str) -> None:
    """Raise DataError unless `name` is a known dataset or `npz:PATH`."""
    if name in DATASETS:
        return
    if name.startswith(NPZ_PREFIX) and name[len(NPZ_PREFIX) :].strip():
        return
    raise DataError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)} or npz:PATH")


# One sample each for train, validation and test at least; every rule scores on the
# validation split and every report on the test split, so neither may be empty.
MIN_SAMPLES_PER_NODE = 3
SPLIT_TOLERANCE = 1e-6


def check_samples_per_node(value: int | None) -> None:
    """Raise DataError unless `value` is unset or an integer >= MIN_SAMPLES_PER_NODE."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < MIN_SAMPLES_PER_NODE
    ):
        raise DataError(f"got {value!r}; allowed: an integer >= {MIN_SAMPLES_PER_NODE} or null")


def check_split(split: tuple[float, ...]) -> None:
    """Raise DataError unless `split` is three fractions > 0 (train, validation, test)
    that sum to 1."""
    parts_ok = len(split) == 3 and all(
        isinstance(part, (int, float)) and math.isfinite(part) and part > 0 for part in split
    )
    if not parts_ok or abs(sum(split) - 1) > SPLIT_TOLERANCE:
        raise DataError(
            f"got {list(split)!r}; allowed: three numbers > 0 (train, "
            "validation, test) that sum to 1"
        )


def check_partition(spec: str) -> None:
    """Raise DataError unless `spec` is one of PARTITION_FORMS."""
    parse_partition(spec)


def parse_partition(spec: str) -> Partition:
    kind, _, rest = spec.strip().partition(":")
    args = rest.split(":") if rest else []

    def bad(why: str) -> DataError:
        return DataError(f"partition {spec!r} is not valid ({why}); allowed: {PARTITION_FORMS}")

    if kind in ("iid", "domains"):
        if args:
            raise bad(f"'{kind}' takes no parameter")
        return Partition(kind)
    if kind == "dirichlet" and len(args) == 1:
        alpha = _parse_number(args[0], float, bad)
        if not alpha > 0:
            raise bad("alpha must be > 0")
        return Partition(kind, alpha)
    if kind == "pathological" and len(args) == 1:
        labels = _parse_number(args[0], int, bad)
        if labels < 1:
            raise bad("labels per node must be >= 1")
        return Partition(kind, labels)
    if kind == "groups" and len(args) == 1:
        share = _parse_number(args[0], float, bad)
        if not 0 <= share <= 1:
            raise bad("the iid share s must be in [0, 1]")
        return Partition(kind, share)
    if kind == "clusters" and len(args) in (1, 2):
        if len(args) == 2 and args[1] != "noisy":
            raise bad("the only option after k is 'noisy'")
        clusters = _parse_number(args[0], int, bad)
        if clusters < 1:
            raise bad("k must be >= 1")
        return Partition(kind, clusters, noisy=len(args) == 2)
    known = ("iid", "domains", "dirichlet", "pathological", "groups", "clusters")
    raise bad("wrong number of parameters" if kind in known else f"unknown form {kind!r}")


def _parse_number(text: str, kind: type, bad: Callable[[str], DataError]) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise bad(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value):
        raise bad(f"{text!r} is not finite")
    return value


# --------------------------------------------------------------------------- pools


@dataclass
class Pool:
    """All samples a dataset offers: labels now, features on demand."""

    labels: np.ndarray  # int64, one per sample
    num_classes: int
    input_shape: tuple[int, ...]
    features: Callable[[np.ndarray], np.ndarray]  # pool indices -> float32 features
    domains: np.ndarray | None = None  # int domain id per sample, for partition 'domains'
    domain_names: tuple[str, ...] = ()
    one_node_per_domain: bool = False  # femnist: node i is writer i; writers are never shared
    balanced_per_class: bool = False  # digit5: a capped domain shard is an equal draw per class


def load_pool(dataset: str, root: str | None) -> Pool:
    """The sample pool of `dataset` (cached per process: every call on the same files is
    cheap after the first)."""
    check_dataset_name(dataset)
    if dataset == "synthetic":
        raise DataError("dataset 'synthetic' is generated per node and has no shared pool")
    if dataset == "digits":
        root = None  # embedded; a user-given root must not make a second cache entry
    elif root is not None:
        root = str(Path(root).expanduser().resolve())
    return _load_pool_cached(dataset, root)


@functools.lru_cache(maxsize=8)
def _load_pool_cached(dataset: str, root: str | None) -> Pool:
    if dataset.startswith(NPZ_PREFIX):
        return _npz_pool(dataset[len(NPZ_PREFIX) :])
    return _POOL_LOADERS[dataset](root)


def _require(dataset: str, root: str | None, relative: str) -> Path:
    """The path of a required file or folder under root, or a DataError that says where it
    was expected."""
    layout = f"--data-root DIR must hold the standard layout (DIR/{relative})"
    if root is None:
        raise DataError(f"dataset {dataset!r} needs its files: {layout}")
    path = Path(root) / relative
    if not path.exists():
        raise DataError(f"dataset {dataset!r}: {path} not found; {layout}")
    return path


def _to_unit_range(images: np.ndarray) -> np.ndarray:
    """uint8 pixels -> float32 in [-1, 1] via [0, 1] and (x - 0.5) / 0.5."""
    return (images.astype(np.float32) / 255.0 - 0.5) / 0.5


def _gray_pool(
    images: np.ndarray, labels: np.ndarray, num_classes: int = 10, **domain_fields
) -> Pool:
    """A pool of uint8 (N, H, W) grayscale images, served as (1, H, W)."""
    height, width = images.shape[1:]
    return Pool(
        labels.astype(np.int64),
        num_classes,
        (1, height, width),
        lambda idx: _to_unit_range(images[idx])[:, None],
        **domain_fields,
    )


def _digits_pool(_root: str | None) -> Pool:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]  # pixel counts are 0..16
    return Pool(bunch.target.astype(np.int64), 10, (1, 8, 8), lambda idx: images[idx])


_T = TypeVar("_T")


def _read_torchvision(dataset: str, build: Callable[[], _T]) -> _T:
    """Run a torchvision constructor, turning its errors about bad files into one line."""
    try:
        return build()
    except (RuntimeError, OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise DataError(f"dataset {dataset!r} could not be read: {first_line}") from None


def _mnist_like_images(
    source: str, root: str | None, dataset: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """MNIST's or Fashion-MNIST's train split; `dataset` names the user's dataset in errors."""
    import torchvision

    folder, reader = {
        "mnist": ("MNIST", torchvision.datasets.MNIST),
        "fmnist": ("FashionMNIST", torchvision.datasets.FashionMNIST),
    }[source]
    dataset = dataset or source
    _require(dataset, root, f"{folder}/raw/train-images-idx3-ubyte")
    _require(dataset, root, f"{folder}/raw/train-labels-idx1-ubyte")
    train = _read_torchvision(dataset, lambda: reader(root, train=True, download=False))
    return train.data.numpy(), train.targets.numpy()


def _mnist_pool(root: str | None) -> Pool:
    return _gray_pool(*_mnist_like_images("mnist", root))


def _fmnist_pool(root: str | None) -> Pool:
    return _gray_pool(*_mnist_like_images("fmnist", root))


def _usps_images(root: str | None, dataset: str = "usps") -> tuple[np.ndarray, np.ndarray]:
    import torchvision

    folder = _require(dataset, root, "usps/usps.bz2").parent
    source = _read_torchvision(
        dataset, lambda: torchvision.datasets.USPS(str(folder), train=True, download=False)
    )
    return source.data, np.asarray(source.targets)  # uint8, ink bright on a dark background


def _usps_pool(root: str | None) -> Pool:
    return _gray_pool(*_usps_images(root))


def _cifar10_pool(root: str | None) -> Pool:
    import torchvision
    from PIL import Image

    folder = _require("cifar10", root, "cifar10/test")
    source = _read_torchvision("cifar10", lambda: torchvision.datasets.ImageFolder(str(folder)))
    paths = [path for path, _ in source.samples]

    def decode(idx: np.ndarray) -> np.ndarray:
        # Decoding is the expensive part, so only the node's own images are decoded.
        images = np.stack([np.asarray(Image.open(paths[i]).convert("RGB")) for i in idx])
        return _to_unit_range(images).transpose(0, 3, 1, 2)

    labels = np.asarray(source.targets, dtype=np.int64)
    return Pool(labels, len(source.classes), (3, 32, 32), decode)


def _mnistm_arrays(root: str | None, dataset: str = "mnistm") -> tuple[np.ndarray, np.ndarray]:
    path = _require(dataset, root, "mnist_m/mnist_m_test.npz")
    images, labels = _read_npz(dataset, path)
    if images.ndim != 4 or images.shape[1:] != (32, 32, 3):
        raise DataError(
            f"dataset {dataset!r}: {path} x has shape {images.shape}, expected (N, 32, 32, 3)"
        )
    return images, labels


def _mnistm_pool(root: str | None) -> Pool:
    images, labels = _mnistm_arrays(root)
    return Pool(
        labels, 10, (3, 32, 32), lambda idx: _to_unit_range(images[idx]).transpose(0, 3, 1, 2)
    )


def _femnist_pool(root: str | None) -> Pool:
    """LEAF's FEMNIST writers: train and test files pooled (the node makes its own split).

    Pixels are kept as LEAF gives them (dark ink on a white background). Writers are
    ordered by falling sample count, name breaking ties, so node i under partition
    'domains' gets the i-th largest writer and a small mesh gets usable shards.
    """
    parts = [
        _require("femnist", root, f"femnist/femnist_{split}.npz") for split in ("train", "test")
    ]
    arrays = [np.load(path) for path in parts]
    for path, array in zip(parts, arrays, strict=True):
        if not {"x", "y", "user"} <= set(array.files):
            raise DataError(f"dataset 'femnist': {path} must hold arrays x, y and user")
    images = np.concatenate([a["x"] for a in arrays])
    labels = np.concatenate([a["y"] for a in arrays]).astype(np.int64)
    writer_names, writer_of_sample, counts = np.unique(
        np.concatenate([a["user"] for a in arrays]), return_inverse=True, return_counts=True
    )
    order = np.lexsort((writer_names, -counts))  # largest writer first
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return _gray_pool(
        images,
        labels,
        num_classes=62,
        domains=rank[writer_of_sample],
        domain_names=tuple(str(name) for name in writer_names[order]),
        one_node_per_domain=True,
    )


def _office_pool(root: str | None) -> Pool:
    """Office-Caltech10 as SURF bag-of-words histograms (800-d), four domains.

    Only the SURF files are used: DeCAF6 features exist for dslr and webcam only, and
    mixing the two kinds would make the domains incomparable. Each histogram is divided
    by its total count (images differ in how many keypoints they have), then every
    feature is z-scored within its domain, as is usual for these features (Gong et al.).
    The domain statistics use no labels.
    """
    from scipy.io import loadmat

    features, labels, domains = [], [], []
    for domain_id, file_name in enumerate(OFFICE_DOMAINS.values()):
        path = _require("office", root, f"office_caltech10/{file_name}")
        mat = loadmat(str(path))
        if "fts" not in mat or "labels" not in mat:
            raise DataError(f"dataset 'office': {path} must hold 'fts' and 'labels'")
        histograms = mat["fts"].astype(np.float64)
        histograms /= np.maximum(histograms.sum(axis=1, keepdims=True), 1.0)
        spread = histograms.std(axis=0)
        standardized = (histograms - histograms.mean(axis=0)) / np.where(spread > 0, spread, 1.0)
        features.append(standardized.astype(np.float32))
        labels.append(mat["labels"].ravel().astype(np.int64) - 1)  # files count classes 1..10
        domains.append(np.full(len(histograms), domain_id))
    table = np.concatenate(features)
    return Pool(
        np.concatenate(labels),
        10,
        (table.shape[1],),
        lambda idx: table[idx],
        domains=np.concatenate(domains),
        domain_names=tuple(OFFICE_DOMAINS),
    )


def _read_npz(dataset: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        arrays = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise DataError(f"dataset {dataset!r}: {path} is not a readable .npz ({error})") from None
    if not {"x", "y"} <= set(arrays.files):
        raise DataError(
            f"dataset {dataset!r}: {path} must hold arrays x and y; it holds "
            f"{', '.join(arrays.files) or 'none'}"
        )
    return arrays["x"], arrays["y"]


def _npz_pool(path_text: str) -> Pool:
    """Any .npz with x (N, ...) and integer labels y in 0..C-1; uint8 x is read as pixels."""
    dataset = NPZ_PREFIX + path_text
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise DataError(
            f"dataset {dataset!r}: file {path} not found; give npz:PATH to a .npz "
            "holding arrays x and y"
        )
    images, labels = _read_npz(dataset, path)
    if labels.ndim != 1 or len(labels) != len(images) or len(labels) == 0:
        raise DataError(
            f"dataset {dataset!r}: y must be 1-d with one label per row of x, got "
            f"x {images.shape} and y {labels.shape}"
        )
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise DataError(f"dataset {dataset!r}: y must hold integer labels 0..C-1")
    _check_features(dataset, path, images)

    def features(idx: np.ndarray) -> np.ndarray:
        chosen = images[idx]
        return (
            chosen.astype(np.float32) / 255.0
            if chosen.dtype == np.uint8
            else chosen.astype(np.float32)
        )

    return Pool(labels.astype(np.int64), int(labels.max()) + 1, tuple(images.shape[1:]), features)


def _check_features(dataset: str, path: Path, images: np.ndarray) -> None:
    """x must be numbers, every one finite: a NaN trains silently to chance accuracy."""
    if images.dtype.kind not in "biuf":
        raise DataError(
            f"dataset {dataset!r}: x in {path} must hold numbers (integers or "
            f"floats), got dtype {images.dtype}"
        )
    if images.dtype.kind == "f":
        bad = int(images.size - np.count_nonzero(np.isfinite(images)))
        if bad:
            raise DataError(
                f"dataset {dataset!r}: x in {path} holds {bad} NaN or infinite "
                f"value(s) of {images.size}; clean or drop those samples"
            )


def _digit5_pool(root: str | None) -> Pool:
    """Digit-5 as far as it can be built offline: mnist, usps, mnistm and two derived domains.

    `mnist_inv` is MNIST with inverted intensity and `usps_color` a USPS digit on a solid
    random background (the digit in black or white, whichever contrasts more). Derived
    domains take the other half of their source's samples, so no image appears in two
    domains; MNIST-M comes from MNIST's test split, which the mnist domain never uses.
    All images are resized to 3x32x32, grayscale replicated to three channels.
    """
    mnist_images, mnist_labels = _mnist_like_images("mnist", root, "digit5")
    usps_images, usps_labels = _usps_images(root, "digit5")
    mnistm_images, mnistm_labels = _mnistm_arrays(root, "digit5")
    builder = np.random.default_rng(_DIGIT5_BUILD_SEED)
    mnist_half = np.array_split(builder.permutation(len(mnist_labels)), 2)
    usps_half = np.array_split(builder.permutation(len(usps_labels)), 2)
    backgrounds = builder.random((len(usps_labels), 3)).astype(np.float32)

    def gray(images: np.ndarray) -> np.ndarray:  # uint8 (n, H, W) -> [0, 1] (n, 3, 32, 32)
        tensor = torch.from_numpy(images.astype(np.float32) / 255.0)[:, None]
        resized = torch.nn.functional.interpolate(
            tensor, size=(32, 32), mode="bilinear", align_corners=False
        )
        return resized.clamp(0, 1).expand(-1, 3, -1, -1).numpy()

    def colored(local: np.ndarray) -> np.ndarray:
        ink = gray(usps_images[local])
        background = backgrounds[local]
        # White ink on a dark background, black ink on a light one.
        luma = np.array([0.299, 0.587, 0.114], dtype=np.float32)
        digit = (background @ luma < 0.5).astype(np.float32)
        return background[:, :, None, None] * (1 - ink) + digit[:, None, None, None] * ink

    # Each domain: the samples it draws from its source, and how it renders them in [0, 1].
    sources = [
        (mnist_half[0], mnist_labels, lambda local: gray(mnist_images[local])),
        (usps_half[0], usps_labels, lambda local: gray(usps_images[local])),
        (
            np.arange(len(mnistm_labels)),
            mnistm_labels,
            lambda local: mnistm_images[local].transpose(0, 3, 1, 2).astype(np.float32) / 255.0,
        ),
        (mnist_half[1], mnist_labels, lambda local: 1.0 - gray(mnist_images[local])),
        (usps_half[1], usps_labels, colored),
    ]
    local_index = np.concatenate([members for members, _, _ in sources])
    labels = np.concatenate([source_labels[members] for members, source_labels, _ in sources])
    domains = np.concatenate(
        [np.full(len(members), d) for d, (members, _, _) in enumerate(sources)]
    )

    def features(idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx), 3, 32, 32), dtype=np.float32)
        for domain_id, (_, _, render) in enumerate(sources):
            mask = domains[idx] == domain_id
            if mask.any():
                out[mask] = render(local_index[idx[mask]])
        return (out - 0.5) / 0.5

    return Pool(
        labels.astype(np.int64),
        10,
        (3, 32, 32),
        features,
        domains=domains,
        domain_names=DIGIT5_DOMAINS,
        balanced_per_class=True,
    )


_POOL_LOADERS: dict[str, Callable[[str | None], Pool]] = {
    "digits": _digits_pool,
    "mnist": _mnist_pool,
    "fmnist": _fmnist_pool,
    "usps": _usps_pool,
    "cifar10": _cifar10_pool,
    "mnistm": _mnistm_pool,
    "femnist": _femnist_pool,
    "office": _office_pool,
    "digit5": _digit5_pool,
}


# --------------------------------------------------------------------------- partitions


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
    rng = np.random.default_rng((seed, _PARTITION_STREAM))
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
        trim = np.random.default_rng((seed, _CAP_STREAM))
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


# --------------------------------------------------------------------------- synthetic


def _synthetic_node(
    node_index: int, seed: int, iid: bool, cap: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """One user of the synthetic(alpha=1, beta=1) data of FedProx/LEAF (60 features, 5
    classes), generated from the node's own seed stream, so nobody else's data is needed.

    Non-IID: the user's model W ~ N(u, 1), b ~ N(u, 1) with u ~ N(0, alpha) differs per
    user, and so does the feature mean v ~ N(B, 1) with B ~ N(0, beta); x ~ N(v, S) with
    S diagonal, S_jj = j^-1.2; y = argmax(W x + b). IID: one model shared by all users
    (from the mesh seed) and v = 0. Unbalanced: 50 + lognormal(4, 2) samples per user,
    cut to the cap (or to SYNTHETIC_MAX_SAMPLES).
    """
    alpha = beta = 1.0
    rng = np.random.default_rng((seed, _SYNTHETIC_STREAM, node_index))
    count = 50 + int(rng.lognormal(4.0, 2.0))
    count = min(count, cap if cap is not None else SYNTHETIC_MAX_SAMPLES)
    if iid:
        shared = np.random.default_rng((seed, _SYNTHETIC_STREAM))
        weights = shared.normal(0.0, 1.0, (SYNTHETIC_FEATURES, SYNTHETIC_CLASSES))
        bias = shared.normal(0.0, 1.0, SYNTHETIC_CLASSES)
        mean = np.zeros(SYNTHETIC_FEATURES)
    else:
        model_center = rng.normal(0.0, alpha)
        weights = rng.normal(model_center, 1.0, (SYNTHETIC_FEATURES, SYNTHETIC_CLASSES))
        bias = rng.normal(model_center, 1.0, SYNTHETIC_CLASSES)
        mean = rng.normal(rng.normal(0.0, beta), 1.0, SYNTHETIC_FEATURES)
    spread = np.arange(1, SYNTHETIC_FEATURES + 1) ** -0.6  # std = sqrt(j^-1.2)
    features = rng.normal(mean, spread, (count, SYNTHETIC_FEATURES))
    labels = np.argmax(features @ weights + bias, axis=1)
    return features.astype(np.float32), labels.astype(np.int64)


# --------------------------------------------------------------------------- the node


@dataclass
class NodeData:
    x_train: torch.Tensor  # float32 features, int64 labels
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
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
) -> NodeData:
    """This node's shard of the mesh's partition, split into train/val/test.

    Deterministic in its arguments; nodes with different indices get disjoint shards.
    `samples_per_node` counts the shard before its split (digit5: an equal draw per class).
    """
    check_dataset_name(dataset)
    spec = parse_partition(partition)
    _check_mesh(num_nodes, node_index, seed, samples_per_node, split)
    if dataset == "synthetic":
        # Every node is one user; 'iid' switches to the shared model, other forms are moot.
        features, labels = _synthetic_node(node_index, seed, spec.kind == "iid", samples_per_node)
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
        num_classes, input_shape, info = pool.num_classes, pool.input_shape, shard.info
    split_rng = np.random.default_rng((seed, _SPLIT_STREAM, node_index))
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
