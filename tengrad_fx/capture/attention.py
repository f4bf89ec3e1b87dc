"""``nn.MultiheadAttention``: its projections preconditioned exactly.

torch traces ``nn.MultiheadAttention`` as one leaf (``call_module``): its in-projection
(``in_proj_weight``/``in_proj_bias``, or separate ``q/k/v_proj_weight``) and its
``out_proj`` are ``F.linear`` calls inside ``F.multi_head_attention_forward``, where no
capture op can see them. :func:`rewrite_attention` replaces each call of an exact
``nn.MultiheadAttention`` by :func:`mha`, which, while capture is active, runs the
functional decomposition of torch's slow path with the projections as capture-op linears
on batch-first inputs ``[m, L, E]`` (so the leading dim indexes samples whatever
``batch_first`` is):

* packed, self-attention (``query is key is value``): one linear ``[m, L, E] → [m, L, 3E]``
  with ``in_proj_weight [3E, E]``, chunked into q, k, v (torch's own order);
* packed, cross-attention: ONE linear on the inputs concatenated along positions
  (``[m, L+S(+S), E]``), keeping the q/k/v column blocks of its rows. The rows of the
  other blocks get a zero output gradient, so the per-sample gradient ``Σ_s G_s x_sᵀ``
  is exactly ``[G_qᵀX_q; G_kᵀX_k; G_vᵀX_v]`` and the block is the packed weight and bias;
* separate ``q/k/v_proj_weight`` (``kdim``/``vdim`` ≠ ``embed_dim``): three bias-free
  linears (three layers) and ``in_proj_bias [3E]`` as an added parameter (its per-sample
  gradient is the per-sample sum of the three output gradients, :mod:`.params`);
* ``bias_k``/``bias_v`` (``add_bias_kv``): added parameters broadcast along the batch;
* ``out_proj``: a linear on ``[m, L, E]``.

Its outputs equal the module's up to floating-point rounding (the same ops; the linears
run on batch-first rows). With capture off, without grad, or for unbatched inputs it is
the module's own forward (fast path included), bit for bit.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import ops, params
from .context import RewriteContext
from .match import LayerSpec
from .params import ParamHolder

__all__ = ["rewrite_attention", "mha", "is_exact_mha", "functional_children"]


def is_exact_mha(mod: nn.Module) -> bool:
    """An ``nn.MultiheadAttention`` (or subclass) that still runs torch's forward."""
    return isinstance(mod, nn.MultiheadAttention) and type(mod).forward is nn.MultiheadAttention.forward


def functional_children(model: nn.Module) -> list[str]:
    """Names of the ``out_proj`` Linears that attention modules call functionally
    (``F.linear`` on their weight, never the module): not module-call layers. Covered
    only through :func:`rewrite_attention`."""
    return [f"{name}.out_proj" if name else "out_proj" for name, mod in model.named_modules()
            if isinstance(mod, nn.MultiheadAttention) and isinstance(getattr(mod, "out_proj", None), nn.Linear)]


def _layer_parts(name: str, mod: nn.MultiheadAttention) -> list[tuple[str, str, Any]]:
    """``(layer name, kind, holder)`` of each capture site of one call, in site order."""
    p = f"{name}." if name else ""
    parts: list[tuple[str, str, Any]] = []
    if mod._qkv_same_embed_dim:
        parts.append((f"{p}in_proj", "linear", ParamHolder(mod.in_proj_weight, mod.in_proj_bias)))
    else:
        for w in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            parts.append((f"{p}{w}", "linear", ParamHolder(getattr(mod, w))))
        if mod.in_proj_bias is not None:
            parts.append((f"{p}in_proj_bias", "param", ParamHolder(mod.in_proj_bias)))
    if mod.bias_k is not None:
        parts += [(f"{p}bias_k", "param", ParamHolder(mod.bias_k)), (f"{p}bias_v", "param", ParamHolder(mod.bias_v))]  # type: ignore[arg-type]
    parts.append((f"{p}out_proj", "linear", mod.out_proj))
    return parts


