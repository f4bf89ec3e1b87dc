"""The capture site of a bias-only layer: a covered Linear, ConvNd or norm layer whose
weight is frozen (``requires_grad=False``) and whose bias is trainable (BitFit).

Such a layer runs its plain forward (the module's own output, bit for bit, and aten's own
input and bias gradients); its output ``y`` (``[m, *]``) then goes through
``tengrad_fx::bias_site``, an identity whose backward records the per-sample bias
gradients ``P = [Σ_s G_i[s]]_i`` (``[m, C]``, ``G`` summed over every position of each
sample, per bias entry: per output channel of a Linear/Conv, per ``β`` entry of a norm
layer) and passes ``G`` on unchanged. ``J = k·P`` needs no input ``I``: nothing of the
layer's input is recorded (the plain forward saves what aten saves: a Linear keeps only its
weight, a convolution its input as well).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .amp import acc, autocast_off
from .eager import alias, capture_op, use_custom_ops
from .norm_ops import per_sample_sums
from .store import Record, lookup

__all__ = ["bias_site"]

def _forward(y: Tensor, C: int, channel_first: bool, key: int, site: int) -> Tensor:
    """The custom op's forward: a copy of ``y`` (a custom op's output may not alias its input)."""
    lookup(key).begin()
    return y.clone()


def _eager_forward(y: Tensor, C: int, channel_first: bool, key: int, site: int) -> Tensor:
    """The eager Function's forward: ``y`` itself, as an alias without a view relation
    (in-place ops on the output stay allowed), or a copy of a non-contiguous ``y``."""
    lookup(key).begin()
    return alias(y)


def _eager_backward(grad: Tensor, C: int, channel_first: bool, key: int, site: int) -> Tensor:
    """Records ``P [m, C]`` (accumulated in float32 under autocast) and returns ``grad``."""
    with autocast_off(grad):
        m = grad.shape[0]
        P = per_sample_sums(acc(grad), C, channel_first)
        lookup(key).record(site, Record(None, None, P, P.new_zeros(m, 0), tuple(grad.shape)))
    return grad


def _backward(grad: Tensor, C: int, channel_first: bool, key: int, site: int) -> Tensor:
    """The custom op's backward: :func:`_eager_backward`, the gradient passed on as a copy."""
    return _eager_backward(grad, C, channel_first, key, site).clone()


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.conf = inputs[1:]


def _formula(backward: Callable[..., Tensor], ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
    return backward(grad, *ctx.conf), None, None, None, None


_op, _backward_op, BiasSite = capture_op("bias_site", _forward, _backward, _setup, _formula,
                                         eager_forward=_eager_forward, eager_backward=_eager_backward)


@_op.register_fake
def _(y: Tensor, C: int, channel_first: bool, key: int, site: int) -> Tensor:
    return torch.empty_like(y)


@_backward_op.register_fake
def _(grad: Tensor, C: int, channel_first: bool, key: int, site: int) -> Tensor:
    return torch.empty_like(grad)


def bias_site(y: Tensor, bias: Tensor, channel_first: bool, key: int, site: int) -> Tensor:
    """``y`` (``[m, C, *]`` when ``channel_first``, else ``[m, *, *bias.shape]``), recording the
    per-sample gradients of ``bias`` (``C = bias.numel()`` entries) in its backward."""
    run = torch.ops.tengrad_fx.bias_site if use_custom_ops() else BiasSite.apply
    return run(y, bias.numel(), channel_first, key, site)
