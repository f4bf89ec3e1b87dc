"""Batched GEMM helpers of the stacked forms (:mod:`.materialized`, :mod:`.factored`)."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["scaled_bmm"]

_ZEROS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def scaled_bmm(X: Tensor, Y: Tensor, alpha: float) -> Tensor:
    """``alpha·(X @ Y)`` for ``X [L, a, n]``, ``Y [L, n, b]``: ``[L, a, b]`` as one GEMM
    (``beta = 0``: its 0-d input, made once per dtype and device, is never read); a plain
    ``bmm`` for ``alpha = 1`` (the form the fused, compiled path takes)."""
    if alpha == 1.0:
        return torch.bmm(X, Y)
    key = (X.dtype, X.device)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = _ZEROS[key] = X.new_zeros(())
    return torch.baddbmm(zero, X, Y, beta=0.0, alpha=alpha)
