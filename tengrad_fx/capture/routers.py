"""Mixture-of-experts routers: a weight ``[E, d]`` applied to the batch folded to token rows.

A router (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ...) computes
``logits = F.linear(hidden_states.reshape(-1, d), self.weight)`` on the block input folded
to rows ``[m·T, d]`` (row ``r`` belongs to sample ``r // T``), then a softmax and a top-k
that do not read the weight (with ``self.bias`` too: GPT-OSS). Sample ``i``'s gradient is
``Σ_{t ∈ i} g_t x_tᵀ``: the one expert of :class:`.experts.ExpertLinear` (the bias's,
``Σ_{t ∈ i} g_t``: :class:`.experts.ExpertBias`). A module beside an experts module (a
child of the module that holds one) qualifies when, traced by ``torch.fx`` in train and
eval mode, its weight (and bias) is read by exactly one ``F.linear(x, weight[, bias])``
and nowhere else; its forward then runs those graphs with that call captured, and each
parameter is one ``"param"`` layer whose row layout prepare checks on ``example_inputs``
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
from .experts import ExpertBias, ExpertLinear, is_experts, samples_of_rows
from .match import LayerSpec
from .params import ParamHolder
from .store import CaptureStore
from .swapped import swapped_class

__all__ = ["router_graphs", "cover_routers", "router_linear"]


def router_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], key: int, site: int, bias_site: int,
                  name: str) -> Tensor:
    """``F.linear(x, weight, bias)`` (``x [*rows, d]``, ``weight [E, d]``, ``bias [E]`` or None;
    returns ``[*rows, E]``), through :class:`.experts.ExpertLinear` and
    :class:`.experts.ExpertBias` as one expert when capture is on."""
    m = ops.SAMPLES.get(key)
    if not (ops.ENABLED.get(key, False) and torch.is_grad_enabled()) or m is None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    samples = samples_of_rows(x2.shape[0], 1, m, x.device, name)
    ids = torch.zeros_like(samples)
    if weight.requires_grad:
        y = ExpertLinear.apply(x2, weight.unsqueeze(0), ids, samples, m, key, site, False)
    else:
        y = F.linear(x2, weight)
    if bias is not None:
        y = ExpertBias.apply(y, bias.unsqueeze(0), ids, samples, m, key, bias_site) if bias.requires_grad \
            else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


fx.wrap("router_linear")


def _linear_call(graph: fx.Graph, with_bias: bool) -> Optional[fx.Node]:
    """The one ``F.linear(x, weight[, bias])`` reading ``weight`` (and ``bias``), when nothing
    else reads them."""
    names = ("weight", "bias") if with_bias else ("weight",)
    attrs = {name: [n for n in graph.nodes if n.op == "get_attr" and n.target == name] for name in names}
    users = {name: [u for a in nodes for u in a.users] for name, nodes in attrs.items()}
    if any(len(u) != 1 for u in users.values()):
        return None
    call = users["weight"][0]
    if call.op != "call_function" or call.target not in (F.linear, torch._C._nn.linear) or call.kwargs:
        return None
    args = [*call.args, None][:3] if len(call.args) == 2 else list(call.args)
    if len(args) != 3 or args[1] not in attrs["weight"] or args[0] in attrs["weight"]:
        return None
    if (args[2] in attrs["bias"]) if with_bias else (args[2] is None):
        call.args = tuple(args)
        return call
    return None


def _router_params(mod: nn.Module) -> dict[str, nn.Parameter]:
    """``mod``'s own parameters by name (``None`` entries left out)."""
    return {n: p for n, p in mod._parameters.items() if isinstance(p, nn.Parameter)}


def router_graphs(mod: nn.Module) -> Optional[dict[bool, fx.Graph]]:
    """``{training: graph}`` of ``mod``'s forward when it is a router (module docstring)."""
    params = _router_params(mod)
    w, b = params.get("weight"), params.get("bias")
    with_bias = b is not None
    if w is None or w.dim() != 2 or set(params) - {"weight", "bias"} or (b is not None and b.shape != w.shape[:1]) \
            or type(mod).forward is nn.Module.forward or isinstance(mod, (nn.Linear, nn.Embedding)):
        return None
    was = mod.training
    graphs = {}
    try:
        for mode in (False, True):
            mod.training = mode
            graph = fx.Tracer().trace(mod)
            if _linear_call(graph, with_bias) is None:
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


def _routed_class(cls: type) -> type:
    return swapped_class("router", cls, {"forward": _routed_forward, "_tengrad_capturing": True})


def _beside_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the children of every module that also holds an experts module
    (:func:`.experts.is_experts`): where a router is."""
    out = []
    for parent_name, parent in model.named_modules():
        children = list(parent.named_children())
        if any(is_experts(c) for _, c in children):
            out += [(f"{parent_name}.{n}" if parent_name else n, c) for n, c in children if not is_experts(c)]
    return out


def cover_routers(model: nn.Module, covered: set[int], fallback: dict[str, str],
                  store: CaptureStore) -> list[LayerSpec]:
    """One ``"param"`` layer per router parameter of ``model`` (a module beside an experts
    module, not a covered layer, whose only parameters ``weight`` and ``bias`` its forward
    reads by one ``F.linear``: module docstring); their ids join ``covered``."""
    layers = []
    for mod_name, mod in _beside_experts(model):
        w = mod._parameters.get("weight")
        if w is None or id(w) in covered:
            continue
        graphs = router_graphs(mod)
        if graphs is None:
            continue
        params = _router_params(mod)
        sites = {}
        for pn, p in params.items():
            full = f"{mod_name}.{pn}" if mod_name else pn
            sites[pn] = store.n_sites
            store.n_sites += 1
            layers.append(LayerSpec(name=full, kind="param", module=cast(nn.Module, ParamHolder(p)),
                                    sites=[sites[pn]], surgery=True))
            covered.add(id(p))
            fallback.pop(full, None)
        gms = {}
        for mode, graph in graphs.items():
            call = _linear_call(graph, "bias" in params)
            assert call is not None
            call.target = router_linear
            call.args = (*call.args, store.key, sites["weight"], sites.get("bias", -1), mod_name or "<root>")
            gms[mode] = fx.GraphModule(mod, graph)
        mod.__class__ = _routed_class(type(mod))
        mod.__dict__["_tengrad_router"] = gms
    if layers:
        ops.NEEDS_SAMPLES[store.key] = True
    return layers
