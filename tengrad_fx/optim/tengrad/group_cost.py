"""What a reuse step costs over the groups of :mod:`tengrad_fx.optim.tengrad.layer_groups`: the
flops and bytes of its curvature work (``J g``, the two triangular solves, ``Jᵀ c``), which
``tools.bench`` prints beside the measured time."""
from __future__ import annotations

from .group_forms import ConvStackGroup, FactoredLinearGroup, MaterializedGroup
from .layer_groups import LayerGroup

__all__ = ["reuse_cost"]


def _products_cost(grp: LayerGroup, es: int) -> tuple[float, float]:
    """``(flops, bytes)`` of one group's ``J g`` and ``Jᵀ c`` (each one pass over the cached
    ``P``, or over ``I``, ``G``)."""
    L = len(grp.layers)
    if isinstance(grp, MaterializedGroup):  # a packed group's zero columns are read and multiplied too
        P_numel = grp.Pw.numel() + (grp.Pb.numel() if grp.Pb is not None else 0)
        return 2 * 2.0 * P_numel, 2.0 * P_numel * es
    if isinstance(grp, FactoredLinearGroup):
        return 2 * 2.0 * L * grp.m * grp.A.shape[2] * grp.B.shape[2], 2.0 * (grp.A.numel() + grp.B.numel()) * es
    g, S, f, o = grp.layers[0].dims()
    if isinstance(grp, ConvStackGroup):
        return 2 * 2.0 * L * grp.m * S * f * o * g, 2.0 * (grp.A.numel() + grp.B.numel()) * es
    records = sum((r.I.numel() if r.I is not None else 0) + (r.G.numel() if r.G is not None else 0)
                  for r in grp.layers[0].records())
    return 2 * 2.0 * grp.m * S * f * o * g, 2.0 * records * es


def reuse_cost(groups: list[LayerGroup]) -> tuple[float, float]:
    """``(flops, bytes)`` of a reuse step's curvature work over ``groups``: per layer
    ``J g`` and ``Jᵀ c`` (each one pass over the cached ``P``, or over ``I``, ``G``), the two
    triangular solves with the cached factors, and reading ``g`` / writing ``u``. The
    final momentum update (a few passes over the parameters) is not included."""
    flops = nbytes = 0.0
    for grp in groups:
        L = len(grp.layers)
        n = sum(p.numel() for lay in grp.layers for p in (lay.weight, lay.bias) if p is not None)  # all L
        es = grp.layers[0].weight.element_size()
        f_jc, b_jc = _products_cost(grp, es)
        flops += f_jc + 2 * 2.0 * L * grp.m * grp.m
        nbytes += b_jc + L * grp.m * grp.m * (grp.chol.element_size() if grp.chol is not None else es) + 2.0 * n * es
    return flops, nbytes
