"""Capture ops of the norm layers (``torch.library`` custom ops, no hooks).

* ``tengrad_fx::batch_norm`` / ``layer_norm`` / ``group_norm`` — aten's fused
  ``native_*_norm`` kernel with the affine (same output, same running-statistics update,
  bit for bit), returning the saved statistics too. Their backward ops compute ``∂L/∂x``
  with aten's ``native_*_norm_backward`` and the parameter gradients from the per-sample
  sums below.
* ``tengrad_fx::affine`` — ``γ ⊙ x̂ + β`` for norms whose module computes ``x̂`` by
  composite ops (RMSNorm): the module's own arithmetic, split at the affine.

Every backward op computes, from the saved statistics, the per-sample gradients
``P = [Σ_s G_i[s] ⊙ x̂_i[s]]_i`` and ``Gsum = [Σ_s G_i[s]]_i`` (``[m, C]``; for BatchNorm and
GroupNorm by aten's batch-norm backward kernel over ``m·C`` one-sample channels, no ``x̂``) and,
through :func:`_record`, hands the store either those or ``(x̂, G)``; the weight and bias
gradients are their sums over the batch. Outside ``torch.compile`` the same bodies run
in plain ``autograd.Function``s (:mod:`.eager`).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .amp import acc, as_dtype, autocast_off, cast_like_aten
from .eager import capture_op, use_custom_ops
from .store import CaptureStore, Record, lookup

__all__ = ["per_sample_sums", "bcast"]

# the backward kernels have no torch.* binding: their OpOverloads (cheaper per call than
# the torch.ops.aten packets); the forwards call the torch.* bindings (see .ops)
_bn_backward_kernel = torch.ops.aten.native_batch_norm_backward.default
_ln_backward_kernel = torch.ops.aten.native_layer_norm_backward.default
_gn_backward_kernel = torch.ops.aten.native_group_norm_backward.default


def bcast(p: Tensor, ndim: int, channel_first: bool) -> Tensor:
    """γ or β shaped to broadcast against ``x̂`` of ``ndim`` dims."""
    return p.view(-1, *([1] * (ndim - 2))) if channel_first else p


def per_sample_sums(t: Tensor, C: int, channel_first: bool) -> Tensor:
    """``[m, C]``: ``t`` summed over every position of each sample, per affine parameter."""
    m = t.shape[0]
    return t.reshape(m, C, -1).sum(2) if channel_first else t.reshape(m, -1, C).sum(1)


def _record(store: CaptureStore, site: int, grad: Tensor, Pw: Tensor, Pb: Tensor, weight: Tensor,
            has_bias: bool, gx: Tensor, xhat: Callable[[], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Record ``P``/``Gsum`` (materialized sites) or ``(x̂, G)`` and return ``(gx, gγ, gβ)``
    (``Pw``, ``Pb``: float32 under autocast, :mod:`.amp`; the gradients in γ's dtype)."""
    if store.wants_jacobian(site):
        store.record(site, Record(None, None, Pw, Pb, tuple(grad.shape)))
    else:
        store.record(site, Record(xhat(), grad))
    if store.grad_only:  # MC-Fisher pass: G only, no parameter gradients
        return gx, weight.new_zeros(weight.shape), weight.new_zeros(weight.shape if has_bias else 0)
    gw = Pw.sum(0) if weight.dim() == 1 else Pw.sum(0).view(weight.shape)
    if not has_bias:
        return gx, as_dtype(gw, weight.dtype), weight.new_empty(0)
    gb = Pb.sum(0) if weight.dim() == 1 else Pb.sum(0).view(weight.shape)
    return gx, as_dtype(gw, weight.dtype), as_dtype(gb, weight.dtype)


