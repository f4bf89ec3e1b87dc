"""The push-through probe of a :class:`~tengrad_fx.optim.tengrad.tengrad_groups.LayerGroup`: is each
layer's gradient the captured batch's ``s·Jᵀ1``? (the push-through form is exact only when
it holds; decided per layer on the device, no host read).

Checked on random coordinates (a fresh draw every curvature step from a private
generator, so the global RNG stays untouched), which costs a small fraction of ``J g``:
``n_probe`` weight coordinates plus the whole bias of a stacked ``P`` or factored Linear;
a few output channels of every group of a ``"conv"`` stack; every column of a packed
group (small layers only) and all of a ``"layer"``.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Protocol, Sequence

import torch
from torch import Tensor

from ... import solve
from ...curvature import conv_stack

__all__ = ["probe", "probe_generator", "ProbedGroup", "PROBE_MIN_CHANNELS"]


class ProbedGroup(Protocol):
    """What the probe reads of a group of ``L`` layers (a
    :class:`~tengrad_fx.optim.tengrad.tengrad_groups.LayerGroup`)."""

    form: str
    layers: Sequence[Any]
    m: int
    k: float
    Pw: Optional[Tensor]
    Pb: Optional[Tensor]
    A: Optional[Tensor]
    B: Optional[Tensor]
    cols: Optional[list[tuple[int, int]]]

    @property
    def has_bias(self) -> bool: ...

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]: ...

_PROBE_GENERATORS: dict[str, torch.Generator] = {}
PROBE_MIN_CHANNELS = 8
"""Fewest output channels per group a ``"conv"`` stack's probe samples: oneDNN's grouped
weight-gradient convolution with fewer than 8 output channels per group runs a slow path
(7 groups of 128 → 1..4 channels, m = 16 at 16×16, one thread: 70 ms; 8 channels: 10 ms;
all 128, the full ``Jᵀ1``: 163 ms)."""


def probe_generator(device: torch.device) -> torch.Generator:
    """A private generator for the consistency probe (the global RNG stays untouched)."""
    key = str(device)
    if key not in _PROBE_GENERATORS:
        _PROBE_GENERATORS[key] = torch.Generator(device=device).manual_seed(0)
    return _PROBE_GENERATORS[key]


def probe(grp: ProbedGroup, gw: Tensor, gb: Optional[Tensor], s: float, n_probe: int = 256) -> Tensor:
    """Is each layer of ``grp`` (gradients ``gw [L, n_w]``, ``gb [L, n_b]``) the captured
    batch's ``s·Jᵀ1``? ``[L]`` bool, on the device (False after gradient clipping, a loss
    term outside the captured layers or accumulation). Coordinates: ``n_probe`` random
    weight coordinates plus the bias; a factored Linear's ``(t, j)`` drawn as a row ``t``
    of ``B`` and a column ``j`` of ``A``; a ``"conv"`` stack's as random output channels of
    every group (:func:`_conv_probe_rows`), by one weight-gradient convolution over those
    channels only (:func:`~tengrad_fx.curvature.conv_stack.channel_sums`), at a fraction of
    the full ``Jᵀ1``'s cost; in full for ``"layer"``, for a ``"conv"`` stack with too few
    channels to sample, and for packed groups (small layers only). The test
    ``‖g − s·Jᵀ1‖ ≤ tol·‖g‖`` over them: :func:`tengrad_fx.solve.push_through_holds`."""
    ks = grp.k * s  # got below is unscaled: J = k·[...]
    got_b: Optional[Tensor] = None
    gen = probe_generator(gw.device)
    n_r = _conv_probe_rows(grp, n_probe) if grp.form == "conv" else None
    if grp.cols is not None:  # packed: every column (small layers only, group_build)
        assert grp.Pw is not None
        got, ref = grp.Pw.sum(1), gw
    elif n_r is not None:  # a "conv" stack wide enough to sample
        assert grp.A is not None and grp.B is not None
        spec = grp.layers[0].spec
        c_out = spec.weight.shape[0]
        rows = torch.randint(0, c_out // spec.groups, (n_r,), device=gw.device, generator=gen)
        sums, channels = conv_stack.channel_sums(spec, grp.A, grp.B, rows)
        got, ref = sums.flatten(1), gw.view(gw.shape[0], c_out, -1).index_select(1, channels).flatten(1)
        got_b = grp.B.flatten(3).sum((0, 3)) if grp.has_bias else None  # [L, c_out]
    elif grp.form in ("layer", "conv"):  # in full; vjp is scaled already
        got, got_b = grp.vjp(torch.ones(gw.shape[0], grp.m, dtype=gw.dtype, device=gw.device))
        ref, ks = gw, s
    elif grp.form == "P":  # (index_select: a plain gather, a fraction of advanced indexing's host time)
        assert grp.Pw is not None
        idx = torch.randint(0, gw.shape[1], (min(n_probe, gw.shape[1]),), device=gw.device, generator=gen)
        got, ref = grp.Pw.index_select(2, idx).sum(1), gw.index_select(1, idx)
        got_b = grp.Pb.sum(1) if grp.Pb is not None else None
    else:
        assert grp.A is not None and grp.B is not None
        o, f, n = grp.B.shape[2], grp.A.shape[2], min(n_probe, gw.shape[1])
        rows = torch.randint(0, o, (n,), device=gw.device, generator=gen)
        cols = torch.randint(0, f, (n,), device=gw.device, generator=gen)
        got = (grp.B.index_select(2, rows) * grp.A.index_select(2, cols)).sum(1)
        ref = gw.view(-1, o, f)[:, rows, cols]
        got_b = grp.B.sum(1) if grp.has_bias else None
    if got_b is not None and gb is not None:
        got, ref = torch.cat([got, got_b], 1), torch.cat([ref, gb], 1)
    return solve.push_through_holds(ref, got, ks)


def _conv_probe_rows(grp: ProbedGroup, n_probe: int) -> Optional[int]:
    """Output channels per group the ``"conv"`` probe samples (each holds ``c_in/g·Πk``
    coordinates, in every one of the ``g`` groups): enough for ``n_probe`` coordinates
    and at least :data:`PROBE_MIN_CHANNELS`; None where that is every channel (then the
    probe checks the full ``Jᵀ1``)."""
    spec = grp.layers[0].spec
    per_group = spec.weight.shape[0] // spec.groups
    n_r = max(PROBE_MIN_CHANNELS, -(-n_probe // (math.prod(spec.weight.shape[1:]) * spec.groups)))
    return n_r if n_r < per_group else None