def rewrite_attention(graph: fx.Graph, ctx: RewriteContext, batch_node: Optional[fx.Node], mark: str) -> None:
    """Replace each ``call_module`` of an exact ``nn.MultiheadAttention`` by :func:`mha`,
    with one layer per projection (module docstring), its layers and sites in ``ctx``.
    ``mark``: node-meta flag of capture arguments."""
    model, layers, key = ctx.model, ctx.layers, ctx.key
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        mod = model.get_submodule(str(node.target))
        if not is_exact_mha(mod):
            continue
        name = str(node.target)
        sites = []
        for lname, kind, holder in _layer_parts(name, mod):  # type: ignore[arg-type]
            spec = layers.get(lname)
            if spec is None:
                spec = layers[lname] = LayerSpec(name=lname, kind=kind, module=holder)  # type: ignore[arg-type]
            site = ctx.new_site()
            spec.sites.append(site)
            sites.append(site)
        with graph.inserting_before(node):
            mnode = graph.get_attr(name)
            mnode.meta[mark] = True
            new = graph.call_function(mha, (mnode, *node.args), dict(
                node.kwargs, store_key=key, sites=tuple(sites), batch=batch_node, name=name))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()


def _lin(x: Tensor, w: Tensor, b: Optional[Tensor], key: int, site: int, batch: Optional[int], name: str) -> Tensor:
    return ops.linear(x, w, b, key, site, batch=batch, name=name)


def _batched(p: Tensor, shape: list[int], x: Tensor, key: int, site: int, batch: Optional[int],
             name: str) -> Tensor:
    """``p`` broadcast to ``shape`` (leading dim the batch) through the added-parameter op."""
    y = params._run(p, shape, x, key, site, batch, name)
    return p.expand(shape) if y is None else y


def mha(mod: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
        key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
        attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True, is_causal: bool = False,
        *, store_key: int, sites: tuple[int, ...], batch: Optional[int] = None,
        name: str = "") -> tuple[Tensor, Optional[Tensor]]:
    """``mod(query, key, value, ...)`` with the projections captured (module docstring).

    query ``[m, L, E]`` (``[L, m, E]`` unless ``batch_first``), key/value ``[m, S, kdim/vdim]``;
    returns ``(attn_output, attn_weights or None)`` as the module does."""
    forward = nn.MultiheadAttention.forward
    args = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
    if query.dim() != 3:  # unbatched: no sample dimension
        if ops.PROBE is not None:
            for s in sites:
                ops.PROBE[(store_key, s)] = (-1,)
        return forward(mod, *args)
    capture = ops.ENABLED.get(store_key, False) and torch.is_grad_enabled()
    if ops.PROBE is None and not (capture and any(p.requires_grad for p in mod.parameters())):
        return forward(mod, *args)  # (prepare's probes run the decomposition: its shapes)
    return _decomposed(mod, *args, store_key=store_key, sites=list(sites), batch=batch, name=name)


