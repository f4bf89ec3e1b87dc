"""The fx path of ``prepare``: trace the model in train and eval mode, replace each covered
module call (and, with added parameters, functional layer calls, attention calls and added
parameters) by a capture-op call, and install the rewritten graphs' forward on a
GraphModule sharing the model's children and tensors."""
from __future__ import annotations

from typing import Any, Optional, Sequence, cast

import torch
import torch.fx as fx
import torch.nn as nn

from . import attention, embedding, functional, norm, ops, params
from .context import RewriteContext
from .inputs import leading_dim
from .match import LayerSpec, module_spec, pad_same_input
from .norm import NORM_KINDS
from .plain_graph import compiled_forward, drop_dead_attributes, install_forward, plain_graph
from .sharing import OURS, drop_layer, note_functional_uses
from .surgery import cover_in_leaves
from .trace import trace
from .unprepare import ORIGINAL

__all__ = ["TraceFailed", "prepare_fx"]


class TraceFailed(Exception):
    """torch.fx could not trace the model (``reason``): ``prepare`` falls back to module surgery."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


Consts = dict[str, torch.Tensor]


def _trace_modes(model: nn.Module) -> tuple[fx.Graph, Optional[fx.Graph], Consts, Consts]:
    """Trace in train and eval mode; the second graph only if the code differs.

    The tracer stores tensor constants it meets (``_tensor_constant0`` ...) as attributes
    of ``model``; they are taken off the model again and returned per graph (the eval
    graph's renamed ``_eval_*`` so that both can live on one module)."""
    was_training = model.training
    graphs = {}
    consts: dict[bool, Consts] = {}
    try:
        for mode in (True, False):
            model.train(mode)
            before = set(model.__dict__)
            try:
                graphs[mode] = trace(model)
            except Exception as exc:
                raise TraceFailed(f"{type(exc).__name__}: {exc}") from exc
            finally:
                consts[mode] = {k: model.__dict__.pop(k) for k in set(model.__dict__) - before}
    finally:
        model.train(was_training)
    g_train, g_eval = graphs[True], graphs[False]
    if g_train.python_code("self").src == g_eval.python_code("self").src:
        return g_train, None, consts[True], {}
    for node in g_eval.nodes:
        if node.op == "get_attr" and node.target in consts[False]:
            node.target = "_eval" + str(node.target)
    return g_train, g_eval, consts[True], {"_eval" + k: v for k, v in consts[False].items()}


def _graph_module(model: nn.Module, graph: fx.Graph, consts: Consts) -> fx.GraphModule:
    """A GraphModule over ``graph`` that shares ALL of ``model``'s children and tensors.

    Tensors the graph reads that are not ``model``'s parameters or buffers (tracer
    constants, plain tensor attributes) become non-persistent buffers of the GraphModule,
    so ``state_dict`` keys do not change and ``.to()`` moves them."""
    model.__dict__.update(consts)
    try:
        gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    finally:
        for k in consts:
            model.__dict__.pop(k, None)
    extra = {k: v for k, v in gm._buffers.items() if k not in model._buffers}
    gm._modules = dict(model._modules)
    gm._parameters = dict(model._parameters)
    gm._buffers = dict(model._buffers)
    gm._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
    for k, v in extra.items():
        gm.register_buffer(k, v, persistent=False)
    gm.train(model.training)
    return gm


def _rewrite(graph: fx.Graph, ctx: RewriteContext) -> None:
    """Replace each ``call_module`` of a candidate by a capture-op call.

    Candidates also called with another signature are collected in ``ctx.odd`` (their
    other calls are not captured, so they must fall back)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    batch = None
    if ctx.runtime_batch and placeholders:
        with graph.inserting_after(placeholders[-1]):
            batch = graph.call_function(leading_dim, tuple(placeholders))
    for node in list(graph.nodes):
        if node.op != "call_module" or node.target not in ctx.candidates:
            continue
        name = str(node.target)
        mod = ctx.candidates[name]
        x_arg, out_size = _call_arguments(node, mod)
        if x_arg is None:
            ctx.odd.add(name)  # unusual call signature: leave it, its params fall back
            continue
        spec = ctx.layers.get(name)
        if spec is None:
            spec = ctx.layers[name] = module_spec(name, mod)
        site = ctx.new_site()
        spec.sites.append(site)
        kw: dict[str, Any] = dict(key=ctx.key, site=site, batch=batch, name=name)
        with graph.inserting_before(node):
            if spec.kind in NORM_KINDS:
                new = graph.call_function(norm.norm, (x_arg, _own_attr(graph, name)), kw)
            elif spec.kind == "embedding":
                assert isinstance(mod, nn.Embedding)  # match_embedding covers nothing else
                w = _own_attr(graph, f"{name}.weight" if name else "weight")
                new = graph.call_function(embedding.embedding, (x_arg, w, mod.padding_idx), kw)
            else:
                new = _linear_conv_call(graph, spec, mod, x_arg, out_size, kw)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()


def _own_attr(graph: fx.Graph, target: str) -> fx.Node:
    """A ``get_attr`` node of a capture call's own argument (not a use outside the layer)."""
    node = graph.get_attr(target)
    node.meta[OURS] = True
    return node


def _linear_conv_call(graph: fx.Graph, spec: LayerSpec, mod: nn.Module, x_arg: fx.node.Argument,
                      out_size: Any, kw: dict[str, Any]) -> fx.Node:
    """The capture-op call (:func:`.ops.linear` / :func:`.ops.conv`) of a Linear or Conv
    layer's call on ``x_arg``; ``kw``: the capture arguments (key, site, batch, name)."""
    prefix = f"{spec.name}." if spec.name else ""
    w = _own_attr(graph, f"{prefix}weight")
    b = _own_attr(graph, f"{prefix}bias") if spec.bias is not None else None
    if spec.kind == "linear":
        if spec.transposed:  # Hugging Face Conv1D: weight [d_in, d_out]
            kw.update(transposed=True)
        return graph.call_function(ops.linear, (x_arg, w, b), kw)
    assert isinstance(mod, nn.modules.conv._ConvNd)  # every conv kind of match_module
    kw.update(pre_pad=spec.pre_pad, pad_mode=spec.pad_mode)
    if spec.transposed:
        out_padding: Any = spec.output_padding
        if out_size is not None:  # computed at run time, as torch does
            out_padding = graph.call_function(_transposed_output_padding, (
                x_arg, out_size, spec.stride, spec.padding, tuple(mod.kernel_size), spec.dilation))
        kw.update(transposed=True, output_padding=out_padding)
    x = x_arg
    if spec.dynamic_same:
        x = graph.call_function(pad_same_input, (x_arg, tuple(mod.weight.shape[2:]), spec.stride, spec.dilation))
    return graph.call_function(ops.conv, (x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups), kw)


def _call_arguments(node: fx.Node, mod: nn.Module) -> tuple[Any, Any]:
    """``(input, output_size)`` of a covered module's call, or ``(None, None)`` for any other
    signature. ``output_size`` (positional or keyword) only for ConvTransposeNd."""
    args, kwargs = list(node.args), dict(node.kwargs)
    out_size = None
    if getattr(mod, "transposed", False):
        if len(args) == 2:
            out_size = args.pop()
        elif len(args) == 1 and set(kwargs) == {"output_size"}:
            out_size = kwargs.pop("output_size")
    if len(args) != 1 or kwargs:
        return None, None
    return args[0], out_size


def _transposed_output_padding(x: torch.Tensor, output_size: Sequence[int], stride: Sequence[int],
                               padding: Sequence[int], kernel_size: Sequence[int],
                               dilation: Sequence[int]) -> list[int]:
    """``output_padding`` of ``ConvTransposeNd(x, output_size)``, computed as torch does
    (torch's method reads nothing from the module when ``output_size`` is given)."""
    no_module = cast(nn.modules.conv._ConvTransposeNd, None)  # read only without output_size
    return nn.modules.conv._ConvTransposeNd._output_padding(
        no_module, x, list(output_size), list(stride), list(padding), list(kernel_size),
        len(stride), list(dilation))


def _batch_node(graph: fx.Graph) -> Optional[fx.Node]:
    return next((n for n in graph.nodes if n.op == "call_function" and n.target is leading_dim), None)


def prepare_fx(ctx: RewriteContext) -> tuple[fx.GraphModule, bool]:
    """The fx-rewritten model, and whether it has a separate eval graph; fills ``ctx``.
    Raises :class:`TraceFailed` when torch.fx cannot trace ``ctx.model``."""
    model = ctx.model
    g_train, g_eval, c_train, c_eval = _trace_modes(model)
    def rewritten(node: fx.Node) -> bool:  # as _rewrite: a candidate called with its input only
        mod = ctx.candidates.get(str(node.target))
        return mod is not None and _call_arguments(node, mod)[0] is not None
    plain = [plain_graph(g, model, rewritten, ctx.added_params) if g is not None else None for g in (g_train, g_eval)]
    _rewrite_graph(g_train, ctx)
    gm = _graph_module(model, g_train, c_train)
    eval_forward = None
    if g_eval is not None:
        _rewrite_graph(g_eval, ctx)
        gm_eval = _graph_module(model, g_eval, c_eval)
        for k, v in gm_eval._buffers.items():  # the eval graph runs on gm: give it gm_eval's extras
            if k not in gm._buffers and v is not None:
                gm.register_buffer(k, v, persistent=False)
        eval_forward = type(gm_eval).forward
        gm.__dict__["_tengrad_eval_graph"] = gm_eval.graph
    plain_fwd = [compiled_forward(gm, g) if g is not None else None for g in plain]
    install_forward(gm, ctx.key, eval_forward, plain_fwd[0], plain_fwd[1] if g_eval is not None else plain_fwd[0])
    if not ctx.runtime_batch:  # verified on example_inputs: modules inside leaves too
        cover_in_leaves({k: v for k, v in ctx.candidates.items() if k not in ctx.odd}, ctx)
    gm.__dict__[ORIGINAL] = model  # for unprepare()
    note_functional_uses(gm, g_train, g_eval, ctx.layers, ctx.fallback)
    if ctx.added_params:
        functional.note_unmatched(model, ctx.layers, ctx.fallback)
    _drop_odd_and_refused(ctx)
    return gm, g_eval is not None


def _rewrite_graph(graph: fx.Graph, ctx: RewriteContext) -> None:
    """Every rewrite of one traced graph: covered module calls, then (``ctx.added_params``)
    functional layer calls, exact attention calls and added parameters."""
    _rewrite(graph, ctx)
    if ctx.added_params:
        for rewrite in (functional.rewrite_functional_layers, attention.rewrite_attention):
            rewrite(graph, ctx, _batch_node(graph), OURS)
        params.rewrite_params(graph, ctx, _batch_node(graph))
    drop_dead_attributes(graph)


def _drop_odd_and_refused(ctx: RewriteContext) -> None:
    """Uncover the candidates also called with another signature (``ctx.odd``) and the
    added parameters a graph could not cover (``ctx.refused``), with their reasons."""
    for name in ctx.odd:
        if name not in ctx.layers:  # every call unusual: no layer was made
            for pn, _ in ctx.candidates[name].named_parameters(prefix=name, recurse=False):
                ctx.fallback[pn] = "module called with keyword or extra arguments (not captured)"
        drop_layer(ctx.layers, name, "module also called with keyword or extra arguments (that call is not captured)")
    for name, why in ctx.refused.items():  # e.g. coverable in the train graph, not in the eval graph
        drop_layer(ctx.layers, name, why)
        ctx.fallback.setdefault(name, why)
