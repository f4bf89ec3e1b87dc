"""Curvature products of ``L`` layers kept as materialized per-sample gradients.

Layer ``l``'s ``J`` is ``k·[Pw[l], Pb[l]]``: ``Pw [L, m, n_w]``, ``Pb [L, m, n_b]`` (or None:
no bias part; a packed stack, several layers' ``[P_w, P_b]`` side by side and zero-padded,
is one ``Pw``). Gradients are stacked alike, ``gw [L, n_w]``, ``gb [L, n_b]``; ``c`` and
``J g`` are ``[L, m]``. Each product is one batched GEMM per part, the scale ``k`` (or
``k²``) in its ``alpha``. These are the only definitions of the form's Gram, ``J g`` and
``Jᵀ c``: the layer groups (:mod:`tengrad_fx.optim.tengrad.group_forms`), the fused update
(:mod:`tengrad_fx.optim.tengrad.fused_update`, one layer at a time with ``L = 1`` under
``torch.func.vmap``, ``k`` already folded in) and distributed ``gram-blocks`` call them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .batched import scaled_bmm

__all__ = ["gram", "jvp", "vjp", "woodbury"]


def gram(Pw: Tensor, Pb: Optional[Tensor], kk: float) -> Tensor:
    """``K = J Jᵀ = k²·(Pw Pwᵀ + Pb Pbᵀ)``, ``[L, m, m]`` (``kk = k²``)."""
    K = scaled_bmm(Pw, Pw.transpose(1, 2), kk)
    if Pb is not None:
        K = torch.baddbmm(K, Pb, Pb.transpose(1, 2), alpha=kk)
    return K


def jvp(Pw: Tensor, Pb: Optional[Tensor], gw: Tensor, gb: Optional[Tensor], k: float) -> Tensor:
    """``J g = k·(Pw gw + Pb gb)``, ``[L, m]``, as the row-vector form ``gᵀ Pᵀ``
    (``[L, 1, n]·[L, n, m]``): a batched GEMV that reads ``P`` once row-major (the column
    form ``P·g`` is 3–5× slower batched on CPU BLAS)."""
    out = torch.baddbmm(Pw.new_empty(()), gw.unsqueeze(1), Pw.transpose(1, 2), beta=0.0, alpha=k)
    if Pb is not None and gb is not None:
        out = torch.baddbmm(out, gb.unsqueeze(1), Pb.transpose(1, 2), alpha=k)
    return out.squeeze(1)


def vjp(Pw: Tensor, Pb: Optional[Tensor], c: Tensor, k: float) -> tuple[Tensor, Optional[Tensor]]:
    """``Jᵀ c = k·(cᵀ Pw, cᵀ Pb)`` for ``c [L, m]``: ``(w [L, n_w], b [L, n_b] or None)``."""
    c = c.to(Pw.dtype) * k
    w = torch.bmm(c.unsqueeze(1), Pw).squeeze(1)
    b = torch.bmm(c.unsqueeze(1), Pb).squeeze(1) if Pb is not None else None
    return w, b


def woodbury(Pw: Tensor, Pb: Optional[Tensor], c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float,
             gamma: float, k: float) -> tuple[Tensor, Optional[Tensor]]:
    """``u = β·g + γ·Jᵀc`` for ``c [L, m]``: ``(uw [L, n_w], ub [L, n_b] or None)``, one
    ``baddbmm`` per part (the row form of :func:`vjp`, ``γ·k`` in its ``alpha``)."""
    c3 = c.to(Pw.dtype).unsqueeze(1)  # [L, 1, m]
    uw = torch.baddbmm(gw.unsqueeze(1), c3, Pw, beta=beta, alpha=gamma * k)
    ub = None
    if Pb is not None and gb is not None:
        ub = torch.baddbmm(gb.unsqueeze(1), c3, Pb, beta=beta, alpha=gamma * k)
    return uw.squeeze(1), (ub.squeeze(1) if ub is not None else None)
