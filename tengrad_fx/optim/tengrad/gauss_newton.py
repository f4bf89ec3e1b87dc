"""Exact generalized Gauss–Newton (GGN) capture for squared-error regression.

For a per-sample loss ``ℓ_i = ½‖f(x_i) − y_i‖²`` (a Gaussian likelihood with unit
variance, whose Fisher equals the GGN) with ``k`` outputs per sample, the layer block is

    F = (1/m) Σ_i J_iᵀ J_i,        J_i = ∂f(x_i)/∂θ_layer   ([k, n] per sample),

i.e. ``F = J̃ᵀJ̃ / (m·k)`` for the ``[m·k, n]`` matrix ``J̃`` whose rows are
``√k · ∂f_ij/∂θ``. :func:`gauss_newton_capture` records exactly that: one backward of
``Σ_i f_ij`` per output ``j`` (``k`` backward passes through the graph, G-only: no
parameter gradients), then the ``k`` records of every call site are stacked into one
record of ``m·k`` rows. The optimizer then sees an ordinary captured batch of ``m·k``
"samples" whose Woodbury system is ``(J̃J̃ᵀ + m·k·αI)``, which gives
``(F + αI)⁻¹g`` exactly.

Cost per curvature step: ``k`` extra backward passes, and Grams / solves of size
``m·k`` instead of ``m`` (``O((mk)²·…)`` Gram, ``O((mk)³)`` Cholesky), memory ``k×``
the records. Under gradient accumulation each micro-batch stacks its own records (a mean
over its ``m_j·k`` rows, ``Record.own_loss``); the store's union keeps every row's scale.
Hence ``k ≤ MAX_OUTPUTS`` (16); beyond that use ``fisher="mc"`` (one sampled backward,
same expectation).

``curvature_samples=s`` keeps the rows of the step's first ``s`` samples. Under a
distribution (and gradient accumulation) the step's global batch is its micro-batches in
order, each the ranks' equal micro-batches in rank order (micro-batch major, rank minor):
what one process sees accumulating micro-batches that are each the ranks' concatenation.
A rank keeps its samples among the first ``s`` of that order (the Fisher is a sum over
the set of rows, whatever order they are gathered in).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ...capture.store import CaptureStore, Record, samples_held
from ..step.mc import second_backward

__all__ = ["MAX_OUTPUTS", "gauss_newton_capture"]

MAX_OUTPUTS = 16


def _cat(ts: list[Tensor | None], scale: float) -> Tensor | None:
    if ts[0] is None:
        return None
    return torch.cat([t * scale for t in ts], 0)  # type: ignore[misc, operator]


def _stack_records(per_output: list[Record], g_scale: float, samples: Optional[int] = None) -> Record:
    """One record of ``m·k`` rows from the ``k`` records of one call (row ``j·m + i``);
    with ``samples`` ``s < m``, of the first ``s`` samples' ``s·k`` rows (row ``j·s + i``).
    Its ``batch`` is ``m·k`` (the scale's, ``Record.loss_batch``), which also marks its rows
    as not to be cut again (``CaptureStore.keep_samples`` would cut across outputs)."""
    batch = per_output[0].m * len(per_output)
    if samples is not None and per_output[0].m > samples:
        per_output = [r.first(samples) for r in per_output]
    first = per_output[0]
    k = len(per_output)
    I = None if first.I is None else torch.cat([first.I] * k, 0)
    rec = Record(I=I, G=_cat([r.G for r in per_output], g_scale), P=_cat([r.P for r in per_output], g_scale),
                 Gsum=_cat([r.Gsum for r in per_output], g_scale))
    rec.in_shape = (first.in_shape[0] * k, *first.in_shape[1:])
    rec.batch = batch
    rec.own_loss = True
    return rec


def _samples_held_before(earlier: list[dict[int, list[Record]]], k: int) -> int:
    """Samples this part held in the step's ``earlier`` micro-batches (their stacked records'
    ``loss_batch // k``: the micro-batch's ``m``, whatever its rows were cut to). A micro-batch
    without records (after the first ``samples`` were reached) follows those that reach them."""
    firsts = (next((recs[0] for recs in part.values() if recs), None) for part in earlier)
    return sum(r.loss_batch for r in firsts if r is not None) // k


def gauss_newton_capture(store: CaptureStore, outputs: Tensor, weights: Sequence[Tensor],
                         loss_reduction: str, max_outputs: int = MAX_OUTPUTS,
                         loss_scale: Optional[Tensor] = None, samples: Optional[int] = None,
                         part: int = 0, parts: int = 1) -> None:
    """Record the GGN of ``½‖outputs − y‖²`` (see the module docstring) in ``store``.

    Args:
        store: the prepared model's capture store (records of this forward's graph).
        outputs: ``[m, *]`` model outputs with their graph; ``k = prod(shape[1:])``.
        weights: covered layers' weights (targets of the G-only backwards).
        loss_reduction: the prepared model's ``"mean"`` / ``"sum"``: the layers rescale
            captured ``G`` by ``m`` (of the stacked record: ``m·k``) for ``"mean"``.
        max_outputs: largest ``k`` allowed.
        loss_scale: a GradScaler's scale: each backward's output is multiplied by it, so
            the records carry the training backward's scale (:mod:`tengrad_fx.optim.step.amp`).
        samples: keep the rows of the first ``samples`` samples only (``TENGraD(curvature_samples=...)``);
            under gradient accumulation, of the micro-batches' union: the samples the
            earlier micro-batches hold count, and a micro-batch after the first ``samples``
            runs no backward at all.
        part, parts: the ``m`` samples here are part ``part`` of a global micro-batch of ``parts·m``
            (rank order; the distribution's ``curvature_part``): the rows kept are this part's
            share of the global batch's first ``samples`` (none: records of 0 rows, after the
            same backwards as every other part's). Under accumulation the step's global batch
            is its micro-batches in order, each the parts' micro-batches in part order
            (micro-batch major, part minor: one process accumulating the concatenations);
            with ``earlier`` samples held here in the step's earlier micro-batches, this
            part's samples are the global positions ``parts·earlier + part·m`` to ``+ m``,
            and none is kept, on every part alike, once ``samples ≤ parts·earlier``.

    Raises:
        ValueError: ``k > max_outputs`` (use ``fisher="mc"``), or ``outputs`` without a graph.
    """
    if outputs.dim() < 1 or not outputs.requires_grad:
        raise ValueError("fisher='gauss-newton': outputs must be the model's output [m, *] with its autograd graph "
                         "(call opt.mc_capture(out) before loss.backward(), outside no_grad)")
    m = outputs.shape[0]
    flat = outputs.reshape(m, -1)
    k = flat.shape[1]
    if k > max_outputs:
        raise ValueError(f"fisher='gauss-newton': the model has k = {k} outputs per sample; the exact GGN needs k "
                         f"backward passes and an (m·k)² system, allowed up to k = {max_outputs}. "
                         "Use fisher='mc' (one sampled backward with the same expectation).")
    # captured G of a Σ_i f_ij backward is ∂f_ij/∂out; the layers multiply by m·k for "mean"
    g_scale = math.sqrt(k) / (m * k if loss_reduction == "mean" else 1.0)
    if samples is not None:  # global positions parts·earlier + part·m ... + m in the step's batch
        earlier = _samples_held_before(store.parts, k)
        if samples <= parts * earlier:  # alike on every part: each runs the same backwards
            store.end_sampled()
            return
        samples = samples_held(samples - parts * earlier, m, part, parts)
    store.records = {}
    store.grad_only = True
    per_site: dict[int, list[list[Record]]] = {}
    try:
        for j in range(k):
            f_j = flat[:, j].sum()
            f_j = f_j if loss_scale is None else f_j * loss_scale
            second_backward(f_j, weights)
            for site, recs in store.records.items():
                per_site.setdefault(site, []).append(recs)
            store.records = {}
    finally:
        store.grad_only = False
    store.records = {site: [_stack_records([runs[j][c] for j in range(k)], g_scale, samples)
                            for c in range(len(runs[0]))]
                     for site, runs in per_site.items()}
    store.end_sampled()
