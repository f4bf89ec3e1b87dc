"""Pure tensor math of per-sample gradients of a linear layer with shared dimensions.

Every covered layer (Linear on ``[m, *, d_in]``, grouped ConvNd after unfolding) is, per
group, ``y[s] = W x[s] + b`` over *positions* ``s`` that share the weight. Layout:

  * ``A``: ``[m, g, S, f]`` — layer inputs (unfolded patches for conv), per group ``g``,
    position ``s`` and input feature ``f``.
  * ``B``: ``[m, g, S, o]`` — per-sample gradients w.r.t. the outputs, same layout.
  * weight-shaped tensors: ``[g, o, f]``; bias-shaped: ``[g, o]``.

Sample ``i``'s gradient is ``dW_i = Σ_s B[i,:,s]ᵀ A[i,:,s]`` (``[g, o, f]``) and
``db_i = Σ_s B[i,:,s]`` (``[g, o]``). ``J`` stacks ``vec(dW_i, db_i)`` as rows. The bias is
treated apart from the weight everywhere (the "+1" of the paper's ``(I Iᵀ + 1) ⊙ (G Gᵀ)``)
so no ones-column copy of ``A`` is ever made.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import factored

__all__ = [
    "per_sample_grads", "gram_factor", "gram_factor_stacked", "gram_materialize", "gram_bias", "jvp", "vjp",
    "DEFAULT_BLOCK_BYTES",
]

DEFAULT_BLOCK_BYTES = 64 * 2**20
"""Working-memory bound (bytes) for the blocked Gram contractions."""


def per_sample_grads(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """``(dW [m, g, o, f], db [m, g, o])`` per sample."""
    m, g, S, f = A.shape
    o = B.shape[-1]
    dW = torch.bmm(B.reshape(m * g, S, o).transpose(1, 2), A.reshape(m * g, S, f))
    return dW.reshape(m, g, o, f), B.sum(2)


def gram_bias(B: Tensor) -> Tensor:
    """Bias part of ``J Jᵀ``: ``K[i, j] = Σ_g <Σ_s B[i,g,s], Σ_t B[j,g,t]>``, ``[m, m]``."""
    bs = B.sum(2).flatten(1)
    return bs @ bs.T


def gram_factor(A: Tensor, B: Tensor, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Tensor:
    """Weight part of ``J Jᵀ`` by covariance factorization, ``[m, m]``.

    ``K[i, j] = Σ_g Σ_{s,t} (A[i,g,s]·A[j,g,t]) (B[i,g,s]·B[j,g,t])``. Never forms
    ``J``; for ``S > 1`` the ``[bi·S, bj·S]`` products are computed over sample blocks
    sized so each block's working set stays under ``block_bytes`` (at least one pair).
    Cost ``2·m²·S²·(f + o)·g`` flops. One layer of :func:`gram_factor_stacked`.
    """
    return gram_factor_stacked(A.transpose(0, 1).unsqueeze(0), B.transpose(0, 1).unsqueeze(0), block_bytes)[0]


def gram_factor_stacked(A: Tensor, B: Tensor, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Tensor:
    """:func:`gram_factor` of ``L`` stacked layers at once, ``[L, m, m]``: ``A [L, g, m, S, f]``,
    ``B [L, g, m, S, o]`` (layer, group, sample, position, feature). Each sample block is
    one ``bmm`` over ``L·g`` for ``A`` and one for ``B`` (the block bound covers all ``L``)."""
    L, g, m, S, f = A.shape
    o = B.shape[-1]
    if S == 1:
        a, b = A[..., 0, :].reshape(L * g, m, f), B[..., 0, :].reshape(L * g, m, o)
        return factored.gram(a, b).view(L, g, m, m).sum(1)
    per_pair = 2 * L * g * S * S * A.element_size()
    blk = max(1, min(m, int(math.sqrt(block_bytes / per_pair))))
    K = A.new_zeros(L, m, m)
    for i0 in range(0, m, blk):
        i1 = min(m, i0 + blk)
        ai = A[:, :, i0:i1].reshape(L * g, -1, f)
        bi = B[:, :, i0:i1].reshape(L * g, -1, o)
        for j0 in range(i0, m, blk):
            j1 = min(m, j0 + blk)
            aabb = factored.gram(ai, bi, A2=A[:, :, j0:j1].reshape(L * g, -1, f),
                                 B2=B[:, :, j0:j1].reshape(L * g, -1, o))  # (a_i a_jᵀ) ⊙ (b_i b_jᵀ)
            blkK = aabb.reshape(L, g, i1 - i0, S, j1 - j0, S).sum((1, 3, 5))
            K[:, i0:i1, j0:j1] = blkK
            if j0 != i0:
                K[:, j0:j1, i0:i1] = blkK.transpose(1, 2)
    return K


def gram_materialize(A: Tensor, B: Tensor, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Tensor:
    """Weight part of ``J Jᵀ`` from explicit per-sample gradients, ``[m, m]``.

    The per-sample gradients are formed for a chunk of output channels at a time
    (at most ``block_bytes`` of them), and their Gram accumulated.
    Cost ``2·m·S·f·o·g + 2·m²·f·o·g`` flops.
    """
    m, g, S, f = A.shape
    o = B.shape[-1]
    chunk = max(1, min(o, block_bytes // max(1, m * g * f * A.element_size())))
    a = A.reshape(m * g, S, f)
    K = A.new_zeros(m, m)
    for c0 in range(0, o, chunk):
        b = B[..., c0:c0 + chunk].reshape(m * g, S, -1).transpose(1, 2)
        P = torch.bmm(b, a).reshape(m, -1)
        K.addmm_(P, P.T)
    return K


def jvp(A: Tensor, B: Tensor, vW: Tensor, vb: Optional[Tensor] = None) -> Tensor:
    """``J v``, ``[m]``: ``Σ_{g,s} B[i,g,s] · (vW[g] A[i,g,s] + vb[g])``.

    One ``[m·S, f] × [f, o]`` GEMM per group (never ``m`` separate products with ``vW``).
    """
    m, g, S, f = A.shape
    o = B.shape[-1]
    Ag = A.transpose(0, 1).reshape(g, m * S, f)
    Av = torch.bmm(Ag, vW.transpose(1, 2)).reshape(g, m, S, o)  # [g, m, S, o]
    out = (Av * B.transpose(0, 1)).sum((0, 2, 3))
    if vb is not None:
        out = out + (B.sum(2) * vb.unsqueeze(0)).flatten(1).sum(1)
    return out


def vjp(A: Tensor, B: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ c`` as ``(weight part [g, o, f], bias part [g, o])``: one GEMM per group."""
    m, g, S, f = A.shape
    o = B.shape[-1]
    Bc = B * c.reshape(m, 1, 1, 1)
    Bg = Bc.transpose(0, 1).reshape(g, m * S, o)
    gW = torch.bmm(Bg.transpose(1, 2), A.transpose(0, 1).reshape(g, m * S, f))
    return gW, Bc.sum((0, 2))
