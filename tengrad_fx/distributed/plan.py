"""Who solves which layer: the per-layer solve cost and the greedy (KAISA-like) assignment.

For a covered layer on a global curvature batch of ``M = W·m`` samples (``W`` ranks,
``m`` per rank) the owner's curvature work is the Gram ``J Jᵀ`` (the cheaper of the two
strategies of :func:`tengrad_fx.curvature.layer.gram_flops`) plus the Cholesky of the
``M × M`` damped Gram (``M³/3`` flops)::

    cost = min(2·M²·S²·(f+o)·g,  2·M·S·f·o·g + 2·M²·f·o·g) + M³/3

Layers are taken in decreasing cost (ties: graph order) and each goes to the rank with
the least cost so far (ties: the lowest rank). The inputs are shapes every rank knows
identically, so every rank computes the same assignment without communicating.
"""
from __future__ import annotations

from typing import Sequence

from ..curvature.layer import gram_flops

__all__ = ["solve_cost", "assign_owners"]


def solve_cost(M: int, dims: tuple[int, int, int, int]) -> float:
    """Flops of one layer's curvature step on ``M`` samples; ``dims = (g, S, f, o)``."""
    g, S, f, o = dims
    return min(gram_flops(M, g, S, f, o).values()) + M ** 3 / 3.0


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """The owning rank of each layer (greedy by decreasing ``costs``, least-loaded rank)."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += costs[i]
    return owner


def step_flops(M: int, dims: tuple[int, int, int, int]) -> float:
    """Flops of one layer's ``J g`` and ``Jᵀ c`` on ``M`` samples (``2·M·S·f·o·g`` each)."""
    g, S, f, o = dims
    return 4.0 * M * S * f * o * g


def choose_placement(M: int, n: int, record_bytes: float, dims: tuple[int, int, int, int], world: int,
                     T: int, bandwidth: float, flop_rate: float) -> str:
    """``"replicate"`` when receiving the layer's ``u`` (``n`` 4-byte values, every step)
    takes longer than computing it on every rank (its curvature work amortized over ``T``
    steps plus ``J g``/``Jᵀ c``), else ``"owner"``. ``record_bytes``: one rank's records
    of the layer; both placements move ``(W−1)·record_bytes`` into a rank that solves it
    on a curvature step (an owner, or every rank), so they do not enter the choice."""
    if world == 1:
        return "owner"
    t_u = 4.0 * n / bandwidth
    t_solve = (solve_cost(M, dims) / T + step_flops(M, dims)) / flop_rate
    return "replicate" if t_u > t_solve else "owner"
