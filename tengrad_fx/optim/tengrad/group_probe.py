"""The push-through probe's coordinates: is each layer's gradient the captured batch's
``s·Jᵀ1``? (the push-through form is exact only when it holds; decided per layer on the
device, no host read, by :func:`tengrad_fx.solve.push_through_holds`).

Checked on random coordinates (a fresh draw every curvature step from a private
generator, so the global RNG stays untouched), which costs a small fraction of ``J g``:
``n_probe`` weight coordinates plus the whole bias of a stacked ``P`` or factored Linear;
a few output channels of every group of a ``"conv"`` stack; every column of a packed
group (small layers only) and all of a ``"layer"``. Each form picks its coordinates
(``_probe_terms`` of :mod:`.group_forms`); :meth:`.layer_groups.LayerGroup.probe`
compares them.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["ProbeTerms", "conv_probe_rows", "probe_generator", "PROBE_MIN_CHANNELS"]

ProbeTerms = tuple[Tensor, Tensor, Optional[Tensor], float]
"""``(got [L, d], ref [L, d], got_b [L, n_b] or None, scale)``: the unscaled ``Jᵀ1`` and
the gradient on the probed weight coordinates, ``Jᵀ1``'s bias part, and the scale of
``got`` (``k·s``, or ``s`` where ``got`` came from a scaled ``vjp``)."""

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


def conv_probe_rows(spec: Any, n_probe: int) -> Optional[int]:
    """Output channels per group the ``"conv"`` probe samples for a convolution ``spec``
    (each holds ``c_in/g·Πk`` coordinates, in every one of the ``g`` groups): enough for
    ``n_probe`` coordinates and at least :data:`PROBE_MIN_CHANNELS`; None where that is
    every channel (then the probe checks the full ``Jᵀ1``)."""
    per_group = spec.weight.shape[0] // spec.groups
    n_r = max(PROBE_MIN_CHANNELS, -(-n_probe // (math.prod(spec.weight.shape[1:]) * spec.groups)))
    return n_r if n_r < per_group else None
