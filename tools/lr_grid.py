"""The lr grids and lr schedules of ``tools.peer_bench`` (and ``tools.ablate``, ``tools.lm_protocol``).

* A grid of ``k`` points (odd ``k``) ``step`` apart, centred on ``c``: ``c · step^j`` for
  ``j = −k//2 … k//2`` (:func:`lr_factors`, :func:`lr_grid`); ``--lr-grid-for`` names one
  method's grid: ``NAME=CENTRE:K`` (``K`` points centred on ``CENTRE``) or ``NAME=a,b,c``
  (those lrs) (:func:`parse_lr_grid`).
* The schedule (:func:`lr_multiplier`): the factor on every param group's lr after ``t``
  steps of a run of ``steps``: a linear warm-up over the first ``warmup`` steps (the step
  ``t < warmup`` at ``(t + 1) / warmup`` of the lr), then ``"constant"`` 1 or ``"cosine"``
  ``½(1 + cos(π·(t − warmup)/(steps − warmup)))``, from 1 down to exactly 0 after the last
  step (``t = steps``).
"""
from __future__ import annotations

import math
from typing import Callable

__all__ = ["SCHEDULES", "lr_factors", "lr_grid", "lr_multiplier", "parse_lr_grid"]

SCHEDULES = ("constant", "cosine")
"""The ``--schedule`` choices (:func:`lr_multiplier`)."""


def lr_factors(k: int, step: float = 3.0) -> list[float]:
    """The multipliers of a grid's centre: ``step^j`` for ``j = −k//2 … k//2`` (odd ``k``)."""
    if k < 1 or k % 2 == 0:
        raise ValueError(f"--lr-grid must be an odd number ≥ 1, got {k}")
    if step <= 1:
        raise ValueError(f"--lr-step must be > 1, got {step}")
    return [step ** j for j in range(-(k // 2), k // 2 + 1)]


def lr_grid(centre: float, k: int, step: float = 3.0) -> list[float]:
    """``k`` lrs ``step`` apart centred on ``centre``, each rounded to 6 significant digits."""
    return [float(f"{centre * f:.6g}") for f in lr_factors(k, step)]


def parse_lr_grid(spec: str, step: float = 3.0) -> tuple[str, list[float]]:
    """``"NAME=CENTRE:K"`` → (NAME, :func:`lr_grid` (CENTRE, K, ``step``)); ``"NAME=a,b,c"`` →
    (NAME, [a, b, c] ascending)."""
    name, eq, body = spec.partition("=")
    try:
        if not eq or not name.strip():
            raise ValueError("no NAME=")
        if ":" in body:
            centre, _, k = body.partition(":")
            return name.strip(), lr_grid(float(centre), int(k), step)
        lrs = sorted(float(v) for v in body.split(","))
    except ValueError as e:
        raise ValueError(f"--lr-grid-for {spec!r}: give NAME=CENTRE:K (K odd) or NAME=LR,LR,... ({e})") from None
    if not lrs or min(lrs) <= 0:
        raise ValueError(f"--lr-grid-for {spec!r}: the lrs must be positive")
    return name.strip(), lrs


def lr_multiplier(schedule: str, steps: int, warmup: int = 0) -> Callable[[int], float]:
    """The schedule's factor on every group's lr after ``t`` steps (module docstring);
    ``0 ≤ warmup < steps``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0 <= warmup < steps:
        raise ValueError(f"--lr-warmup must be in [0, steps = {steps}), got {warmup}")
    decay = steps - warmup

    def factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        if schedule == "constant":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(t - warmup, decay) / decay))

    return factor
