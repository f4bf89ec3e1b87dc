"""The prepared model's forward: the rewritten graph when capturing, the plain one otherwise.

A prepared (FX) model carries two programs per train/eval mode:

* the **rewritten graph** (``gm.graph``): every covered call through a capture wrapper of
  :mod:`.ops` / :mod:`.norm` / ... that records when capture is on;
* the **plain graph**: the traced graph before the rewrite, each covered layer called as
  ``type(layer).forward(layer, x)`` (:func:`layer_forward`) — the layer's own computation, without
  ``Module.__call__`` (no hooks: as in the rewritten graph, a covered layer's hooks never
  run) and without the wrappers' Python work.

With capture off (``tengrad_fx.capturing(model, False)``, a TENGraD reuse step) or grad
disabled, every wrapper of the rewritten graph would run the plain op anyway; the plain
graph runs the same aten ops (the plain model's, counted in
``tests/capture/test_capture_off_plain.py``) without a Python wrapper per layer call, so the
prepared model's forward costs what the plain model's does. While ``prepare()`` probes
shapes (``ops.PROBE``) the rewritten graph runs whatever the state.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from .._compile import own_code
from . import ops
from .inputs import leading_dim
from .output_hook import WANTED, attach, graph_breaks_allowed
from .scored import note_scored
from .attention import is_exact_mha

__all__ = ["plain_graph", "install_forward", "drop_dead_attributes", "layer_forward"]

Forward = Callable[..., Any]


def plain_graph(graph: fx.Graph, model: nn.Module, rewritten: Callable[[fx.Node], bool],
                attention: bool) -> Optional[fx.Graph]:
    """A copy of the traced ``graph`` (before the capture rewrite) whose module calls that
    the rewrite replaces (``rewritten(node)``; exact ``nn.MultiheadAttention`` too if
    ``attention``) call the class's ``forward`` directly; None for a root that is itself
    the layer (its graph calls ``self``)."""
    graph = copy.deepcopy(graph)
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        name = str(node.target)
        if not name:
            return None
        mod = model.get_submodule(name)
        if not (rewritten(node) or (attention and is_exact_mha(mod))):
            continue
        with graph.inserting_before(node):
            mnode = graph.get_attr(name)
            new = graph.call_function(layer_forward, (mnode, *node.args), dict(node.kwargs))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    drop_dead_attributes(graph)
    graph.lint()
    return graph


def drop_dead_attributes(graph: fx.Graph) -> None:
    """Erase ``get_attr`` nodes nobody uses (the tracer leaves one per parameter it saw read,
    e.g. a leaf layer's ``weight``): each costs a ``Module.__getattr__`` per forward."""
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)


def layer_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``layer``'s own computation: its class's ``forward``, no ``Module.__call__`` (hooks)."""
    return type(layer).forward(layer, *args, **kwargs)


def compiled_forward(gm: fx.GraphModule, graph: fx.Graph) -> Forward:
    """The generated ``forward(self, ...)`` of ``graph``, to be called with ``self = gm``
    (every name it reads, ``gm`` has)."""
    return type(fx.GraphModule(gm, graph)).forward


def install_forward(gm: fx.GraphModule, key: int, eval_forward: Optional[Forward],
                    plain: Optional[Forward], plain_eval: Optional[Forward]) -> None:
    """Make ``gm`` run: its own graph (train mode, or always without an eval graph) or
    ``eval_forward`` (eval mode) when capturing; ``plain`` / ``plain_eval`` (train / eval
    mode; None: the capturing one) when capture is off or grad disabled (module docstring).
    A capturing forward hands its output to :func:`.output_hook.attach` when an optimizer
    asked for it (MC/Gauss-Newton Fisher: its sampled backward runs first)."""
    cls = type(gm)  # GraphModule gives each instance its own class
    train_forward = cls.forward
    eval_forward = eval_forward or train_forward
    plain, plain_eval = plain or train_forward, plain_eval or eval_forward
    enabled, wanted, samples = ops.ENABLED, WANTED, ops.SAMPLES  # (never rebound)

    @functools.wraps(train_forward)
    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if (enabled.get(key, False) and torch.is_grad_enabled()) or ops.PROBE is not None:
            if ops.NEEDS_SAMPLES.get(key, False):  # shared position ids, added parameters
                samples[key] = leading_dim(args, kwargs)
            out = (train_forward if self.training else eval_forward)(self, *args, **kwargs)
            if enabled.get(key, False) and torch.is_grad_enabled():
                note_scored(key, self, kwargs, out)
            if wanted.get(key, False) and (not torch.compiler.is_compiling() or graph_breaks_allowed()):
                return attach(key, out)
            return out
        return (plain if self.training else plain_eval)(self, *args, **kwargs)

    cls.forward = own_code(forward)  # its guards name this model's key
