"""Demo: prepare a model, print its coverage report, one training batch's Grams.

Run: ``python -m tools.demo``. Uses real Fashion-MNIST images when the Debian package
``dataset-fashion-mnist`` is installed, random images otherwise.
"""
from __future__ import annotations

import gzip
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx

FMNIST = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    if os.path.exists(FMNIST):
        imgs = np.frombuffer(gzip.open(FMNIST).read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
        labels = np.frombuffer(gzip.open(FMNIST.replace("images-idx3", "labels-idx1")).read(), np.uint8, offset=8)
        x = (torch.from_numpy(imgs[:m].copy()).float() / 255 - 0.2860) / 0.3530
        return x, torch.from_numpy(labels[:m].astype(np.int64)), "Fashion-MNIST"
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, 1, 28, 28, generator=g), torch.randint(0, 10, (m,), generator=g), "random"


def small_cnn() -> nn.Module:
    """A 3C1F-shaped CNN, narrower (32 channels) so the demo runs in seconds."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3), nn.Flatten(),
        nn.Linear(9 * 9 * 32, 500), nn.ReLU(), nn.Linear(500, 10),
    )


def main() -> None:
    torch.manual_seed(0)
    m = 64
    x, y, src = _batch(m)
    model = tengrad_fx.prepare(small_cnn(), example_inputs=(x[:2],))
    print(tengrad_fx.report(model, m=m))
    F.cross_entropy(model(x), y).backward()
    print(f"\nOne batch of {m} {src} images: per-layer Gram J Jᵀ (exact, m×m)")
    for layer in tengrad_fx.covered_layers(model):
        t0 = time.perf_counter()
        K = layer.gram("auto")
        dt = time.perf_counter() - t0
        print(f"  {layer.name:>3} {layer.kind:<7} strategy={layer.choose():<11} trace={K.trace().item():.4g} "
              f"time={dt * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
