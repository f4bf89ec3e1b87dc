"""``TENGraD(curvature_samples=k)``: the Fisher of the first ``k`` samples, inverted exactly.

On a curvature step of a batch of ``m`` samples, every covered layer's records are cut to
their first ``k`` samples (:meth:`~tengrad_fx.capture.store.CaptureStore.keep_samples`;
copies, so the full batch's records are freed), and every step until the next curvature
step preconditions the whole batch's gradient ``g`` with them::

    F_k = (1/k) Σ_{i<k} J_iᵀ J_i,    u = (F_k + αI)⁻¹ g = (1/α)(g − J_kᵀ (J_k J_kᵀ + kαI)⁻¹ J_k g)

(a ``k × k`` Gram and Cholesky, ``J g`` and ``Jᵀ c`` over ``k`` rows: a reuse step's
curvature work is ``∝ k``). Row ``i`` of ``J_k`` is sample ``i``'s gradient of its own loss:
with a mean loss over the batch the captured ``G`` carries ``1/m``, so the records keep the
loss's batch size ``m`` (``Record.loss_batch``) for the per-sample scale, while the Gram's size
and the ``kαI`` use ``k``. The push-through form (``g = Jᵀ1/m`` of the same rows) does not
hold for a subsample: such curvature steps take the Woodbury form. ``k ≥ m`` keeps the
whole batch (the same bits as without the option). The Gauss-Newton Fisher keeps the
``K`` output rows of each of the first ``k`` samples
(:func:`~tengrad_fx.optim.tengrad.gauss_newton.gauss_newton_capture`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..step.checks import check_interval
from .position_rows import draw_position_rows

__all__ = ["check_curvature_samples", "choose_rows"]


def check_curvature_samples(k: Optional[int]) -> Optional[int]:
    """``k`` if it is None or an int ``>= 1``, else ``ValueError``."""
    if k is not None:
        check_interval("curvature_samples", k, " (the samples of each curvature batch the Fisher is taken from) "
                       "or None (the whole batch)")
    return k


def choose_rows(opt: Any) -> bool:
    """The records of the TENGraD ``opt`` cut to the first ``curvature_samples`` samples
    (:meth:`~tengrad_fx.capture.store.CaptureStore.keep_samples`) or drawn as ``position_rows``
    (:mod:`.position_rows`), over the batch its distribution's ``curvature_part`` says; whether
    they are now other rows than the batch's samples (False without either option)."""
    store = opt._info.store
    if opt.position_rows is None and opt.curvature_samples is None:
        return False
    part, parts, scored = opt.distribution.curvature_part(opt)  # rows drawn over the whole batch
    if opt.position_rows is not None:
        device = opt._layers[0].weight.device if opt._layers else torch.device("cpu")
        return draw_position_rows(store, opt._layers, opt.position_rows, opt._mc_rng.get(device), part, parts,
                                  scored)
    return store.keep_samples(opt.curvature_samples, part, parts)
