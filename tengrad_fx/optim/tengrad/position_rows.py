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

Where the loss scores only some positions (padding, the last position of a shifted causal
loss: ``store.scored``, :mod:`tengrad_fx.capture.scored`, bool ``[m, S]``), the loss is the
mean over the ``N`` scored ones, row ``(i, t)`` is ``N·G_it x_itᵀ`` (``= ∇ℓ_it``), and the
``k`` rows are drawn among the scored positions only (:func:`scored_draw`, on the device:
the ``k`` largest of a uniform key that is ``−1`` at unscored positions). A batch with
``N < k`` scored positions draws them all: the other ``k − N`` rows are zero and the kept
ones carry ``√(k/N)``, so ``F_k = (1/N) Σ_scored j jᵀ`` with no host read of ``N``.

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
from ...capture.union import global_samples
from ...curvature.layer import CoveredLayer
from ..step.checks import check_interval

__all__ = ["check_position_rows", "draw_position_rows", "position_sites", "scored_draw", "takes_position_rows"]


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


def scored_draw(scored: Tensor, k: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``k`` (at most ``scored.numel()``) of the flat positions of ``scored`` (bool ``[m, S]``),
    drawn uniformly without replacement among the scored ones first; and the rows' weights
    ``[k]``: ``√(k/N)`` at a scored position, 0 at an unscored one (drawn only when fewer
    than ``k`` are scored), ``N = min(k, Σ scored)`` (module docstring). All on the device."""
    flat = scored.reshape(-1)
    k = min(k, flat.numel())
    keys = torch.rand(flat.numel(), generator=generator, device=generator.device).to(flat.device)
    idx = torch.where(flat, keys, -1.0).topk(k).indices
    n = flat.sum(dtype=torch.float64).clamp(min=1, max=k)
    return idx, flat[idx] * (k / n).sqrt()


def _rows(layer: CoveredLayer, rec: Record, S: int, idx: Tensor, scale: float | Tensor) -> Record:
    """``rec`` as the position rows ``idx`` of its ``m·S``: ``I [k, d_in]``, ``G·scale [k, d_out]``
    (an Embedding: ``idx [k, 1]``, ``G·scale [k, 1, D]``; ``scale``: ``S``, or per row ``[k]``);
    the loss's batch stays ``m``."""
    assert rec.I is not None and rec.G is not None
    m, k = rec.m, idx.numel()
    if layer.kind == "embedding":
        I = rec.I.reshape(m * S)[idx].unsqueeze(1)
        G = rec.G.reshape(m * S, 1, rec.G.shape[-1])[idx]
    else:
        I = rec.I.reshape(m * S, rec.I.shape[-1])[idx]
        G = rec.G.reshape(m * S, rec.G.shape[-1])[idx]
    if isinstance(scale, Tensor):
        scale = scale.to(G.dtype).reshape(k, *([1] * (G.dim() - 1)))
    return rec._like(Record(I, G * scale, in_shape=(k, *I.shape[1:]), batch=rec.loss_batch))


def _micro_major(scored: Tensor, micro: tuple[int, ...], parts: int) -> Tensor:
    """The global batch's mask ``[parts·m, S]`` gathered in part order (each part's union)
    reordered micro-batch major (:func:`~tengrad_fx.capture.union.global_samples`' order)."""
    where = torch.cat([global_samples(micro, q, parts) for q in range(parts)])  # part order -> global sample
    order = torch.empty_like(where)
    order[where] = torch.arange(where.numel())
    return scored[order.to(scored.device)]


def _draw(scored: Optional[Tensor], m: int, S: int, k: int, generator: torch.Generator, device: torch.device,
          part: int, parts: int, micro: tuple[int, ...]) -> tuple[Tensor, Optional[Tensor]]:
    """``k`` of the ``parts·m·S`` position rows of the global batch
    (:func:`~tengrad_fx.capture.union.global_samples`' order; ``micro``: this part's
    micro-batch sizes, summing to ``m``), kept where they
    fall in this process's ``m·S`` (as local indices on ``device``; every row with
    ``parts = 1``), and their ``G`` scale's numerator per row: None for a uniform draw (the
    scale is ``S``); where ``scored`` has ``parts·m·S`` entries, the draw among them
    (:func:`scored_draw`) and ``N·w`` (with the Gram's per-sample scale ``m`` and the scale
    ``N·w/m`` the row is ``N·G``, weighted by ``w``)."""
    total = parts * m * S
    if scored is None or scored.numel() != total:
        idx, per_row = torch.randperm(total, generator=generator, device=generator.device)[:k].to(device), None
    else:
        here = (_micro_major(scored, micro, parts) if parts > 1 else scored).to(device)
        idx, weights = scored_draw(here, k, generator)
        per_row = weights * here.sum(dtype=torch.float64)
    if parts == 1:
        return idx, per_row
    local = torch.full((total,), -1, dtype=torch.long, device=device)  # global row -> this process's row
    rows = (global_samples(micro, part, parts)[:, None] * S + torch.arange(S)).reshape(-1)
    local[rows.to(device)] = torch.arange(m * S, device=device)
    at = local[idx]
    held = (at >= 0).nonzero().squeeze(1)  # a host read of the count
    return at[held], None if per_row is None else per_row[held]


def draw_position_rows(store: CaptureStore, layers: list[CoveredLayer], k: int,
                       generator: torch.Generator, part: int = 0, parts: int = 1,
                       scored: Optional[Tensor] = None) -> bool:
    """Replace the records of every layer that takes position rows by ``k`` of its
    ``m·S`` position rows (module docstring; among the scored ones where the mask ``scored``,
    default ``store.scored``, has ``m·S`` entries). Returns whether any layer's records changed.
    Records with one position per sample (those replaced already among them) stay.

    With ``parts > 1`` this process holds part ``part`` of a batch of ``parts·m`` samples
    (rank order; ``scored``: the whole batch's mask ``[parts·m, S]``, the parts' in part
    order): the ``k`` rows are drawn from all ``parts·m·S`` as one process holding them all
    would (``generator`` in the same state everywhere; of accumulated micro-batches, the
    global batch is micro-batch major: :func:`~tengrad_fx.capture.union.global_samples`),
    and the drawn rows of this process's samples are kept, scaled for the whole batch's loss
    (the ``G`` of each part's records is ``parts`` times the batch's)."""
    draws: dict[tuple[int, torch.device, tuple[int, ...]], tuple[Tensor, Optional[Tensor]]] = {}
    scored = store.scored if scored is None else scored
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
        micro = recs[0].micro or (m,)
        key = (m * S, device, micro)
        if key not in draws:
            draws[key] = _draw(scored, m, S, k, generator, device, part, parts, micro)
        idx, per_row = draws[key]
        for s in sites:
            store.records[s] = [_rows(lay, r, S, idx, S if per_row is None else per_row / (parts * r.loss_batch))
                                for r in store.records[s]]
        changed = True
    return changed
