"""The repository-only ``tools`` package (benchmarks and scripts, not installed), for the
tests that exercise it: ``tool("bench")`` is ``tools.bench`` of this repository, whatever
the working directory and whatever other ``tools`` an environment may have."""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

__all__ = ["REPO", "tool"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The repository root (holds ``tools/``, ``testing/``, ``tests/``)."""


def tool(name: str) -> ModuleType:
    """The module ``tools.<name>`` of this repository (the root goes first on ``sys.path``,
    so spawned child processes find the same package)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    pkg = importlib.import_module("tools")
    where = os.path.dirname(os.path.abspath(pkg.__file__ or ""))
    if where != os.path.join(REPO, "tools"):
        raise ImportError(f"'tools' was imported from {where}, not from this repository ({REPO})")
    return importlib.import_module(f"tools.{name}")
