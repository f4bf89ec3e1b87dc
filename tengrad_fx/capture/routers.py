"""Mixture-of-experts routers: a weight ``[E, d]`` applied to the batch folded to token rows.

A router (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ...) computes
``logits = F.linear(hidden_states.reshape(-1, d), self.weight)`` on the block input folded
to rows ``[m·T, d]`` (row ``r`` belongs to sample ``r // T``), then a softmax and a top-k
that do not read the weight. Sample ``i``'s gradient is ``Σ_{t ∈ i} g_t x_tᵀ``: the one
expert of :class:`.experts.ExpertLinear`. A module qualifies when, traced by ``torch.fx``
in train and eval mode, its weight is read by exactly one ``F.linear(x, weight)`` without
bias and nowhere else; its forward then runs those graphs with that call captured, and the
weight is one ``"param"`` layer whose row layout prepare checks on ``example_inputs``
(:func:`.added_params.check_sample_independence`).
"""
from __future__ import annotations

from typing import Any, Optional, cast

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .experts import ExpertLinear, samples_of_rows
from .match import LayerSpec
from .params import ParamHolder
from .store import CaptureStore

__all__ = ["router_graphs", "cover_routers", "router_linear"]


def router_linear(x: Tensor, weight: Tensor, key: int, site: int, name: str) -> Tensor:
    """``F.linear(x, weight)`` (``x [*rows, d]``, ``weight [E, d]``, returns ``[*rows, E]``),
    through :class:`.experts.ExpertLinear` as one expert when capture is on."""
    m = ops.SAMPLES.get(key)
    if not (ops.ENABLED.get(key, False) and torch.is_grad_enabled() and weight.requires_grad) or m is None:
        return F.linear(x, weight)
    x2 = x.reshape(-1, x.shape[-1])
    samples = samples_of_rows(x2.shape[0], 1, m, x.device, name)
    ids = torch.zeros_like(samples)
    y = ExpertLinear.apply(x2, weight.unsqueeze(0), ids, samples, m, key, site, False)
    return y.reshape(*x.shape[:-1], weight.shape[0])


fx.wrap("router_linear")


def _linear_call(graph: fx.Graph) -> Optional[fx.Node]:
    """The one ``F.linear(x, weight)`` reading ``weight``, when nothing else reads it."""
    weights = [n for n in graph.nodes if n.op == "get_attr" and n.target == "weight"]
    users = [u for w in weights for u in w.users]
    if not weights or len(users) != 1:
        return None
    call = users[0]
    if call.op != "call_function" or call.target not in (F.linear, torch._C._nn.linear) or call.kwargs:
        return None
    if len(call.args) != 2 or call.args[1] not in weights or call.args[0] in weights:
        return None
    return call


def router_graphs(mod: nn.Module) -> Optional[dict[bool, fx.Graph]]:
    """``{training: graph}`` of ``mod``'s forward when it is a router (module docstring)."""
    w = mod._parameters.get("weight")
    if not isinstance(w, nn.Parameter) or w.dim() != 2 or set(mod._parameters) != {"weight"} or \
            type(mod).forward is nn.Module.forward or isinstance(mod, (nn.Linear, nn.Embedding)):
        return None
    was = mod.training
    graphs = {}
    try:
        for mode in (False, True):
            mod.training = mode
            graph = fx.Tracer().trace(mod)
            if _linear_call(graph) is None:
                return None
            graphs[mode] = graph
    except Exception:
        return None
    finally:
        mod.training = was
    return graphs


def _routed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    graphs = self.__dict__["_tengrad_router"]
    return graphs[bool(self.training)](*args, **kwargs)


_ROUTED: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    if cls not in _ROUTED:
        _ROUTED[cls] = type(cls.__name__, (cls,), {"forward": _routed_forward, "__module__": cls.__module__,
                                                   "_tengrad_capturing": True})
    return _ROUTED[cls]


def cover_routers(model: nn.Module, covered: set[int], fallback: dict[str, str],
                  store: CaptureStore) -> list[LayerSpec]:
    """One ``"param"`` layer per router of ``model`` (a module, not a covered layer, whose
    only parameter ``weight`` its forward reads by one ``F.linear``: module docstring);
    their ids join ``covered``."""
    layers = []
    for mod_name, mod in model.named_modules():
        full = f"{mod_name}.weight" if mod_name else "weight"
        w = mod._parameters.get("weight")
        if w is None or id(w) in covered:
            continue
        graphs = router_graphs(mod)
        if graphs is None:
            continue
        site = store.n_sites
        store.n_sites += 1
        gms = {}
        for mode, graph in graphs.items():
            call = _linear_call(graph)
            assert call is not None
            call.target, call.args = router_linear, (*call.args, store.key, site, full)
            gms[mode] = fx.GraphModule(mod, graph)
        layers.append(LayerSpec(name=full, kind="param", module=cast(nn.Module, ParamHolder(cast(nn.Parameter, w))),
                                sites=[site], surgery=True))
        covered.add(id(w))
        fallback.pop(full, None)
        mod.__class__ = _routed_class(type(mod))
        mod.__dict__["_tengrad_router"] = gms
    if layers:
        ops.NEEDS_SAMPLES[store.key] = True
    return layers
