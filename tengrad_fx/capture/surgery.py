"""The module-surgery fallback: when torch.fx cannot trace a model, covered modules'
classes are swapped for capturing subclasses (in place; needs ``example_inputs``); the root's
class for one that hands its output to :func:`.output_hook.maybe_attach` on capturing forwards."""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from . import embedding, norm, ops
from .added_params import cover_added_params
from .context import RewriteContext
from .experts import cover_experts
from .routers import cover_routers
from .inputs import leading_dim
from .lookups import cover_overriding_lookups
from .match import LayerSpec, module_spec, pad_same_input
from .norm import NORM_KINDS
from .output_hook import maybe_attach
from .scored import note_scored
from .sharing import note_tied, param_owners
from .store import CaptureStore
from .swapped import swapped_class

__all__ = ["prepare_surgery", "cover_in_leaves"]


def prepare_surgery(model: nn.Module, candidates: dict[str, nn.Module], fallback: dict[str, str],
                    store: CaptureStore, added_params: bool = True) -> list[LayerSpec]:
    """Tracing failed: swap each covered module's class for a capturing subclass (and, with
    ``added_params``, other modules' ``[1, ...]`` parameters: :mod:`.added_params`), in place.
    Returns the layers; their sites count on from ``store.n_sites``."""
    layers = []
    for name, mod in candidates.items():
        spec = module_spec(name, mod, sites=[store.n_sites])
        store.n_sites += 1
        mod.__class__ = _capturing_class(type(mod))
        mod.__dict__["_tengrad_call"] = (store.key, spec)
        layers.append(spec)
    covered = {id(p) for mod in candidates.values() for p in mod.parameters(recurse=False)}
    layers += cover_experts(model, covered, fallback, store)
    layers += cover_routers(model, covered, fallback, store)
    if added_params:
        layers += cover_added_params(model, covered, fallback, store)
    layers += cover_overriding_lookups(model, fallback, store)
    model.__class__ = _output_class(type(model))
    model.__dict__["_tengrad_output_key"] = store.key
    note_tied(model, {spec.name: spec for spec in layers}, param_owners(layers))
    return layers


def cover_in_leaves(candidates: dict[str, nn.Module], ctx: RewriteContext) -> None:
    """Covered modules the fx graph does not call (they run inside a module it keeps as a
    leaf, e.g. timm's untraceable attention): their classes are swapped as module surgery
    does, with sites of the graph's store. Marked ``in_leaf``: ``prepare``'s probe drops
    those that never run (a weight used functionally, not through its module)."""
    for name, mod in candidates.items():
        if name in ctx.layers:
            continue
        spec = ctx.layers[name] = module_spec(name, mod, sites=[ctx.new_site()], in_leaf=True)
        mod.__class__ = _capturing_class(type(mod))
        mod.__dict__["_tengrad_call"] = (ctx.key, spec)


def _capturing_forward(self: Any, input: Tensor, output_size: Optional[Sequence[int]] = None) -> Tensor:
    # self: a covered module whose class _capturing_class swapped; torch's argument names
    x = input
    key, spec = self.__dict__["_tengrad_call"]
    if not spec.sites:  # dropped to the fallback (tied, or input not per sample): plain layer
        return self._tengrad_base.forward(self, x, *([output_size] if output_size is not None else []))
    if spec.kind in NORM_KINDS:
        return norm.norm(x, self, key, spec.sites[0], name=spec.name)
    if spec.kind == "embedding":
        return embedding.embedding(x, self.weight, self.padding_idx, key, spec.sites[0], name=spec.name)
    if spec.kind == "linear":
        return ops.linear(x, self.weight, self.bias, key, spec.sites[0], name=spec.name, transposed=spec.transposed)
    extra: dict[str, Any] = {}
    if spec.transposed:  # ConvTransposeNd.forward(input, output_size=None)
        nd = self.weight.dim() - 2
        op = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, nd, self.dilation)
        extra = dict(transposed=True, output_padding=tuple(op))
    if spec.dynamic_same:
        x = pad_same_input(x, tuple(self.weight.shape[2:]), spec.stride, spec.dilation)
    return ops.conv(x, self.weight, self.bias, spec.stride, spec.padding, spec.dilation, spec.groups,
                    key, spec.sites[0], pre_pad=spec.pre_pad, pad_mode=spec.pad_mode, name=spec.name, **extra)


def _capturing_class(cls: type) -> type:
    return swapped_class("layer", cls, {"forward": _capturing_forward, "_tengrad_capturing": True,
                                        "_tengrad_base": cls})


def _output_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    key = self.__dict__["_tengrad_output_key"]
    if ops.NEEDS_SAMPLES.get(key, False):  # shared position ids, added parameters
        ops.SAMPLES[key] = leading_dim(args, kwargs)
    out = self._tengrad_root_forward(*args, **kwargs)
    if ops.ENABLED.get(key, False) and torch.is_grad_enabled():
        note_scored(key, self, kwargs, out)
        out = maybe_attach(key, out)
    return out


def _output_class(cls: type[nn.Module]) -> type:
    """``cls`` whose forward passes its output to :func:`.output_hook.maybe_attach`. The
    forward keeps ``cls.forward``'s name, docstring and signature (``__wrapped__``), which
    callers inspect (the Hugging Face ``Trainer`` keeps only the batch keys it names)."""
    forward = functools.wraps(cls.forward)(lambda self, *args, **kwargs: _output_forward(self, *args, **kwargs))
    covered = cls.__dict__.get("_tengrad_capturing", False)  # a covered root stays one
    return swapped_class("output", cls, {"forward": forward, "_tengrad_root_forward": cls.forward,
                                         "_tengrad_capturing": covered})
