"""Counting the calls of functions by wrapping them (tests that check one home per maths)."""
from __future__ import annotations

from collections import Counter
from types import ModuleType
from typing import Any, Callable

import pytest

__all__ = ["count_calls"]


def count_calls(monkeypatch: pytest.MonkeyPatch, modules: dict[str, ModuleType], names: tuple[str, ...]) -> Counter:
    """Wrap ``names`` of each of ``modules`` (by label) in a counter that calls the original;
    the counts by ``"<label>.<function>"`` (``"<function>"`` for the label ``""``)."""
    counts: Counter = Counter()

    def counting(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    for label, mod in modules.items():
        for name in names:
            monkeypatch.setattr(mod, name, counting(f"{label}.{name}" if label else name, getattr(mod, name)))
    return counts
