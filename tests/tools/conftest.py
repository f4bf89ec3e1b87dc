"""Shared fixtures of the tools tests: a tiny synthetic Fashion-MNIST, and real English text
for the language models (this repository's own documentation)."""
from __future__ import annotations

from pathlib import Path

import pytest

from testing.repo_tools import REPO
from testing.tiny_data import write_fashion_mnist


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 training and 32 test images of random Fashion-MNIST-shaped data (IDX files)."""
    return write_fashion_mnist(tmp_path_factory.mktemp("fmnist"))


@pytest.fixture(scope="session")
def docs_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's ``docs/*.md`` as one UTF-8 file (about 240 kB of English)."""
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_text("\n".join(p.read_text(encoding="utf-8") for p in sorted(Path(REPO, "docs").glob("*.md"))),
                    encoding="utf-8")
    return path
