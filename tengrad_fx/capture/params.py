"""Parameters that are not module calls: class/position tokens, layer scales, other
parameters combined with the activations by broadcasting.

A parameter ``p`` read in the graph (``get_attr``) whose every use — after shape-only
ops (``reshape``/``view``/``unsqueeze``/``flatten``) — is

* one operand of an elementwise ``add``/``sub``/``mul``/``div`` with a per-sample tensor
  ``x`` (position embeddings, layer scale ``γ``), or
* ``p.expand(B, ...)`` with ``B`` the batch size (class tokens),

is rewritten to go through ``tengrad_fx::param_batch``, which hands the consumer ``p``
broadcast along a leading batch dimension (``[m, *p_pad[1:]]``, the same values, so the
consumer computes the same output). Autograd then delivers that tensor's gradient
``[m, ...]``, already reduced over the consumer's broadcast dims; its rows, summed over
the remaining broadcast dims, are the exact per-sample gradients ``P [m, p.numel()]``
(sample ``i``'s rows of the consumer's output depend on ``p`` only through row ``i``).
The parameter's gradient is ``P.sum(0)``. That the other operand (or ``B``) follows the
batch is checked by prepare's batch-2/3 probe like every layer input. Any other use
(``matmul``, indexing, ``cat`` of the raw parameter, ...) leaves ``p`` to the fallback,
with the use named in the reason.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch import Tensor

from . import ops
from .eager import capture_op, use_custom_ops
from .context import RewriteContext
from .match import LayerSpec
from .sharing import OURS
from .store import Record, lookup

__all__ = ["rewrite_params", "batched", "expanded", "ParamHolder"]

_SHAPE_METHODS = {"reshape", "view", "unsqueeze", "flatten"}
_BINARY_FNS = {operator.add, operator.sub, operator.mul, operator.truediv,
               torch.add, torch.sub, torch.mul, torch.div}
_BINARY_METHODS = {"add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_"}


class ParamHolder:
    """Stands in for a module in the :class:`LayerSpec` of an added parameter (or of a
    projection that is a parameter pair of a bigger module, e.g. attention's in-projection)."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter] = None):
        self.weight = weight
        self.bias = bias


# --------------------------------------------------------------------------- the op
def _padded(p_shape: Sequence[int], out_shape: Sequence[int]) -> list[int]:
    return [1] * (len(out_shape) - len(p_shape)) + list(p_shape)


def _param_batch_forward(p: Tensor, out_shape: Sequence[int], key: int, site: int) -> Tensor:
    """``p`` broadcast to ``out_shape = [m, ...]`` (a contiguous copy)."""
    lookup(key).begin()
    pad = _padded(p.shape, out_shape)
    return p.reshape(pad).expand(list(out_shape)).clone(memory_format=torch.contiguous_format)


def _param_batch_backward(grad: Tensor, p_shape: Sequence[int], key: int, site: int) -> Tensor:
    """``∂L/∂p`` (``p_shape``) from ``grad [m, ...]``; records ``P [m, p.numel()]``."""
    store = lookup(key)
    m = grad.shape[0]
    pad = _padded(p_shape, grad.shape)
    P = grad.sum_to_size([m, *pad[1:]]).reshape(m, -1)
    store.record(site, Record(None, None, P, grad.new_zeros(m, 0), tuple(grad.shape)))
    if store.grad_only:
        return grad.new_zeros(list(p_shape))
    return P.sum(0).view(list(p_shape))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    p, out_shape, key, site = inputs
    ctx.conf = (list(p.shape), key, site)


def _formula(backward: Callable[..., Tensor], ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
    p_shape, key, site = ctx.conf
    return backward(grad, p_shape, key, site), None, None, None


_param_batch_op, _param_batch_backward_op, ParamBatchCapture = capture_op(
    "param_batch", _param_batch_forward, _param_batch_backward, _setup, _formula)


@_param_batch_op.register_fake
def _(p: Tensor, out_shape: Sequence[int], key: int, site: int) -> Tensor:
    return p.new_empty(list(out_shape))


@_param_batch_backward_op.register_fake
def _(grad: Tensor, p_shape: Sequence[int], key: int, site: int) -> Tensor:
    return grad.new_empty(list(p_shape))


def _run(p: Tensor, out_shape: list[int], x: Optional[Tensor], key: int, site: int,
         batch: Optional[int], name: str) -> Optional[Tensor]:
    """The batched ``p`` when capture is on, None to use ``p`` as the graph had it."""
    if ops.PROBE is not None:
        ops.PROBE[(key, site)] = tuple(out_shape)
    if not ops._active(key, p if x is None else x, p, None):
        return None
    if batch is not None and out_shape[0] != batch:
        ops._check_batch(p.new_empty(out_shape[0], 0), batch, name)
    run = torch.ops.tengrad_fx.param_batch if use_custom_ops() else ParamBatchCapture.apply
    return run(p, out_shape, key, site)


def batched(p: Tensor, x: Any, key: int, site: int, batch: Optional[int] = None, name: str = "") -> Tensor:
    """``p`` as the operand of an elementwise op with ``x [m, ...]``: ``[m, *p_pad[1:]]``."""
    if not isinstance(x, Tensor) or x.dim() < p.dim() or x.dim() == 0 or (x.dim() == p.dim() and p.shape[0] != 1):
        if ops.PROBE is not None:  # no batch dimension to add: the probe drops the layer
            ops.PROBE[(key, site)] = (-1,)
        return p
    out_shape = [x.shape[0], *_padded(p.shape, x.shape)[1:]]
    y = _run(p, out_shape, x, key, site, batch, name)
    return p if y is None else y


def expanded(p: Tensor, *sizes: int, key: int, site: int, batch: Optional[int] = None, name: str = "") -> Tensor:
    """``p.expand(*sizes)`` with ``sizes[0]`` the batch size."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    pad = _padded(p.shape, sizes)
    out_shape = [int(pad[i]) if int(s) == -1 else int(s) for i, s in enumerate(sizes)]
    if len(sizes) < p.dim() or pad[0] != 1:
        if ops.PROBE is not None:
            ops.PROBE[(key, site)] = (-1,)
        return p.expand(*sizes)
    y = _run(p, out_shape, None, key, site, batch, name)
    return p.expand(*sizes) if y is None else y


# --------------------------------------------------------------------------- the graph pass
def _uses(node: fx.Node) -> tuple[list[fx.Node], str]:
    """The consumers of ``node`` after shape-only ops, or ``([], reason)``."""
    ends = []
    for u in node.users:
        if u.op == "call_method" and u.target in _SHAPE_METHODS and u.args[0] is node:
            sub, why = _uses(u)
            if why:
                return [], why
            ends += sub
        elif u.op == "call_method" and u.target == "expand" and u.args[0] is node:
            ends.append(u)
        elif (u.op == "call_function" and u.target in _BINARY_FNS and len(u.args) == 2 and not u.kwargs) or \
                (u.op == "call_method" and u.target in _BINARY_METHODS and len(u.args) == 2
                 and not u.kwargs and u.args[0] is not node):
            if not all(isinstance(a, fx.Node) for a in u.args):
                return [], f"combined with a constant by {u.target}"
            ends.append(u)
        elif u.op == "call_function" and u.target is batched:
            return [], "combined with another added parameter (no batch dimension)"
        else:
            t = u.target if isinstance(u.target, str) else getattr(u.target, "__name__", str(u.target))
            return [], f"added parameter used by {t} (no per-sample rule)"
    return ends, ""


def rewrite_params(graph: fx.Graph, ctx: RewriteContext, batch_node: Optional[fx.Node]) -> None:
    """Rewrite each coverable added parameter's uses (module docstring); parameters with
    another use get their reason in ``ctx.refused``. The covered layers' own parameters
    (``ctx.layer_params``) are left alone."""
    params = dict(ctx.model.named_parameters())
    skip = ctx.layer_params
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.meta.get(OURS) or node.target not in params:
            continue
        name = str(node.target)
        p = params[name]
        if id(p) in skip or name in ctx.refused:
            continue
        ends, why = _uses(node)
        if why or not ends:
            ctx.refused[name] = why or "parameter never used"
            continue
        spec = ctx.layers.get(name)
        if spec is None:
            spec = ctx.layers[name] = LayerSpec(name=name, kind="param", module=ParamHolder(p))  # type: ignore[arg-type]
        for u in ends:
            site = ctx.new_site()
            spec.sites.append(site)
            kw: dict[str, Any] = dict(key=ctx.key, site=site, batch=batch_node, name=name)
            if u.target == "expand":
                with graph.inserting_before(u):
                    new = graph.call_function(expanded, tuple(u.args), kw)
                u.replace_all_uses_with(new)
                graph.erase_node(u)
                continue
            src = next(a for a in u.args if _reaches(a, node))
            assert isinstance(src, fx.Node)  # _reaches holds for nodes only
            other = u.args[1] if u.args[0] is src else u.args[0]
            with graph.inserting_before(u):
                new = graph.call_function(batched, (src, other), kw)
            u.replace_input_with(src, new)
        node.meta[OURS] = True
    graph.lint()


def _reaches(a: Any, node: fx.Node) -> bool:
    """Is ``a`` ``node`` or a shape-only op chain on it?"""
    while isinstance(a, fx.Node):
        if a is node:
            return True
        if a.op == "call_method" and a.target in _SHAPE_METHODS:
            a = a.args[0]
            continue
        return False
    return False
