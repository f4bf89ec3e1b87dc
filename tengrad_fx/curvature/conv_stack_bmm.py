"""``J v`` and ``Jᵀ c`` of a convolution stack with few output positions, by batched matmul.

A stack of :mod:`.conv_stack` (``I [m, L, c_in, *sp]``, ``G [m, L, c_out, *sp_out]``) whose
outputs have ``P = Π sp_out`` positions per sample, with ``P`` small, makes oneDNN's grouped
weight-gradient convolution (``Jᵀ c``) slow, while a ``bmm`` over the unfolded inputs is
not. With the operands (:class:`Operands`, made once per set of records)

* ``U [L, m·P, n_in]``, ``n_in = c_in·Πk``: the input patches (:func:`.conv.unfold`, the
  weight's ``[c_in, *k]`` order), rows (sample, position);
* ``Gm [L, c_out, m·P]``: the output gradients, columns (sample, position);
* ``Gs [L, c_out, m]``: ``Σ_P G``, the per-sample bias gradients,

the products are

* ``J v = Σ_{o,p} (vw Uᵀ)⊙Gm`` per sample, ``+ vbᵀ Gs`` (``vw [L, c_out, n_in]``);
* ``Jᵀ c = (Gm·c) U`` (``Gm``'s columns scaled by their sample's ``c``), bias ``Gs c``, and
  with it the update ``u = β·g + γ·Jᵀc`` as one ``baddbmm`` (:func:`woodbury`):

the sums the convolutions of :mod:`.conv_stack` form, unscaled. :func:`applies` says which
stacks take this form: ungrouped, non-transposed convolutions (1-D, 2-D and 3-D) with
``P ≤`` :data:`MAX_POSITIONS` whose ``U`` holds at most :data:`MAX_RATIO` times the
elements of ``I``.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from .conv import unfold

__all__ = ["MAX_POSITIONS", "MAX_RATIO", "Operands", "applies", "operands", "jvp", "vjp", "woodbury", "channel_sums"]

MAX_POSITIONS = 4
"""Most output positions per sample (``P``) a stack takes the ``bmm`` form with."""
MAX_RATIO = 9
"""Most elements ``U`` may hold, as a multiple of the stacked ``I``'s (a 3×3 kernel, any map)."""


class Operands(NamedTuple):
    """``U [L, m·P, n_in]``, ``Gm [L, c_out, m·P]``, ``Gs [L, c_out, m]`` (module docstring)."""

    U: Tensor
    Gm: Tensor
    Gs: Tensor


def applies(spec: Any, I: Tensor, G: Tensor) -> bool:
    """Whether the stack ``I [m, L, c_in, *sp]``, ``G [m, L, c_out, *sp_out]`` of the
    convolution ``spec`` takes the ``bmm`` form (module docstring)."""
    if spec.groups != 1 or getattr(spec, "transposed", False):
        return False
    P = math.prod(G.shape[3:])
    U_numel = I.shape[0] * I.shape[1] * P * spec.weight[0].numel()
    return P <= MAX_POSITIONS and U_numel <= MAX_RATIO * I.numel()


def operands(spec: Any, I: Tensor, G: Tensor) -> Operands:
    """The :class:`Operands` of the stack ``I``, ``G`` of the convolution ``spec``."""
    m, L = I.shape[:2]
    c_out = G.shape[2]
    w = spec.weight
    cols = unfold(I.flatten(0, 1), tuple(w.shape[2:]), tuple(spec.stride), tuple(spec.padding),
                  tuple(spec.dilation))  # [m·L, P, n_in]
    P = cols.shape[1]
    U = cols.reshape(m, L, P, -1).transpose(0, 1).reshape(L, m * P, -1)
    G4 = G.reshape(m, L, c_out, P)
    Gm = G4.permute(1, 2, 0, 3).reshape(L, c_out, m * P)
    Gs = G4.sum(3).permute(1, 2, 0)
    return Operands(U, Gm.contiguous(), Gs.contiguous())


def jvp(ops: Operands, vw: Tensor, vb: Optional[Tensor]) -> Tensor:
    """``J v`` of every layer, ``[L, m]``, for ``v = (vw [L, n_w], vb [L, c_out] or None)``."""
    U, Gm, Gs = ops
    L, c_out, m = Gs.shape
    y = torch.bmm(vw.to(U.dtype).view(L, c_out, -1), U.transpose(1, 2))  # [L, c_out, m·P]
    out = (y * Gm).sum(1).view(L, m, -1).sum(2)
    if vb is not None:
        out = torch.baddbmm(out.unsqueeze(1), vb.to(U.dtype).unsqueeze(1), Gs).squeeze(1)
    return out


def _scaled_columns(ops: Operands, c: Tensor) -> tuple[Tensor, Tensor]:
    """``(Gm·c [L, c_out, m·P], c [L, m, 1])``: each column of ``Gm`` times its sample's ``c``."""
    L, c_out, m = ops.Gs.shape
    cc = c.to(ops.U.dtype)
    return (ops.Gm.view(L, c_out, m, -1) * cc.view(L, 1, m, 1)).view(L, c_out, -1), cc.unsqueeze(2)


def vjp(ops: Operands, c: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ c`` of every layer for ``c [L, m]``: ``(w [L, n_w], b [L, c_out])``."""
    Gc, cc = _scaled_columns(ops, c)
    return torch.bmm(Gc, ops.U).flatten(1), torch.bmm(ops.Gs, cc).squeeze(2)


def woodbury(ops: Operands, c: Tensor, gw: Tensor, gb: Optional[Tensor], beta: float, gamma: float,
             ) -> tuple[Tensor, Optional[Tensor]]:
    """``u = β·g + γ·Jᵀc`` for ``c [L, m]`` and ``g = (gw [L, n_w], gb [L, c_out] or None)`` of
    the operands' dtype: ``(uw [L, n_w], ub [L, c_out] or None)``, one ``baddbmm`` per part
    (``β = 0`` reads no ``g``)."""
    Gc, cc = _scaled_columns(ops, c)
    uw = torch.baddbmm(gw.reshape(Gc.shape[0], Gc.shape[1], -1), Gc, ops.U, beta=beta, alpha=gamma).flatten(1)
    ub = None if gb is None else torch.baddbmm(gb.unsqueeze(2), ops.Gs, cc, beta=beta, alpha=gamma).squeeze(2)
    return uw, ub


def channel_sums(ops: Operands, rows: Tensor) -> Tensor:
    """``Jᵀ1`` of every layer (unscaled) at the output channels ``rows [n_r]``,
    ``[L, n_r, n_in]``: :func:`.conv_stack.channel_sums` of an ungrouped stack."""
    return torch.bmm(ops.Gm.index_select(1, rows), ops.U)
