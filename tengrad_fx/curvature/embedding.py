"""Curvature kernel for ``nn.Embedding``: index matching, never ``m`` dense ``vocab × D``.

Records hold ``I = idx [m, *positions]`` and ``G [m, *positions, D]``; positions with
``idx == padding_idx`` carry no gradient. Sample ``i``'s gradient is ``Z_i = Σ_s
onehot(idx_i[s]) G_i[s]ᵀ``, so ``K_ij = Σ_{s,t: idx_i[s] = idx_j[t]} ⟨G_i[s], G_j[t]⟩``.
:func:`gram` forms ``Z`` only on the rows ``U`` the batch touches (``[m, U, D]``, in chunks
of ``D`` bounded by ``tensors.DEFAULT_BLOCK_BYTES``): ``2·m²·U·D`` flops; with few positions
(``S² ≤ 2U``) from the position pairs instead, ``m²·S²·D`` flops. ``auto`` always
takes this form (``MATERIALIZE = False``); the dense per-sample gradients
(:func:`per_sample_grads`, ``[m, vocab·D]``) exist for tests and small vocabularies.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..capture.match import LayerSpec
from .tensors import DEFAULT_BLOCK_BYTES

__all__ = ["dims", "gram", "jvp", "vjp", "per_sample_grads", "MATERIALIZE"]

MATERIALIZE = False


def _flat(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """``(idx [m, S], G [m, S, D])`` with padding positions' ``G`` zeroed."""
    m, D = I.shape[0], G.shape[-1]
    idx, g = I.reshape(m, -1), G.reshape(m, -1, D)
    pad = spec.module.padding_idx
    if pad is not None:
        g = g * (idx != pad).unsqueeze(-1).to(g.dtype)  # type: ignore[attr-defined]
    return idx, g


def dims(spec: LayerSpec, in_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """``(1, S, vocab, D)``."""
    S = 1
    for d in in_shape[1:]:
        S *= d
    return 1, S, spec.weight.shape[0], spec.weight.shape[1]


def _scatter(idx: Tensor, g: Tensor, rows: Tensor, n_rows: int) -> Tensor:
    """``Z [m, n_rows, d]``: ``Z[i, rows[i, s]] += g[i, s]``."""
    m, S, d = g.shape
    Z = g.new_zeros(m, n_rows, d)
    sample = torch.arange(m, device=g.device).unsqueeze(1).expand(m, S)
    Z.index_put_((sample.reshape(-1), rows.reshape(-1)), g.reshape(-1, d), accumulate=True)
    return Z


def gram(spec: LayerSpec, recs: list[tuple[Tensor, Tensor]]) -> Tensor:
    """``J Jᵀ`` (unscaled), ``[m, m]``, over all calls' positions by index matching: by
    position pairs where ``S² ≤ 2U`` (:func:`_pair_gram`), else through ``Z``."""
    flats = [_flat(spec, I, G) for I, G in recs]
    idx = torch.cat([f[0] for f in flats], 1)
    g = torch.cat([f[1] for f in flats], 1)
    m, S, D = g.shape
    uniq, inv = torch.unique(idx, return_inverse=True)
    U = uniq.numel()
    if S * S <= 2 * U and (m * S) ** 2 * g.element_size() <= DEFAULT_BLOCK_BYTES:
        return _pair_gram(idx, g)
    chunk = max(1, min(D, DEFAULT_BLOCK_BYTES // max(1, m * U * g.element_size())))
    K = g.new_zeros(m, m)
    for d0 in range(0, D, chunk):
        Z = _scatter(idx, g[..., d0:d0 + chunk], inv.reshape(m, S), U).reshape(m, -1)
        K.addmm_(Z, Z.T)
    return K


def _pair_gram(idx: Tensor, g: Tensor) -> Tensor:
    """``K_ij = Σ_{s,t} [idx_i[s] = idx_j[t]]·⟨g_i[s], g_j[t]⟩`` from the ``(m·S)²`` position
    pairs: ``m²·S²·D`` flops against ``Z``'s ``2·m²·U·D`` (one position per sample, as
    ``position_rows`` records have: ``(idx idxᵀ equal) ⊙ (g gᵀ)``)."""
    m, S, D = g.shape
    flat, keys = g.reshape(m * S, D), idx.reshape(m * S)
    P = (flat @ flat.T) * (keys[:, None] == keys[None, :]).to(g.dtype)
    return P if S == 1 else P.reshape(m, S, m, S).sum((1, 3))


def jvp(spec: LayerSpec, I: Tensor, G: Tensor, vW: Tensor, vb: Optional[Tensor]) -> Tensor:
    """``J v = [Σ_s ⟨G_i[s], vW[idx_i[s]]⟩]_i``, ``[m]``."""
    idx, g = _flat(spec, I, G)
    return (g * vW[idx]).sum((1, 2))


def vjp(spec: LayerSpec, I: Tensor, G: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``Jᵀ c`` as ``(weight [vocab, D], empty bias)``: one ``index_add``."""
    idx, g = _flat(spec, I, G)
    gc = (g * c.reshape(-1, 1, 1)).reshape(-1, g.shape[-1])
    W = gc.new_zeros(spec.weight.shape).index_add_(0, idx.reshape(-1), gc)
    return W, g.new_zeros(0)


def per_sample_grads(spec: LayerSpec, I: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
    """Dense ``(dW [m, vocab·D], empty [m, 0])`` — for tests and small vocabularies."""
    idx, g = _flat(spec, I, G)
    Z = _scatter(idx, g, idx, spec.weight.shape[0])
    return Z.reshape(Z.shape[0], -1), g.new_zeros(Z.shape[0], 0)
