"""Capture ops: Linear and ConvNd as ``torch.library`` custom ops that record (I, G).

Two ops per layer kind, no hooks:

* ``tengrad_fx::linear`` / ``tengrad_fx::conv`` — the layer's forward (identical
  output to ``F.linear`` / ``aten.convolution``, transposed convolutions included). Its autograd formula
  (``register_autograd``) calls
* ``tengrad_fx::linear_backward`` / ``tengrad_fx::conv_backward`` — computes the
  input/weight/bias gradients with aten's own kernels and, as a side effect of its
  implementation, hands ``(I, G)`` to the model's :class:`CaptureStore`.

Both ops are opaque to ``torch.compile`` (they carry fake implementations for
shape propagation), so a compiled model still records; the backward op's outputs
are the parameter gradients, so it is never dead-code eliminated. Outside compilation
the same bodies run in a plain ``autograd.Function`` (:mod:`.eager`: no custom-op
dispatch, a fraction of its per-call cost).

The Python functions :func:`linear` and :func:`conv` are what the rewritten FX graph
calls. They dispatch to the plain aten op when capture is off, when grad is disabled,
or when nothing requires grad — then capture costs nothing (and an FX-prepared model
runs its plain graph instead, :mod:`.plain_graph`).

Per-call cost: these wrappers and bodies run once per covered layer call, and on a GPU
the step is launch-bound, so they call the generated ``torch.*`` bindings
(``torch.convolution``: half the host time of the ``torch.ops.aten`` packet, which parses
its arguments against the schema) and ``OpOverload``s (``.default``) where no binding
exists, and pass the per-site constant tuples through unconverted
(``tools.bench --capture``: the launch-bound table).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .amp import acc, as_dtype, autocast_off, cast_lower
from .bias import bias_site
from .per_sample_conv import per_sample_conv_weight_grads
from .eager import alias, capture_op, use_custom_ops
from .folded_rows import FOLDS, fold_rows, unfold_rows
from .store import Record, lookup

__all__ = ["linear", "conv", "bias_only", "PROBE"]

# When not None, prepare() is probing shapes: wrappers record (key, site) -> input shape.
PROBE: Optional[dict[tuple[int, int], tuple[int, ...]]] = None
# When not None, prepare()'s fold probe also keeps (key, site) -> the input itself.
PROBE_INPUTS: Optional[dict[tuple[int, int], Tensor]] = None


def probe(key: int, site: int, x: Tensor) -> None:
    """Note one call's input for prepare()'s probes (no-op outside them)."""
    if PROBE is not None:
        PROBE[(key, site)] = tuple(x.shape)
        if PROBE_INPUTS is not None:
            PROBE_INPUTS[(key, site)] = x.detach().clone()


# key -> capture enabled? (read by the wrappers; a plain dict so torch.compile guards on it)
ENABLED: dict[int, bool] = {}
# store key -> the batch size of the prepared model's current forward call (the leading dim
# of its first tensor input), set by the prepared model's forward
SAMPLES: dict[int, Optional[int]] = {}
# store key -> whether its forward must set SAMPLES (shared position ids, added parameters)
NEEDS_SAMPLES: dict[int, bool] = {}
# store key -> the embedding sites whose indices all samples share ([1, *positions])
SHARED_INDEX_SITES: dict[int, frozenset[int]] = {}


def _active(key: int, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> bool:
    """Capture this call? Only with capture on, grad enabled and a weight that requires
    grad: a frozen layer (weight ``requires_grad=False``) runs the plain aten op (input and
    bias gradients as usual; a trainable bias is captured alone, :func:`bias_only`). Read at every call, so
    ``requires_grad_(True)`` after prepare() takes effect at the next forward."""
    return ENABLED.get(key, False) and torch.is_grad_enabled() and weight.requires_grad


def bias_only(y: Tensor, bias: Optional[Tensor], channel_first: bool, keep: int, key: int, site: int,
              batch: Optional[int], name: str) -> Tensor:
    """The output ``y`` of a layer whose weight is frozen, its plain forward: through the
    bias site (:mod:`.bias`) when capture is on and its ``bias`` is trainable (a bias-only
    layer, whose curvature is the per-sample bias gradients), else unchanged. ``keep``:
    the trailing dims a folded batch keeps (Linear 1, LayerNorm its normalized dims)."""
    if bias is None or not (bias.requires_grad and ENABLED.get(key, False) and torch.is_grad_enabled()):
        return y
    fold = FOLDS.get((key, site)) if FOLDS else None
    if fold is not None:  # per-sample sums over the sample's rows, regrouped
        rows = y.shape[:y.dim() - keep]
        rows_per_sample = fold_rows(y, fold, keep, name, SAMPLES.get(key))
        return unfold_rows(bias_site(rows_per_sample, bias, channel_first, key, site), fold, rows)
    _check_batch(y, batch, name)
    return bias_site(y, bias, channel_first, key, site)


def _check_batch(x: Tensor, batch: Optional[int], name: str) -> None:
    if batch is not None and x.shape[0] != batch:
        raise RuntimeError(
            f"tengrad_fx: layer '{name}' received an input with leading dimension "
            f"{x.shape[0]} while the model's batch is {batch}; its input does not index "
            "samples, so its per-sample gradients would be wrong. Pass example_inputs= to "
            "tengrad_fx.prepare() so such layers are detected and left to the SGD fallback."
        )


_convolution_backward = torch.ops.aten.convolution_backward.default
# output_padding of a convolution that is not transposed, by spatial dims
_NO_OUTPUT_PADDING = {1: (0,), 2: (0, 0), 3: (0, 0, 0)}


def _not_a_view(out: Tensor) -> Tensor:
    """``out`` without a view relation to the kernel's intermediate (F.linear on ``[m, *, d]``
    and Conv1d return views). Autograd forbids in-place ops on a view made inside a custom
    op, so an in-place activation or ``+=`` after a captured layer would raise; an alias
    without the view relation (what ``matmul`` itself returns) is safe, nothing else holds it."""
    return alias(out) if out._is_view() else out


# --------------------------------------------------------------------------- linear
def _linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], key: int, site: int) -> Tensor:
    """``F.linear``, ``[m, *, d_out]``; starts a new capture."""
    lookup(key).begin()
    return _not_a_view(F.linear(x, weight, bias))


def _linear_backward(grad: Tensor, x: Tensor, weight: Tensor, has_bias: bool, need_input: bool,
                     key: int, site: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(∂L/∂x or [0], ∂L/∂W, ∂L/∂b or [0])`` from ``grad [m, *, d_out]``; records
    ``(x, grad)`` or, at a materialized site, ``P [m, d_out·d_in]`` and ``Gsum [m, d_out]``."""
    with autocast_off(grad):
        store = lookup(key)
        gx = grad.matmul(weight) if need_input else grad.new_empty(0)
        if store.wants_jacobian(site):  # per-sample gradients, accumulated and kept in fp32
            m, o = x.shape[0], weight.shape[0]
            gs, xs = acc(grad).reshape(m, -1, o), acc(x).reshape(m, -1, x.shape[-1])
            # P in the parameter's layout: [m, d_out·d_in], or [m, d_in·d_out] for a weight
            # stored as [d_in, d_out] (given here as its transpose ``weight``)
            transposed = site in store.transposed_sites
            P = (torch.bmm(xs.transpose(1, 2), gs) if transposed else torch.bmm(gs.transpose(1, 2), xs)).reshape(m, -1)
            gsum = gs.sum(1)
            store.record(site, Record(None, None, P, gsum, tuple(x.shape)))
            if store.grad_only:
                return gx, grad.new_zeros(weight.shape), grad.new_zeros(o if has_bias else 0)
            gb = as_dtype(gsum.sum(0), grad.dtype) if has_bias else grad.new_empty(0)
            gw = P.sum(0).view(weight.shape[1], o).t() if transposed else P.sum(0).view(weight.shape)
            return gx, as_dtype(gw, weight.dtype), gb
        store.record(site, Record(x, grad))
        if store.grad_only:  # MC-Fisher pass: G only, no parameter gradients
            return gx, grad.new_zeros(weight.shape), grad.new_zeros(weight.shape[0] if has_bias else 0)
        g2 = grad.reshape(-1, grad.shape[-1])
        gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        gb = g2.sum(0) if has_bias else grad.new_empty(0)
        return gx, gw, gb


