"""``nn.Embedding`` as a capture site: ``tengrad_fx::embedding`` records ``(idx, G)``.

The forward is ``F.embedding`` (aten's kernel), the backward op returns aten's
``embedding_dense_backward`` weight gradient and hands the store the indices ``I = idx``
(``[m, *positions]``, integer) and ``G = dL/dy`` (``[m, *positions, D]``). Sample ``i``'s
gradient is the row-sparse scatter sum ``Σ_s onehot(idx_i[s]) G_i[s]ᵀ`` over its positions
(rows ``padding_idx`` excluded); the Gram is computed by index matching
(:mod:`..curvature.embedding`), never as ``m`` dense ``vocab × D`` matrices.

Covered: ``nn.Embedding`` itself with ``max_norm=None`` (it renormalizes the weight in
place during the forward), ``scale_grad_by_freq=False`` (the gradient scale depends on the
whole batch) and ``sparse=False``; otherwise a fallback with that reason.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .eager import capture_op, use_custom_ops
from .amp import acc
from .store import Record, lookup

__all__ = ["match_embedding", "embedding", "per_sample_indices", "linear_record"]


def match_embedding(mod: nn.Module) -> tuple[Optional[str], str]:
    """``("embedding", "")`` for a covered ``nn.Embedding``, ``(None, reason)`` otherwise
    (``(None, "")`` for modules that are not embeddings)."""
    if not isinstance(mod, nn.Embedding):
        return None, ""
    if type(mod).forward is not nn.Embedding.forward:
        return None, f"{type(mod).__name__} overrides Embedding.forward (not provably exact)"
    if mod.max_norm is not None:
        return None, "Embedding(max_norm=...) renormalizes its weight in the forward"
    if mod.scale_grad_by_freq:
        return None, "Embedding(scale_grad_by_freq=True): the gradient scale depends on the whole batch"
    if mod.sparse:
        return None, "Embedding(sparse=True): sparse gradients have no capture path"
    if not isinstance(mod.weight, nn.Parameter):
        return None, "weight is not a Parameter"
    return "embedding", ""


def _embedding_forward(idx: Tensor, weight: Tensor, padding_idx: int, key: int, site: int) -> Tensor:
    """``F.embedding``, ``[m, *positions, D]`` (``padding_idx < 0``: none)."""
    lookup(key).begin()
    return F.embedding(idx, weight, None if padding_idx < 0 else padding_idx)


def _embedding_backward(grad: Tensor, idx: Tensor, num_weights: int, padding_idx: int,
                        key: int, site: int) -> Tensor:
    """``∂L/∂weight [vocab, D]``; records ``(idx, grad)``."""
    store = lookup(key)
    if site in store.onehot_sites:
        store.record(site, linear_record(grad, idx, num_weights, padding_idx, store.wants_jacobian(site),
                                         cancel_bias=site in BIASED_HOST_SITES.get(key, ())))
    else:
        store.record(site, Record(idx, grad))
    if store.grad_only:
        return grad.new_zeros(num_weights, grad.shape[-1])
    return torch.ops.aten.embedding_dense_backward.default(grad, idx, num_weights, padding_idx, False)


# store key -> lookup sites tied to a Linear with a bias (BERT's decoder): their records
# must add nothing to the bias gradient (:func:`linear_record`'s ``cancel_bias``)
BIASED_HOST_SITES: dict[int, set[int]] = {}


def linear_record(G: Tensor, idx: Tensor, vocab: int, padding_idx: int, materialize: bool,
                  cancel_bias: bool = False) -> Record:
    """The lookup as a Linear call on the same weight ``[vocab, D]`` (tied input/output
    embeddings): ``y = onehot(idx) W`` has per-sample gradient ``Σ_s onehot(idx_i[s]) G_i[s]ᵀ``,
    which is Linear's ``Σ_s G'_i[s] I'_i[s]ᵀ`` with output gradients ``G' = onehot(idx)``
    (``[m, *positions, vocab]``, zero rows at ``padding_idx``) and inputs ``I' = G``
    (``[m, *positions, D]``). ``materialize``: ``P [m, vocab·D]`` by a scatter-add and
    ``Gsum [m, vocab]`` (the counts) instead, as a materialized Linear site keeps them.

    ``cancel_bias`` (the Linear has a bias, which the lookup does not use): Linear's bias
    gradient ``Σ_s G'_i[s]`` must get nothing from the lookup, so the positions are
    flattened and one is appended with ``G' = -Σ_s onehot(idx_i[s])``, ``I' = 0``
    (``[m, P + 1, vocab]``, ``[m, P + 1, D]``): it cancels the bias part and adds nothing to
    the weight part; materialized, ``Gsum`` is zero."""
    m, D = G.shape[0], G.shape[-1]
    keep = (idx != padding_idx).to(G.dtype)
    if materialize:
        g = acc(G).reshape(m, -1, D) * keep.reshape(m, -1, 1)
        flat = idx.reshape(m, -1)
        P = g.new_zeros(m, vocab, D).scatter_add_(1, flat.unsqueeze(-1).expand(-1, -1, D), g)
        counts = g.new_zeros(m, vocab).scatter_add_(1, flat, keep.reshape(m, -1).to(g.dtype))
        return Record(None, None, P.reshape(m, -1), counts.zero_() if cancel_bias else counts, tuple(G.shape))
    onehot = F.one_hot(idx, vocab).to(G.dtype) * keep.unsqueeze(-1)
    if cancel_bias:
        onehot = onehot.reshape(m, -1, vocab)
        onehot = torch.cat([onehot, -onehot.sum(1, keepdim=True)], 1)
        G = torch.cat([G.reshape(m, -1, D), G.new_zeros(m, 1, D)], 1)
    return Record(G, onehot)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    idx, weight, padding_idx, key, site = inputs
    ctx.save_for_backward(idx)
    ctx.conf = (weight.shape[0], padding_idx, key, site)


def _formula(backward, ctx, grad):  # type: ignore[no-untyped-def]
    (idx,) = ctx.saved_tensors
    n, padding_idx, key, site = ctx.conf
    return None, backward(grad, idx, n, padding_idx, key, site), None, None, None


_embedding_op, _embedding_backward_op, EmbeddingCapture = capture_op(
    "embedding", _embedding_forward, _embedding_backward, _setup, _formula)


@_embedding_op.register_fake
def _(idx, weight, padding_idx, key, site):  # type: ignore[no-untyped-def]
    return weight.new_empty((*idx.shape, weight.shape[1]))


@_embedding_backward_op.register_fake
def _(grad, idx, num_weights, padding_idx, key, site):  # type: ignore[no-untyped-def]
    return grad.new_empty(num_weights, grad.shape[-1])


def per_sample_indices(idx: Tensor, key: int, site: int) -> Tensor:
    """Indices that every sample shares (``[1, *positions]``: position ids) broadcast to
    ``[m, *positions]`` at the sites ``prepare`` verified (``ops.SHARED_INDEX_SITES``): the
    lookup is then ``[m, *positions, D]``, the same values its consumer broadcast, and its
    output gradient arrives per sample (sample ``i``'s position embeddings get ``G_i``)."""
    if idx.dim() == 0 or idx.shape[0] != 1 or site not in ops.SHARED_INDEX_SITES.get(key, ()):
        return idx
    m = ops.SAMPLES.get(key)
    return idx if m is None or m == 1 else idx.expand(m, *idx.shape[1:])


def embedding(idx: Tensor, weight: Tensor, padding_idx: Optional[int], key: int, site: int,
              batch: Optional[int] = None, name: str = "") -> Tensor:
    """``F.embedding(idx, weight, padding_idx)`` recording ``(idx, dL/dy)`` when capture is on.

    idx: ``[m, *positions]`` integer; weight: ``[vocab, D]``; returns ``[m, *positions, D]``.
    """
    idx = per_sample_indices(idx, key, site)
    if ops.PROBE is not None:
        ops.PROBE[(key, site)] = tuple(idx.shape)
    if not ops._active(key, idx, weight, None):
        return F.embedding(idx, weight, padding_idx)
    ops._check_batch(idx, batch, name)
    run = torch.ops.tengrad_fx.embedding if use_custom_ops() else EmbeddingCapture.apply
    return run(idx, weight, -1 if padding_idx is None else padding_idx, key, site)
