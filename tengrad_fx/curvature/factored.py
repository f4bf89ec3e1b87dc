"""Curvature products of ``L`` single-position Linear layers kept as ``I``, ``G``.

Layer ``l`` has inputs ``A [L, m, f]`` and output gradients ``B [L, m, o]`` (one position
per sample), so sample ``i``'s gradient is ``k·(B_i A_iᵀ, B_i)`` and

* ``K = J Jᵀ = k²·(A Aᵀ + 1) ⊙ (B Bᵀ)`` (without a bias: ``k²·(A Aᵀ) ⊙ (B Bᵀ)``);
* ``J g = k·Σ (A Gwᵀ) ⊙ B (+ B gb)`` for ``g = (gw [L, o·f], gb [L, o])``;
* ``Jᵀ c = k·((B ⊙ c)ᵀ A, Σ B ⊙ c)`` for ``c [L, m]``.

The Gram is also the cross block of two row sets, ``(A_a A_bᵀ + 1) ⊙ (B_a B_bᵀ)``
(:func:`gram` with ``A2``, ``B2``): the positions form of
:func:`~tengrad_fx.curvature.tensors.gram_factor_stacked` takes its blocks of samples by
it. These are the only definitions of the form's Gram, ``J g`` and ``Jᵀ c``: the layer
groups (:mod:`tengrad_fx.optim.tengrad.group_forms`), the fused update
(:mod:`tengrad_fx.optim.tengrad.fused_update`, ``L = 1``, ``k`` folded into ``B``) and distributed
``gram-blocks`` call them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .batched import scaled_bmm

__all__ = ["gram", "jvp", "vjp", "woodbury"]


def gram(A: Tensor, B: Tensor, kk: float = 1.0, bias: bool = False,
         A2: Optional[Tensor] = None, B2: Optional[Tensor] = None) -> Tensor:
    """``k²·(A A2ᵀ + 1) ⊙ (B B2ᵀ)`` (``bias``; else ``k²·(A A2ᵀ) ⊙ (B B2ᵀ)``), ``[L, a, b]``,
    for ``A [L, a, f]``, ``B [L, a, o]`` and ``A2 [L, b, f]``, ``B2 [L, b, o]`` (default:
    ``A``, ``B``, the Gram ``[L, m, m]``). ``kk = k²`` rides in the GEMM's ``alpha``; the
    ``+1`` and the product are one ``addcmul`` (without it one in-place ``mul_``: two
    ``[L, a, b]`` buffers)."""
    AA = torch.bmm(A, (A if A2 is None else A2).transpose(1, 2))
    BB = scaled_bmm(B, (B if B2 is None else B2).transpose(1, 2), kk)
    return torch.addcmul(BB, AA, BB) if bias else AA.mul_(BB)


def jvp(A: Tensor, B: Tensor, gw: Tensor, gb: Optional[Tensor], k: float) -> Tensor:
    """``J g``, ``[L, m]``, for ``gw [L, o·f]`` and ``gb [L, o]`` (or None): ``k·Σ (A Gwᵀ)⊙B``
    or ``k·Σ (B Gw)⊙A``, the order with the smaller ``[m, min(o, f)]`` intermediate (equal
    flops ``m·o·f``)."""
    Gw = gw.view(gw.shape[0], B.shape[2], A.shape[2])  # [L, o, f]
    if B.shape[2] <= A.shape[2]:
        out = (torch.bmm(A, Gw.transpose(1, 2)) * B).sum(2)
    else:
        out = (torch.bmm(B, Gw) * A).sum(2)
    if gb is not None:
        out = out + torch.bmm(B, gb.unsqueeze(2)).squeeze(2)
    return out * k


def vjp(A: Tensor, B: Tensor, c: Tensor, k: float, bias: bool) -> tuple[Tensor, Optional[Tensor]]:
    """``Jᵀ c`` for ``c [L, m]``: ``(k·(B⊙c)ᵀ A [L, o·f], k·Σ B⊙c [L, o] or None)``."""
    Bc = B * (c.to(B.dtype) * k).unsqueeze(2)
    w = torch.bmm(Bc.transpose(1, 2), A).flatten(1)
    return w, (Bc.sum(1) if bias else None)


def woodbury(A: Tensor, B: Tensor, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float, gamma: float,
             k: float) -> tuple[Tensor, Optional[Tensor]]:
    """``u = β·g + γ·Jᵀc`` for ``c [L, m]``: ``(uw [L, o·f], ub [L, o] or None)``; the weight
    part is one ``baddbmm`` (``γ·k`` in its ``alpha``), the bias part one ``add``."""
    Bc = B * c.to(B.dtype).unsqueeze(2)  # [L, m, o]
    Gw = gw.view(gw.shape[0], B.shape[2], A.shape[2])  # [L, o, f]
    uw = torch.baddbmm(Gw, Bc.transpose(1, 2), A, beta=beta, alpha=gamma * k).flatten(1)
    ub = None
    if gb is not None:
        ub = torch.add(gb * beta if beta != 1.0 else gb, Bc.sum(1), alpha=gamma * k)
    return uw, ub
