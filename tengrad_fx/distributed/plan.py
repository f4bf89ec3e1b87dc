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

from typing import Optional, Sequence

from ..curvature.layer import gram_flops
from .traffic import blocks_step_sent, gather_step_sent

__all__ = ["solve_cost", "assign_owners", "polar_work", "polar_owners", "step_flops", "solve_flops", "mode_times",
           "choose_modes", "choose_placement"]


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


def polar_work(a: int, b: int) -> int:
    """The size of the polar factor of an ``[a, b]`` matrix: ``min(a, b)²·max(a, b)``, what
    its ``min × min`` Gram, the Newton–Schulz steps' products and the final product each
    cost up to a constant (:mod:`tengrad_fx.solve.polar`)."""
    return min(a, b) ** 2 * max(a, b)


def polar_owners(shapes: Sequence[tuple[int, int]], shards: int) -> list[int]:
    """The rank (of ``shards``) that computes the polar factor of each matrix ``[a, b]`` of
    ``shapes``: greedy by decreasing :func:`polar_work` (ties: the earlier matrix) onto the
    least loaded rank (ties: the lowest), :func:`assign_owners`. A rank's work is then at
    most ``Σ work / shards`` plus one matrix's. Shapes every rank knows: every rank computes
    the same owners without communicating."""
    return assign_owners([float(polar_work(a, b)) for a, b in shapes], shards)


def step_flops(M: int, dims: tuple[int, int, int, int]) -> float:
    """Flops of one layer's ``J g`` and ``Jᵀ c`` on ``M`` samples (``2·M·S·f·o·g`` each)."""
    g, S, f, o = dims
    return 4.0 * M * S * f * o * g


def solve_flops(M: int) -> float:
    """Flops of ``c = (K + MαI)⁻¹ v`` from the cached ``M × M`` Cholesky factor: two
    triangular solves, ``2·M²``."""
    return 2.0 * M * M


def mode_times(M: int, n: int, dims: tuple[int, int, int, int], world: int, bandwidth: float,
               flop_rate: float, nbytes: int = 4) -> tuple[float, float]:
    """Per-step seconds of one layer in each mode, ``(gather on its owner, gram-blocks on
    every rank)``, ``m = M/W``, ``n`` parameters, ``b = nbytes``::

        gather:      n·b / bandwidth + 4·M·S·f·o·g / flop_rate
                     (the owner's u, sent once; J g and Jᵀc on all M rows, at the owner)
        gram-blocks: (2(W−1)/W·n·b + (W−1)·m·b + M·b) / bandwidth + 4·m·S·f·o·g / flop_rate
                     (ring all-reduce of the Jᵀc partial sums, all-gather of the m-vectors
                     J_a g, broadcast of c; J g and Jᵀc on each rank's own m rows)

    (the bytes: :func:`.traffic.gather_step_sent`, :func:`.traffic.blocks_step_sent`).
    The Gram and the Cholesky of a curvature step are the same in both modes and do not
    enter; the records each rank sends on a curvature step may differ (gather may send
    ``P``): :func:`choose_modes` adds that difference."""
    m = M // world
    t_gather = gather_step_sent(n, nbytes) / bandwidth + step_flops(M, dims) / flop_rate
    return t_gather, blocks_step_sent(m, world, n, nbytes) / bandwidth + step_flops(m, dims) / flop_rate


def choose_modes(M: int, ns: Sequence[int], dims: Sequence[tuple[int, int, int, int]], owners: Sequence[int],
                 world: int, bandwidth: float, flop_rate: float,
                 records: Optional[Sequence[tuple[float, float]]] = None, T: int = 1) -> list[str]:
    """``"gather"`` or ``"gram-blocks"`` per layer (``ns``, ``dims``, ``owners``: per
    layer), minimizing the busiest rank's per-step time (:func:`mode_times`; ``records``:
    per layer the bytes a rank sends on a curvature step in gather and in gram-blocks mode,
    :func:`.records.record_bytes` — gather may send the smaller ``P``; every rank sends its
    part in either mode, so their difference, amortized over ``T`` steps, is added to the
    gram-blocks time).

    In ``gather`` a layer's per-step time falls on its owner (the other ranks work on
    their own layers meanwhile); in ``gram-blocks`` every rank spends the layer's
    (``W`` times smaller) share. With the layers sorted by decreasing gather time (ties:
    order), the ``k`` largest go ``gram-blocks``, for the ``k`` that minimizes
    ``max_r(load_r) + shared`` (``load_r``: rank ``r``'s remaining gather layers,
    ``shared``: the ``k`` gram-blocks layers; the smallest such ``k``). So ``gram-blocks``
    takes the layers whose ``J g``/``Jᵀc`` on the global batch would make their owners the
    stragglers, when moving their vectors is cheaper; the inputs are shapes every rank
    knows, so every rank agrees."""
    modes = ["gather"] * len(ns)
    if world == 1 or not ns:
        return modes
    recs = list(records) if records is not None else [(0.0, 0.0)] * len(ns)
    times = []
    for n, d, (rg, rb) in zip(ns, dims, recs):
        tg, tb = mode_times(M, n, d, world, bandwidth, flop_rate)
        times.append((tg, tb + (rb - rg) / T / bandwidth))
    load = [0.0] * world
    for (tg, _), r in zip(times, owners):
        load[r] += tg
    order = sorted(range(len(ns)), key=lambda j: (-times[j][0], j))
    best, best_k, shared = max(load), 0, 0.0
    for k, i in enumerate(order, 1):
        load[owners[i]] -= times[i][0]
        shared += times[i][1]
        cost = max(load) + shared
        if cost < best:
            best, best_k = cost, k
    for i in order[:best_k]:
        modes[i] = "gram-blocks"
    return modes


def choose_placement(M: int, n: int, record_bytes: float, dims: tuple[int, int, int, int], world: int,
                     T: int, bandwidth: float, flop_rate: float, mode: str = "gather") -> str:
    """``"replicate"`` when receiving what the owner sends every step takes longer than
    computing it on every rank (its curvature work amortized over ``T`` steps plus the
    per-step work), else ``"owner"``. ``mode="gather"``: the owner sends ``u`` (``n``
    4-byte values), the per-step work is ``J g``/``Jᵀ c`` on ``M`` rows;
    ``mode="gram-blocks"``: the owner sends ``c`` (``M`` values), the per-step work is the
    two triangular solves (``2·M²`` flops). ``record_bytes``: one rank's records of the
    layer; both placements move ``(W−1)·record_bytes`` into a rank that solves it on a
    curvature step (an owner, or every rank), so they do not enter the choice."""
    if world == 1:
        return "owner"
    if mode == "gram-blocks":
        t_recv, step = 4.0 * M / bandwidth, solve_flops(M)
    else:
        t_recv, step = 4.0 * n / bandwidth, step_flops(M, dims)
    t_solve = (solve_cost(M, dims) / T + step) / flop_rate
    return "replicate" if t_recv > t_solve else "owner"
