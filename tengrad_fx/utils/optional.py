"""Optional dependencies, imported where they are used: a missing one raises an
``ImportError`` that names the extra of ``tengrad-fx`` that installs it."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """``importlib.import_module(module)``; if it is missing, an ``ImportError`` saying that
    ``needed_by`` needs it and ``pip install 'tengrad-fx[extra]'`` brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.partition(".")[0]
        raise ImportError(f"{needed_by} needs {top}, which is not installed: "
                          f"pip install 'tengrad-fx[{extra}]'") from exc
