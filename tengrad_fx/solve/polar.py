"""The orthogonal polar factor of a matrix, with small singular values floored: the direction
Muon steps along.

For ``M [A, B]`` with the thin SVD ``M = U Σ Vᵀ``::

    Q_δ(M) = U diag(σᵢ / max(σᵢ, δ σ_max)) Vᵀ

which is the polar factor ``U Vᵀ`` on every singular value ``≥ δ σ_max`` and shrinks the
smaller ones instead of raising them to 1 (so rounding noise in a rank-deficient ``M``,
e.g. a rank-``m`` update of a wide layer, is not amplified; Muon's Newton–Schulz steps
leave such values small too). ``M = 0`` gives ``0``. Computed through the
eigendecomposition of the smaller Gram, with no iteration: for ``A ≤ B``::

    M Mᵀ = E Λ Eᵀ,    Q_δ = E diag(1 / √max(λ, δ² λ_max)) Eᵀ M

(``B < A``: the same on ``Mᵀ``). A non-finite ``M`` (or one whose Gram overflows) gives all
NaN (the optimizer's finite check then skips the step) rather than an eigensolver error.
The eigensolver reads its status on the host (one sync per matrix on CUDA, and no CUDA graph).

:func:`newton_schulz_polar` is Muon's matmul-only approximation instead: ``s`` steps of the
quintic ``X ← aX + (bXXᵀ + c(XXᵀ)²)X`` from ``X₀ = M / ‖M‖_F``, which map each singular
value ``σ`` of ``M`` to ``p(p(…p(σ/‖M‖_F)))``, ``p(x) = ax + bx³ + cx⁵``, with
``(a, b, c) = (3.4445, −4.7750, 2.0315)``: after 5 steps every ``σ ≥ 2·10⁻³‖M‖_F`` lands in
about ``[0.7, 1.2]``, and ``σ ≤ 10⁻⁴‖M‖_F`` stays below 0.05. No host read, no eigensolver: it can be
captured in a CUDA graph.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .eigen import floored_eigh

__all__ = ["GRAM_SIDE_MIN_SAVING", "NEWTON_SCHULZ_COEFFS", "NEWTON_SCHULZ_STEPS", "POLAR_FLOOR", "gram_side_saving",
           "newton_schulz_polar", "polar_factor"]

POLAR_FLOOR = 1e-3  # δ: singular values below δ·σ_max are shrunk, not raised to 1
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)  # Muon's quintic (a, b, c)
NEWTON_SCHULZ_STEPS = 5
GRAM_SIDE_MIN_SAVING = 2 ** 27  # FLOPs the Gram form must save (it launches ~2 more kernels per step)


def polar_factor(m: Tensor, floor: float = POLAR_FLOOR, scale: float = 1.0) -> Tensor:
    """``scale·Q_δ(m)`` of ``m [A, B]`` (module docstring), ``δ = floor``; same shape and dtype
    (float16 / bfloat16 computed in float32). ``scale`` is folded into the ``A × A`` factor:
    no pass over the ``A × B`` result."""
    if m.ndim != 2:
        raise ValueError(f"polar_factor takes a 2-D tensor, got shape {tuple(m.shape)}")
    if m.shape[0] > m.shape[1]:
        return polar_factor(m.mT, floor, scale).mT
    work = m.float() if m.dtype in (torch.float16, torch.bfloat16) else m  # eigh needs float32/64
    # [A, A]: non-finite wherever ``work`` is, checked at A×A, not A×B (decomposed as zeros, NaN returned)
    lam, vec, finite = floored_eigh(work @ work.mT, floor ** 2)
    inv_sqrt = lam.rsqrt() * scale
    nan = torch.full((), float("nan"), dtype=lam.dtype, device=lam.device)
    inv_sqrt = torch.where(finite, inv_sqrt, nan)  # an all-NaN A×A factor makes every entry of q NaN
    q = ((vec * inv_sqrt) @ vec.mT) @ work  # the A×A inverse root first: one A×A×B product
    return q.to(m.dtype)


def newton_schulz_polar(m: Tensor, steps: int = NEWTON_SCHULZ_STEPS, scale: float = 1.0) -> Tensor:
    """``scale·X_s`` of ``m [..., A, B]`` (a matrix, or a batch of equal-shaped ones):
    ``steps`` quintic Newton–Schulz steps (module docstring) on the ``min(A, B)`` side; same
    shape and dtype (float16 / bfloat16 computed in float32). A non-finite matrix gives all
    NaN; ``0`` gives ``0``. With ``A ≤ B``, a wide matrix iterates on its ``A × A`` Gram
    (:func:`_newton_schulz_gram`, the same polynomial) where that saves at least
    ``GRAM_SIDE_MIN_SAVING`` FLOPs per matrix; any other on ``X`` itself."""
    if m.ndim not in (2, 3):
        raise ValueError(f"newton_schulz_polar takes a matrix [A, B] or a batch [k, A, B], got shape {tuple(m.shape)}")
    if m.shape[-2] > m.shape[-1]:
        return newton_schulz_polar(m.mT, steps, scale).mT
    work = m.float() if m.dtype in (torch.float16, torch.bfloat16) else m
    # scale-invariant (a grafted norm would not change it); m = 0 stays 0
    norm = torch.linalg.vector_norm(work, dim=(-2, -1), keepdim=True)
    x = work / norm.clamp(min=torch.finfo(work.dtype).tiny)
    if not steps:
        return (x * scale).to(m.dtype)
    gram_side = gram_side_saving(x.shape[-2], x.shape[-1], steps) >= GRAM_SIDE_MIN_SAVING
    return (_newton_schulz_gram if gram_side else _newton_schulz_direct)(x, steps, scale).to(m.dtype)


def gram_side_saving(a: int, b: int, steps: int = NEWTON_SCHULZ_STEPS) -> int:
    """FLOPs the Gram form saves on ``[a, b]`` (``a ≤ b``): ``s·(4a²b + 2a³) − (4a²b + 8sa³)``
    (negative where the direct steps cost less, e.g. ``b < 1.5a``)."""
    return steps * (4 * a * a * b + 2 * a ** 3) - (4 * a * a * b + 8 * steps * a ** 3)


def _addmm(bias: Tensor, m1: Tensor, m2: Tensor, beta: float, alpha: float) -> Tensor:
    """``beta·bias + alpha·m1 @ m2`` in one kernel, for matrices or batches of them."""
    fn = torch.addmm if bias.ndim == 2 else torch.baddbmm
    return fn(bias, m1, m2, beta=beta, alpha=alpha)


def _newton_schulz_direct(x: Tensor, steps: int, scale: float) -> Tensor:
    """``scale·X_s`` from ``X₀ = x [..., A, B]`` by ``X ← aX + (bXXᵀ + c(XXᵀ)²)X``: per step
    two ``A × A × B`` products and one ``A × A × A`` (``≈ 4A²B + 2A³`` FLOPs)."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    for i in range(steps):
        gram = x @ x.mT  # [..., A, A]
        last = scale if i == steps - 1 else 1.0  # the scale folded into the last step: no extra A×B pass
        x = _addmm(x, _addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a * last, alpha=last)
    return x


