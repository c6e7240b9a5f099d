"""The datasets a node can learn from, each read as a pool of samples.

`load_pool` reads a dataset's sample pool from the user's `--data-root`: labels eagerly,
features lazily (only the node's own samples are converted to float, so a CIFAR-10 node
decodes its own few hundred JPEGs, not 10,000). `synthetic` has no pool: every node
generates its own user's samples (`synthetic_node`).

Features are float32. Images are scaled to [0, 1] and then mapped to [-1, 1] by
(x - 0.5) / 0.5, except `digits` (x / 16, in [0, 1], as scikit-learn gives it).
`office` gives standardized SURF histograms, `synthetic` raw Gaussian features, and
`npz:PATH` its x as stored (uint8 divided by 255).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from .data_rules import DATASETS, NPZ_PREFIX, DataError, check_dataset_name

__all__ = [
    "DATASETS",
    "NPZ_PREFIX",
    "DataError",
    "Pool",
    "check_dataset_name",
    "load_pool",
    "synthetic_node",
]


DIGIT5_DOMAINS = ("mnist", "usps", "mnistm", "mnist_inv", "usps_color")
OFFICE_DOMAINS = {  # domain -> SURF file; the DeCAF6 files exist only for dslr and webcam
    "amazon": "amazon_SURF_L10.mat",
    "caltech": "Caltech10_SURF_L10.mat",
    "dslr": "dslr_SURF_L10.mat",
    "webcam": "webcam_SURF_L10.mat",
}
SYNTHETIC_FEATURES = 60
SYNTHETIC_CLASSES = 5
SYNTHETIC_MAX_SAMPLES = 10_000  # the lognormal tail is long; bound memory without a cap

# Separate random streams of one seed, one per use in the data modules (datasets,
# partitions, splits), so that e.g. changing the split never changes the partition.
PARTITION_STREAM, CAP_STREAM, SPLIT_STREAM, SYNTHETIC_STREAM = 1, 2, 3, 4
# Digit-5's derived domains are part of the dataset's definition, not of a run: every run
# sees the same inverted and coloured images, whatever its seed.
_DIGIT5_BUILD_SEED = 20_240_501


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
        raise DataError(
            f"dataset {dataset!r} reads its files from a data root, and none was given:"
            f" pass --data-root DIR (or set data.root) where DIR/{relative} is"
        )
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
    rows = _digits_rows()
    images = (rows[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)[:, None]  # 0..16
    return Pool(rows[:, -1].astype(np.int64), 10, (1, 8, 8), lambda idx: images[idx])


def _digits_rows() -> np.ndarray:
    """scikit-learn's digits, one row a sample: 64 pixel counts, then the label. Read
    from the file scikit-learn ships, found without importing scikit-learn, whose import
    (scipy's with it) took a node 1.6 s of its 4 s start; its own loader where the
    file is not where scikit-learn has always kept it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if shipped.is_file():
            return np.loadtxt(shipped, delimiter=",")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


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


# --------------------------------------------------------------------------- synthetic


def synthetic_node(
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
    rng = np.random.default_rng((seed, SYNTHETIC_STREAM, node_index))
    count = 50 + int(rng.lognormal(4.0, 2.0))
    count = min(count, cap if cap is not None else SYNTHETIC_MAX_SAMPLES)
    if iid:
        shared = np.random.default_rng((seed, SYNTHETIC_STREAM))
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
