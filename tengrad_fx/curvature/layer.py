"""``CoveredLayer``: exact per-layer curvature of the last captured batch.

For a captured batch of ``m`` samples (after gradient accumulation: the micro-batches'
union, :func:`tengrad_fx.capture.union.union`) with per-sample losses ``ℓ_i``, ``J`` is the
``m × n`` matrix whose row ``i`` is ``vec(∂ℓ_i/∂W, ∂ℓ_i/∂b)`` (``n`` = weight + bias size).
With ``loss_reduction="mean"`` the captured output gradients are rescaled by ``m``.
With batch norm in train mode, samples are coupled through the batch statistics; then
"sample i's gradient" is sample i's term ``Σ_s G_i[s]ᵀ I_i[s]`` of the batch gradient,
as in every K-FAC / NGD code. In eval mode it is exactly ``∂ℓ_i/∂W``.

Gram strategies and the cost model (per layer; ``g`` groups, ``S`` positions, ``f`` inputs
and ``o`` outputs per group, several calls of one module add their positions):

* ``"factor"`` (covariance factorization, the paper's): ``2·m²·S²·(f+o)·g`` flops,
  working memory bounded by ``tensors.DEFAULT_BLOCK_BYTES``.
* ``"materialize"`` (explicit per-sample gradients ``P``, then ``P Pᵀ``):
  ``2·m·S·f·o·g + 2·m²·f·o·g`` flops; for convolutions ``P`` comes from
  :mod:`tengrad_fx.capture.per_sample_conv` (a grouped weight-gradient convolution over the
  batch, or unfold + one ``bmm``, per layer and device), for Linear from a batched matmul
  in output-channel chunks.
* ``"auto"`` picks the one with fewer flops.
"""
from __future__ import annotations

from types import ModuleType
from typing import Literal, Optional

import torch
from torch import Tensor

from ..capture.info import PrepareInfo, get_info
from ..capture.match import LayerSpec
from ..capture.store import Record
from ..capture.norm import NORM_KINDS
from . import bias as bias_kernel
from . import conv, embedding, linear, norm, param, tensors

__all__ = ["CoveredLayer", "covered_layers", "Strategy", "gram_flops", "choose_strategy"]

Strategy = Literal["auto", "factor", "materialize"]

KERNELS: dict[str, ModuleType] = {
    "linear": linear,
    "conv1d": conv, "conv2d": conv, "conv3d": conv,
    "conv_transpose1d": conv, "conv_transpose2d": conv, "conv_transpose3d": conv,
}
"""Kernel module per layer kind: ``layout``, ``dims``, ``jvp``, ``vjp``, ``per_sample_grads``
and, where the bias gradient is not ``Σ_s B`` of the layout, ``bias_grads``."""
KERNELS.update({kind: norm for kind in NORM_KINDS})
KERNELS["param"] = param
KERNELS["embedding"] = embedding


def gram_flops(m: int, g: int, S: int, f: int, o: int) -> dict[str, float]:
    """Flop counts of the two Gram strategies for one call (see module docstring)."""
    return {
        "factor": 2.0 * m * m * S * S * (f + o) * g,
        "materialize": 2.0 * m * S * f * o * g + 2.0 * m * m * f * o * g,
    }


def choose_strategy(m: int, g: int, S: int, f: int, o: int) -> Literal["factor", "materialize"]:
    """The cheaper strategy by :func:`gram_flops`."""
    c = gram_flops(m, g, S, f, o)
    return "factor" if c["factor"] <= c["materialize"] else "materialize"