def _linear_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias, key, site = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.key, ctx.site = key, site


def _linear_formula(backward, ctx, grad):  # type: ignore[no-untyped-def]
    x, weight = ctx.saved_tensors
    need_input = ctx.needs_input_grad[0]
    gx, gw, gb = backward(grad, x, weight, ctx.has_bias, need_input, ctx.key, ctx.site)
    return (gx if need_input else None), gw, (gb if ctx.has_bias else None), None, None


_linear_op, _linear_backward_op, LinearCapture = capture_op(
    "linear", _linear_forward, _linear_backward, _linear_setup, _linear_formula)


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor], key: int, site: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_linear_backward_op.register_fake
def _(grad, x, weight, has_bias, need_input, key, site):  # type: ignore[no-untyped-def]
    gx = grad.new_empty(x.shape) if need_input else grad.new_empty(0)
    gb = grad.new_empty(weight.shape[0]) if has_bias else grad.new_empty(0)
    return gx, grad.new_empty(weight.shape), gb


def linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], key: int, site: int,
    batch: Optional[int] = None, name: str = "", transposed: bool = False,
) -> Tensor:
    """``F.linear(x, weight, bias)`` that records ``(x, dL/dy)`` when capture is on.

    x: ``[m, *, d_in]``; weight: ``[d_out, d_in]`` (``transposed``: ``[d_in, d_out]``, as
    Hugging Face's ``Conv1D`` stores it, ``y = x @ weight + bias``); returns ``[m, *, d_out]``.
    The records are a Linear's either way. Under ``torch.autocast`` the arguments are cast
    as for ``aten::linear`` (:mod:`.amp`).
    """
    if transposed:
        weight = weight.t()
    x, weight, bias = cast_lower(x, weight, bias)  # type: ignore[assignment]
    if PROBE is not None:
        probe(key, site, x)
    if not (ENABLED.get(key, False) and torch.is_grad_enabled() and weight.requires_grad):  # _active
        return bias_only(F.linear(x, weight, bias), bias, False, 1, key, site, batch, name)
    run = torch.ops.tengrad_fx.linear if use_custom_ops() else LinearCapture.apply
    if FOLDS:
        fold = FOLDS.get((key, site))
        if fold is not None:  # a folded batch: run on the rows regrouped per sample
            y = run(fold_rows(x, fold, 1, name, SAMPLES.get(key)), weight, bias, key, site)
            return unfold_rows(y, fold, x.shape[:-1])
    if batch is not None:
        _check_batch(x, batch, name)
    return run(x, weight, bias, key, site)


