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

import math
from typing import Callable, Optional, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

__all__ = ["damped_cholesky", "damped_cholesky_ex", "solve_cholesky", "woodbury_solve", "woodbury_coefficients",
           "woodbury_combine", "push_through_rhs", "push_through_scale", "woodbury_apply", "woodbury_push_through",
           "CholeskyFailed", "HOST_RETRIES", "JITTERS", "TRIES_BYTES"]


class CholeskyFailed(RuntimeError):
    """Raised when a damped Gram stays non-positive-definite after every jitter retry."""


JITTERS = (1e-6, 1e-4, 1e-1)
"""Relative jitters of the fixed retries of :func:`damped_cholesky_ex` (times ``mean|diag|``)."""


TRIES_BYTES = 64 * 2**20
"""Bound on the bytes of all tries' damped Grams held at once: within it every try of
:func:`damped_cholesky_ex` is one batched ``cholesky_ex``; beyond it the tries go one by
one (the same factors)."""
HOST_RETRIES = True
"""On a CPU (eager), :func:`damped_cholesky_ex` factorizes each damped Gram once and runs
the retries only for the matrices that failed, which takes a host read (free there). On
other devices, under ``torch.compile``, under ``vmap`` and under a ``TorchDispatchMode``
every try runs, with no host read. ``False`` takes that path everywhere (the factors are
the same bits either way)."""
_TRIES = (0.0, *JITTERS)
_CONSTANTS: dict[tuple[int, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}


def _eye_and_tries(m: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """``(I [m, m], (0, *JITTERS) [T, 1, 1, 1])`` in ``like``'s dtype and device, made once
    per ``(m, dtype, device)`` and only ever read (two launches less per factorization).
    Under ``torch.compile`` they are made in the graph (constants there): a cache filled
    while tracing would be guarded on and recompile the caller at its next call."""
    if torch.compiler.is_compiling():
        return (torch.eye(m, dtype=like.dtype, device=like.device),
                torch.tensor(_TRIES, dtype=like.dtype, device=like.device).reshape(-1, 1, 1, 1))
    key = (m, like.dtype, like.device)
    const = _CONSTANTS.get(key)
    if const is None:
        const = _CONSTANTS[key] = (torch.eye(m, dtype=like.dtype, device=like.device),
                                   torch.tensor(_TRIES, dtype=like.dtype, device=like.device).reshape(-1, 1, 1, 1))
    return const


def damped_cholesky_ex(K: Tensor, shift: Tensor | float,
                       dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """``(L, ok)``: lower Cholesky factors of ``K + shift·I`` and, per matrix, whether
    the factor is valid; no host read (nothing here waits for the device).

    ``K``: ``[B, m, m]`` (or ``[m, m]``); ``shift``: ``m·α`` (scalar or ``[B]``).

    The rule: the damped Gram ``A = K + shift·I`` and ``len(JITTERS)`` retries of it with
    ``jitter·mean|diag A|`` added to the diagonal (``jitter`` from :data:`JITTERS`, each
    from ``A`` itself, not cumulative) are factorized, always, and each matrix keeps its
    first successful factor (healthy matrices keep the unjittered one, bit for bit).
    ``ok`` is False where every try failed or the input is non-finite. On a device (see
    :data:`HOST_RETRIES`) all ``1 + len(JITTERS)`` tries are ONE batched ``cholesky_ex``
    over ``[T·B, m, m]`` while they fit in :data:`TRIES_BYTES` (about 17 ops in all,
    whatever ``B``), else one per try: three more ``m×m`` factorizations per matrix, on
    curvature steps only. On a CPU a retry runs only for the matrices that need it.
    """
    Kd = K if dtype is None else K.to(dtype)
    batched = Kd.dim() == 3
    if not batched:
        Kd = Kd.unsqueeze(0)
    B, m = Kd.shape[0], Kd.shape[-1]
    eye, tries = _eye_and_tries(m, Kd)
    if isinstance(shift, Tensor):
        A = Kd + shift.to(Kd.device, Kd.dtype).reshape(-1, 1, 1) * eye
    else:
        A = Kd + float(shift) * eye
    scale = A.diagonal(dim1=1, dim2=2).abs().mean(1).clamp_min(torch.finfo(A.dtype).tiny)
    jit = tries * scale.reshape(1, -1, 1, 1)  # [T, B, 1, 1]; try 0 adds exact zeros
    if _retry_on_host(A):
        chol, done = _retries_where_failed(A, jit, eye)
    elif len(_TRIES) * A.numel() * A.element_size() <= TRIES_BYTES:
        chols, info = torch.linalg.cholesky_ex(A + jit * eye)  # [T, B, m, m], [T, B]
        # first try with info == 0 (the first one where all failed): min of info clamped to 1
        best, first = info.clamp_max(1).min(0)
        chol = chols.gather(0, first.reshape(1, B, 1, 1).expand(1, B, m, m))[0]
        done = best == 0
    else:
        chol, info = torch.linalg.cholesky_ex(A)
        done = info == 0
        for j in range(1, len(_TRIES)):
            c2, i2 = torch.linalg.cholesky_ex(A + jit[j] * eye)
            take = ~done & (i2 == 0)
            chol = torch.where(take.reshape(-1, 1, 1), c2, chol)
            done = done | take
    # finite: max|A| < inf (amax propagates NaN; three ops where isfinite's composite is five)
    ok = done & (A.abs().amax((1, 2)) < math.inf)
    return (chol, ok) if batched else (chol[0], ok[0])


def _retry_on_host(A: Tensor) -> bool:
    """Whether :func:`damped_cholesky_ex` may read ``A``'s factorization status on the host:
    :data:`HOST_RETRIES`, a CPU tensor, eager (not compiling, not under ``vmap``) and no
    ``TorchDispatchMode`` watching (the sync and op counters of ``tengrad_fx.utils.dispatch``
    stand in for a GPU, so they see the device path)."""
    return (HOST_RETRIES and A.device.type == "cpu" and not torch.compiler.is_compiling()
            and not torch._C._functorch.is_functorch_wrapped_tensor(A) and not is_in_torch_dispatch_mode())


def _retries_where_failed(A: Tensor, jit: Tensor, eye: Tensor) -> tuple[Tensor, Tensor]:
    """``(L [B, m, m], done [B])``: :func:`damped_cholesky_ex`'s rule with each retry run on
    the matrices still failing only (``A [B, m, m]``, ``jit [T, B, 1, 1]``); host reads."""
    chol, info = torch.linalg.cholesky_ex(A)
    done = info == 0
    for j in range(1, len(_TRIES)):
        left = (~done).nonzero().flatten()
        if left.numel() == 0:
            break
        c2, i2 = torch.linalg.cholesky_ex(A[left] + jit[j, left] * eye)
        took = left[i2 == 0]
        chol[took] = c2[i2 == 0]
        done[took] = True
    return chol.contiguous(), done  # row-major, as the batched path's factors (the same solves' bits)


def damped_cholesky(K: Tensor, shift: Tensor | float, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Lower Cholesky factors of ``K + shift·I`` by :func:`damped_cholesky_ex`, raising
    :class:`CholeskyFailed` (one host read) where a factor failed."""
    chol, ok = damped_cholesky_ex(K, shift, dtype)
    if not bool(ok.all()):
        if not bool(torch.isfinite(K).all()):
            raise CholeskyFailed("non-finite entries in the damped Gram")
        raise CholeskyFailed(f"damped Gram not positive definite after {len(JITTERS)} jitter retries")
    return chol


def solve_cholesky(chol: Tensor, rhs: Tensor) -> Tensor:
    """``(L Lᵀ)⁻¹ rhs`` for ``chol = L`` ``[..., m, m]`` (lower), ``rhs [..., m]``, in
    ``chol``'s dtype: two (batched) triangular solves, which is what ``cholesky_solve``
    does, but ``trsm`` never synchronizes, so a CUDA graph can capture it."""
    y = torch.linalg.solve_triangular(chol, rhs.to(chol.dtype).unsqueeze(-1), upper=False)
    return torch.linalg.solve_triangular(chol.mH, y, upper=True).squeeze(-1)


def push_through_scale(m: int, loss_reduction: str) -> float:
    """``s·m`` of the push-through form: the batch gradient is ``g = s·Jᵀ1`` with ``s = 1/m``
    for a mean loss and ``1`` for a sum, and ``(F + αI)⁻¹ g = s·m·Jᵀ(K + mαI)⁻¹1``."""
    return float(m) * (1.0 if loss_reduction == "sum" else 1.0 / m)


def push_through_rhs(Jg: Tensor, push: Tensor) -> Tensor:
    """The right-hand side of :func:`woodbury_solve` per layer: ``1`` where ``push``
    (``[L]`` bool) holds, ``J g`` (``[L, m]``) elsewhere."""
    return torch.where(push.unsqueeze(1), torch.ones_like(Jg), Jg)


def woodbury_solve(chol: Tensor, rhs: Tensor, damping: Union[float, Tensor], push: Union[Tensor, bool, None] = None,
                   scale: float = 1.0, g_dtype: Optional[torch.dtype] = None,
                   ) -> tuple[Tensor, Union[float, Tensor], float]:
    """``(c, β, γ)`` with ``(F + αI)⁻¹ g = β·g + γ·Jᵀc`` per layer: ``(K + mαI)⁻¹ rhs`` by
    :func:`solve_cholesky`, then :func:`woodbury_coefficients`.

    ``chol``: ``[..., m, m]`` factors of ``K + mαI``; ``rhs``: ``[..., m]``, ``J g``
    (Woodbury) or ``1`` (push-through, :func:`push_through_rhs`)."""
    return woodbury_coefficients(solve_cholesky(chol, rhs), damping, push, scale, g_dtype)


def woodbury_coefficients(c: Tensor, damping: Union[float, Tensor], push: Union[Tensor, bool, None] = None,
                          scale: float = 1.0, g_dtype: Optional[torch.dtype] = None,
                          ) -> tuple[Tensor, Union[float, Tensor], float]:
    """``(c', β, γ)`` with ``(F + αI)⁻¹ g = β·g + γ·Jᵀc'`` per layer, from the solution
    ``c = (K + mαI)⁻¹ rhs`` (``[..., m]``; ``c'`` in its dtype). ``push``:

    * None or False — Woodbury (``rhs = J g``): ``c' = c``, ``β = 1/α``, ``γ = −1/α``;
    * True — push-through (``rhs = 1``): ``c' = scale·c``, ``β = 0``, ``γ = 1``;
    * ``[...]`` bool — per layer, on the device: ``β`` (in ``g_dtype``) is ``0`` where
      ``push`` holds, else ``1/α``; ``c'`` is ``scale·c`` there, ``−c/α`` elsewhere;
      ``γ = 1``.

    ``damping``: ``α``, or one per layer (``[...]``: ``β`` and ``c'`` per layer as for a
    bool ``push``, with its ``1/α``).
    """
    if push is True:
        return c * scale, 0.0, 1.0
    if isinstance(damping, Tensor):  # one α per layer: β = 1/α_l, c' = −c/α_l, γ = 1
        inv = damping.to(c.device, torch.float64).reciprocal()
        held = push if isinstance(push, Tensor) else torch.zeros(inv.shape, dtype=torch.bool, device=c.device)
        beta = torch.where(held, 0.0, inv).to(g_dtype or c.dtype)
        return c * torch.where(held, scale, -inv).to(c.dtype).unsqueeze(-1), beta, 1.0
    a = 1.0 / damping
    if push is None or push is False:
        return c, a, -a
    dev = c.device
    beta = torch.where(push, 0.0, torch.full((), a, dtype=g_dtype or c.dtype, device=dev))
    c = c * torch.where(push, torch.full((), scale, dtype=c.dtype, device=dev), -a).unsqueeze(-1)
    return c, beta, 1.0


def woodbury_combine(g: Tensor, JTc: Tensor, beta: Union[float, Tensor], gamma: float) -> Tensor:
    """``u = β·g + γ·Jᵀc`` (``g``, ``Jᵀc``: ``[..., n]``; ``β`` a float or one per row,
    ``[...]``), in ``g``'s dtype; ``β = 0`` (a float) reads no ``g``."""
    JTc = JTc.to(g.dtype)
    if isinstance(beta, Tensor):
        g = g * beta.unsqueeze(-1)
    elif beta == 0.0:
        return JTc if gamma == 1.0 else JTc * gamma
    elif beta != 1.0:
        g = g * beta
    return torch.add(g, JTc, alpha=gamma)


def woodbury_apply(chol: Tensor, g: Tensor, damping: float,
                   jvp: Callable[[Tensor], Tensor], vjp: Callable[[Tensor], Tensor]) -> Tensor:
    """``(F + αI)⁻¹ g`` for one layer; ``chol``: factor of ``K + mαI`` (``[m, m]``).

    ``g``: flat ``[n]``; ``jvp(g) -> J g [m]``; ``vjp(c) -> Jᵀ c [n]``.
    """
    c, beta, gamma = woodbury_solve(chol, jvp(g), damping)
    return woodbury_combine(g, vjp(c), beta, gamma)


def woodbury_push_through(chol: Tensor, scale: float, vjp: Callable[[Tensor], Tensor]) -> Tensor:
    """``(F + αI)⁻¹ g`` for ``g = scale_g · Jᵀ1``: ``scale · Jᵀ (K + mαI)⁻¹ 1``.

    Pass ``scale = scale_g · m`` (:func:`push_through_scale`).
    """
    ones = torch.ones(chol.shape[-1], dtype=chol.dtype, device=chol.device)
    c, _, _ = woodbury_solve(chol, ones, 1.0, True, scale)
    return vjp(c)