def _batch_first(query: Tensor, key: Tensor, value: Tensor, batch_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as ``[m, ·, ·]``, keeping which of them are the same tensor."""
    if batch_first:
        return query, key, value
    q = query.transpose(0, 1)
    k = q if key is query else key.transpose(0, 1)
    v = k if value is key else (q if value is query else value.transpose(0, 1))
    return q, k, v


def _in_projection(mod: nn.MultiheadAttention, q_in: Tensor, k_in: Tensor, v_in: Tensor, sites: list[int],
                   lin: Any, batched: Any) -> tuple[Tensor, Tensor, Tensor]:
    """q ``[m, L, E]``, k, v ``[m, S, E]``; pops the sites it uses off ``sites``."""
    E = mod.embed_dim
    if mod._qkv_same_embed_dim:
        W, b, site = mod.in_proj_weight, mod.in_proj_bias, sites.pop(0)
        if q_in is k_in and k_in is v_in:
            proj = lin(q_in, W, b, site).unflatten(-1, (3, E))
            return proj[..., 0, :], proj[..., 1, :], proj[..., 2, :]
        L, S = q_in.shape[1], k_in.shape[1]
        parts = [q_in, k_in] if v_in is k_in else [q_in, k_in, v_in]
        y = lin(torch.cat(parts, 1), W, b, site)
        kv = y[:, L:] if v_in is k_in else None
        k = (kv if kv is not None else y[:, L:L + S])[..., E:2 * E]
        v = (kv if kv is not None else y[:, L + S:])[..., 2 * E:]
        return y[:, :L, :E], k, v
    q, k, v = (lin(x, getattr(mod, w), None, sites.pop(0)) for x, w in
               ((q_in, "q_proj_weight"), (k_in, "k_proj_weight"), (v_in, "v_proj_weight")))
    if mod.in_proj_bias is not None:
        bb = batched(mod.in_proj_bias, [q_in.shape[0], 3 * E], q_in, sites.pop(0)).unsqueeze(1)
        q, k, v = q + bb[..., :E], k + bb[..., E:2 * E], v + bb[..., 2 * E:]
    return q, k, v


def _decomposed(mod: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor], need_weights: bool, attn_mask: Optional[Tensor],
                average_attn_weights: bool, is_causal: bool, *, store_key: int, sites: list[int],
                batch: Optional[int], name: str) -> tuple[Tensor, Optional[Tensor]]:
    """torch's slow path (``F.multi_head_attention_forward``), batch first, capture-op projections."""
    lin = (lambda x, w, b, site: _lin(x, w, b, store_key, site, batch, name))
    batched = (lambda p, shape, x, site: _batched(p, shape, x, store_key, site, batch, name))
    kpm = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                            other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                            target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError(f"MultiheadAttention '{name}': is_causal needs attn_mask (as in torch)")
    if is_causal and kpm is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if kpm is not None:
            is_causal = False
    q_in, k_in, v_in = _batch_first(query, key, value, mod.batch_first)
    m, L, E = q_in.shape
    H = mod.num_heads
    hd = E // H
    q, k, v = _in_projection(mod, q_in, k_in, v_in, sites, lin, batched)
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    if mod.bias_k is not None:
        k = torch.cat([k, batched(mod.bias_k, [m, 1, E], q_in, sites.pop(0))], 1)
        v = torch.cat([v, batched(mod.bias_v, [m, 1, E], q_in, sites.pop(0))], 1)
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
    heads = (lambda t: t.reshape(m, t.shape[1], H, hd).transpose(1, 2))  # [m, H, ·, hd]
    q, k, v = heads(q), heads(k), heads(v)
    if mod.add_zero_attn:
        z = k.new_zeros(m, H, 1, hd)
        k, v = torch.cat([k, z], 2), torch.cat([v, z], 2)
        attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
        kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
    S = k.shape[2]
    if kpm is not None:
        kpm = kpm.view(m, 1, 1, S).expand(-1, H, -1, -1).reshape(m * H, 1, S)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    dropout_p = mod.dropout if mod.training else 0.0
    if need_weights:
        qs = (q * math.sqrt(1.0 / float(hd))).reshape(m * H, L, hd)
        kt = k.reshape(m * H, S, hd).transpose(-2, -1)
        a = torch.baddbmm(attn_mask, qs, kt) if attn_mask is not None else torch.bmm(qs, kt)
        a = F.softmax(a, dim=-1)
        if dropout_p > 0.0:
            a = F.dropout(a, p=dropout_p)
        o = torch.bmm(a, v.reshape(m * H, S, hd)).view(m, H, L, hd)
        weights: Optional[Tensor] = a.view(m, H, L, S)
        if average_attn_weights:
            weights = weights.mean(dim=1)  # type: ignore[union-attr]
    else:
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(m, H, -1, S)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        weights = None
    out = lin(o.transpose(1, 2).reshape(m, L, E), mod.out_proj.weight, mod.out_proj.bias, sites.pop(0))
    return (out if mod.batch_first else out.transpose(0, 1)), weights
