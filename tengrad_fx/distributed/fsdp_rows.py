"""The rows of a layer's ``J`` that one FSDP2 rank owns.

``fully_shard`` shards every parameter on dim 0 over the mesh's shard dim: rank ``r``
holds rows ``[a, b)`` of the weight (and of the bias, for kinds whose bias rows are the
weight's). The per-sample gradients restricted to those rows come from the layer's
records restricted alike, so the kernels of :mod:`tengrad_fx.curvature` compute, on the
local shards ``g_r`` of the gradient, the partial product ``J_r g_r`` (``[M]``; summed over
the shard group it is ``J g``) and this rank's rows of ``Jᵀ c``, without any full-size
parameter, gradient or update:

* Linear, ``W [o, f]``: ``G[..., a:b]`` (rows are output features; bias rows too);
* a transposed Linear (Hugging Face's ``Conv1D``), ``W [f, o]``: its rows are input
  features, so the weight's part of ``J`` is that of ``(I[..., a:b], G)``; its bias
  ``[o]`` is sharded apart (rows ``[a', b')`` of the output features: per-sample
  gradients ``Σ_s G[:, s, a':b']``), :class:`TransposedRows`;
* ConvNd, ``W [o, c/g, *k]``: ``G[:, a:b]``, and with ``g > 1`` groups the input channels of
  the groups the rows touch; rows that start or end inside a group are completed to whole
  groups by zero rows of ``G`` (their per-sample gradients zero: the Gram and ``J_r g_r``
  unchanged, the products' extra rows dropped), so the rows are a convolution of those groups;
* ConvTransposeNd, ``W [c, o/g, *k]``: its rows are input channels, ``I[:, a:b]``, and ``G``
  (with ``g > 1`` groups the output channels of the groups the rows touch, partial groups
  completed by zero channels of ``I`` alike); its ``J`` is that of the transposed convolution
  of those channels (``x[s]·unfold(G)[s]``, the roles of ``I`` and ``G`` swapped,
  :mod:`tengrad_fx.curvature.conv`); its bias ``[o]`` is sharded apart as a transposed
  Linear's (per-sample gradients ``Σ_t G[:, a':b', t]``, :class:`TransposedRows`);
* norm layers: the affine elements ``[a·r, b·r)`` of ``x̂`` and ``G`` (``r`` = elements
  per row of ``γ``; channel-first kinds: channels ``a:b``);
* Embedding, ``W [V, D]``: positions whose index is in ``[a, b)``, re-indexed from ``a``
  (others, and padding, contribute nothing); a lookup tied to a Linear is recorded in the
  Linear's layout (``G' = onehot``) and sliced as a Linear.
* layers recorded as per-sample gradients ``P`` only (bias-only, added parameters): ``P``'s
  columns of the rows, :class:`PerSampleRows`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..capture.norm import CHANNEL_FIRST, NORM_KINDS
from ..curvature import tensors
from ..curvature.layer import KERNELS, CoveredLayer, choose_strategy

__all__ = ["RowSpec", "RowRecords", "TransposedRows", "PerSampleRows", "Rows", "per_sample_only",
           "layer_rows", "row_range", "row_chunk", "group_rows", "check_shardable", "row_records", "row_spec", "cut",
           "bias_apart", "cut_bias", "local", "like", "fully_sharded"]


def fully_sharded(model: Any) -> bool:
    """Is ``model`` sharded by FSDP2: a module ``fully_shard`` wrapped, or a DTensor parameter?"""
    if not isinstance(model, torch.nn.Module):
        return False
    from torch.distributed.fsdp import FSDPModule
    return any(isinstance(mod, FSDPModule) for mod in model.modules()) or \
        any(isinstance(p, DTensor) for p in model.parameters())


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard (a plain tensor as is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def like(p: Tensor, shard: Tensor) -> Tensor:
    """``shard`` (a local tensor of ``p``'s local shape) as a DTensor of ``p``'s mesh and
    placements, sharing ``shard``'s memory; a plain tensor for a plain ``p``."""
    if not isinstance(p, DTensor):
        return shard
    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def row_chunk(n: int, shards: int, c: int) -> tuple[int, int]:
    """``[a, b)``: the rows of an ``n``-row parameter that shard ``c`` of ``shards`` holds
    (``torch.chunk``'s split, what ``fully_shard`` uses: ``⌈n/S⌉`` rows each, the last
    ones fewer or none)."""
    size = -(-n // shards)
    a = min(c * size, n)
    return a, min(a + size, n)


def row_range(p: Tensor) -> tuple[int, int]:
    """``[a, b)``: the dim-0 rows of the DTensor ``p`` this rank holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    assert isinstance(p, DTensor)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]), int(offset[0]) + int(shape[0])


def per_sample_only(lay: CoveredLayer) -> bool:
    """Does ``lay`` record only per-sample gradients ``P`` (a bias-only layer, an added parameter)?"""
    return lay.bias_only or lay.kind == "param"


def group_rows(spec: Any, a: int, b: int, rows_total: int) -> tuple[int, int]:
    """``[lo, hi)``: the rows ``[a, b)`` of a grouped convolution's ``rows_total`` (output
    channels; a transposed one's: input channels) widened to the whole groups they touch;
    ``(a, b)`` for any other layer, or no rows."""
    groups = _conv_groups(spec)
    if groups == 1 or a >= b:
        return a, b
    per = rows_total // groups
    return a - a % per, -(-b // per) * per


def _conv_groups(spec: Any) -> int:
    """A convolution's groups (1 for any other layer)."""
    return int(getattr(spec, "groups", 1)) if getattr(spec, "kind", "").startswith("conv") else 1


def check_shardable(lay: CoveredLayer) -> None:
    """``ValueError`` naming the layer where its ``J`` cannot be cut by rows here."""
    kind = lay.kind
    if per_sample_only(lay):  # P's columns are cut by rows (PerSampleRows)
        return
    if kind not in ("linear", "embedding") and not kind.startswith("conv") and kind not in NORM_KINDS:
        raise ValueError(f"DistributedTENGraD (FSDP2): layer '{lay.name}' is a layer of kind {kind!r}, whose rows "
                         "are not cut here; leave it out of the optimizer's params (a plain optimizer for it) or "
                         "out of fully_shard")


class RowSpec:
    """A layer's spec with its weight (and bias) replaced by this rank's shards (what the
    kernels read for shapes); every other field is the layer's. A grouped convolution's:
    ``groups``, those its rows touch, and ``pad``, the zero rows before and after its rows
    that complete them to whole groups (:func:`group_rows`)."""

    def __init__(self, spec: Any, weight: Tensor, bias: Optional[Tensor], groups: int = 1,
                 pad: tuple[int, int] = (0, 0)):
        self._spec, self.weight, self.bias = spec, weight, bias
        self.module = SimpleNamespace(padding_idx=None)  # embedding: padding is masked in the records
        self.groups, self.pad = groups, pad

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)

    def whole_groups(self) -> "RowSpec":
        """This spec over the rows completed to whole groups (zero rows added; itself where none are)."""
        if self.pad == (0, 0):
            return self
        bias = None if self.bias is None else pad_rows(self.bias, self.pad, 0)
        return RowSpec(self._spec, pad_rows(self.weight, self.pad, 0), bias, self.groups)

    def own_rows(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """``t``'s rows (dim 0) of this spec's own rows, the completing zero rows dropped."""
        return t if t is None or self.pad == (0, 0) else t[self.pad[0]:t.shape[0] - self.pad[1]]


def pad_rows(t: Tensor, pad: tuple[int, int], dim: int) -> Tensor:
    """``t`` with ``pad[0]`` zero slices before and ``pad[1]`` after along ``dim``."""
    if pad == (0, 0):
        return t
    shape = list(t.shape)
    zeros = [t.new_zeros(shape[:dim] + [n] + shape[dim + 1:]) for n in pad]
    return torch.cat([zeros[0], t, zeros[1]], dim)


@dataclass
class RowRecords:
    """One layer's records cut to this rank's rows: ``parts`` per call ``(I', G')``, the
    kernel, the spec over the local shards, and ``k`` (the records' per-sample scale). A
    grouped convolution's rows that split groups are completed to whole groups by zero
    channels of ``G'`` (a transposed one's: ``I'``), whose per-sample gradients are zero;
    the kernels run on ``kernel_spec`` over those rows and the products keep the own rows."""

    spec: RowSpec
    parts: list[tuple[Tensor, Tensor]]
    k: float

    def __post_init__(self) -> None:
        """Records in the parameters' dtype (a mixed-precision forward records in its
        compute dtype; the products meet the gradient shards, in the parameters'), the rows'
        channels completed to whole groups."""
        dtype, pad = self.spec.weight.dtype, self.spec.pad
        self.parts = [(_in(I, dtype), _in(G, dtype)) for I, G in self.parts]
        self.parts = [(pad_rows(I, pad, 1), G) if self.spec.transposed else (I, pad_rows(G, pad, 1))
                      for I, G in self.parts]
        self.kernel_spec = self.spec.whole_groups()

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        """``J_r g_r``, ``[M]``: this rank's rows' part of ``J g`` (zeros where it holds none)."""
        if not gw.numel():
            I, G = self.parts[0]
            return G.new_zeros(G.shape[0])
        kernel, spec, pad = KERNELS[self.spec.kind], self.kernel_spec, self.spec.pad
        gw = pad_rows(gw, pad, 0)
        gb = None if gb is None else pad_rows(gb, pad, 0)
        out: Tensor = sum(kernel.jvp(spec, I, G, gw, gb) for I, G in self.parts)
        return out * self.k

    def gram(self) -> Tensor:
        """``J_r J_rᵀ``, ``[M, M]``, of these rows (zeros where there are none): summed over
        the row shards it is the layer's Gram. An embedding matches indices; other kinds
        take the cheaper of the factored and the materialized form (:func:`choose_strategy`)."""
        spec, kernel = self.kernel_spec, KERNELS[self.spec.kind]
        M = self.parts[0][0].shape[0]
        if not spec.weight.numel():
            return self.parts[0][1].new_zeros(M, M)
        if hasattr(kernel, "gram"):
            return kernel.gram(spec, self.parts) * self.k ** 2
        S_total = 0
        for I, _ in self.parts:
            g, S, f, o = kernel.dims(spec, tuple(I.shape))
            S_total += S
        if choose_strategy(M, g, S_total, f, o) == "materialize" or len(self.parts) > 1:
            J = self._jacobian()
            return (J @ J.T) * self.k ** 2
        A, B = kernel.layout(spec, *self.parts[0])
        K = tensors.gram_factor(A, B)
        if spec.bias is not None:
            bias_grads = getattr(kernel, "bias_grads", None)
            if bias_grads is None:
                K = K + tensors.gram_bias(B)
            else:
                db = bias_grads(spec, *self.parts[0])
                K = K + db @ db.T
        return K * self.k ** 2

    def _jacobian(self) -> Tensor:
        """``J_r`` materialized, ``[M, n_r]`` (unscaled): these rows' per-sample gradients
        (with the zero columns of rows completing partial groups)."""
        kernel = KERNELS[self.spec.kind]
        dW: Optional[Tensor] = None
        db: Optional[Tensor] = None
        for I, G in self.parts:
            w, b = kernel.per_sample_grads(self.kernel_spec, I, G)
            w, b = w.reshape(w.shape[0], -1), b.reshape(b.shape[0], -1)
            dW, db = (w, b) if dW is None or db is None else (dW + w, db + b)
        assert dW is not None and db is not None
        return dW if self.spec.bias is None else torch.cat([dW, db], 1)

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's rows of ``Jᵀ c`` as ``(weight shard, bias shard or None)``."""
        bias = self.spec.bias
        if not self.spec.weight.numel():  # no rows here
            return torch.zeros_like(self.spec.weight), (None if bias is None else torch.zeros_like(bias))
        kernel = KERNELS[self.spec.kind]
        gw: Optional[Tensor] = None
        gb: Optional[Tensor] = None
        c = c.to(self.spec.weight.dtype)
        for I, G in self.parts:
            w, b = kernel.vjp(self.kernel_spec, I, G, c)
            gw = w if gw is None else gw + w
            gb = b if gb is None else gb + b
        gw, gb = self.spec.own_rows(gw), self.spec.own_rows(gb)
        assert gw is not None
        return gw.reshape(self.spec.weight.shape) * self.k, \
            (gb.reshape(bias.shape) * self.k if bias is not None and gb is not None else None)


@dataclass
class TransposedRows:
    """A transposed layer's rows (a transposed Linear or convolution: module docstring):
    ``weight``, the records cut to the weight's rows (input features or channels) with no bias,
    and ``db`` ``[M, b'−a']``, the per-sample gradients of this rank's bias rows (output
    features or channels; scaled by ``k``; None: no bias). ``J_r`` is their columns side by
    side, so each product is the weight's plus the bias's."""

    weight: RowRecords
    db: Optional[Tensor]

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        """``J_r g_r``, ``[M]`` (``gw``: the weight's rows ``[b−a, ...]``, ``gb [b'−a']``)."""
        out = self.weight.jvp(gw, None)
        return out if self.db is None or gb is None else out + self.db @ gb.to(self.db.dtype)

    def gram(self) -> Tensor:
        """``J_r J_rᵀ``, ``[M, M]``."""
        K = self.weight.gram()
        return K if self.db is None else K + self.db @ self.db.T

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's rows of ``Jᵀ c``: ``(weight [b−a, ...], bias [b'−a'] or None)``."""
        gw, _ = self.weight.vjp(c)
        return gw, (None if self.db is None else c.to(self.db.dtype) @ self.db)


@dataclass
class PerSampleRows:
    """A layer recorded as per-sample gradients only (a bias-only layer: ``∂ℓ_i/∂b``; an added
    parameter): ``J_r`` is ``P``'s columns of this rank's rows, ``[M, n_r]``, scaled by the
    records' ``k``; ``shape`` is the local shard's."""

    J: Tensor
    shape: torch.Size

    @staticmethod
    def cut(lay: CoveredLayer, a: int, b: int) -> "PerSampleRows":
        """``lay``'s (global) records' ``P`` cut to the parameter's rows ``[a, b)``."""
        w = lay.weight
        J: Optional[Tensor] = None
        for r in lay.records():
            assert r.P is not None, f"layer '{lay.name}': per-sample gradients expected"
            part = r.P.reshape(r.P.shape[0], *w.shape)[:, a:b].reshape(r.P.shape[0], -1)
            J = part if J is None else J + part
        assert J is not None
        return PerSampleRows((J * lay._scale()).to(w.dtype).contiguous(), torch.Size((b - a, *w.shape[1:])))

    def jvp(self, gw: Tensor, gb: Optional[Tensor]) -> Tensor:
        """``J_r g_r``, ``[M]``."""
        return self.J @ gw.reshape(-1).to(self.J.dtype)

    def gram(self) -> Tensor:
        """``J_r J_rᵀ``, ``[M, M]``."""
        return self.J @ self.J.T

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """This rank's rows of ``Jᵀ c`` (the parameter's shard; no second block)."""
        return (c.to(self.J.dtype) @ self.J).reshape(self.shape), None


Rows = RowRecords | TransposedRows | PerSampleRows


def layer_rows(lay: CoveredLayer, parts: list[tuple[Tensor, Tensor]], k: float,
               rows: Optional[tuple[int, int]] = None, db: Optional[Tensor] = None) -> Rows:
    """``lay``'s row records from its records' cut ``parts`` (:func:`cut`; ``k``: their
    per-sample scale) over this rank's shards, or (``rows``) over those rows of the whole
    parameters. ``db``: a transposed layer's bias rows' per-sample gradients (:func:`cut_bias`
    summed over the calls, unscaled), required where :func:`bias_apart`."""
    spec = row_spec(lay, rows)
    if not lay.spec.transposed:
        return RowRecords(spec, parts, k)
    weight = RowRecords(RowSpec(lay.spec, spec.weight, None, spec.groups, spec.pad), parts, k)
    if lay.bias is None:
        return TransposedRows(weight, None)
    if db is None:
        raise ValueError(f"layer '{lay.name}': a transposed layer's bias rows (output features or channels) are "
                         "sharded apart from its weight's; pass their per-sample gradients db")
    return TransposedRows(weight, db.to(spec.weight.dtype) * k)


def bias_apart(lay: CoveredLayer) -> bool:
    """Is ``lay``'s bias sharded apart from its weight's rows: a transposed layer's bias, whose
    rows are output features or channels while the weight's are input ones?"""
    return bool(lay.spec.transposed) and lay.bias is not None


def cut_bias(kind: str, G: Tensor, a: int, b: int) -> Tensor:
    """A transposed layer's bias rows ``[a, b)``: their per-sample gradients from one record's
    whole ``G``, ``[m, b−a]`` (``G``'s output features or channels ``a:b`` summed over positions)."""
    if kind == "linear":  # (the positions counted out: a record may hold no rows)
        return G.reshape(G.shape[0], math.prod(G.shape[1:-1]), G.shape[-1])[..., a:b].sum(1)
    return G[:, a:b].flatten(2).sum(2)


def _in(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A floating ``t`` in ``dtype`` (indices as they are)."""
    return t.to(dtype) if t.is_floating_point() else t


def cut(kind: str, spec: Any, I: Tensor, G: Tensor, a: int, b: int, rows_total: int) -> tuple[Tensor, Tensor]:
    """One record ``(I, G)`` cut to the rows ``[a, b)`` of a weight with ``rows_total`` rows."""
    if kind == "linear":  # transposed (Conv1D): the weight's rows are input features
        return (I[..., a:b], G) if spec.transposed else (I, G[..., a:b])
    if kind.startswith("conv"):  # rows: G's channels (transposed: I's); grouped: the touched groups' other ones
        mine, other = (I, G) if spec.transposed else (G, I)
        if spec.groups > 1:  # (partial groups are completed by zero rows in RowRecords)
            lo, hi = group_rows(spec, a, b, rows_total)
            per, c = rows_total // spec.groups, other.shape[1] // spec.groups
            other = other[:, lo // per * c:hi // per * c]
        return (mine[:, a:b], other) if spec.transposed else (other, mine[:, a:b])
    if kind in CHANNEL_FIRST:
        return I[:, a:b], G[:, a:b]
    if kind in NORM_KINDS:  # trailing normalized dims: elements [a·r, b·r) of the flattened γ
        C = spec.weight.numel()
        r = C // rows_total
        m, n = I.shape[0], I.shape[1:].numel() // C  # (n counted out: a record may hold no rows)
        return I.reshape(m, n, C)[..., a * r:b * r], G.reshape(m, n, C)[..., a * r:b * r]
    # embedding: idx [m, *pos], G [m, *pos, D]
    pad = spec.module.padding_idx
    keep = (I >= a) & (I < b)
    if pad is not None:
        keep &= I != pad
    idx = torch.where(keep, I - a, torch.zeros_like(I))
    return idx, G * keep.unsqueeze(-1).to(G.dtype)


def row_spec(lay: CoveredLayer, rows: Optional[tuple[int, int]] = None) -> RowSpec:
    """``lay``'s spec over this rank's shards (``rows``: over those rows of the whole parameters)."""
    w, bias = lay.weight, lay.bias
    a, b = row_range(w) if rows is None else rows
    lo, hi = group_rows(lay.spec, a, b, w.shape[0])
    groups = _conv_groups(lay.spec)
    touched = (hi - lo) // (w.shape[0] // groups) if groups > 1 else 1
    if rows is None:
        return RowSpec(lay.spec, local(w).detach(), None if bias is None else local(bias).detach(), touched,
                       (a - lo, hi - b))
    return RowSpec(lay.spec, w.detach()[a:b], None if bias is None else bias.detach()[a:b], touched,
                   (a - lo, hi - b))


def row_records(lay: CoveredLayer, rows: Optional[tuple[int, int]] = None,
                bias_rows: Optional[tuple[int, int]] = None) -> Rows:
    """``lay``'s current (global) records cut to the rows ``[a, b)`` of its weight (default:
    this rank's, :func:`row_range`; then the spec holds the local shards, else the rows of
    the whole parameters), as tensors of their own (no view keeps a whole record alive);
    ``bias_rows``: a transposed layer's rows of its bias (output features or channels; default
    this rank's, :func:`row_range` of the bias; needed with ``rows``)."""
    w = lay.weight
    a, b = row_range(w) if rows is None else rows
    if per_sample_only(lay):
        return PerSampleRows.cut(lay, a, b)
    if bias_apart(lay) and bias_rows is None:
        if rows is not None:
            raise ValueError(f"layer '{lay.name}': a transposed layer's rows of its bias (output features or "
                             "channels) are its own; pass bias_rows with rows")
        assert lay.bias is not None
        bias_rows = row_range(lay.bias)
    parts, db = [], None
    for r in lay.records():
        if r.I is None or r.G is None:
            raise RuntimeError(f"layer '{lay.name}': only per-sample gradients were kept; FSDP2 needs I and G")
        I, G = cut(lay.kind, lay.spec, r.I, r.G, a, b, w.shape[0])
        parts.append((I.contiguous(), G.contiguous()))
        if bias_apart(lay) and bias_rows is not None:
            part = cut_bias(lay.kind, r.G, *bias_rows)
            db = part if db is None else db + part
    return layer_rows(lay, parts, lay._scale(), rows, db)