def _newton_schulz_gram(x: Tensor, steps: int, scale: float) -> Tensor:
    """The same ``scale·X_s`` from ``X₀ = x [..., A, B]``, iterated on ``A × A`` matrices.

    Every ``X_k = P_k X₀`` with ``P_k`` a polynomial in ``S₀ = X₀X₀ᵀ`` (symmetric, commuting
    with ``S₀``), so with ``S_k = X_k X_kᵀ`` and ``Q_k = aI + bS_k + cS_k²``::

        P_{k+1} = Q_k P_k,    S_{k+1} = Q_k S_k Q_k

    ``A × A × B`` products only for ``S₀`` and the final ``P_s X₀`` (``≈ 4A²B + 8sA³``
    FLOPs against the direct form's ``s·(4A²B + 2A³)``). ``P_s`` carries the quintic's gain
    on small singular values (up to ``3.44^s``), so float32 rounding grows more than in the
    direct form: about 3e-4 of the result (relative, Frobenius) for singular values spread
    over six decades, against 1e-5 (``tests/solve/test_polar.py``)."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    s_k = x @ x.mT  # [..., A, A]
    p_k: Tensor | None = None
    for i in range(steps):
        q = _addmm(s_k, s_k, s_k, beta=b, alpha=c)
        q.diagonal(dim1=-2, dim2=-1).add_(a)
        p_k = q if p_k is None else q @ p_k
        if i < steps - 1:
            s_k = q @ s_k @ q
    return (p_k * scale) @ x  # type: ignore[operator]  # steps ≥ 1: p_k is set
