"""Does the training loss match ``prepare(..., loss_reduction=...)``? Checked once, on the
first (empirical) curvature step.

Why ``p.grad`` alone cannot tell: the captured output gradients ``G`` and ``p.grad`` come
from the same backward, so ``p.grad = Σ_i (per-sample terms of G)`` holds whatever the
loss's scale; only the Fisher (``J Jᵀ``, quadratic in the scale) is off, by ``m²`` for a
summed loss prepared as ``"mean"``. The scale is identified where the loss is known: a
cross-entropy with hard labels on the output of a covered Linear (a classifier head,
input ``[m, d]``). There, sample ``i``'s captured output gradient is ``s·(p_i − e_{y_i})``
with ``p_i`` = softmax of the head's output (recomputed from the captured input and the
weights, which the step has not changed yet): ``y_i`` is the one negative entry and ``s``
the least-squares fit. ``s = 1/m`` is a mean, ``s = 1`` a sum, anything else a loss
scaled by a constant (``loss * 0.5``). When no head fits that form to ``1e-3`` (another
loss, label smoothing, soft targets, a head that is not the output), nothing is said.

One host read of ``s`` (a sync), on the first curvature step only.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from ...curvature.layer import CoveredLayer

__all__ = ["cross_entropy_scale", "check_loss_reduction"]

FIT_TOL = 1e-3


def cross_entropy_scale(layers: list[CoveredLayer]) -> Optional[tuple[float, str, int]]:
    """``(s, layer name, m)``: the captured ``G`` of a covered Linear head is ``s·(softmax − onehot)``
    (to ``FIT_TOL``), or None when no layer's capture has that form."""
    for layer in reversed(layers):
        if layer.kind != "linear":
            continue
        recs = [r for site in layer.spec.sites for r in layer._info.store.records.get(site, [])]
        if len(recs) != 1 or recs[0].I is None or recs[0].G is None or recs[0].I.dim() != 2:
            continue
        I, G = recs[0].I.double(), recs[0].G.double()
        if G.shape[1] < 2 or not bool(torch.isfinite(G).all()):
            continue
        w = layer.weight.detach().double()
        if layer.spec.transposed:  # Hugging Face Conv1D: weight [d_in, d_out]
            w = w.t()
        b = layer.spec.bias.detach().double() if layer.spec.bias is not None else None  # trainable or not
        p = torch.softmax(F.linear(I, w, b), 1)
        d = p - F.one_hot(G.argmin(1), G.shape[1]).to(p.dtype)
        dd = (d * d).sum()
        if dd <= 0:
            continue
        s = (G * d).sum() / dd
        if s <= 0 or (G - s * d).norm() > FIT_TOL * (s * d).norm():
            continue
        return float(s), layer.name, int(G.shape[0])
    return None


def check_loss_reduction(layers: list[CoveredLayer], reduction: str, owner: str) -> Optional[float]:
    """Raise ``RuntimeError`` when the captured loss is a sum prepared as ``"mean"`` or a mean
    prepared as ``"sum"``; warn (once per call: the caller checks once) when it is scaled by
    another constant. Returns the ratio of the loss's scale to the prepared one (None: unknown)."""
    found = cross_entropy_scale(layers)
    if found is None:
        return None
    s, name, m = found
    expected = 1.0 / m if reduction == "mean" else 1.0
    ratio = s / expected
    if abs(ratio - 1.0) <= FIT_TOL or m == 1:
        return ratio
    other = "sum" if reduction == "mean" else "mean"
    if abs(ratio - (m if reduction == "mean" else 1.0 / m)) <= FIT_TOL * max(ratio, 1.0):
        raise RuntimeError(
            f"{owner}: the training loss is reduced by {other!r} over the batch (the output gradients "
            f"captured at layer '{name}' are those of a cross-entropy with reduction={other!r}) but the model "
            f"was prepared with loss_reduction={reduction!r}: the Fisher would be off by a factor "
            f"{m}² = {m * m}. Fix: tengrad_fx.prepare(model, loss_reduction={other!r}), or reduce the loss "
            f"with {reduction!r} (e.g. F.cross_entropy(out, y, reduction={reduction!r})).")
    warnings.warn(
        f"{owner}: the training loss looks like a {reduction}-reduced cross-entropy multiplied by {ratio:.4g} "
        f"(from the output gradients captured at layer '{name}'). With a loss scaled by c the Fisher "
        f"scales by c² and the gradient by c, so the step is (1/c)·(F + (damping/c²)·I)⁻¹ g: the "
        f"effective damping is damping/{ratio * ratio:.4g}. Tune damping and lr for that, or unscale "
        "the loss. Checked once, on the first curvature step.", RuntimeWarning)
    return ratio
