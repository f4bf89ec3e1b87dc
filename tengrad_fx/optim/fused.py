"""The fused TENGraD update over all layers: Gram → damped Cholesky → solve → Jᵀc.

One pure function, :func:`fused_update`, run eagerly or under ``torch.compile``. Layers
enter in one of two forms (both already scaled to per-sample gradients):

* ``("J", Jw [m, n_w], Jb [m, n_b])`` — materialized per-sample gradients (weight and
  bias parts; ``n_b`` may be 0). Layers whose ``J`` have equal shapes are stacked and
  handled by one ``torch.func.vmap`` of :func:`_update_materialized`.
* ``("IG", A [m, f], B [m, o], has_bias)`` — a Linear layer with one position per
  sample, by covariance factorization: ``K = (A Aᵀ + 1)⊙(B Bᵀ)``, ``Jᵀc = Bᵀ diag(c) A``.

``mode="push_through"``: ``u = scale·Jᵀ(K + shift·I)⁻¹1`` (``g = Jᵀ1·scale/m`` is the
same batch's gradient); ``mode="woodbury"``: ``u = (g − Jᵀ(K + shift·I)⁻¹ J g)/α``.
Returns the per-layer updates and the Cholesky ``info`` codes (non-zero: not positive
definite — the caller then falls back to the eager path with jitter retries).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["fused_update", "LayerInput"]

LayerInput = Union[tuple[str, Tensor, Tensor], tuple[str, Tensor, Tensor, bool]]


def _solve(K: Tensor, rhs: Tensor, shift: float, dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    Kd = K if dtype is None else K.to(dtype)
    eye = torch.eye(K.shape[-1], dtype=Kd.dtype, device=Kd.device)
    L, info = torch.linalg.cholesky_ex(Kd + shift * eye)
    c = torch.cholesky_solve(rhs.to(Kd.dtype).unsqueeze(-1), L).squeeze(-1)
    return c.to(K.dtype), info


def _update_materialized(Jw: Tensor, Jb: Tensor, g: Tensor, shift: float, scale: float,
                         damping: float, push_through: bool,
                         dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """One layer from materialized ``J``: ``(u [n_w + n_b], info)``."""
    K = Jw @ Jw.T + Jb @ Jb.T
    if push_through:
        c, info = _solve(K, torch.ones_like(K[0]), shift, dtype)
        return torch.cat([Jw.T @ c, Jb.T @ c]) * scale, info
    nw = Jw.shape[1]
    Jg = Jw @ g[:nw] + Jb @ g[nw:]
    c, info = _solve(K, Jg, shift, dtype)
    return (g - torch.cat([Jw.T @ c, Jb.T @ c])) / damping, info


def _update_factored(A: Tensor, B: Tensor, has_bias: bool, g: Tensor, shift: float, scale: float,
                     damping: float, push_through: bool,
                     dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor]:
    """One single-position Linear layer by covariance factorization."""
    AA = A @ A.T
    K = (AA + 1.0 if has_bias else AA) * (B @ B.T)

    def jtc(c: Tensor) -> Tensor:
        Bc = B * c.unsqueeze(1)
        w = (Bc.T @ A).flatten()
        return torch.cat([w, Bc.sum(0)]) if has_bias else w

    if push_through:
        c, info = _solve(K, torch.ones_like(K[0]), shift, dtype)
        return jtc(c) * scale, info
    o, f = B.shape[1], A.shape[1]
    Gw = g[: o * f].view(o, f)
    Jg = ((B @ Gw) * A).sum(1)
    if has_bias:
        Jg = Jg + B @ g[o * f:]
    c, info = _solve(K, Jg, shift, dtype)
    return (g - jtc(c)) / damping, info


def fused_update(layers: Sequence[LayerInput], grads: Sequence[Tensor], shift: float, scale: float,
                 damping: float, push_through: bool,
                 dtype: Optional[torch.dtype] = None) -> tuple[list[Tensor], Tensor]:
    """Updates ``u`` (flat, per layer, in input order) and all Cholesky info codes."""
    out: list[Optional[Tensor]] = [None] * len(layers)
    infos: list[Tensor] = []
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, lay in enumerate(layers):
        if lay[0] == "J":
            groups.setdefault((tuple(lay[1].shape), tuple(lay[2].shape)), []).append(i)
        else:
            u, info = _update_factored(lay[1], lay[2], bool(lay[3]), grads[i], shift, scale,  # type: ignore[misc]
                                       damping, push_through, dtype)
            out[i] = u
            infos.append(info.reshape(1))
    for idx in groups.values():
        if len(idx) == 1:
            i = idx[0]
            u, info = _update_materialized(layers[i][1], layers[i][2], grads[i], shift, scale,
                                           damping, push_through, dtype)
            out[i] = u
            infos.append(info.reshape(1))
            continue
        Jw = torch.stack([layers[i][1] for i in idx])
        Jb = torch.stack([layers[i][2] for i in idx])
        g = torch.stack([grads[i] for i in idx])
        us, info = torch.func.vmap(
            lambda a, b, gg: _update_materialized(a, b, gg, shift, scale, damping, push_through, dtype)
        )(Jw, Jb, g)
        for k, i in enumerate(idx):
            out[i] = us[k]
        infos.append(info.reshape(-1))
    return [u for u in out if u is not None], torch.cat(infos) if infos else torch.zeros(0, dtype=torch.int32)
