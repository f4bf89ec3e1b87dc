"""``TENGraD(position_rows=k)``: one row of ``J`` per (sample, position), ``k`` rows drawn.

A Linear applied at ``S`` positions of each of ``m`` samples (a sequence model's
projections), or an Embedding looking up ``S`` indices per sample, has one row per sample,
``J_i = c·Σ_t G_it x_itᵀ`` (``c``: the captured ``G``'s per-sample scale, ``m`` for a mean
loss), so its Fisher ``JᵀJ/m`` has rank ``≤ m``. With position rows each ``(i, t)`` is a row
of its own (K-FAC's "expand" rows; the cross-position terms are dropped)::

    j_it = c·S·G_it x_itᵀ,      F_pos = (1/(m·S)) Σ_it j_it j_itᵀ

For a loss that is the mean over every position, ``(1/(m·S)) Σ_it ℓ_it`` (a language
model's cross-entropy), ``j_it = ∇ℓ_it`` wherever position ``t``'s output depends on no other
position's input through this layer — the Fisher of the per-position losses. On each curvature
step ``k`` of the ``m·S`` rows are drawn uniformly without replacement (one draw per ``m·S``,
shared by every layer and call of that size, from the MC label generator, which
``state_dict`` saves) and every step until the next curvature step preconditions the whole
batch's gradient with them, as ``curvature_samples`` does::

    u = (F_k + αI)⁻¹ g = (1/α)(g − J_kᵀ (J_k J_kᵀ + kαI)⁻¹ J_k g),    F_k = (1/k) Σ_rows j jᵀ

The rows stay factored (``I [k, d_in]``, ``G [k, d_out]``: the Gram is
``(I Iᵀ) ⊙ (G Gᵀ)`` over ``k`` rows, ``J g`` and ``Jᵀ c`` cost ``∝ k·n``). The push-through
form does not apply (``g`` is not ``J_kᵀ1/k``). Layers with one position per sample, with
materialized records, or whose calls differ in batch or positions keep one row per sample.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...capture.store import CaptureStore, Record
from ...curvature.layer import CoveredLayer
from ..step.checks import check_interval

__all__ = ["check_position_rows", "draw_position_rows", "position_sites", "takes_position_rows"]


def check_position_rows(k: Optional[int]) -> Optional[int]:
    """``k`` if it is None or an int ``>= 1``, else ``ValueError``."""
    if k is not None:
        check_interval("position_rows", k, " (the (sample, position) rows drawn on each curvature step) "
                       "or None (one row per sample)")
    return k


def takes_position_rows(layer: CoveredLayer) -> bool:
    """Whether ``layer`` can take position rows: a Linear or Embedding weight."""
    return not layer.bias_only and layer.kind in ("linear", "embedding")


def position_sites(layers: list[CoveredLayer]) -> set[int]:
    """The call sites of the ``layers`` that can take position rows (kept factored: a
    materialized ``J`` has no positions left to split)."""
    return {site for lay in layers if takes_position_rows(lay) for site in lay.spec.sites}


def _positions(layer: CoveredLayer, rec: Record) -> int:
    """``S``: the positions per sample of one call."""
    return layer._kernel.dims(layer.spec, rec.in_shape)[1]


def _rows(layer: CoveredLayer, rec: Record, S: int, idx: Tensor) -> Record:
    """``rec`` as the position rows ``idx`` of its ``m·S``: ``I [k, d_in]``, ``G·S [k, d_out]``
    (an Embedding: ``idx [k, 1]``, ``G·S [k, 1, D]``); the loss's batch stays ``m``."""
    assert rec.I is not None and rec.G is not None
    m, k = rec.m, idx.numel()
    if layer.kind == "embedding":
        I = rec.I.reshape(m * S)[idx].unsqueeze(1)
        G = rec.G.reshape(m * S, 1, rec.G.shape[-1])[idx] * S
    else:
        I = rec.I.reshape(m * S, rec.I.shape[-1])[idx]
        G = rec.G.reshape(m * S, rec.G.shape[-1])[idx] * S
    return rec._like(Record(I, G, in_shape=(k, *I.shape[1:]), batch=rec.loss_batch))


def draw_position_rows(store: CaptureStore, layers: list[CoveredLayer], k: int,
                       generator: torch.Generator) -> bool:
    """Replace the records of every layer that takes position rows by ``k`` of its
    ``m·S`` position rows (module docstring). Returns whether any layer's records changed.
    Records with one position per sample (those replaced already among them) stay."""
    draws: dict[tuple[int, torch.device], Tensor] = {}
    changed = False
    for lay in layers:
        if not takes_position_rows(lay):
            continue
        sites = [s for s in lay.spec.sites if store.records.get(s)]
        recs = [r for s in sites for r in store.records[s]]
        if not recs or any(r.P is not None or r.I is None or r.G is None for r in recs):
            continue
        shapes = {(r.m, _positions(lay, r)) for r in recs}
        if len(shapes) != 1:
            continue
        ((m, S),) = shapes
        if S == 1:
            continue
        device = recs[0].G.device  # type: ignore[union-attr]
        key = (m * S, device)
        if key not in draws:
            draws[key] = torch.randperm(m * S, generator=generator, device=generator.device)[:k].to(device)
        for s in sites:
            store.records[s] = [_rows(lay, r, S, draws[key]) for r in store.records[s]]
        changed = True
    return changed
