"""Folded batches: a layer input whose rows of sample ``i`` are a fixed index set.

A covered call may see the batch folded into other dims: mobilevit's unfold to
``(B·P, N, D)``, swin's windows ``(B·nW, Wt, C)``, a sequence-first ``(L, B, E)``.
Flattening every dim but the ``keep`` trailing ones gives ``T`` rows; prepare's fold
probe (:mod:`.fold`) establishes that these rows are laid out as ``[A, m, C]`` — sample
``i`` owns rows ``{a·m·C + i·C + c}`` — and records ``(A, C)`` for the call site in
:data:`FOLDS`. The capture op then runs on the rows regrouped batch first,
``[m, A·C, *trailing]``, and its output is put back in the caller's layout: for a
row-wise layer (Linear, LayerNorm, RMSNorm) this is the same computation, and the
regrouped rows are the sample's positions, so its records are exact.
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

__all__ = ["FOLDS", "fold_rows", "unfold_rows"]

# (store key, site) -> (A, C); set by prepare() for call sites whose input is a folded batch
FOLDS: dict[tuple[int, int], tuple[int, int]] = {}


def fold_rows(x: Tensor, fold: tuple[int, int], keep: int, name: str) -> Tensor:
    """``x [*rows, *trailing]`` (``keep`` trailing dims) as ``[m, A·C, *trailing]``."""
    A, C = fold
    trailing = x.shape[x.dim() - keep:]
    T = x.numel() // max(1, trailing.numel()) if x.numel() else 0
    if T == 0 or T % (A * C):
        raise RuntimeError(
            f"tengrad_fx: layer '{name}' sees a folded batch whose layout was probed as "
            f"[{A}, m, {C}] rows, but its input {tuple(x.shape)} has {T} rows. Prepare the model "
            "with example_inputs of the shape used for training.")
    m = T // (A * C)
    if A == 1:
        return x.reshape(m, C, *trailing)
    return x.reshape(A, m, C, *trailing).transpose(0, 1).reshape(m, A * C, *trailing)


def unfold_rows(y: Tensor, fold: tuple[int, int], rows_shape: Sequence[int]) -> Tensor:
    """Inverse of :func:`fold_rows` for an output ``[m, A·C, *trailing_out]``: the caller's
    layout ``[*rows_shape, *trailing_out]``."""
    A, C = fold
    m, trailing = y.shape[0], y.shape[2:]
    if A != 1:
        y = y.reshape(m, A, C, *trailing).transpose(0, 1)
    return y.reshape(*rows_shape, *trailing)
