"""Traceable forwards of torch's transformer modules, so that their Linear, LayerNorm and
``nn.MultiheadAttention`` calls become capture sites.

``torch.fx`` keeps every ``torch.nn`` module as a leaf, and the forwards of
``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` /
``nn.Transformer`` branch on tensor properties (their inference fast path, nested
tensors, causal-mask detection), which symbolic tracing cannot follow. Where torch runs
its *slow path*, :func:`traced_forward` gives the tracer that path (the same submodule
calls, in the same order):

* ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder``, train mode (torch takes the
  slow path whenever ``training`` is set). In eval mode they stay leaves, so eval outputs
  are torch's own (fast path included) and nothing inside is captured in eval mode;
* ``nn.TransformerDecoderLayer`` (no fast path: traced as it is), ``nn.TransformerDecoder``
  and ``nn.Transformer``, both modes.

Masks are passed on uncanonicalized (``nn.MultiheadAttention`` canonicalizes them the same
way), and a causal-mask hint of ``None`` is passed as ``False`` (the mask itself is then
applied; the result is the same up to rounding). Subclasses that override ``forward``
stay leaves.

timm's ``MobileVitBlock`` (a timm "notrace" leaf: its unfold branches on the feature map
size) is traced with its unfold and fold as single graph nodes (the same ops).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["traced_forward"]


def _encoder_layer(m: nn.TransformerEncoderLayer, src: Any, src_mask: Any = None,
                   src_key_padding_mask: Any = None, is_causal: bool = False) -> Any:
    x = src
    if m.norm_first:
        x = x + m._sa_block(m.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        return x + m._ff_block(m.norm2(x))
    x = m.norm1(x + m._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
    return m.norm2(x + m._ff_block(x))


def _encoder(m: nn.TransformerEncoder, src: Any, mask: Any = None, src_key_padding_mask: Any = None,
             is_causal: Optional[bool] = None) -> Any:
    out = src
    for layer in m.layers:
        out = layer(out, src_mask=mask, is_causal=bool(is_causal), src_key_padding_mask=src_key_padding_mask)
    return m.norm(out) if m.norm is not None else out


def _decoder(m: nn.TransformerDecoder, tgt: Any, memory: Any, tgt_mask: Any = None, memory_mask: Any = None,
             tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
             tgt_is_causal: Optional[bool] = None, memory_is_causal: bool = False) -> Any:
    out = tgt
    for layer in m.layers:
        out = layer(out, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                    tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                    tgt_is_causal=bool(tgt_is_causal), memory_is_causal=memory_is_causal)
    return m.norm(out) if m.norm is not None else out


def _transformer(m: nn.Transformer, src: Any, tgt: Any, src_mask: Any = None, tgt_mask: Any = None,
                 memory_mask: Any = None, src_key_padding_mask: Any = None, tgt_key_padding_mask: Any = None,
                 memory_key_padding_mask: Any = None, src_is_causal: Optional[bool] = None,
                 tgt_is_causal: Optional[bool] = None, memory_is_causal: bool = False) -> Any:
    memory = m.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal)
    return m.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                     tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                     tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)


_TRAIN_ONLY: dict[type[nn.Module], Callable[..., Any]] = {
    nn.TransformerEncoderLayer: _encoder_layer, nn.TransformerEncoder: _encoder}
_ALWAYS: dict[type[nn.Module], Optional[Callable[..., Any]]] = {
    nn.TransformerDecoderLayer: None, nn.TransformerDecoder: _decoder, nn.Transformer: _transformer}


def traced_forward(m: nn.Module) -> Optional[Callable[..., Any]]:
    """The forward the tracer should trace through for ``m`` (``m.forward`` itself where it
    is traceable), or None to keep ``m`` as torch.fx decides."""
    for table, train_only in ((_TRAIN_ONLY, True), (_ALWAYS, False), (_timm_substitutes(), False)):
        for cls, fn in table.items():
            if isinstance(m, cls) and type(m).forward is cls.forward and (m.training or not train_only):
                return m.forward if fn is None else partial(fn, m)
    return None


# --------------------------------------------------------------------------- timm MobileViT
def _mobilevit_unfold(x: Any, patch: tuple[int, int], area: int) -> tuple[Any, tuple[int, ...]]:
    """timm ``MobileVitBlock``'s unfold, ``[B, C, H, W] → [B·P, N, C]`` (its own ops), and
    ``(B, C, H, W, new_h, new_w)`` for the fold back."""
    ph, pw = patch
    B, C, H, W = x.shape
    new_h, new_w = math.ceil(H / ph) * ph, math.ceil(W / pw) * pw
    nh, nw = new_h // ph, new_w // pw
    if new_h != H or new_w != W:
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False)
    x = x.reshape(B * C * nh, ph, nw, pw).transpose(1, 2)
    x = x.reshape(B, C, nh * nw, area).transpose(1, 3).reshape(B * area, nh * nw, -1)
    return x, (B, C, H, W, new_h, new_w)


def _mobilevit_fold(x: Any, shape: tuple[int, ...], patch: tuple[int, int], area: int) -> Any:
    """Inverse of :func:`_mobilevit_unfold` (timm's fold)."""
    ph, pw = patch
    B, C, H, W, new_h, new_w = shape
    nh, nw = new_h // ph, new_w // pw
    x = x.contiguous().view(B, area, nh * nw, -1)
    x = x.transpose(1, 3).reshape(B * C * nh, nw, ph, pw)
    x = x.transpose(1, 2).reshape(B, C, nh * ph, nw * pw)
    if (new_h, new_w) != (H, W):
        x = F.interpolate(x, size=(H, W), mode="bilinear", align_corners=False)
    return x


torch.fx.wrap("_mobilevit_unfold")
torch.fx.wrap("_mobilevit_fold")


def _mobilevit_block(m: Any, x: Any) -> Any:
    """timm ``MobileVitBlock.forward`` with its shape-dependent unfold/fold as graph leaves, so
    its convs, transformer blocks and norm are traced (the transformer's rows are the folded
    batch ``[B·P, N, C]``; prepare's fold probe finds them). ``m``: a ``MobileVitBlock``."""
    shortcut = x
    x = m.conv_1x1(m.conv_kxk(x))
    x, shape = _mobilevit_unfold(x, tuple(m.patch_size), m.patch_area)
    x = m.norm(m.transformer(x))
    x = m.conv_proj(_mobilevit_fold(x, shape, tuple(m.patch_size), m.patch_area))
    if m.conv_fusion is not None:
        x = m.conv_fusion(torch.cat((shortcut, x), dim=1))
    return x


def _timm_substitutes() -> dict[type[nn.Module], Callable[..., Any]]:
    try:
        from timm.models.mobilevit import MobileVitBlock
    except Exception:  # pragma: no cover - timm missing or moved
        return {}
    return {MobileVitBlock: _mobilevit_block}
