"""Shared fixture of the tools tests: a tiny synthetic Fashion-MNIST."""
from __future__ import annotations

from pathlib import Path

import pytest

from testing.tiny_data import write_fashion_mnist


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 training and 32 test images of random Fashion-MNIST-shaped data (IDX files)."""
    return write_fashion_mnist(tmp_path_factory.mktemp("fmnist"))
