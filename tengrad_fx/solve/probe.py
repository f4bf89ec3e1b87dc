"""The push-through probe's rule: is a layer's gradient the captured batch's ``s·Jᵀ1``?

The push-through form ``(F + αI)⁻¹ g = s·m·Jᵀ(K + mαI)⁻¹1`` is exact only for
``g = s·Jᵀ1``. Callers compare ``g`` with ``Jᵀ1`` on some coordinates (chosen by them:
:mod:`tengrad_fx.optim.tengrad.group_forms`, :mod:`tengrad_fx.distributed.gram_blocks`)
and decide per layer, on the device, by :func:`push_through_holds`.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["probe_tolerance", "push_through_holds"]

_LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def probe_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of :func:`push_through_holds` for gradients of ``dtype``."""
    return 1e-4 if dtype in _LOW_PRECISION else 1e-9


def push_through_holds(ref: Tensor, got: Tensor, scale: float) -> Tensor:
    """``‖ref − scale·got‖ ≤ tol·‖ref‖`` per row: ``[L]`` bool, on the device.

    ``ref``: ``[L, d]``, the gradient on the probed coordinates; ``got``: ``[L, d]``,
    ``Jᵀ1`` (unscaled) there; ``tol``: :func:`probe_tolerance` of ``ref``'s dtype. One
    ``sub`` (the scale as its ``alpha``), two norms and a compare."""
    err = torch.linalg.vector_norm(torch.sub(ref, got, alpha=scale), dim=1)
    return err <= probe_tolerance(ref.dtype) * torch.linalg.vector_norm(ref, dim=1)
