"""When TENGraD takes new curvature: every ``T`` steps, after an optional warm-up of
curvature at every step and an optional geometric growth of the interval.

With ``T = curvature_every``, ``K = curvature_warmup`` and ``r = curvature_growth``, the
interval from the curvature step at schedule count ``s`` (the ``n``-th one, ``n ≥ 1``) to
the next is::

    1                             if s < K − 1   (steps 0 … K−1 all take curvature)
    min(T, max(1, ⌊r^n⌋))          with growth r   (r = 2: steps 0, 2, 6, 14, 30, 62, …)
    T                             otherwise

``K = 0`` and no growth is the fixed period ``T`` of the paper.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..step.checks import check_interval

__all__ = ["CurvatureSchedule"]


@dataclass(frozen=True)
class CurvatureSchedule:
    """The curvature interval rule of the module docstring (arguments checked on construction)."""

    every: int = 100
    warmup: int = 0
    growth: Optional[float] = None

    def __post_init__(self) -> None:
        check_interval("curvature_every", self.every)
        if not (isinstance(self.warmup, int) and not isinstance(self.warmup, bool) and self.warmup >= 0):
            raise ValueError(f"curvature_warmup must be an int >= 0 (steps with curvature at every step), "
                             f"got {self.warmup!r}")
        if self.growth is not None and not (isinstance(self.growth, (int, float)) and self.growth > 1):
            raise ValueError(f"curvature_growth must be a number > 1 (the interval's factor per curvature "
                             f"step) or None, got {self.growth!r}")

    def interval(self, last: int, taken: int) -> int:
        """Steps from the curvature step at schedule count ``last`` to the next one, when
        ``taken ≥ 1`` curvature steps have been taken (that one included)."""
        if last < self.warmup - 1:
            return 1
        if self.growth is None:
            return self.every
        if taken * math.log(self.growth) >= math.log(self.every) + 1.0:  # r^n far past T (no overflow)
            return self.every
        return max(1, min(self.every, math.floor(self.growth ** taken)))

    def due(self, step: int, last: int, taken: int) -> bool:
        """Does schedule count ``step`` take curvature, the last one at ``last`` (``taken`` so far)?"""
        return taken == 0 or step - last >= self.interval(last, taken)