def _finish(store: CaptureStore, site: int, grad: Tensor, xhat: Tensor, weight: Tensor,
            has_bias: bool, channel_first: bool, gx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """From an explicit ``x̂``: per-sample sums first, then over the batch."""
    C = weight.numel()
    Pw = per_sample_sums(acc(grad) * acc(xhat), C, channel_first)
    Pb = per_sample_sums(acc(grad), C, channel_first)
    return _record(store, site, grad, Pw, Pb, weight, has_bias, gx, lambda: xhat)


def _finish_channel_stats(store: CaptureStore, site: int, grad: Tensor, x: Tensor, mean: Tensor,
                          rstd: Tensor, weight: Tensor, has_bias: bool,
                          gx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Channel-first norms whose statistics are constant over each (sample, channel)'s
    positions (BatchNorm, GroupNorm; ``mean``, ``rstd``: ``[m, C]`` or ``[C]``): without forming
    ``x̂``, ``dγ_i = rstd ⊙ Σ_s G_i[s] (x_i[s] − mean)`` and ``dβ_i = Σ_s G_i[s]`` are the
    affine gradients of a batch norm over ``m·C`` channels of one sample each
    (``[1, m·C, S]``, these statistics given as the saved ones): one fused aten kernel
    (``native_batch_norm_backward``, ``∂L/∂x`` not requested), no full-size temporary."""
    m, C = grad.shape[:2]
    # dense: with one position per channel (S = 1) the kernel reads the statistics as
    # contiguous vectors, and C = 1 would otherwise give a stride-0 view (wrong values)
    stats = [_dense(acc(t), m, C) for t in (mean, rstd)]
    # an explicit unit γ: CUDA's kernel computes no γ-gradient (and fails) without a weight
    ones = _ones(m * C, stats[1])
    _, Pw, Pb = _bn_backward_kernel(
        acc(grad).reshape(1, m * C, -1), acc(x).reshape(1, m * C, -1), ones, None, None, *stats, True, 0.0,
        [False, True, True])
    shape = (-1, C, *([1] * (x.dim() - 2)))
    return _record(store, site, grad, Pw.view(m, C), Pb.view(m, C), weight, has_bias, gx,
                   lambda: (x - mean.reshape(shape)) * rstd.reshape(shape))


def _dense(t: Tensor, m: int, C: int) -> Tensor:
    """``t [m, C]`` or ``[C]`` as a contiguous ``[m·C]`` (entry ``i·C + c``: ``t[i, c]`` or
    ``t[c]``), copied where ``t`` is ``[C]`` (never a stride-0 view; ``expand`` +
    ``contiguous``: a fraction of ``repeat``'s host time)."""
    return t.expand(m, C).contiguous().view(m * C) if t.dim() == 1 else t.reshape(m * C)


_ONES: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _ones(n: int, like: Tensor) -> Tensor:
    """A ``[n]`` tensor of ones in ``like``'s dtype and device, made once per (n, dtype,
    device) and only ever read (one kernel launch less per layer call)."""
    k = (n, like.dtype, like.device)
    ones = _ONES.get(k)
    if ones is None:
        ones = _ONES[k] = like.new_ones(n)
    return ones


def _fake_grads(grad: Tensor, x: Tensor, weight: Tensor, has_bias: bool, need_input: bool):  # type: ignore[no-untyped-def]
    gx = torch.empty_like(x) if need_input else grad.new_empty(0)
    return gx, weight.new_empty(weight.shape), weight.new_empty(weight.shape if has_bias else 0)


# --------------------------------------------------------------------------- batch norm
def _bn_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], running_mean: Optional[Tensor],
                running_var: Optional[Tensor], training: bool, momentum: float, eps: float,
                key: int, site: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, batch mean, batch rstd, new running mean, new running var)``; a functional op
    (autograd needs one): in train mode aten updates copies of the running statistics,
    which :func:`batch_norm` writes back."""
    return _bn_run(x, weight, bias, running_mean, running_var, training, momentum, eps, key, True)


def _bn_forward_in_place(x: Tensor, weight: Tensor, bias: Optional[Tensor], running_mean: Optional[Tensor],
                         running_var: Optional[Tensor], training: bool, momentum: float, eps: float,
                         key: int, site: int) -> tuple[Tensor, Tensor, Tensor]:
    """The eager Function's forward: ``(y, batch mean, batch rstd)``, aten updating the
    running statistics in place (as ``F.batch_norm`` does)."""
    lookup(key).begin()
    return torch.native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps)


def _bn_run(x: Tensor, weight: Tensor, bias: Optional[Tensor], running_mean: Optional[Tensor],
            running_var: Optional[Tensor], training: bool, momentum: float, eps: float, key: int,
            functional: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    lookup(key).begin()
    update = functional and training and running_mean is not None and running_var is not None
    rm = running_mean.clone() if update else running_mean  # type: ignore[union-attr]
    rv = running_var.clone() if update else running_var  # type: ignore[union-attr]
    out, mean, rstd = torch.native_batch_norm(x, weight, bias, rm, rv, training, momentum, eps)
    if not update:
        return out, mean, rstd, x.new_empty(0), x.new_empty(0)
    return out, mean, rstd, rm, rv  # type: ignore[return-value]


def _bn_backward(grad: Tensor, x: Tensor, weight: Tensor, running_mean: Optional[Tensor],
                 running_var: Optional[Tensor], save_mean: Tensor, save_rstd: Tensor, training: bool,
                 eps: float, has_bias: bool, need_input: bool, key: int,
                 site: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(∂L/∂x or [0], ∂L/∂γ, ∂L/∂β or [0])``; records (module docstring)."""
    with autocast_off(grad):
        gx = _bn_backward_kernel(
            grad, x, weight, running_mean, running_var, save_mean, save_rstd, training, eps,
            [True, False, False])[0] if need_input else grad.new_empty(0)
        if training:
            mean, rstd = save_mean, save_rstd
        else:
            assert running_mean is not None and running_var is not None
            mean, rstd = running_mean, (running_var + eps).rsqrt()
        return _finish_channel_stats(lookup(key), site, grad, x, mean, rstd, weight, has_bias, gx)


def _bn_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias, rm, rv, training, momentum, eps, key, site = inputs
    mean, rstd = output[1], output[2]  # (the custom op: then the new running statistics)
    # running statistics are read by the backward only in eval mode (then they are constant)
    ctx.save_for_backward(x, weight, mean, rstd, None if training else rm, None if training else rv)
    ctx.conf = (training, eps, bias is not None, key, site)
    ctx.mark_non_differentiable(*output[1:])


def _bn_formula(backward, ctx, grad, *_):  # type: ignore[no-untyped-def]
    x, weight, mean, rstd, rm, rv = ctx.saved_tensors
    training, eps, has_bias, key, site = ctx.conf
    need_input = ctx.needs_input_grad[0]
    gx, gw, gb = backward(grad, x, weight, rm, rv, mean, rstd, training, eps, has_bias, need_input, key, site)
    return ((gx if need_input else None), gw, (gb if has_bias else None),
            None, None, None, None, None, None, None)


_bn_op, _bn_backward_op, BatchNormCapture = capture_op(
    "batch_norm", _bn_forward, _bn_backward, _bn_setup, _bn_formula, eager_forward=_bn_forward_in_place)


@_bn_op.register_fake
def _(x, weight, bias, running_mean, running_var, training, momentum, eps, key, site):  # type: ignore[no-untyped-def]
    n = x.shape[1] if training else 0
    u = x.shape[1] if training and running_mean is not None and running_var is not None else 0
    return torch.empty_like(x), x.new_empty(n), x.new_empty(n), x.new_empty(u), x.new_empty(u)


@_bn_backward_op.register_fake
def _(grad, x, weight, running_mean, running_var, save_mean, save_rstd, training, eps, has_bias,  # type: ignore[no-untyped-def]
      need_input, key, site):
    return _fake_grads(grad, x, weight, has_bias, need_input)


def batch_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], running_mean: Optional[Tensor],
               running_var: Optional[Tensor], training: bool, momentum: float, eps: float,
               key: int, site: int) -> Tensor:
    """``F.batch_norm`` with affine, recording (``x [m, C, *spatial]``); in train mode the
    running statistics are updated in place, as aten does. Autocast: as ``aten::batch_norm``."""
    x, weight, bias = cast_like_aten("aten::batch_norm", x, weight, bias)  # type: ignore[assignment]
    run = torch.ops.tengrad_fx.batch_norm if use_custom_ops() else BatchNormCapture.apply
    res = run(x, weight, bias, running_mean, running_var, training, momentum, eps, key, site)
    if len(res) == 5 and res[3].numel():  # the custom op's new statistics (the eager Function's: in place)
        with torch.no_grad():
            running_mean.copy_(res[3])  # type: ignore[union-attr]
            running_var.copy_(res[4])  # type: ignore[union-attr]
    return res[0]