class CoveredLayer:
    """One covered module of a prepared model and its curvature for the last batch."""

    def __init__(self, spec: LayerSpec, info: PrepareInfo):
        self.spec = spec
        self._info = info

    # ----------------------------------------------------------------- identity
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def bias_only(self) -> bool:
        """Whether the layer's weight is frozen and its bias trainable (BitFit; read at each call):
        then ``J`` is the per-sample bias gradients alone, ``[Σ_s G_i[s]]_i``, recorded by the
        layer's bias site (:mod:`tengrad_fx.capture.bias`), and :attr:`params` is ``[bias]``."""
        b = self.spec.bias
        return b is not None and b.requires_grad and not self.spec.weight.requires_grad

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters ``J``'s columns belong to, in order: ``[weight, bias]``,
        ``[weight]`` (no bias, or a frozen one) or ``[bias]`` (:attr:`bias_only`)."""
        return [p for p in (self.weight, self.bias) if p is not None]

    @property
    def weight(self) -> torch.nn.Parameter:
        """``J``'s leading block: the layer's weight, or its bias where the layer is
        :attr:`bias_only`."""
        return self.spec.bias if self.bias_only else self.spec.weight

    @property
    def bias(self) -> Optional[torch.nn.Parameter]:
        """``J``'s second block: the bias if it requires grad and the weight does too (a
        frozen bias, ``requires_grad=False``, is not part of ``J`` and is not preconditioned;
        a bias-only layer's bias is :attr:`weight`)."""
        b = self.spec.bias
        return b if b is not None and b.requires_grad and self.spec.weight.requires_grad else None

    @property
    def _kernel(self) -> ModuleType:
        return bias_kernel if self.bias_only else KERNELS[self.spec.kind]

    def __repr__(self) -> str:
        what = "bias-only, bias" if self.bias_only else "weight"
        return f"CoveredLayer({self.name!r}, {self.kind}, {what}={tuple(self.weight.shape)})"

    # ----------------------------------------------------------------- captured data
    def records(self) -> list[Record]:
        """The captured records of every call (``G`` as autograd delivered it); after
        accumulated micro-batches, their union (:meth:`~tengrad_fx.capture.store.CaptureStore.merge`)."""
        self._info.store.merge(self._info.loss_reduction)
        self._info.store.verify_records()
        recs = [r for site in self.spec.sites for r in self._info.store.records.get(site, [])]
        if not recs:
            raise RuntimeError(
                f"layer '{self.name}': nothing captured yet — run a forward and backward "
                "with capture on (and grad enabled) first"
            )
        m = recs[0].m
        if any(r.m != m for r in recs):
            raise RuntimeError(f"layer '{self.name}': calls captured different batch sizes")
        return recs

    @property
    def captured(self) -> bool:
        """Whether the last capture recorded any call of this layer (False for a layer the
        forward did not call, or called with capture off)."""
        self._info.store.merge(self._info.loss_reduction)
        return any(self._info.store.records.get(site) for site in self.spec.sites)

    @property
    def m(self) -> int:
        """Number of samples in the captured batch."""
        return self.records()[0].m

    @property
    def materialized(self) -> bool:
        """True when the backward pass already stored the per-sample gradients."""
        return any(r.P is not None for r in self.records())

    def _scale(self, m: Optional[int] = None) -> float:
        """The per-sample scale ``k`` of the captured ``G``: for a mean loss the loss's batch
        size ``m`` (default: the records' :attr:`~tengrad_fx.capture.store.Record.loss_batch`,
        which is more than :attr:`m` where they keep the first samples only)."""
        if self._info.loss_reduction != "mean":
            return 1.0
        return float(self.records()[0].loss_batch if m is None else m)

    def _layouts(self) -> list[tuple[Tensor, Tensor]]:
        out = []
        for r in self.records():
            if r.I is None or r.G is None:
                raise RuntimeError(f"layer '{self.name}': only per-sample gradients were kept")
            out.append(self._kernel.layout(self.spec, r.I, r.G))
        return out

    def dims(self, recs: Optional[list[Record]] = None) -> tuple[int, int, int, int]:
        """``(g, S, f, o)`` of the captured batch, positions of all calls added (``recs``:
        :meth:`records`, when the caller has read them already)."""
        g = S = f = o = 0
        for r in self.records() if recs is None else recs:
            g, s, f, o = self._kernel.dims(self.spec, r.in_shape)
            S += s
        return g, S, f, o

    def choose(self, strategy: Strategy = "auto",
               recs: Optional[list[Record]] = None) -> Literal["factor", "materialize"]:
        """Resolve ``"auto"`` with the cost model for the captured batch (``recs``:
        :meth:`records`, when the caller has read them already)."""
        if strategy not in ("auto", "factor", "materialize"):
            raise ValueError(f"strategy must be 'auto', 'factor' or 'materialize', got {strategy!r}")
        if not getattr(self._kernel, "MATERIALIZE", True):
            return "factor"  # a kernel with its own Gram (embeddings: index matching)
        if strategy != "auto":
            return strategy
        recs = self.records() if recs is None else recs
        if any(r.P is not None for r in recs):  # materialized by the backward
            return "materialize"
        return choose_strategy(recs[0].m, *self.dims(recs))

    # ----------------------------------------------------------------- curvature
    def per_sample_grads(self) -> tuple[Tensor, Optional[Tensor]]:
        """``(∂ℓ_i/∂W [m, *weight.shape], ∂ℓ_i/∂b [m, *bias.shape] or None)``."""
        dW = db = None
        m = self.m
        for r in self.records():
            if r.P is not None:
                w, b = r.P, r.Gsum
            else:
                w, b = self._kernel.per_sample_grads(self.spec, r.I, r.G)
            dW = w.reshape(m, -1) if dW is None else dW + w.reshape(m, -1)
            if b is not None:
                db = b.reshape(m, -1) if db is None else db + b.reshape(m, -1)
        assert dW is not None and db is not None
        k = self._scale()
        dW = (dW * k).reshape(m, *self.weight.shape)
        return dW, (db * k).reshape(m, *self.bias.shape) if self.bias is not None else None

    def jacobian(self) -> Tensor:
        """``J`` materialized, ``[m, n]``: rows ``vec(∂ℓ_i/∂W, ∂ℓ_i/∂b)``."""
        dW, db = self.per_sample_grads()
        return dW.flatten(1) if db is None else torch.cat([dW.flatten(1), db.flatten(1)], 1)

    def gram(self, strategy: Strategy = "auto") -> Tensor:
        """``J Jᵀ``, ``[m, m]``, in the captured dtype. Layers whose per-sample gradients
        were materialized in backward use them whatever the strategy."""
        how = self.choose(strategy)
        if hasattr(self._kernel, "gram"):
            return self._kernel.gram(self.spec, [(r.I, r.G) for r in self.records()]) * self._scale() ** 2
        if self.materialized or (how == "materialize" and (len(self.records()) > 1 or self.kind != "linear")):
            J = self.jacobian()
            return J @ J.T
        lays = self._layouts()
        A = lays[0][0] if len(lays) == 1 else torch.cat([a for a, _ in lays], 2)
        B = lays[0][1] if len(lays) == 1 else torch.cat([b for _, b in lays], 2)
        K = tensors.gram_factor(A, B) if how == "factor" else tensors.gram_materialize(A, B)
        if self.bias is not None:
            bias_grads = getattr(self._kernel, "bias_grads", None)
            if bias_grads is None:
                K = K + tensors.gram_bias(B)
            else:
                db = sum(bias_grads(self.spec, r.I, r.G) for r in self.records())
                K = K + db @ db.T
        return K * self._scale() ** 2

    def jvp(self, v_w: Tensor, v_b: Optional[Tensor] = None) -> Tensor:
        """``J·vec(v_w, v_b)``, ``[m]``, from the stored ``I`` and ``G`` (or ``P``)."""
        _check_shape(self, "v_w", v_w, self.weight)
        if v_b is not None:
            if self.bias is None:
                raise ValueError(f"layer '{self.name}' has no bias; pass v_b=None")
            _check_shape(self, "v_b", v_b, self.bias)
        out = None
        for r in self.records():
            P, Gsum = r.P, r.Gsum
            if P is not None:
                o = P @ v_w.reshape(-1)
                if v_b is not None and Gsum is not None:
                    o = o + Gsum @ v_b
            else:
                o = self._kernel.jvp(self.spec, r.I, r.G, v_w, v_b)
            out = o if out is None else out + o
        assert out is not None
        return out * self._scale()

    def vjp(self, c: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """``Jᵀ c`` as ``(weight-shaped, bias-shaped or None)``; ``c``: ``[m]``."""
        if c.dim() != 1 or c.shape[0] != self.m:
            raise ValueError(f"layer '{self.name}': c must have shape ({self.m},), got {tuple(c.shape)}")
        gW = gb = None
        for r in self.records():
            P, Gsum = r.P, r.Gsum
            if P is not None and Gsum is not None:
                w, b = P.T @ c, Gsum.T @ c
            else:
                w, b = self._kernel.vjp(self.spec, r.I, r.G, c)
            gW = w.reshape(-1) if gW is None else gW + w.reshape(-1)
            gb = b.reshape(-1) if gb is None else gb + b.reshape(-1)
        k = self._scale()
        assert gW is not None and gb is not None
        return (gW * k).reshape(self.weight.shape), (gb * k).reshape(self.bias.shape) if self.bias is not None else None


def _check_shape(layer: CoveredLayer, arg: str, v: Tensor, p: Tensor) -> None:
    if tuple(v.shape) != tuple(p.shape):
        raise ValueError(f"layer '{layer.name}': {arg} must have shape {tuple(p.shape)}, got {tuple(v.shape)}")


def covered_layers(model: torch.nn.Module) -> list[CoveredLayer]:
    """One :class:`CoveredLayer` per covered module of a prepared model, in graph order.

    Layers whose parameters are all frozen (``requires_grad=False``, read now) are left out:
    they capture nothing and are preconditioned by nobody; unfreezing brings them back. A
    layer whose weight is frozen and whose bias is trainable is :attr:`CoveredLayer.bias_only`."""
    info = get_info(model)
    return [CoveredLayer(spec, info) for spec in info.layers
            if spec.weight.requires_grad or (spec.bias is not None and spec.bias.requires_grad)]
