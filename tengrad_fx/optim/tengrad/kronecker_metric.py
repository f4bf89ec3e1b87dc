"""``TENGraD(..., metric="kronecker")``: a base metric ``D = D_L ⊗ D_R`` of full matrices.

The update of a layer is ``u = (F + αD)⁻¹ g``, exact by Woodbury through the change of
variables ``S = D^{-1/2} = S_L ⊗ S_R`` of :mod:`.metric_scaling` (the rows become
``(S_out G_t, S_in x_t)``, so the Gram keeps its factor form; the solve runs on
``S g = S_L g S_R``; its result is scaled by ``S`` again).

The factors are Shampoo's, from the gradient ``g [R, C]`` of the weight (in its own layout:
``[d_out, d_in]``, or ``[d_in, d_out]`` for a transposed Linear) on every step: EMAs
(``beta2``, from zero) ``L = E[g gᵀ] [R, R]`` and ``R = E[gᵀ g] [C, C]``, one matmul each.
With each side normalized to mean eigenvalue 1 (which keeps ``α`` on its usual scale),

    D = L^{1/2} ⊗ R^{1/2},    S = D^{-1/2} = L^{-1/4} ⊗ R^{-1/4}.

Why the exponent ``1/2``: ``L ⊗ R`` (trace-normalized) is one power-iteration step towards the
best Kronecker approximation of the gradients' second moment ``E[vec g vec gᵀ]`` (Morwani et
al., 2024), so ``D`` approximates its square root, as Adam's and Adafactor's denominators
are the square root of theirs: directions the rows do not span get ``L^{-1/2} g R^{-1/2} / α``.
When ``L`` and ``R`` are diagonal this ``D`` is ``metric="factored"``'s ``a ⊗ b`` (``L``'s
diagonal is ``C`` times Adafactor's row means), so the two metrics differ only by the
off-diagonal correlations. And ``S`` is Shampoo's own preconditioner ``L^{-1/4} ⊗ R^{-1/4}``.

Diagonal sides: an Embedding table's vocabulary side (rows of ``[vocab, D]``, also for a
Linear tied to it) keeps only ``L``'s diagonal, the row sums of ``g²``, as does any side
longer than :data:`MAX_FULL_SIDE` (a ``[n, n]`` factor and its eigendecomposition would
cost too much); the same maths on the diagonal. The bias ``[d_out]`` gets the output side's
factor. A norm layer's ``γ`` and ``β`` (flat ``[C]``) each get a diagonal factor, the same
maths on EMAs of ``g²`` (Adam's second moment; a missing or frozen ``β`` keeps zeros, so
``S_β = 1``). Other layers (convolutions, bias-only) keep ``D = I``.

``S`` is refreshed at each curvature step from the moments by one floored eigendecomposition
per distinct factor shape (:func:`tengrad_fx.solve.root_inverse_sqrt`: eigenvalues of
``L^{1/2}`` floored at :data:`FLOOR` of the largest; a non-finite moment gives ``S = I``),
and fixed until the next one. Per step: two matmuls for the moments, two to form ``S g`` and
two for ``S ũ`` per weight, on the device, with no host read; the eigensolver's one host
read per shape falls on curvature steps, which run eagerly, so reuse steps replay as CUDA
graphs. State of each covered weight: ``metric_L``, ``metric_R`` (``[n, n]``, or ``[n]``
for a diagonal side; a norm layer's: ``γ``'s and ``β``'s ``[C]``; the weight's dtype) and the
fixed ``metric_scale_L`` / ``metric_scale_R``. With ``Metric(root_every=k)`` ``S`` is also
recomputed every ``k`` steps between curvature steps (:mod:`.metric_scaling`).
Under DDP ``DistributedTENGraD`` runs it as :mod:`.metric` says of ``"factored"``.
"""
from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import Tensor

from ... import solve
from ...curvature.layer import CoveredLayer
from .metric_scaling import ScaledMetric, ema_finite_, metric_covers, norm_covers, vocabulary_rows

__all__ = ["FLOOR", "KroneckerMetric", "MAX_FULL_SIDE", "full_sides"]

FLOOR = 1e-3  # the least eigenvalue of L^{1/2} (R^{1/2}) relative to its largest
MAX_FULL_SIDE = 4096  # a longer side keeps a diagonal factor


def full_sides(layer: CoveredLayer) -> tuple[bool, bool]:
    """Whether the rows' and the columns' factors of ``layer``'s weight are full matrices
    (else diagonal: a vocabulary, or a side longer than :data:`MAX_FULL_SIDE`)."""
    R, C = layer.weight.shape
    return not vocabulary_rows(layer) and R <= MAX_FULL_SIDE, C <= MAX_FULL_SIDE


class KroneckerMetric(ScaledMetric):
    """Shampoo's Kronecker-factored ``D`` of every covered layer (module docstring).

    Args:
        beta2: the EMA factor of ``L`` and ``R``, in ``[0, 1)``.
    """

    MOMENTS = ("metric_L", "metric_R")
    SCALES = ("metric_scale_L", "metric_scale_R")
    NORMS = True

    def observe(self, state: Any, layers: list[CoveredLayer]) -> None:
        """Fold this step's ``g gᵀ`` and ``gᵀ g`` (or their diagonals) into each covered
        weight's ``L`` and ``R`` (a norm layer's: ``γ``'s and ``β``'s ``g²``)."""
        for lay in layers:
            w = lay.weight
            if w.grad is None:
                continue
            if norm_covers(lay):
                self._observe_norm(state[w], lay)
            if not metric_covers(lay):
                continue
            st, g = state[w], w.grad
            full_rows, full_cols = full_sides(lay)
            if "metric_L" not in st:
                R, C = w.shape
                st["metric_L"] = w.new_zeros((R, R) if full_rows else (R,))
                st["metric_R"] = w.new_zeros((C, C) if full_cols else (C,))
            ema_finite_(st["metric_L"], self.beta2, g @ g.mT if full_rows else g.square().sum(1))
            ema_finite_(st["metric_R"], self.beta2, g.mT @ g if full_cols else g.square().sum(0))

    def _observe_norm(self, st: dict[str, Tensor], layer: CoveredLayer) -> None:
        """``γ``'s and ``β``'s ``g²`` (flat) into ``L`` and ``R`` of a norm layer's state ``st``."""
        w, b = layer.weight, layer.bias
        if "metric_L" not in st:
            st["metric_L"], st["metric_R"] = w.new_zeros(w.numel()), w.new_zeros(w.numel())
        assert w.grad is not None
        ema_finite_(st["metric_L"], self.beta2, w.grad.square().flatten())
        if b is not None and b.grad is not None:
            ema_finite_(st["metric_R"], self.beta2, b.grad.square().flatten())

    def side_scales(self, moments: list[Tensor]) -> list[Tensor]:
        """``S``'s factor of each moment, the equal-shaped ones decomposed in one batch."""
        batches: dict[Hashable, list[int]] = {}
        for i, moment in enumerate(moments):
            batches.setdefault((moment.shape, moment.dtype, moment.device), []).append(i)
        out: list[Tensor] = list(moments)
        for index in batches.values():
            stacked = torch.stack([moments[i] for i in index])
            root = solve.root_inverse_sqrt if stacked.ndim == 3 else solve.diagonal_root_inverse_sqrt
            for i, s in zip(index, root(stacked, FLOOR)):
                out[i] = s.clone()  # its own storage (the state is saved storage by storage)
        return out
