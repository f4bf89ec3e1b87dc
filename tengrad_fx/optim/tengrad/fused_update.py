"""The fused TENGraD update over all layers: Gram → damped Cholesky → solve → Jᵀc.

One pure function, :func:`fused_update`, run eagerly or under ``torch.compile``. Layers
enter in one of two forms (both already scaled to per-sample gradients):

* ``("J", Jw [m, n_w], Jb [m, n_b])`` — materialized per-sample gradients (weight and
  bias parts; ``n_b`` may be 0). Layers whose ``J`` have equal shapes are stacked and
  handled by one ``torch.func.vmap`` of :func:`_update_materialized`.
* ``("IG", A [m, f], B [m, o], has_bias)`` — a Linear layer with one position per
  sample, by covariance factorization: ``K = (A Aᵀ + 1)⊙(B Bᵀ)``, ``Jᵀc = Bᵀ diag(c) A``.

Each form's Gram, ``J g`` and ``Jᵀ c`` are the functions the layer groups use
(:mod:`tengrad_fx.curvature.materialized`, :mod:`tengrad_fx.curvature.factored`), called
on a stack of one layer (``k = 1``: the inputs are scaled already).

``mode="push_through"``: ``u = scale·Jᵀ(K + shift·I)⁻¹1`` (``g = Jᵀ1·scale/m`` is the
same batch's gradient); ``mode="woodbury"``: ``u = (g − Jᵀ(K + shift·I)⁻¹ J g)/α``.
The damped factorization (with its jitter retries), the Woodbury / push-through
coefficients and ``u`` come from :mod:`tengrad_fx.solve`, as on the modular path. Returns
the per-layer updates and, per layer, whether its factor is valid (False: every jitter
try failed or the Gram is non-finite; the caller then skips the step on the device).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from ... import solve
from ...curvature import factored, materialized

__all__ = ["fused_update", "LayerInput"]

LayerInput = Union[tuple[str, Tensor, Tensor], tuple[str, Tensor, Tensor, bool]]


def _update(K: Tensor, jvp: Callable[[Tensor], Tensor], vjp: Callable[[Tensor], Tensor], g: Tensor,
            shift: float, scale: float, damping: float, push_through: bool,
            dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """One layer's ``(u [n], ok)`` from its Gram ``K [m, m]``, ``jvp(g) -> J g [m]`` and
    ``vjp(c) -> Jᵀc [n]``: the damped factorization with its jitter retries, the Woodbury
    or push-through coefficients and ``u = β·g + γ·Jᵀc``, all from :mod:`tengrad_fx.solve`."""
    chol, ok = solve.damped_cholesky_ex(K, shift, dtype)
    rhs = torch.ones_like(K[0]) if push_through else jvp(g)
    c, beta, gamma = solve.woodbury_solve(chol, rhs, damping, push_through, scale)
    return solve.woodbury_combine(g, vjp(c.to(K.dtype)), beta, gamma), ok


def _flat(w: Tensor, b: Optional[Tensor]) -> Tensor:
    """One layer's ``[w, b]`` of a stacked ``(w [1, n_w], b [1, n_b] or None)``, flat."""
    return w[0] if b is None else torch.cat([w[0], b[0]])


def _update_materialized(Jw: Tensor, Jb: Tensor, g: Tensor, shift: float, scale: float,
                         damping: float, push_through: bool,
                         dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """One layer from materialized ``J = [Jw, Jb]`` (``n_b = 0``: no bias part): ``(u [n_w + n_b], ok)``,
    its products by :mod:`tengrad_fx.curvature.materialized` on a stack of one."""
    nw = Jw.shape[1]
    Pw, Pb = Jw.unsqueeze(0), (Jb.unsqueeze(0) if Jb.shape[1] else None)

    def jvp(v: Tensor) -> Tensor:
        return materialized.jvp(Pw, Pb, v[:nw].unsqueeze(0), v[nw:].unsqueeze(0) if Pb is not None else None, 1.0)[0]

    def vjp(c: Tensor) -> Tensor:
        return _flat(*materialized.vjp(Pw, Pb, c.unsqueeze(0), 1.0))

    return _update(materialized.gram(Pw, Pb, 1.0)[0], jvp, vjp, g, shift, scale, damping, push_through, dtype)


def _update_factored(A: Tensor, B: Tensor, has_bias: bool, g: Tensor, shift: float, scale: float,
                     damping: float, push_through: bool,
                     dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """One single-position Linear layer by covariance factorization: ``(u, ok)``, its
    products by :mod:`tengrad_fx.curvature.factored` on a stack of one."""
    A1, B1 = A.unsqueeze(0), B.unsqueeze(0)
    nw = A.shape[1] * B.shape[1]

    def jvp(v: Tensor) -> Tensor:
        return factored.jvp(A1, B1, v[:nw].unsqueeze(0), v[nw:].unsqueeze(0) if has_bias else None, 1.0)[0]

    def vjp(c: Tensor) -> Tensor:
        return _flat(*factored.vjp(A1, B1, c.unsqueeze(0), 1.0, has_bias))

    return _update(factored.gram(A1, B1, 1.0, has_bias)[0], jvp, vjp, g, shift, scale, damping, push_through, dtype)


def fused_update(layers: Sequence[LayerInput], grads: Sequence[Tensor], shift: float, scale: float,
                 damping: float, push_through: bool,
                 dtype: Optional[torch.dtype] = None) -> tuple[list[Tensor], Tensor]:
    """Updates ``u`` (flat, per layer, in input order) and ``ok`` (``[n_layers]`` bool:
    each layer's factor valid)."""
    out: list[Optional[Tensor]] = [None] * len(layers)
    oks: list[Tensor] = []
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, lay in enumerate(layers):
        if lay[0] == "J":
            groups.setdefault((tuple(lay[1].shape), tuple(lay[2].shape)), []).append(i)
        else:
            has_bias = bool(lay[3]) if len(lay) == 4 else True
            u, ok = _update_factored(lay[1], lay[2], has_bias, grads[i], shift, scale, damping, push_through, dtype)
            out[i] = u
            oks.append(ok.reshape(1))
    for idx in groups.values():
        if len(idx) == 1:
            i = idx[0]
            u, ok = _update_materialized(layers[i][1], layers[i][2], grads[i], shift, scale,
                                           damping, push_through, dtype)
            out[i] = u
            oks.append(ok.reshape(1))
            continue
        Jw = torch.stack([layers[i][1] for i in idx])
        Jb = torch.stack([layers[i][2] for i in idx])
        g = torch.stack([grads[i] for i in idx])
        us, ok = torch.func.vmap(
            lambda a, b, gg: _update_materialized(a, b, gg, shift, scale, damping, push_through, dtype)
        )(Jw, Jb, g)
        for k, i in enumerate(idx):
            out[i] = us[k]
        oks.append(ok.reshape(-1))
    return [u for u in out if u is not None], torch.cat(oks) if oks else torch.ones(0, dtype=torch.bool)
