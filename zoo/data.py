"""In-memory datasets (Fashion-MNIST, CIFAR-10, CIFAR-100) and a batched loader.

Every dataset is held as two tensors: ``x`` (float32, N x C x H x W, normalised per
channel) and ``y`` (int64, N).  Batches are produced by tensor indexing and training
augmentation is a single vectorised op per batch, so no per-sample Python runs in the
training loop.

Where the files are looked for
------------------------------
Fashion-MNIST, in order:

1. ``data_dir`` -- the four IDX files (``train-images-idx3-ubyte``,
   ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``,
   each optionally ``.gz``) directly in it, or torchvision's ``data_dir/FashionMNIST/raw/``;
2. the Debian package ``dataset-fashion-mnist``: :data:`DEBIAN_FASHION_MNIST_DIR`;
3. a torchvision download into ``data_dir`` (or :data:`DEFAULT_DOWNLOAD_DIR`) when
   ``download=True``.

CIFAR-10 / CIFAR-100: torchvision's python-pickle layout
(``cifar-10-batches-py/data_batch_1..5, test_batch``; ``cifar-100-python/train, test``,
fine labels) under ``data_dir`` (or ``data_dir`` itself), else a torchvision download
when ``download=True``.

Normalisation
-------------
Fashion-MNIST: mean 0.2860, std 0.3530.  CIFAR: the per-channel pixel mean and standard
deviation of the respective training set (see the ``CIFAR*_MEAN``/``CIFAR*_STD``
constants).  Augmentation pads with the normalised value of a black pixel
(``-mean / std``), which is what ``RandomCrop(32, padding=4)`` before ``Normalize``
does in a torchvision pipeline.
"""

from __future__ import annotations

import dataclasses
import gzip
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..utils.optional import require

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR100_MEAN",
    "CIFAR100_STD",
    "DATASETS",
    "DEBIAN_FASHION_MNIST_DIR",
    "DEFAULT_DOWNLOAD_DIR",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "ArrayDataset",
    "augment_batch",
    "batches",
    "get_dataset",
    "num_batches",
    "read_idx",
    "subset",
]

FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where ``apt-get install dataset-fashion-mnist`` puts the gzipped IDX files."""

DEFAULT_DOWNLOAD_DIR = Path.home() / ".cache" / "tengrad_fx" / "data"
"""Download root used when ``download=True`` and no ``data_dir`` is given."""

DATASETS = ("fashion-mnist", "cifar10", "cifar100")
_ALIASES = {
    "fashion-mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "fmnist": "fashion-mnist",
    "cifar10": "cifar10",
    "cifar-10": "cifar10",
    "cifar100": "cifar100",
    "cifar-100": "cifar100",
}
_SPLITS = ("train", "test")


@dataclass(eq=False)
class ArrayDataset:
    """A whole dataset as tensors.

    Attributes:
        x: float32 inputs, N x C x H x W, normalised.
        y: int64 labels, N.
        num_classes: number of classes.
        augment: whether :func:`batches` applies :func:`augment_batch` when shuffling.
        pad_value: per-channel value (C,) used for augmentation padding, i.e. the
            normalised value of a black pixel; ``None`` pads with zeros.
        name: dataset name, e.g. ``"cifar10"``.
    """

    x: Tensor
    y: Tensor
    num_classes: int
    augment: bool = False
    pad_value: Tensor | None = None
    name: str = ""

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __getitem__(self, index: int | slice | Tensor) -> tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]

    def to(self, device: torch.device | str) -> ArrayDataset:
        """Copy of the dataset with ``x`` and ``y`` on ``device`` (e.g. the whole set on a GPU)."""
        return dataclasses.replace(self, x=self.x.to(device), y=self.y.to(device))


# --------------------------------------------------------------------------- IDX / Fashion-MNIST

_FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path) -> np.ndarray:
    """Read an unsigned-byte IDX file (optionally gzipped) into a uint8 array.

    The header is 4 magic bytes (``0, 0, 0x08, ndim``) and ``ndim`` big-endian uint32
    sizes, so the data start at offset 16 for images (N x H x W) and 8 for labels (N).
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    offset = 4 + 4 * ndim
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, np.uint8, offset=offset)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, found {data.size} bytes of data")
    return data.reshape(dims)


