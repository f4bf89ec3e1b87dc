"""The exact damped Fisher-block inverse through the Woodbury identity.

For one layer with ``J`` (``[m, n]``, rows = per-sample gradients), ``F = JᵀJ/m``, Gram
``K = J Jᵀ`` and damping ``α``::

    (F + αI)⁻¹ g = (1/α)·(g − Jᵀ (K + mαI)⁻¹ J g)            (woodbury_apply)

and, when ``g = s·Jᵀ1`` (the batch gradient of the same batch, ``s = 1/m`` for a mean
loss, ``1`` for a sum), the push-through identity gives, without ``J g``::

    (F + αI)⁻¹ g = s·m · Jᵀ (K + mαI)⁻¹ 1                      (woodbury_push_through)

Only ``m×m`` matrices are factorized here; ``J`` is only touched through ``jvp``/``vjp``
callables provided by the caller. Layers with the same ``m`` are factorized in one
batched Cholesky.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["damped_cholesky", "woodbury_apply", "woodbury_push_through", "CholeskyFailed"]


class CholeskyFailed(RuntimeError):
    """Raised when a damped Gram stays non-positive-definite after every jitter retry."""


def damped_cholesky(K: Tensor, shift: Tensor | float, dtype: Optional[torch.dtype] = None,
                    max_tries: int = 6) -> Tensor:
    """Lower Cholesky factors of ``K + shift·I``; ``K``: ``[L, m, m]`` (or ``[m, m]``).

    ``shift`` is ``m·α`` (scalar or ``[L]``). Factorization runs in ``dtype`` (default: K's).
    A failed factor is retried with jitter ``10^k · 1e-6 · mean(diag)`` added, growing
    tenfold, up to ``max_tries``; then :class:`CholeskyFailed`.
    """
    Kd = K if dtype is None else K.to(dtype)
    batched = Kd.dim() == 3
    if not batched:
        Kd = Kd.unsqueeze(0)
    L_, m, _ = Kd.shape
    eye = torch.eye(m, dtype=Kd.dtype, device=Kd.device)
    shift_t = torch.as_tensor(shift, dtype=Kd.dtype, device=Kd.device).reshape(-1, 1, 1)
    A = Kd + shift_t * eye
    if not torch.isfinite(A).all():
        raise CholeskyFailed("non-finite entries in the damped Gram")
    chol, info = torch.linalg.cholesky_ex(A)
    scale = A.diagonal(dim1=1, dim2=2).abs().mean(1).clamp_min(torch.finfo(A.dtype).tiny)
    jitter = 1e-6
    tries = 0
    while bool((info != 0).any()):
        if tries >= max_tries:
            raise CholeskyFailed(f"damped Gram not positive definite after {max_tries} jitter retries")
        bad = info != 0
        A[bad] = A[bad] + (jitter * scale[bad]).reshape(-1, 1, 1) * eye
        c2, i2 = torch.linalg.cholesky_ex(A[bad])
        chol[bad], info[bad] = c2, i2
        jitter *= 10.0
        tries += 1
    return chol if batched else chol[0]


def _solve(chol: Tensor, rhs: Tensor) -> Tensor:
    out = torch.cholesky_solve(rhs.to(chol.dtype).unsqueeze(-1), chol).squeeze(-1)
    return out.to(rhs.dtype)


def woodbury_apply(chol: Tensor, g: Tensor, damping: float,
                   jvp: Callable[[Tensor], Tensor], vjp: Callable[[Tensor], Tensor]) -> Tensor:
    """``(F + αI)⁻¹ g`` for one layer; ``chol``: factor of ``K + mαI`` (``[m, m]``).

    ``g``: flat ``[n]``; ``jvp(g) -> J g [m]``; ``vjp(c) -> Jᵀ c [n]``.
    """
    c = _solve(chol, jvp(g))
    return (g - vjp(c)) / damping


def woodbury_push_through(chol: Tensor, scale: float, vjp: Callable[[Tensor], Tensor]) -> Tensor:
    """``(F + αI)⁻¹ g`` for ``g = scale_g · Jᵀ1``: ``scale · Jᵀ (K + mαI)⁻¹ 1``.

    Pass ``scale = scale_g · m``.
    """
    m = chol.shape[-1]
    ones = torch.ones(m, dtype=chol.dtype, device=chol.device)
    c = torch.cholesky_solve(ones.unsqueeze(-1), chol).squeeze(-1)
    return vjp(c) * scale
