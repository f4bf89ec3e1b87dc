"""Symmetric eigendecompositions with floored eigenvalues, and the inverse square root of a
Kronecker factor's normalized root built on them.

:func:`floored_eigh` of a symmetric ``A [..., n, n]``: ``A = E diag(λ) Eᵀ`` with every
eigenvalue raised to ``max(λᵢ, δ·max(λ_max, 0), tiny)``, so a rank-deficient or slightly
indefinite ``A`` (rounding) gives a positive spectrum whose smallest value is ``δ`` of its
largest. A non-finite ``A`` is decomposed as zeros (no eigensolver error) and flagged, so the
caller picks what stands in for it.

:func:`root_inverse_sqrt` of a second-moment factor ``M`` (a Kronecker side of a base metric
``D``): with ``D_M = M^{1/2} / mean(eig(M^{1/2}))`` (mean eigenvalue 1, eigenvalues of
``M^{1/2}`` floored at ``δ`` of the largest), ``S = D_M^{-1/2} = E diag(d^{-1/2}) Eᵀ``. ``M``
is a full matrix ``[..., n, n]``; :func:`diagonal_root_inverse_sqrt` is the same maths on a
diagonal ``[..., n]`` (``E = I``). A non-finite ``M`` gives ``S = I``.

When ``S`` is recomputed between curvature steps, rows already scaled by the old factor
``x S_old`` become ``x S_new`` by :func:`root_change` ``S_old⁻¹ S_new`` (one Cholesky of
``S_old``, positive definite with condition at most ``δ^{-1/2}`` by the floor), so only the
scaled rows need be kept.

The eigensolver reads its status on the host (one sync per call on CUDA, whatever the batch);
:func:`root_change` reads nothing.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["diagonal_root_inverse_sqrt", "floored_eigh", "root_change", "root_inverse_sqrt"]


def _floored(lam: Tensor, lam_max: Tensor, floor: float) -> Tensor:
    """``max(λ, floor·max(λ_max, 0), tiny)``."""
    return lam.maximum((lam_max.clamp(min=0) * floor).clamp(min=torch.finfo(lam.dtype).tiny))


def floored_eigh(A: Tensor, floor: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(λ [..., n], E [..., n, n], finite [...])`` of a symmetric ``A [..., n, n]`` (float32
    or float64), ascending ``λ`` floored at ``max(floor·λ_max, tiny)`` (module docstring);
    where ``finite`` is False, the decomposition is that of zeros."""
    finite = torch.isfinite(A).all(-1).all(-1)
    zero = torch.zeros((), dtype=A.dtype, device=A.device)
    lam, vec = torch.linalg.eigh(torch.where(finite[..., None, None], A, zero))
    return _floored(lam, lam[..., -1:], floor), vec, finite


def _inverse_sqrt_of_normalized_root(lam: Tensor) -> Tensor:
    """``d^{-1/2}`` with ``d = √λ / mean(√λ)`` over the last dimension (``λ > 0``)."""
    root = lam.sqrt()
    return (root / root.mean(-1, keepdim=True)).rsqrt()


def _working(moment: Tensor) -> Tensor:
    return moment.float() if moment.dtype in (torch.float16, torch.bfloat16) else moment


def root_inverse_sqrt(moment: Tensor, floor: float) -> Tensor:
    """``S = D_M^{-1/2} [..., n, n]`` of a symmetric positive semi-definite second-moment
    factor ``moment [..., n, n]``; same dtype (float16 / bfloat16 computed in float32).
    ``floor`` is the least eigenvalue of ``M^{1/2}`` relative to its largest (module
    docstring); a non-finite ``moment`` gives the identity."""
    work = _working(moment)
    lam, vec, finite = floored_eigh(work, floor ** 2)  # √λ floored at floor·√λ_max
    s = (vec * _inverse_sqrt_of_normalized_root(lam).unsqueeze(-2)) @ vec.mT
    eye = torch.eye(work.shape[-1], dtype=work.dtype, device=work.device)
    return torch.where(finite[..., None, None], s, eye).to(moment.dtype)


def diagonal_root_inverse_sqrt(moment: Tensor, floor: float) -> Tensor:
    """:func:`root_inverse_sqrt` of a diagonal factor given as its diagonal ``[..., n]``
    (the eigenvalues themselves; ``E = I``): ``S``'s diagonal ``[..., n]``, ones where
    non-finite."""
    work = _working(moment)
    finite = torch.isfinite(work).all(-1, keepdim=True)
    lam = torch.where(finite, work, torch.ones((), dtype=work.dtype, device=work.device))
    lam = _floored(lam, lam.amax(-1, keepdim=True), floor ** 2)
    return _inverse_sqrt_of_normalized_root(lam).to(moment.dtype)


def root_change(old: Tensor, new: Tensor) -> Tensor:
    """``S_old⁻¹ S_new`` of two factors of :func:`root_inverse_sqrt` (``[..., n, n]``, acting
    on row vectors from the right: ``(x S_old) S_old⁻¹ S_new = x S_new``) or of
    :func:`diagonal_root_inverse_sqrt` (``[..., n]``: ``new / old``); ``new``'s dtype
    (float16 / bfloat16 computed in float32). No host read: a Cholesky of ``S_old`` that
    fails (a non-finite factor) gives non-finite entries, which the step's finite check sees."""
    a, b = _working(old), _working(new)
    if old.ndim == 1:
        return (b / a).to(new.dtype)
    chol, _ = torch.linalg.cholesky_ex(a)
    return torch.cholesky_solve(b, chol).to(new.dtype)