def _find_file(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _find_fmnist(directory: Path, split: str) -> tuple[Path, Path] | None:
    images, labels = (_find_file(directory, stem) for stem in _FMNIST_FILES[split])
    return (images, labels) if images is not None and labels is not None else None


def _fmnist_dirs(data_dir: Path) -> list[Path]:
    return [data_dir, data_dir / "FashionMNIST" / "raw"]


def _load_fashion_mnist(split: str, data_dir: Path | None, download: bool) -> tuple[np.ndarray, np.ndarray]:
    candidates = _fmnist_dirs(data_dir) if data_dir is not None else []
    candidates.append(DEBIAN_FASHION_MNIST_DIR)
    for directory in candidates:
        found = _find_fmnist(directory, split)
        if found is not None:
            return read_idx(found[0]), read_idx(found[1])
    root = data_dir if data_dir is not None else DEFAULT_DOWNLOAD_DIR
    if download:
        torchvision = require("torchvision", "zoo", "downloading Fashion-MNIST")
        torchvision.datasets.FashionMNIST(str(root), train=split == "train", download=True)
        found = _find_fmnist(root / "FashionMNIST" / "raw", split)
        if found is None:
            raise FileNotFoundError(f"torchvision download finished but no IDX files in {root}/FashionMNIST/raw")
        return read_idx(found[0]), read_idx(found[1])
    tried = (
        f"--data-dir {data_dir} (looked in {data_dir} and {data_dir / 'FashionMNIST' / 'raw'})"
        if data_dir is not None
        else "--data-dir (none given)"
    )
    stems = ", ".join(f"{s}[.gz]" for s in _FMNIST_FILES[split])
    raise FileNotFoundError(
        f"Fashion-MNIST {split} split not found (needs {stems}). Options: "
        f"(1) {tried}: put the IDX files there or in its FashionMNIST/raw/; "
        f"(2) the Debian package files in {DEBIAN_FASHION_MNIST_DIR}: "
        f"`apt-get install dataset-fashion-mnist`; "
        f"(3) download=True (--download) to fetch it with torchvision into {root}."
    )


# --------------------------------------------------------------------------- CIFAR


@dataclass(frozen=True)
class _CifarSpec:
    folder: str
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    label_key: str
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    pretty: str


_CIFAR = {
    "cifar10": _CifarSpec(
        folder="cifar-10-batches-py",
        train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test_files=("test_batch",),
        label_key="labels",
        num_classes=10,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        pretty="CIFAR-10",
    ),
    "cifar100": _CifarSpec(
        folder="cifar-100-python",
        train_files=("train",),
        test_files=("test",),
        label_key="fine_labels",
        num_classes=100,
        mean=CIFAR100_MEAN,
        std=CIFAR100_STD,
        pretty="CIFAR-100",
    ),
}


def _pickle_get(d: dict[str | bytes, object], key: str) -> object:
    """Look ``key`` up in an unpickled CIFAR batch whose keys may be ``str`` or ``bytes``."""
    if key in d:
        return d[key]
    return d[key.encode()]


def _read_cifar(directory: Path, files: Sequence[str], label_key: str) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for name in files:
        with open(directory / name, "rb") as f:
            batch = pickle.load(f, encoding="latin1")
        xs.append(np.asarray(_pickle_get(batch, "data"), dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(_pickle_get(batch, label_key), dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys)


def _load_cifar(name: str, split: str, data_dir: Path | None, download: bool) -> tuple[np.ndarray, np.ndarray]:
    spec = _CIFAR[name]
    folder, label_key = spec.folder, spec.label_key
    files = spec.train_files if split == "train" else spec.test_files
    candidates = [data_dir / folder, data_dir] if data_dir is not None else []
    for directory in candidates:
        if all((directory / f).is_file() for f in files):
            return _read_cifar(directory, files, label_key)
    root = data_dir if data_dir is not None else DEFAULT_DOWNLOAD_DIR
    if download:
        torchvision = require("torchvision", "zoo", f"downloading {spec.pretty}")
        cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
        cls(str(root), train=split == "train", download=True)
        return _read_cifar(root / folder, files, label_key)
    tried = f"--data-dir {data_dir / folder}" if data_dir is not None else "--data-dir (none given)"
    raise FileNotFoundError(
        f"{spec.pretty} {split} split not found (needs {folder}/{{{','.join(files)}}} in torchvision's "
        f"python-pickle format). Options: (1) {tried}; "
        f"(2) download=True (--download) to fetch it with torchvision into {root / folder}."
    )


# --------------------------------------------------------------------------- public API


def _normalise(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 N x C x H x W -> float32, ``(x / 255 - mean) / std`` per channel."""
    images = np.ascontiguousarray(images)
    if not images.flags.writeable:
        images = images.copy()  # torch.from_numpy wants a writable buffer
    x = torch.from_numpy(images).to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def get_dataset(
    name: str,
    split: str,
    data_dir: str | Path | None = None,
    download: bool = False,
    augment: bool | None = None,
) -> ArrayDataset:
    """Load a whole dataset split into memory.

    Args:
        name: ``"fashion-mnist"``, ``"cifar10"`` or ``"cifar100"`` (case-insensitive).
        split: ``"train"`` or ``"test"``.
        data_dir: directory searched first (see the module docstring for layouts).
        download: allow a torchvision download when the files are not found.
        augment: training augmentation flag; ``None`` means on for the CIFAR training
            splits and off otherwise (Fashion-MNIST is trained without augmentation).

    Returns:
        :class:`ArrayDataset` with ``x`` float32 N x C x H x W (Fashion-MNIST
        N x 1 x 28 x 28, CIFAR N x 3 x 32 x 32) and ``y`` int64 N.

    Raises:
        ValueError: unknown name or split.
        FileNotFoundError: data not found and ``download`` is False; the message lists
            every way to provide it.
    """
    key = _ALIASES.get(name.strip().lower().replace("_", "-"))
    if key is None:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    directory = Path(data_dir).expanduser() if data_dir is not None else None
    if key == "fashion-mnist":
        images, labels = _load_fashion_mnist(split, directory, download)
        images = images.reshape(-1, 1, images.shape[-2], images.shape[-1])
        mean: Sequence[float] = (FASHION_MNIST_MEAN,)
        std: Sequence[float] = (FASHION_MNIST_STD,)
        num_classes = 10
        default_augment = False
    else:
        images, labels = _load_cifar(key, split, directory, download)
        spec = _CIFAR[key]
        num_classes, mean, std = spec.num_classes, spec.mean, spec.std
        default_augment = split == "train"
    x = _normalise(images, mean, std)
    y = torch.from_numpy(labels.astype(np.int64))
    pad_value = -torch.tensor(mean, dtype=torch.float32) / torch.tensor(std, dtype=torch.float32)
    return ArrayDataset(
        x=x,
        y=y,
        num_classes=num_classes,
        augment=default_augment if augment is None else augment,
        pad_value=pad_value,
        name=key,
    )


def augment_batch(
    x: Tensor,
    generator: torch.Generator | None = None,
    padding: int = 4,
    pad_value: Tensor | None = None,
    flip: bool = True,
) -> Tensor:
    """Random crop with padding and random horizontal flip of a whole batch at once.

    Equivalent per image to ``RandomCrop(H, padding)`` followed by
    ``RandomHorizontalFlip()``: the batch is padded once, then each image's crop
    offsets ``(dy, dx)`` in ``[0, 2 * padding]`` and flip bit are drawn in one call
    each (in that order) from ``generator``, and the crops (mirrored where flipped) are
    gathered with a single advanced-indexing op.

    Args:
        x: N x C x H x W batch (any device).
        generator: random source (drawn on its own device, then moved to ``x``'s).
        padding: pixels of padding on each side.
        pad_value: per-channel fill (C,), e.g. ``ArrayDataset.pad_value``; zeros if None.
        flip: whether to apply random horizontal flips.

    Returns:
        Tensor of the same shape, dtype and device as ``x``.
    """
    n, c, h, w = x.shape
    p = padding
    if pad_value is None:
        padded = torch.nn.functional.pad(x, (p, p, p, p))
    else:
        padded = pad_value.to(device=x.device, dtype=x.dtype).view(1, c, 1, 1).expand(n, c, h + 2 * p, w + 2 * p)
        padded = padded.clone()
        padded[:, :, p : p + h, p : p + w] = x
    gen_device = generator.device if generator is not None else torch.device("cpu")
    dy = torch.randint(0, 2 * p + 1, (n,), generator=generator, device=gen_device).to(x.device)
    dx = torch.randint(0, 2 * p + 1, (n,), generator=generator, device=gen_device).to(x.device)
    cols_base = torch.arange(w, device=x.device)
    if flip:
        flips = (torch.rand(n, generator=generator, device=gen_device) < 0.5).to(x.device)
        cols_base = torch.where(flips[:, None], (w - 1) - cols_base, cols_base)  # N x W
    rows = dy[:, None] + torch.arange(h, device=x.device)  # N x H
    cols = dx[:, None] + cols_base  # N x W
    batch_idx = torch.arange(n, device=x.device).view(n, 1, 1, 1)
    chan_idx = torch.arange(c, device=x.device).view(1, c, 1, 1)
    return padded[batch_idx, chan_idx, rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]


def num_batches(dataset: ArrayDataset, batch_size: int, drop_last: bool = False) -> int:
    """Number of batches :func:`batches` yields per epoch."""
    n = len(dataset)
    return n // batch_size if drop_last else -(-n // batch_size)


def batches(
    dataset: ArrayDataset,
    batch_size: int,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """One epoch of ``(x, y)`` batches (B x C x H x W float32, B int64) by tensor indexing.

    With ``shuffle`` the order is ``torch.randperm`` drawn from ``generator`` when the
    first batch is requested, and if ``dataset.augment`` each batch goes through
    :func:`augment_batch` with the same generator.  The output is a deterministic
    function of the generator's state.  Batches live on ``dataset.x``'s device.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(dataset)
    device = dataset.x.device
    if shuffle:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        order = torch.randperm(n, generator=generator, device=gen_device).to(device)
    else:
        order = torch.arange(n, device=device)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start : start + batch_size]
        xb = dataset.x.index_select(0, idx)
        yb = dataset.y.index_select(0, idx)
        if shuffle and dataset.augment:
            xb = augment_batch(xb, generator, pad_value=dataset.pad_value)
        yield xb, yb


def subset(dataset: ArrayDataset, n: int, seed: int | None = 0) -> ArrayDataset:
    """The first ``n`` samples after a fixed shuffle (``torch.randperm`` seeded with ``seed``).

    ``seed=None`` takes the first ``n`` samples in file order instead.  ``n`` larger
    than the dataset is clamped.  All other attributes (augment, pad_value, ...) are kept.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    n = min(n, len(dataset))
    if seed is None:
        idx = torch.arange(n)
    else:
        idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:n]
    idx = idx.to(dataset.x.device)
    return dataclasses.replace(dataset, x=dataset.x.index_select(0, idx), y=dataset.y.index_select(0, idx))
