"""Folded batches: a layer input whose rows of sample ``i`` are a fixed index set.

A covered call may see the batch folded into other dims: mobilevit's unfold to
``(B·P, N, D)``, swin's windows ``(B·nW, Wt, C)``, a language model's ``[B·T, d]``, a
sequence-first ``(L, B, E)``. Flattening every dim but the ``keep`` trailing ones gives
``T`` rows; prepare's fold probe (:mod:`.fold`) establishes that these rows are laid out
as ``[A, m, C]`` — sample ``i`` owns rows ``{a·m·C + i·C + c}`` — and records ``(A, C)``
for the call site in :data:`FOLDS`. The capture op then runs on the rows regrouped batch
first, ``[m, A·C, *trailing]``, and its output is put back in the caller's layout: for a
row-wise layer (Linear, LayerNorm, RMSNorm) this is the same computation, and the
regrouped rows are the sample's positions, so its records are exact.

Other lengths (:func:`layout_at`). With the batch size ``m`` of the call known (the
prepared model's forward sets ``ops.SAMPLES``), an input of ``T'`` rows has
``R' = T'/m`` rows per sample. When ``R'`` is the probed ``A·C`` the probed layout
holds. Otherwise it is generalized only where the per-sample rows are one factor, which
must then be the one that follows the input's length: ``[m, C]`` (``A = 1``, each
sample's rows one contiguous block: ``[B·T, d]``, ``(B·P, N, D)``, ``(B·nW, Wt, C)``)
becomes ``[m, R']``, and ``[A, m]`` (``C = 1``, one row per sample in each of ``A``
blocks: sequence-first ``(L, B, E)``) becomes ``[R', m]``. With both ``A`` and ``C``
above 1 (``(P·B, N, D)``) one probe cannot tell which of them scales, so such an input
raises an error naming the layer.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

__all__ = ["FOLDS", "fold_rows", "unfold_rows", "layout_at"]

# (store key, site) -> (A, C); set by prepare() for call sites whose input is a folded batch
FOLDS: dict[tuple[int, int], tuple[int, int]] = {}


def layout_at(fold: tuple[int, int], per_sample: int) -> Optional[tuple[int, int]]:
    """The layout ``(A', C')`` of rows probed as ``fold = (A, C)`` when each sample has
    ``per_sample`` rows (``A'·C' = per_sample``), or None where it is not determined:
    the probed one at ``A·C`` rows; ``(1, R')`` for ``A = 1``; ``(R', 1)`` for ``C = 1``."""
    A, C = fold
    if per_sample == A * C:
        return fold
    if per_sample < 1:
        return None
    if A == 1 and C > 1:
        return (1, per_sample)
    if C == 1 and A > 1:
        return (per_sample, 1)
    return None


def _layout(fold: tuple[int, int], T: int, m: Optional[int], shape: tuple[int, ...], name: str) -> tuple[int, int]:
    """The layout of ``T`` rows at batch ``m`` (None: unknown, then ``T/(A·C)``), or an error."""
    A, C = fold
    probed = (f"tengrad_fx: layer '{name}' sees a folded batch whose rows were probed as [{A}, m, {C}] "
              f"({A * C} rows per sample), but its input {shape} has {T} rows")
    if m is None or m < 1:
        if T == 0 or T % (A * C):
            raise RuntimeError(f"{probed}. Prepare the model with example_inputs of the shape used for training.")
        return fold
    if T % m:
        raise RuntimeError(f"{probed}, not a multiple of the batch size {m}, so they cannot be rows of its "
                           "samples. Prepare the model with example_inputs of the shape used for training.")
    layout = layout_at(fold, T // m)
    if layout is None:
        raise RuntimeError(
            f"{probed}: {T // m} rows per sample at batch {m}. With the probed A and C both above 1 it is "
            "not known which of them follows the input's length, so the rows cannot be regrouped per "
            "sample exactly. Prepare the model with example_inputs of this length.")
    return layout


def fold_rows(x: Tensor, fold: tuple[int, int], keep: int, name: str, m: Optional[int] = None) -> Tensor:
    """``x [*rows, *trailing]`` (``keep`` trailing dims) as ``[m, A'·C', *trailing]``, the
    probed ``fold`` mapped to this input's rows per sample at batch ``m`` (:func:`layout_at`;
    None: the batch is the row count over the probed ``A·C``)."""
    trailing = x.shape[x.dim() - keep:]
    T = x.numel() // max(1, trailing.numel()) if x.numel() else 0
    A, C = _layout(fold, T, m, tuple(x.shape), name)
    m = T // (A * C)
    if A == 1:
        return x.reshape(m, C, *trailing)
    return x.reshape(A, m, C, *trailing).transpose(0, 1).reshape(m, A * C, *trailing)


def unfold_rows(y: Tensor, fold: tuple[int, int], rows_shape: Sequence[int]) -> Tensor:
    """Inverse of :func:`fold_rows` for an output ``[m, A'·C', *trailing_out]``: the caller's
    layout ``[*rows_shape, *trailing_out]``; ``fold`` is the probed ``(A, C)``."""
    m, trailing = y.shape[0], y.shape[2:]
    layout = layout_at(fold, y.shape[1])
    assert layout is not None, "fold_rows mapped these rows"
    A, C = layout
    if A != 1:
        y = y.reshape(m, A, C, *trailing).transpose(0, 1)
    return y.reshape(*rows_shape, *trailing)
