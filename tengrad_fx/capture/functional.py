"""Linear/Conv subclasses whose own ``forward`` calls ``F.linear`` / ``F.conv*d`` on the
module's own ``weight`` and ``bias``.

Such a subclass is not provably its base layer, so it is not a module-call layer. The
tracer traces through its forward (:func:`traceable_override`: only if that forward traces
on its own, so one untraceable subclass cannot break the model's trace). In the graph, a
``linear`` / ``conv1d/2d/3d`` call whose weight argument is a ``get_attr`` of such a
module's ``weight`` (and whose bias argument is its ``bias``, or ``None`` when it has
none), each read by nothing but this call, is exactly the base layer applied to that call's
input: it becomes the module's capture op (:func:`rewrite_functional_layers`), with the
call's own stride/padding/dilation/groups. Anything else the forward does around the
call (padding, scaling, activations) stays as traced. A forward that transforms the weight
first (weight standardization, ``self.weight * s``) does not match: the module falls back
with the reason naming that.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import ops
from .context import RewriteContext
from .match import _BASES, LayerSpec, conv_call_args, match_module

__all__ = ["traceable_override", "rewrite_functional_layers", "note_unmatched"]

_LINEAR = {torch._C._nn.linear, F.linear}
_CONV = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3, F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_UNMATCHED = ("; traced through, but its weight/bias do not reach one F.linear/F.conv*d call unchanged "
              "(e.g. the weight is transformed first)")


def _overrides(m: nn.Module) -> bool:
    """A Linear/Conv (not transposed) subclass that match_module rejects for its forward."""
    return (isinstance(m, tuple(_BASES)) and not getattr(m, "transposed", False)
            and "overrides" in match_module(m)[1])


def traceable_override(m: nn.Module) -> bool:
    """Trace through ``m``'s forward? Only for an overriding subclass whose forward traces."""
    if not _overrides(m):
        return False
    try:
        fx.Tracer().trace(m)
    except Exception:
        return False
    return True


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _only_use(attr: Any, call: fx.Node) -> bool:
    return isinstance(attr, fx.Node) and attr.op == "get_attr" and set(attr.users) == {call}


def _match(node: fx.Node, model: nn.Module) -> Optional[tuple[str, nn.Module, str]]:
    """``(module name, module, kind)`` when ``node`` is its module's base-layer call."""
    nd = _CONV.get(node.target) if node.target in _CONV else None
    if node.op != "call_function" or (node.target not in _LINEAR and nd is None):
        return None
    w, b = _arg(node, 1, "weight", None), _arg(node, 2, "bias", None)
    if not _only_use(w, node) or not str(w.target).split(".")[-1] == "weight":
        return None
    name = str(w.target).rpartition(".")[0]
    try:
        mod = model.get_submodule(name)
    except AttributeError:
        return None
    kind, _ = match_module(mod)
    if not _overrides(mod) or kind is not None:
        return None
    want = "linear" if nd is None else f"conv{nd}d"
    if nd is None and not isinstance(mod, nn.Linear):
        return None
    if nd is not None and not (isinstance(mod, nn.modules.conv._ConvNd) and mod.weight.dim() - 2 == nd):
        return None
    if (mod.bias is None) != (b is None):
        return None
    if b is not None and not (_only_use(b, node) and b.target == (f"{name}.bias" if name else "bias")):
        return None
    return name, mod, want


def _conv_spec_args(node: fx.Node, mod: nn.Module, nd: int) -> dict[str, Any]:
    """The call's own conv arguments, normalized as :func:`conv_call_args` does."""
    def tup(v: Any) -> Any:
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd if isinstance(v, int) else v

    call = SimpleNamespace(weight=mod.weight, kernel_size=tuple(mod.weight.shape[2:]),  # type: ignore[index]
                           stride=tup(_arg(node, 3, "stride", 1)), padding=tup(_arg(node, 4, "padding", 0)),
                           dilation=tup(_arg(node, 5, "dilation", 1)), groups=_arg(node, 6, "groups", 1),
                           padding_mode="zeros")
    return conv_call_args(call)  # type: ignore[arg-type]


def rewrite_functional_layers(graph: fx.Graph, ctx: RewriteContext, batch_node: Optional[fx.Node],
                              mark: str) -> None:
    """Replace each matching ``linear``/``conv*d`` call by its module's capture op (layers
    and sites in ``ctx``)."""
    model, layers, key = ctx.model, ctx.layers, ctx.key
    for node in list(graph.nodes):
        hit = _match(node, model)
        if hit is None:
            continue
        name, mod, kind = hit
        spec = layers.get(name)
        if spec is None:
            spec = layers[name] = LayerSpec(name=name, kind=kind, module=mod)  # type: ignore[arg-type]
            if kind != "linear":
                for k, v in _conv_spec_args(node, mod, int(kind[4])).items():
                    setattr(spec, k, v)
        elif kind != "linear" and _conv_spec_args(node, mod, int(kind[4])) != {
                k: getattr(spec, k) for k in _conv_spec_args(node, mod, int(kind[4]))}:
            continue  # a second call with other conv arguments: not one layer, left as is
        site = ctx.new_site()
        spec.sites.append(site)
        x, w, b = node.args[0], _arg(node, 1, "weight", None), _arg(node, 2, "bias", None)
        for a in (w, b):
            if a is not None:
                a.meta[mark] = True
        kw: dict[str, Any] = dict(key=key, site=site, batch=batch_node, name=name)
        with graph.inserting_before(node):
            if kind == "linear":
                new = graph.call_function(ops.linear, (x, w, b), kw)
            else:
                kw.update(pre_pad=spec.pre_pad, pad_mode=spec.pad_mode)
                new = graph.call_function(ops.conv, (x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups),
                                          kw)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()


def note_unmatched(model: nn.Module, layers: dict[str, LayerSpec], fallback: dict[str, str]) -> None:
    """Say why a traced-through overriding subclass is still a fallback."""
    for name, mod in model.named_modules():
        if name not in layers and traceable_override(mod):
            for pn, _ in mod.named_parameters(prefix=name, recurse=False):
                if pn in fallback and _UNMATCHED not in fallback[pn]:
                    fallback[pn] += _UNMATCHED
