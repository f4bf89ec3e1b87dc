"""``prepare``: the FX pass that makes every Linear/Conv call site record (I, G)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, cast

import torch
import torch.fx as fx
import torch.nn as nn

from . import attention, embedding, functional, norm, ops, params
from .._compile import keep_saved_tensors
from .plain_graph import compiled_forward, drop_dead_attributes, install_forward, plain_graph
from .info import ATTR, PrepareInfo, get_info
from .inputs import as_call, leading_dim
from .context import RewriteContext
from .match import LayerSpec, match_module, module_spec, pad_same_input
from .norm import NORM_KINDS
from .sharing import OURS, drop_layer, merge_tied_lookups, note_functional_uses
from .store import CaptureStore
from .added_params import check_sample_independence
from .replay import cover_by_replay
from .surgery import cover_in_leaves, prepare_surgery
from .trace import trace
from .unprepare import ORIGINAL
from .verify import drop_weights_used_uncalled, verify_samples

__all__ = ["prepare", "capturing"]


def prepare(
    model: nn.Module,
    *,
    example_inputs: Optional[Sequence[Any]] = None,
    loss_reduction: Literal["mean", "sum"] = "mean",
    only_linear_conv: bool = False,
) -> nn.Module:
    """Rewrite ``model`` so each covered Linear/Conv call records its input and output grad.

    The returned module computes the same outputs and parameter gradients, holds the
    *same* Parameter objects under the same ``state_dict`` keys, and carries a
    :class:`PrepareInfo` (see :func:`tengrad_fx.report`). No module or parameter hooks are
    registered: the capture is the rewritten graph (an MC/Gauss-Newton optimizer has its
    capturing forwards route their output through a one-shot identity site, :mod:`.output_hook`).

    Args:
        model: any ``nn.Module`` (timm and torchvision models included).
        example_inputs: the inputs of one forward call, batch first, as the model is
            called: a tuple of positional inputs (or one tensor), a dict of keyword inputs
            (``model(**batch)``, e.g. a Hugging Face batch), or ``(args, kwargs)``; each
            input may be a tensor or nested tuples/lists/dicts/namedtuples/dataclasses of
            them. With
            them, each layer's sample dimension is verified by running the graph at batch
            sizes 2 and 3: the batch is the leading dim of the first tensor leaf, and every
            tensor leaf with that leading dim is resized (the others, and non-tensor
            leaves such as ints, strings or None, are passed unchanged). A layer whose
            input does not follow the batch (a folded batch, a constant grid) becomes an
            SGD fallback. Without them the check runs at every capturing forward (against
            the leading dim of the first tensor leaf of the inputs) and raises instead.
        loss_reduction: ``"mean"`` if the training loss averages over the batch (then
            per-sample gradients are ``m`` times the captured ones), ``"sum"`` otherwise.
        only_linear_conv: cover only Linear/Conv calls; norm layers and added parameters
            (tokens, layer scales) are left to the fallback (for comparisons).

    Example::

        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> net = tengrad_fx.prepare(net, example_inputs=(torch.randn(5, 4),))
        >>> print(tengrad_fx.report(net))  # doctest: +SKIP
    """
    _check_arguments(model, loss_reduction)
    if example_inputs is not None:
        example_inputs = as_call(example_inputs)
    candidates, fallback = _candidates(model, only_linear_conv)
    info = PrepareInfo(layers=[], covered={}, fallback=fallback, store=CaptureStore(n_sites=0),
                       loss_reduction=loss_reduction, method="fx", verified=example_inputs is not None)
    prepared = _rewritten(model, candidates, info, example_inputs, added_params=not only_linear_conv)
    prepared.__dict__[ATTR] = info
    ops.ENABLED[info.store.key] = True
    keep_saved_tensors()  # a compiled backward of this model may run twice (MC Fisher)
    if example_inputs is not None:
        _verify(prepared, info, example_inputs, replay=not only_linear_conv)
    info.layers = merge_tied_lookups(info.layers, info.store)
    info.store.site_names = {site: spec.name for spec in info.layers for site in spec.sites}
    info.store.params = [p for spec in info.layers for p in (spec.weight, spec.bias) if p is not None]
    info.store.transposed_sites = frozenset(site for spec in info.layers if spec.kind == "linear" and spec.transposed
                                            for site in spec.sites)
    _classify_params(model, info)
    return prepared


def _check_arguments(model: nn.Module, loss_reduction: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare() expects an nn.Module, got {type(model).__name__}")
    if ATTR in model.__dict__:
        raise ValueError("model is already prepared")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")


def _fully_sharded(model: nn.Module) -> bool:
    """Does ``model`` hold a module sharded by ``torch.distributed.fsdp.fully_shard``?"""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return False
    return any(isinstance(mod, FSDPModule) for mod in model.modules())


def _candidates(model: nn.Module, only_linear_conv: bool) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """The modules to cover, by name, and ``parameter name -> reason`` for the parameters of
    the modules left out."""
    fallback: dict[str, str] = {}
    candidates: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        kind, why = match_module(mod)
        if kind in NORM_KINDS and only_linear_conv:
            kind, why = None, "norm layer left out (prepare(only_linear_conv=True))"
        if kind is not None:
            candidates[name] = mod
        elif why:
            for pn, _ in mod.named_parameters(prefix=name, recurse=False):
                fallback[pn] = why
    for name in attention.functional_children(model):  # F.linear on its weight inside the attention
        if candidates.pop(name, None) is not None:
            for pn, _ in model.get_submodule(name).named_parameters(prefix=name, recurse=False):
                fallback[pn] = ("attention out-projection called functionally "
                                "(covered only via an fx-rewritten attention call)")
    if not candidates:
        why = "".join(sorted({f"; {r}" for r in fallback.values()}))
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear or nn.Conv1d/2d/3d (or norm) layer to cover{why}; "
            "use a plain torch.optim optimizer for it"
        )
    return candidates, fallback


def _rewritten(model: nn.Module, candidates: dict[str, nn.Module], info: PrepareInfo,
               example_inputs: Optional[Sequence[Any]], added_params: bool) -> nn.Module:
    """The fx-rewritten model, else (tracing failed, ``example_inputs`` given) ``model``
    itself after module surgery; fills ``info``'s layers, store, method and trace error."""
    ctx = RewriteContext(model=model, store=info.store, candidates=candidates, fallback=info.fallback,
                         runtime_batch=example_inputs is None, added_params=added_params)
    try:
        if _fully_sharded(model):  # FSDP2's hooks gather each module's parameters: its forward must run
            raise _TraceFailed("fully_shard (FSDP2) modules: their forwards gather their parameters, so the "
                               "covered modules are swapped in place")
        prepared, dual = _prepare_fx(ctx)
    except _TraceFailed as exc:
        if example_inputs is None:
            raise RuntimeError(
                f"tengrad_fx.prepare: torch.fx could not trace {type(model).__name__}: {exc.reason}. "
                "Pass example_inputs=(...) to prepare() to use the module-surgery fallback, whose "
                "per-sample structure is verified on those inputs."
            ) from exc.__cause__
        info.layers = prepare_surgery(model, candidates, info.fallback, info.store, added_params=added_params)
        info.method, info.trace_error = "surgery", exc.reason
        return model
    info.layers = list(ctx.layers.values())
    info.method = "fx-dual" if dual else "fx"
    return prepared


