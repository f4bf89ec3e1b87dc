"""``nn.Embedding`` subclasses whose own ``forward`` wraps the base lookup (module surgery).

Learned positions with an offset (OPT's ``OPTLearnedPositionalEmbedding``:
``super().forward(position_ids + 2)`` on positions computed from the attention mask) and
scaled token embeddings (Gemma's and BART's ``...ScaledWordEmbedding``:
``super().forward(ids) * embed_scale``) override ``forward``, so the module is not provably
``nn.Embedding``. It is provably a lookup when, traced by ``torch.fx`` (every argument that
defaults to ``None`` traced both as ``None`` and as a tensor, in train and eval mode), its
forward calls the base ``nn.Embedding.forward`` exactly once and reads ``weight`` nowhere else but for metadata
(dtype, shape): whatever it computes on the indices before, and on the looked-up rows after,
is then outside the weight's gradient path, and the lookup's own ``(idx, G)`` with
``G = ∂L/∂(looked-up rows) [m, *positions, D]`` give the exact per-sample gradients, as for
``nn.Embedding`` (:mod:`.embedding`).

Such a module keeps its forward; its class gets a base between it and ``nn.Embedding``
(:class:`_Lookup`) whose ``forward`` is the capture op, so its ``super().forward`` call is
the layer call. A tied pair (a scaled input embedding sharing its weight with the output
Linear) is then one block as for ``nn.Embedding`` (:mod:`.sharing`).
"""
from __future__ import annotations

import inspect
import itertools
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import embedding
from .match import LayerSpec
from .sharing import META_ATTRS, META_METHODS
from .store import CaptureStore
from .swapped import swapped_class

__all__ = ["overriding_lookup", "cover_overriding_lookups", "lookup_marker"]

_TRACING = [False]


def lookup_marker(idx: Tensor, weight: Tensor) -> Tensor:
    """The base lookup as one graph node while :func:`overriding_lookup` traces."""
    return F.embedding(idx, weight)


fx.wrap("lookup_marker")


class _Lookup(nn.Embedding):
    """The base of a routed class: ``nn.Embedding.forward`` as the capture op."""

    def forward(self, input: Tensor) -> Tensor:
        if _TRACING[0]:
            return lookup_marker(input, self.weight)
        key, spec = self.__dict__["_tengrad_lookup"]
        if not spec.sites:  # dropped to the fallback
            return nn.Embedding.forward(self, input)
        return embedding.embedding(input, self.weight, self.padding_idx, key, spec.sites[0], name=spec.name)


def _routed(cls: type) -> type:
    """``cls`` with :class:`_Lookup` between it and ``nn.Embedding`` in its MRO."""
    return swapped_class("lookup", cls, {"_tengrad_capturing": True}, bases=(_Lookup,))


def _one_lookup(graph: fx.Graph) -> bool:
    """One :func:`lookup_marker` call on ``weight``, which nothing else reads the value of."""
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is lookup_marker]
    if len(calls) != 1 or any(n.op == "call_function" and n.target is F.embedding for n in graph.nodes):
        return False
    weights = [n for n in graph.nodes if n.op == "get_attr" and n.target == "weight"]
    for w in weights:
        if any(not _metadata(u) for u in w.users if u is not calls[0]):
            return False
    return calls[0].args[1] in weights


def _metadata(user: fx.Node) -> bool:
    """Does ``user`` read only the weight's metadata (``weight.dtype``, ``weight.size()``)?"""
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) > 1 and user.args[1] in META_ATTRS
    return user.op == "call_method" and user.target in META_METHODS


def overriding_lookup(mod: nn.Module) -> str:
    """``""`` when ``mod`` is an ``nn.Embedding`` subclass whose forward provably wraps one
    base lookup (module docstring), else why not."""
    cls = type(mod)
    if not isinstance(mod, nn.Embedding) or cls.forward is nn.Embedding.forward:
        return "not an overriding Embedding subclass"
    if mod.max_norm is not None or mod.scale_grad_by_freq or mod.sparse or not isinstance(mod.weight, nn.Parameter):
        return f"{cls.__name__}: Embedding options without a capture path"
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    optional = [p.name for p in params if p.default is None][:3]
    was, training = mod.__class__, mod.training
    mod.__class__ = _routed(was)
    _TRACING[0] = True
    try:
        for mode, nones in itertools.product((False, True), itertools.product((False, True), repeat=len(optional))):
            mod.training = mode
            concrete = {n: None for n, none in zip(optional, nones) if none}
            if not _one_lookup(fx.Tracer().trace(mod, concrete_args=concrete or None)):
                return (f"{cls.__name__} overrides Embedding.forward (not provably exact: its weight is not used "
                        "by exactly one base lookup)")
    except Exception as e:
        return f"{cls.__name__} overrides Embedding.forward (not provably exact: it does not trace, {type(e).__name__})"
    finally:
        _TRACING[0] = False
        mod.__class__, mod.training = was, training
    return ""


def cover_overriding_lookups(model: nn.Module, fallback: dict[str, str], store: CaptureStore) -> list[LayerSpec]:
    """An ``"embedding"`` layer for each provable overriding lookup of ``model`` (its class
    routed, module docstring); the others keep their reason in ``fallback``."""
    layers = []
    for name, mod in model.named_modules():
        pn = f"{name}.weight" if name else "weight"
        if not isinstance(mod, nn.Embedding) or pn not in fallback or overriding_lookup(mod):
            if isinstance(mod, nn.Embedding) and pn in fallback and "overrides" in fallback[pn]:
                fallback[pn] = overriding_lookup(mod) or fallback[pn]
            continue
        spec = LayerSpec(name=name, kind="embedding", module=mod, sites=[store.n_sites])
        store.n_sites += 1
        mod.__class__ = _routed(type(mod))
        mod.__dict__["_tengrad_lookup"] = (store.key, spec)
        del fallback[pn]
        layers.append(spec)
    return layers