# --------------------------------------------------------------------------- layer norm
def _ln_forward(x: Tensor, normalized_shape: Sequence[int], weight: Tensor, bias: Optional[Tensor],
                eps: float, key: int, site: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of ``aten.native_layer_norm``."""
    lookup(key).begin()
    out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
    return out, mean, rstd


def _ln_backward(grad: Tensor, x: Tensor, normalized_shape: Sequence[int], mean: Tensor,
                 rstd: Tensor, weight: Tensor, has_bias: bool, need_input: bool, key: int,
                 site: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(∂L/∂x or [0], ∂L/∂γ, ∂L/∂β or [0])``; records (module docstring)."""
    with autocast_off(grad):
        gx = _ln_backward_kernel(grad, x, normalized_shape, mean, rstd, weight, None,
                                 [True, False, False])[0] if need_input else grad.new_empty(0)
        # dγ_i = Σ_s G[s] ⊙ (x[s] − μ_s) r_s = Σ_s r_s (G ⊙ x)[s] − Σ_s μ_s r_s G[s]: two
        # batched products over positions, one full-size temporary (G ⊙ x)
        m, D = x.shape[0], weight.numel()
        r = acc(rstd).reshape(m, 1, -1)
        ga, xa = acc(grad), acc(x)
        g3 = ga.reshape(m, -1, D)
        Pw = (torch.bmm(r, (ga * xa).reshape(m, -1, D)) - torch.bmm(acc(mean).reshape(m, 1, -1) * r, g3)).view(m, D)
        Pb = g3.sum(1)
        return _record(lookup(key), site, grad, Pw, Pb, weight, has_bias, gx, lambda: (x - mean) * rstd)


def _stats_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    """Layer and group norm: ``inputs = (x, shape-or-groups, weight, bias, eps, key, site)``."""
    x, arg, weight, bias, eps, key, site = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.conf = (arg, bias is not None, key, site)
    ctx.mark_non_differentiable(mean, rstd)


def _stats_formula(backward, ctx, grad, *_):  # type: ignore[no-untyped-def]
    """Layer and group norm: ``backward(grad, x, arg, mean, rstd, weight, has_bias,
    need_input, key, site)``."""
    x, weight, mean, rstd = ctx.saved_tensors
    arg, has_bias, key, site = ctx.conf
    need_input = ctx.needs_input_grad[0]
    gx, gw, gb = backward(grad, x, arg, mean, rstd, weight, has_bias, need_input, key, site)
    return (gx if need_input else None), None, gw, (gb if has_bias else None), None, None, None


_ln_op, _ln_backward_op, LayerNormCapture = capture_op(
    "layer_norm", _ln_forward, _ln_backward, _stats_setup, _stats_formula)


@_ln_op.register_fake
def _(x, normalized_shape, weight, bias, eps, key, site):  # type: ignore[no-untyped-def]
    k = len(normalized_shape)
    stat = (*x.shape[: x.dim() - k], *([1] * k))
    return torch.empty_like(x), x.new_empty(stat), x.new_empty(stat)


@_ln_backward_op.register_fake
def _(grad, x, normalized_shape, mean, rstd, weight, has_bias, need_input, key, site):  # type: ignore[no-untyped-def]
    return _fake_grads(grad, x, weight, has_bias, need_input)


def layer_norm(x: Tensor, normalized_shape: Sequence[int], weight: Tensor, bias: Optional[Tensor],
               eps: float, key: int, site: int) -> Tensor:
    """``F.layer_norm`` with affine, recording (``x [m, *positions, *normalized_shape]``).
    Autocast: as ``aten::layer_norm`` (:mod:`.amp`)."""
    x, weight, bias = cast_like_aten("aten::layer_norm", x, weight, bias)  # type: ignore[assignment]
    run = torch.ops.tengrad_fx.layer_norm if use_custom_ops() else LayerNormCapture.apply
    return run(x, list(normalized_shape), weight, bias, eps, key, site)[0]


# --------------------------------------------------------------------------- group norm
def _gn_forward(x: Tensor, num_groups: int, weight: Tensor, bias: Optional[Tensor], eps: float,
                key: int, site: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of ``aten.native_group_norm`` (statistics ``[m, groups]``)."""
    lookup(key).begin()
    N, C = x.shape[:2]
    out, mean, rstd = torch.native_group_norm(x, weight, bias, N, C, math.prod(x.shape[2:]),
                                                       num_groups, eps)
    return out, mean, rstd


def _gn_backward(grad: Tensor, x: Tensor, num_groups: int, mean: Tensor, rstd: Tensor,
                 weight: Tensor, has_bias: bool, need_input: bool, key: int,
                 site: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(∂L/∂x or [0], ∂L/∂γ, ∂L/∂β or [0])``; records (module docstring)."""
    with autocast_off(grad):
        N, C = x.shape[:2]
        gx = _gn_backward_kernel(grad, x, mean, rstd, weight, N, C, math.prod(x.shape[2:]), num_groups,
                                 [True, False, False])[0] if need_input else grad.new_empty(0)
        k = C // num_groups  # channels per group: the group's statistics per channel
        return _finish_channel_stats(lookup(key), site, grad, x, mean.repeat_interleave(k, 1),
                                     rstd.repeat_interleave(k, 1), weight, has_bias, gx)


_gn_op, _gn_backward_op, GroupNormCapture = capture_op(
    "group_norm", _gn_forward, _gn_backward, _stats_setup, _stats_formula)


@_gn_op.register_fake
def _(x, num_groups, weight, bias, eps, key, site):  # type: ignore[no-untyped-def]
    return torch.empty_like(x), x.new_empty(x.shape[0], num_groups), x.new_empty(x.shape[0], num_groups)


@_gn_backward_op.register_fake
def _(grad, x, num_groups, mean, rstd, weight, has_bias, need_input, key, site):  # type: ignore[no-untyped-def]
    return _fake_grads(grad, x, weight, has_bias, need_input)


def group_norm(x: Tensor, num_groups: int, weight: Tensor, bias: Optional[Tensor], eps: float,
               key: int, site: int) -> Tensor:
    """``F.group_norm`` with affine, recording (``x [m, C, *spatial]``). Autocast: as
    ``aten::group_norm``."""
    x, weight, bias = cast_like_aten("aten::group_norm", x, weight, bias)  # type: ignore[assignment]
    run = torch.ops.tengrad_fx.group_norm if use_custom_ops() else GroupNormCapture.apply
    return run(x, num_groups, weight, bias, eps, key, site)[0]


# --------------------------------------------------------------------------- affine (composite norms)
def _affine_forward(xhat: Tensor, weight: Tensor, bias: Optional[Tensor], channel_first: bool,
                    key: int, site: int) -> Tensor:
    """``γ ⊙ x̂ + β``, shaped as ``x̂``."""
    lookup(key).begin()
    w = bcast(weight, xhat.dim(), channel_first)
    if bias is None:
        return xhat * w
    return torch.addcmul(bcast(bias, xhat.dim(), channel_first), xhat, w)


def _affine_backward(grad: Tensor, xhat: Tensor, weight: Tensor, has_bias: bool, need_input: bool,
                     channel_first: bool, key: int, site: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(∂L/∂x̂ or [0], ∂L/∂γ, ∂L/∂β or [0])``; records (module docstring)."""
    with autocast_off(grad):
        gx = as_dtype(grad * bcast(weight, xhat.dim(), channel_first), xhat.dtype) if need_input else grad.new_empty(0)
        return _finish(lookup(key), site, grad, xhat, weight, has_bias, channel_first, gx)


def _affine_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    xhat, weight, bias, channel_first, key, site = inputs
    ctx.save_for_backward(xhat, weight)
    ctx.conf = (channel_first, bias is not None, key, site)


def _affine_formula(backward, ctx, grad):  # type: ignore[no-untyped-def]
    xhat, weight = ctx.saved_tensors
    channel_first, has_bias, key, site = ctx.conf
    need_input = ctx.needs_input_grad[0]
    gx, gw, gb = backward(grad, xhat, weight, has_bias, need_input, channel_first, key, site)
    return (gx if need_input else None), gw, (gb if has_bias else None), None, None, None


_affine_op, _affine_backward_op, AffineCapture = capture_op(
    "affine", _affine_forward, _affine_backward, _affine_setup, _affine_formula)


@_affine_op.register_fake
def _(xhat, weight, bias, channel_first, key, site):  # type: ignore[no-untyped-def]
    return torch.empty_like(xhat)


@_affine_backward_op.register_fake
def _(grad, xhat, weight, has_bias, need_input, channel_first, key, site):  # type: ignore[no-untyped-def]
    return _fake_grads(grad, xhat, weight, has_bias, need_input)


def affine(xhat: Tensor, weight: Tensor, bias: Optional[Tensor], channel_first: bool,
           key: int, site: int) -> Tensor:
    """``γ ⊙ x̂ + β`` (γ over dim 1 if ``channel_first``, else over the trailing dims), recording."""
    run = torch.ops.tengrad_fx.affine if use_custom_ops() else AffineCapture.apply
    return run(xhat, weight, bias, channel_first, key, site)