def _verify(prepared: nn.Module, info: PrepareInfo, example_inputs: Sequence[Any], replay: bool) -> None:
    """Drop the layers whose inputs (or added parameters' uses) are not per sample on
    ``example_inputs``, and the modules inside leaves that never ran; with ``replay``, cover
    what remains uncovered by replaying a module that uses it, where one replays exactly."""
    verify_samples(prepared, info, example_inputs)
    check_sample_independence(prepared, info.layers, info.store, example_inputs)
    for spec in info.layers:
        if spec.in_leaf and spec.sites and not spec.input_shapes:
            drop_layer({spec.name: spec}, spec.name, "module not called as a layer in the traced graph "
                       "(inside a leaf module or used functionally)")
    drop_weights_used_uncalled(prepared, info, example_inputs)
    if replay:
        cover_by_replay(prepared, info, example_inputs)


class _TraceFailed(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------- fx path
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
                raise _TraceFailed(f"{type(exc).__name__}: {exc}") from exc
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


def _prepare_fx(ctx: RewriteContext) -> tuple[fx.GraphModule, bool]:
    """The fx-rewritten model, and whether it has a separate eval graph; fills ``ctx``.
    Raises :class:`_TraceFailed` when torch.fx cannot trace ``ctx.model``."""
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


def _classify_params(model: nn.Module, info: PrepareInfo) -> None:
    """Fill ``info.covered`` / ``info.fallback`` for every parameter of ``model``."""
    by_id: dict[int, tuple[LayerSpec, bool]] = {}
    for spec in info.layers:
        ok = bool(spec.sites)
        by_id[id(spec.weight)] = (spec, ok)
        if spec.bias is not None:
            by_id[id(spec.bias)] = (spec, ok)
    owner_of: dict[str, nn.Module] = {}
    for mod_name, mod in model.named_modules():
        for pn, _ in mod.named_parameters(prefix=mod_name, recurse=False):
            owner_of[pn] = mod
    for pn, p in model.named_parameters():
        if id(p) in by_id:
            spec, ok = by_id[id(p)]
            if ok:
                info.covered[pn] = spec.name
                info.fallback.pop(pn, None)
            else:
                info.fallback[pn] = spec.param_reasons.get(id(p), spec.fallback_reason or "never called in forward")
        elif pn not in info.fallback:
            owner = owner_of.get(pn)
            kind, _ = match_module(owner) if owner is not None else (None, "")
            if kind is not None:
                info.fallback[pn] = ("module not called as a layer in the traced graph "
                                     "(inside a leaf module or used functionally)")
            else:
                info.fallback[pn] = f"{type(owner).__name__ if owner is not None else '?'}: no capture kernel"
    # fallback layers' calls still run the capture op: make them record nothing
    info.store.ignored_sites = {site for s in info.layers for site in s.dropped_sites}
    info.layers = [s for s in info.layers if s.sites]


class capturing:
    """Switch capture on or off for a prepared model; restores on exit when used in ``with``.

    ``tengrad_fx.capturing(model, False)`` turns capture off until turned on again;
    ``with tengrad_fx.capturing(model, False): ...`` turns it off for the block only.
    While off (and under ``torch.no_grad()``), covered layers run plain aten ops and no
    tensor is retained.
    """

    def __init__(self, model: nn.Module, enabled: bool = True):
        key = get_info(model).store.key
        self._key, self._prev = key, ops.ENABLED.get(key, False)
        ops.ENABLED[key] = bool(enabled)

    def __enter__(self) -> "capturing":
        return self

    def __exit__(self, *exc: object) -> None:
        ops.ENABLED[self._key] = self._prev
