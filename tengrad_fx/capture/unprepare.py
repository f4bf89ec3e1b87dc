"""``unprepare``: the model :func:`tengrad_fx.prepare` was given, back, for deployment.

What ``prepare`` returned, and what ``unprepare`` returns:

* **FX path** (``PrepareInfo.method`` ``"fx"`` / ``"fx-dual"``): ``prepare`` returned a
  ``GraphModule`` that shares every child module, Parameter and buffer of the original
  module and keeps that module (:data:`ORIGINAL`). ``unprepare`` returns the *original
  module object*: its own class and ``forward`` (a Hugging Face model keeps ``generate``),
  with the prepared module's current root entries (parameters, buffers, children: new
  ones after ``.to()``, ``load_state_dict(assign=True)`` or a replaced child) and its
  train/eval flag. Covered
  modules inside an fx leaf, whose classes ``prepare`` swapped, get their classes back.
* **Module surgery** (``"surgery"``: the model could not be traced, e.g. ``prepare(DDP(model))``
  or a Hugging Face model): ``prepare`` changed the model in place; ``unprepare`` restores
  every swapped class (covered layers, modules holding added parameters, the root) and
  removes the attributes it set, and returns the same object.

Either way the result holds the same Parameter and buffer objects under the same
``state_dict`` keys, runs no capture op, and refers to nothing of ``tengrad_fx``: it
deep-copies, pickles, and goes through ``torch.jit.trace`` and ``torch.export`` as the
model did before ``prepare`` (its exported program holds aten ops only and loads without
``tengrad_fx``). The prepared module is spent: its capture state is released, it is no
longer prepared, and a GraphModule of the FX path runs its plain program; train further
with ``prepare(unprepare(model))`` and a new optimizer.
"""
from __future__ import annotations

import torch.nn as nn

from . import ops
from .info import ATTR, get_info
from .output_hook import _MUTED, want_output
from .folded_rows import FOLDS
from .swapped import restore_class

__all__ = ["unprepare", "ORIGINAL"]

# the FX path's prepared GraphModule keeps the module it was made from under this key
ORIGINAL = "_tengrad_original"


def unprepare(model: nn.Module) -> nn.Module:
    """The module given to :func:`tengrad_fx.prepare`, without capture (module docstring).

    Args:
        model: the module ``prepare`` returned (or its ``torch.compile`` wrapper).

    Returns:
        the unprepared module: for the FX path the original module object, for module
        surgery ``model`` itself with its classes restored; the same Parameter objects.

    Raises:
        ValueError: ``model`` is not a prepared module.

    Example::

        >>> net = tengrad_fx.prepare(net, example_inputs=(x,))  # doctest: +SKIP
        >>> ...  # train with TENGraD
        >>> net = tengrad_fx.unprepare(net)  # doctest: +SKIP
        >>> torch.export.save(torch.export.export(net.eval(), (x,)), "net.pt2")  # doctest: +SKIP
    """
    prepared = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    inner = getattr(prepared, "module", None)
    if ATTR not in prepared.__dict__ and isinstance(inner, nn.Module) and ATTR in inner.__dict__:
        raise ValueError(f"unprepare() expects the module prepare() returned; {type(prepared).__name__} "
                         "wraps it: pass model.module")
    info = get_info(prepared)
    if info.method == "surgery":
        root = prepared
    else:
        root = prepared.__dict__.get(ORIGINAL)
        if not isinstance(root, nn.Module):
            raise ValueError(f"{type(prepared).__name__}: this prepared module does not hold the module it was "
                             "made from (prepared by an older tengrad_fx?); save its state_dict and load it "
                             "into a new instance of the model instead")
        _take_root_state(root, prepared)
    for mod in root.modules():
        restore_class(mod)
    _release(info.store.key)
    info.store.clear()
    prepared.__dict__.pop(ATTR, None)
    prepared.__dict__.pop(ORIGINAL, None)
    return root


def _take_root_state(root: nn.Module, prepared: nn.Module) -> None:
    """Give ``root`` the prepared module's current entries of ``root``'s own parameters,
    buffers and children (the same objects unless replaced after ``prepare``; a buffer is
    a new tensor after ``prepared.to(...)``) and its train/eval flag."""
    for own, current in ((root._parameters, prepared._parameters), (root._buffers, prepared._buffers),
                         (root._modules, prepared._modules)):
        for name in own:
            if name in current:
                own[name] = current[name]  # type: ignore[assignment]
    root.training = prepared.training


def _release(key: int) -> None:
    """Forget every global entry of the capture store ``key`` (the prepared forward then
    runs its plain program)."""
    ops.ENABLED.pop(key, None)
    ops.SAMPLES.pop(key, None)
    ops.NEEDS_SAMPLES.pop(key, None)
    ops.SHARED_INDEX_SITES.pop(key, None)
    for k in [k for k in FOLDS if k[0] == key]:
        del FOLDS[k]
    want_output(key, None)
    _MUTED.discard(key)
