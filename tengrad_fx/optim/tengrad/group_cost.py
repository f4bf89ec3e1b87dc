"""What a reuse step costs over the groups of :mod:`tengrad_fx.optim.tengrad.tengrad_groups`: the
flops and bytes of its curvature work (``J g``, the two triangular solves, ``Jᵀ c``), which
``tools.bench`` prints beside the measured time."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tengrad_groups import LayerGroup

__all__ = ["reuse_cost"]


def reuse_cost(groups: "list[LayerGroup]") -> tuple[float, float]:
    """``(flops, bytes)`` of a reuse step's curvature work over ``groups``: per layer
    ``J g`` and ``Jᵀ c`` (each one pass over the cached ``P``, or over ``I``, ``G``), the two
    triangular solves with the cached factors, and reading ``g`` / writing ``u``. The
    final momentum update (a few passes over the parameters) is not included."""
    flops = nbytes = 0.0
    for grp in groups:
        L = len(grp.layers)
        n = sum(p.numel() for lay in grp.layers for p in (lay.weight, lay.bias) if p is not None)  # all L
        es = grp.layers[0].weight.element_size()
        if grp.form == "P":  # a packed group's zero columns are read and multiplied too
            assert grp.Pw is not None
            P_numel = grp.Pw.numel() + (grp.Pb.numel() if grp.Pb is not None else 0)
            flops += 2 * 2.0 * P_numel
            nbytes += 2.0 * P_numel * es
        elif grp.form == "IG":
            assert grp.A is not None and grp.B is not None
            flops += 2 * 2.0 * L * grp.m * grp.A.shape[2] * grp.B.shape[2]
            nbytes += 2.0 * (grp.A.numel() + grp.B.numel()) * es
        elif grp.form == "conv":
            assert grp.A is not None and grp.B is not None
            g, S, f, o = grp.layers[0].dims()
            flops += 2 * 2.0 * L * grp.m * S * f * o * g
            nbytes += 2.0 * (grp.A.numel() + grp.B.numel()) * es
        else:
            lay = grp.layers[0]
            g, S, f, o = lay.dims()
            flops += 2 * 2.0 * grp.m * S * f * o * g
            nbytes += 2.0 * sum((r.I.numel() if r.I is not None else 0) + (r.G.numel() if r.G is not None else 0)
                                for r in lay.records()) * es
        flops += 2 * 2.0 * L * grp.m * grp.m
        nbytes += L * grp.m * grp.m * (grp.chol.element_size() if grp.chol is not None else es) + 2.0 * n * es
    return flops, nbytes
