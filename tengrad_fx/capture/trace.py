"""Symbolic tracing for arbitrary model-zoo architectures.

Covered layers are kept as leaves (one ``call_module`` node per call), and so are the
modules and functions that timm marks as not traceable, so that timm and torchvision
models trace without changes. torch's transformer modules are traced through their slow
path (:mod:`.transformer`). A root module that is itself a covered Linear/Conv/ConvTranspose
(``prepare(nn.Linear(10, 5))``) becomes a one-node graph calling the root as a layer.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx
import torch.nn as nn

from .functional import traceable_override
from .match import _BASES, is_transposed_linear, match_module
from .norm import is_norm_leaf
from .transformer import traced_forward

__all__ = ["trace"]


def _timm_notrace() -> tuple[tuple[type, ...], tuple[Callable[..., Any], ...]]:
    try:
        import timm.models  # noqa: F401  (registers timm's notrace modules/functions)
        from timm.layers import _fx as timm_fx

        return tuple(timm_fx.get_notrace_modules()), tuple(timm_fx.get_notrace_functions())
    except Exception:  # pragma: no cover - timm absent or reorganized
        return (), ()


class _Tracer(fx.Tracer):
    def __init__(self, leaf_types: tuple[type, ...], autowrap: tuple[Callable[..., Any], ...]):
        super().__init__(autowrap_functions=autowrap)
        self._leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, tuple(_BASES)):  # covered or not, a Linear/Conv stays one node, unless
            # its own forward overrides the base one and traces (timm's "notrace" ones do not)
            return bool(self._leaf_types and isinstance(m, self._leaf_types)) or not traceable_override(m)
        if is_norm_leaf(m) or is_transposed_linear(m):  # a norm layer with a capture path (timm's
            return True  # too), a Hugging Face Conv1D: one node
        if traced_forward(m) is not None:  # torch transformer modules, timm MobileVitBlock: traced through
            return False
        if self._leaf_types and isinstance(m, self._leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        sub = traced_forward(m)
        return super().call_module(m, sub if sub is not None else forward, args, kwargs)


def trace(model: nn.Module) -> fx.Graph:
    """Trace ``model.forward`` in the model's current train/eval mode into an FX graph.

    Raises whatever the tracer raises (the caller reports it).
    """
    if isinstance(model, tuple(_BASES)) and match_module(model)[0] is not None:
        return _root_layer_graph()  # (a bare norm layer is traced as usual: it falls back)
    leaf_types, autowrap = _timm_notrace()
    tracer = _Tracer(leaf_types, autowrap)
    return tracer.trace(model)


def _root_layer_graph() -> fx.Graph:
    """``forward(input) = self(input)`` as one ``call_module`` node with target ``""`` (the
    root itself), which the capture pass replaces by its capture op on the root's own
    ``weight`` and ``bias``."""
    graph = fx.Graph()
    x = graph.placeholder("input")
    graph.output(graph.call_module("", (x,)))
    return graph
