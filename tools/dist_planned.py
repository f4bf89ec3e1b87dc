"""The cost of two distributed modes, rank-reduced rows (``DistributedTENGraD(position_rows=k)``
runs them, its draw uniform over the global batch rather than stratified) and
the owner polar factor (what FSDP2 runs: :mod:`tengrad_fx.distributed.fsdp_shaping`): what
:mod:`tools.dist_scaling` reports for them, from the library's own pieces
(:mod:`tengrad_fx.distributed.traffic` for the bytes, :mod:`tengrad_fx.distributed.plan`
for the flops and the greedy owners, :func:`tengrad_fx.solve.polar.gram_side_saving` for
Newton–Schulz).

* **Rank-reduced rows** (:func:`rows_layer_cost`): ``k`` rows of ``J`` — one per
  (sample, position), as ``TENGraD(position_rows=k)`` draws them on one process — drawn
  once for the global batch of ``M·S`` rows by a generator seeded alike on every rank; each
  rank supplies the rows it holds (a draw stratified over the ranks: at most ``⌈k/W⌉``
  each) to the layer's owner, which forms the ``k × k`` Gram, factorizes it, computes
  ``J_k g`` and ``J_kᵀ c`` over its ``k`` rows and broadcasts ``u``. The bytes are bounded
  by ``k``, not by ``M = W·m``.
* **Owner polar factor** (:func:`owner_polar_cost`): each 2-D update ``U [a, b]`` starts
  row-sharded over the ``W`` ranks (FSDP2's ``torch.chunk`` rows,
  :func:`tengrad_fx.distributed.fsdp_rows.row_chunk`); one all-to-all takes every shard to
  the matrix's owner, the owner runs Newton–Schulz on the whole matrix, and a second
  all-to-all scatters the polar factor's row shards back. Owners are balanced by their
  Newton–Schulz flops (:func:`tengrad_fx.distributed.plan.assign_owners`).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from tengrad_fx.distributed.fsdp_rows import row_chunk
from tengrad_fx.distributed.plan import assign_owners, solve_cost, solve_flops, step_flops
from tengrad_fx.distributed.traffic import gather_sent, gather_step_sent
from tengrad_fx.solve.polar import GRAM_SIDE_MIN_SAVING, NEWTON_SCHULZ_STEPS, gram_side_saving

__all__ = ["LayerCost", "rows_per_rank", "rows_layer_cost", "newton_schulz_flops", "owner_polar_cost"]


class LayerCost(NamedTuple):
    """One layer's cost in one mode, per step (bytes sent, flops), on a curvature step
    (``curv_*``) and on a reuse step (``reuse_*``): ``*_all`` on every rank, ``*_owner``
    only on the layer's owner, ``curv_others`` only on the other ranks (the records they
    send), ``curv_recv`` the records the owner receives."""
    curv_all: float
    curv_others: float
    reuse_all: float
    curv_flops_all: float
    curv_flops_owner: float
    reuse_flops_all: float
    reuse_flops_owner: float
    curv_recv: float = 0.0


def rows_per_rank(k: int, world: int) -> tuple[int, int]:
    """The fewest and the most of ``k`` rows drawn for the global batch that one rank
    holds, ``(⌊k/W⌋, ⌈k/W⌉)`` (the draw stratified over the ranks)."""
    return k // world, -(-k // world)


def rows_layer_cost(k: int, world: int, n: int, dims: tuple[int, int, int, int], row_bytes: float,
                    es: int = 4) -> LayerCost:
    """Rank-reduced rows (module docstring) for a layer of ``n`` parameters whose records
    have ``dims = (g, S, f, o)`` per sample and ``row_bytes`` per (sample, position) row
    (``I`` and ``G`` of one position). With ``r = ⌈k/W⌉`` rows per rank and one row per
    position (``dims_row = (g, 1, f, o)``)::

        curvature step, a non-owner:  r·row_bytes   (its rows to the owner; the owner none)
        the owner receives:           (k − ⌊k/W⌋)·row_bytes ≤ k·row_bytes
        every step, every rank:       n·es          (the owner's u, a pipelined broadcast)
        owner, curvature step:        solve_cost(k, dims_row)         (k × k Gram + k³/3)
        owner, every step:            step_flops(k, dims_row) + 2k²   (J_k g, J_kᵀc, two solves)
    """
    g, _, f, o = dims
    row_dims = (g, 1, f, o)
    per_step = step_flops(k, row_dims) + solve_flops(k)
    u = gather_step_sent(n, es)
    fewest, most = rows_per_rank(k, world)
    return LayerCost(curv_all=u, curv_others=gather_sent(most * row_bytes, False), reuse_all=u,
                     curv_flops_all=0.0, curv_flops_owner=solve_cost(k, row_dims) + per_step,
                     reuse_flops_all=0.0, reuse_flops_owner=per_step, curv_recv=(k - fewest) * row_bytes)


def newton_schulz_flops(a: int, b: int, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """Flops of :func:`tengrad_fx.solve.newton_schulz_polar` on one ``[a, b]`` matrix
    (``A = min(a, b)``, ``B = max``): ``s·(4A²B + 2A³)`` on ``X`` itself, less
    :func:`~tengrad_fx.solve.polar.gram_side_saving` where the code takes the Gram form
    (a saving of at least ``GRAM_SIDE_MIN_SAVING``)."""
    A, B = min(a, b), max(a, b)
    direct = steps * (4 * A * A * B + 2 * A ** 3)
    saving = gram_side_saving(A, B, steps)
    return float(direct - saving if saving >= GRAM_SIDE_MIN_SAVING else direct)


class PolarCost(NamedTuple):
    """Per rank (lists of ``W``): bytes sent and Newton–Schulz flops per step; ``total``:
    every matrix's flops (what each rank spends when every rank orthogonalizes every
    update); ``owners``: each matrix's owner."""
    sent: list[float]
    flops: list[float]
    total: float
    owners: list[int]


def owner_polar_cost(shapes: Sequence[tuple[int, int]], world: int, es: int = 4) -> PolarCost:
    """The owner polar factor (module docstring) of the 2-D updates ``shapes`` (``[a, b]``,
    rows sharded) on ``W`` ranks. Rank ``d`` holds ``s_d(U) = rows_d·b·es`` bytes of each
    ``U``; per step it sends::

        Σ_{U: owner(U) ≠ d} s_d(U)            (its shards to their owners, all-to-all)
      + Σ_{U: owner(U) = d} Σ_{e ≠ d} s_e(U)   (the polar factor's shards back, all-to-all)

    and its flops are :func:`newton_schulz_flops` of the matrices it owns (greedy by flops:
    at most ``total/W`` plus one matrix)."""
    costs = [newton_schulz_flops(a, b) for a, b in shapes]
    owners = assign_owners(costs, world)
    sent, flops = [0.0] * world, [0.0] * world
    for (a, b), cost, owner in zip(shapes, costs, owners):
        shard = [(hi - lo) * b * es for lo, hi in (row_chunk(a, world, d) for d in range(world))]
        for d in range(world):
            sent[d] += gather_sent(shard[d], d == owner)
        sent[owner] += sum(shard) - shard[owner]
        flops[owner] += cost
    return PolarCost(sent, flops, sum(costs), owners)
