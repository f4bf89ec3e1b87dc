"""A tiny synthetic Fashion-MNIST (IDX files) and a tiny CNN, for CLI tests."""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

__all__ = ["tiny_cnn", "write_fashion_mnist"]


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def write_fashion_mnist(d: Path, n_train: int = 64, n_test: int = 32, seed: int = 0) -> Path:
    """Random Fashion-MNIST-shaped images and labels as the four ``*-idx*-ubyte.gz`` files in ``d``."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(d / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(d / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
    return d


def tiny_cnn(name: str, dataset: Any) -> nn.Module:
    """Stands in for ``tengrad_fx.cli.train.build_model`` (whatever the model's name)."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4), nn.Flatten(),
                         nn.Linear(8 * 7 * 7, 32), nn.ReLU(), nn.Linear(32, 10))
