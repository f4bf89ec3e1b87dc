"""Damped Grams of different sizes in one batched factorization, exactly.

Layers whose ``J`` have different numbers of rows ``m_l`` (``TENGraD(position_rows=k)``: ``k``
rows for a layer over a sequence, ``m`` for the others) share one batched Cholesky and solve
by zero padding to ``M = max m_l``. With the shift ``m_l·α_l > 0`` on the whole diagonal the
padded matrix is ``blockdiag(K_l + m_l·α_l·I, m_l·α_l·I)``: its factor is
``blockdiag(L_l, √(m_l·α_l)·I)``, and a right-hand side that is zero on the padded entries has
the solution ``(K_l + m_l·α_l·I)⁻¹ rhs_l`` on the first ``m_l`` and zero after them.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["pad_gram", "pad_rows"]


def pad_gram(K: Tensor, M: int) -> Tensor:
    """``K [..., m, m]`` zero-padded to ``[..., M, M]`` (``K`` itself when ``m == M``)."""
    m = K.shape[-1]
    return K if m == M else F.pad(K, (0, M - m, 0, M - m))


def pad_rows(v: Tensor, M: int) -> Tensor:
    """``v [..., m]`` zero-padded to ``[..., M]`` (``v`` itself when ``m == M``)."""
    m = v.shape[-1]
    return v if m == M else F.pad(v, (0, M - m))
