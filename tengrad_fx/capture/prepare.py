"""``prepare``: make every covered Linear/Conv (and norm, embedding, added-parameter) call site
record (I, G): the fx rewrite (:mod:`.fx_rewrite`) where torch.fx traces the model, else
module surgery (:mod:`.surgery`) verified on ``example_inputs``; then the per-sample checks and
the covered/fallback classification of every parameter."""
from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch.nn as nn

from . import attention, ops
from .._compile import keep_saved_tensors
from .info import ATTR, PrepareInfo
from .inputs import as_call
from .context import RewriteContext
from .fx_rewrite import TraceFailed, prepare_fx
from .match import LayerSpec, match_module
from .norm import NORM_KINDS
from .sharing import drop_layer, merge_tied_lookups
from .store import CaptureStore
from .added_params import check_sample_independence
from .replay import cover_by_replay
from .surgery import prepare_surgery
from .switch import capturing  # also importable from here
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
            raise TraceFailed("fully_shard (FSDP2) modules: their forwards gather their parameters, so the "
                               "covered modules are swapped in place")
        prepared, dual = prepare_fx(ctx)
    except TraceFailed as exc:
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
