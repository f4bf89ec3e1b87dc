"""Argument checks shared by the optimizers: a ValueError that names the argument."""
from __future__ import annotations

import math
from typing import Any

__all__ = ["check_positive", "check_nonneg", "check_unit", "check_interval", "check_choice"]


def check_positive(name: str, v: Any) -> float:
    if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


def check_nonneg(name: str, v: Any) -> float:
    if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


def check_unit(name: str, v: Any, closed: bool = False) -> float:
    """``v`` in ``[0, 1)`` (or ``[0, 1]`` when ``closed``)."""
    ok = isinstance(v, (int, float)) and 0 <= v and (v <= 1 if closed else v < 1)
    if not ok:
        raise ValueError(f"{name} must be in [0, {'1]' if closed else '1)'}, got {v!r}")
    return float(v)


def check_interval(name: str, v: Any, meaning: str = "") -> int:
    """``v`` an int ``>= 1``; ``meaning`` (e.g. ``" (what it counts)"``) goes into the error."""
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ValueError(f"{name} must be an int >= 1{meaning}, got {v!r}")
    return v


def check_choice(name: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {v!r}")
    return v