# --------------------------------------------------------------------------- conv
# ``transposed``/``output_padding`` as in ``aten.convolution``: ConvTransposeNd, weight
# ``[c_in, c_out/g, *k]``; its weight gradient is a convolution with the roles of the input
# and the output gradient swapped, which ``aten.convolution_backward`` computes.
def _conv_forward(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
    groups: int, key: int, site: int,
) -> Tensor:
    """``aten.convolution``, ``[m, c_out, *spatial_out]``; starts a new capture."""
    lookup(key).begin()
    return _not_a_view(torch.convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding,
                                         groups))


def _conv_backward_amp(
    grad: Tensor, x: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    has_bias: bool, need_input: bool, key: int, site: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward op's body: :func:`_conv_backward` with autocast off."""
    with autocast_off(grad):
        return _conv_backward(grad, x, weight, (stride, padding, dilation, transposed, output_padding, groups),
                              has_bias, need_input, key, site)


def _conv_backward(grad: Tensor, x: Tensor, weight: Tensor, conf: tuple, has_bias: bool,
                   need_input: bool, key: int, site: int) -> tuple[Tensor, Tensor, Tensor]:
    store = lookup(key)
    stride, padding, dilation, transposed, output_padding, groups = conf
    if store.wants_jacobian(site):  # per-sample weight grads in place of the weight grad
        P = per_sample_conv_weight_grads(acc(grad), acc(x), weight.shape, stride, padding, dilation, groups,
                                         transposed=transposed, output_padding=output_padding)
        gsum = acc(grad).flatten(2).sum(2)
        store.record(site, Record(None, None, P, gsum, tuple(x.shape)))
        gx = _conv_input_grad(grad, x, weight, conf) if need_input else grad.new_empty(0)
        if store.grad_only:
            return gx, *_zero_param_grads(grad, weight, has_bias)
        return (gx, as_dtype(P.sum(0).view(weight.shape), weight.dtype),
                (as_dtype(gsum.sum(0), grad.dtype) if has_bias else grad.new_empty(0)))
    store.record(site, Record(x, grad))
    if store.grad_only:  # MC-Fisher pass: G only, no parameter gradients
        gx = _conv_input_grad(grad, x, weight, conf) if need_input else grad.new_empty(0)
        return gx, *_zero_param_grads(grad, weight, has_bias)
    gx, gw, gb = _convolution_backward(
        grad, x, weight, [grad.shape[1]] if has_bias else None, *conf, [need_input, True, has_bias],
    )
    return (gx if need_input else grad.new_empty(0)), gw, (gb if has_bias else grad.new_empty(0))


def _zero_param_grads(grad: Tensor, weight: Tensor, has_bias: bool) -> tuple[Tensor, Tensor]:
    """Zero weight and bias gradients (MC-Fisher pass); fresh tensors each time: a custom
    op's outputs must not alias each other."""
    return grad.new_zeros(weight.shape), (grad.new_zeros(grad.shape[1]) if has_bias else grad.new_empty(0))


def _conv_input_grad(grad: Tensor, x: Tensor, weight: Tensor, conf: tuple) -> Tensor:
    return _convolution_backward(grad, x, weight, None, *conf, [True, False, False])[0]


def _conv_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, key, site = inputs
    ctx.save_for_backward(x, weight)
    ctx.conf = (stride, padding, dilation, transposed, output_padding, groups)
    ctx.has_bias = bias is not None
    ctx.key, ctx.site = key, site


def _conv_formula(backward, ctx, grad):  # type: ignore[no-untyped-def]
    x, weight = ctx.saved_tensors
    need_input = ctx.needs_input_grad[0]
    gx, gw, gb = backward(grad, x, weight, *ctx.conf, ctx.has_bias, need_input, ctx.key, ctx.site)
    return ((gx if need_input else None), gw, (gb if ctx.has_bias else None),
            None, None, None, None, None, None, None, None)


_conv_op, _conv_backward_op, ConvCapture = capture_op(
    "conv", _conv_forward, _conv_backward_amp, _conv_setup, _conv_formula)


@_conv_op.register_fake
def _(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, key, site):  # type: ignore[no-untyped-def]
    return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@_conv_backward_op.register_fake
def _(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups, has_bias, need_input, key, site):  # type: ignore[no-untyped-def]
    gx = grad.new_empty(x.shape) if need_input else grad.new_empty(0)
    gb = grad.new_empty(grad.shape[1]) if has_bias else grad.new_empty(0)
    return gx, grad.new_empty(weight.shape), gb


def conv(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], groups: int, key: int, site: int,
    pre_pad: Optional[Sequence[int]] = None, pad_mode: str = "constant",
    batch: Optional[int] = None, name: str = "",
    transposed: bool = False, output_padding: Optional[Sequence[int]] = None,
) -> Tensor:
    """ConvNd (or ConvTransposeNd when ``transposed``) that records ``(x_padded, dL/dy)``
    when capture is on.

    x: ``[m, c_in, *spatial]``; weight: ``[c_out, c_in/groups, *k]`` (transposed:
    ``[c_in, c_out/groups, *k]``); returns ``[m, c_out, *spatial_out]``. ``pre_pad``
    (``F.pad`` order) is applied first, with ``pad_mode``, for padding modes other than
    zeros and for asymmetric ``padding='same'``; the recorded input is then the padded one.
    """
    if pre_pad is not None:
        x = F.pad(x, list(pre_pad), mode=pad_mode)
    x, weight, bias = cast_lower(x, weight, bias)  # type: ignore[assignment]  # as aten::conv*d (.amp)
    if PROBE is not None:
        probe(key, site, x)
    op = _NO_OUTPUT_PADDING[weight.dim() - 2] if output_padding is None else output_padding
    if not (ENABLED.get(key, False) and torch.is_grad_enabled() and weight.requires_grad):  # _active
        y = torch.convolution(x, weight, bias, stride, padding, dilation, transposed, op, groups)
        return bias_only(y, bias, True, 0, key, site, batch, name)
    if batch is not None:
        _check_batch(x, batch, name)
    if use_custom_ops():  # the schema's int[]: lists
        return torch.ops.tengrad_fx.conv(x, weight, bias, list(stride), list(padding), list(dilation),
                                         transposed, list(op), groups, key, site)
    return ConvCapture.apply(x, weight, bias, stride, padding, dilation, transposed, op, groups, key, site)
