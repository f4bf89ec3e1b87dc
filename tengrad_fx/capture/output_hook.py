"""A one-shot site on a prepared model's output: the optimizer's own backward first.

An optimizer with an MC ("true") or Gauss-Newton Fisher needs one backward of a loss of
*sampled* labels through the graph of the batch before the training backward (it records
``G``; :func:`tengrad_fx.optim.step.mc.mc_capture`). With :func:`want_output` set for a
model, every capturing forward (capture on, grad enabled: curvature/statistics steps
only, so a reuse step pays nothing) calls :func:`attach` on its output ``out``
(``[m, *]``; a mapping's ``"logits"``, and its ``"loss"`` where the model computed
one), which routes it through an identity autograd function (the output site; no hook).
When the user's ``loss.backward()`` reaches the output — before anything below it has
run — the site's backward calls the optimizer's callback with ``out``; the callback runs
its sampled-loss backward (``retain_graph=True``, re-entrant in the engine) and switches
recording off, then the training backward goes on unchanged. The result is bit for bit
that of calling ``opt.mc_capture(out)`` before ``loss.backward()``: the same ``out``, the
same draw of the optimizer's label generator, the same ops.

The site fires once (its cell is emptied before the callback, so the callback's own
backward through ``out`` does not re-enter it). Only the output of the latest capturing
forward is held (:data:`_PENDING`); a forward that is never backpropagated keeps its
output until the next capturing forward or :func:`release`.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .eager import alias

__all__ = ["WANTED", "attach", "graph_breaks_allowed", "maybe_attach", "muted", "release", "want_output",
           "wants_output"]

# key -> an optimizer wants the output of capturing forwards (a plain dict of bools, read
# by the prepared forward: torch.compile guards on it, as on ops.ENABLED)
WANTED: dict[int, bool] = {}
_CALLBACKS: dict[int, "weakref.WeakMethod[Callable[[Tensor], None]]"] = {}
_PENDING: dict[int, list[Tensor]] = {}
_MUTED: set[int] = set()


def want_output(key: int, callback: Optional[Callable[[Tensor], None]]) -> None:
    """Call ``callback(out)`` (a bound method, held weakly) when a backward reaches the
    output of a capturing forward of the model with capture ``key``; None: stop."""
    release(key)
    if callback is None:
        WANTED.pop(key, None)
        _CALLBACKS.pop(key, None)
        return
    _CALLBACKS[key] = weakref.WeakMethod(callback)
    WANTED[key] = True


def release(key: int) -> None:
    """Forget the output held for ``key`` (its site then does nothing)."""
    cell = _PENDING.pop(key, None)
    if cell is not None:
        cell.clear()


def _output_tensor(out: Any) -> Optional[Tensor]:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("logits"), Tensor):
        return out["logits"]
    return None


def _fire(key: int, cell: list[Tensor], grad: Tensor) -> None:
    if not cell:
        return
    out = cell.pop()
    if _PENDING.get(key) is cell:
        del _PENDING[key]
    ref = None if key in _MUTED else _CALLBACKS.get(key)
    callback = ref() if ref is not None else None
    if callback is not None:
        with torch.enable_grad():
            callback(out)


class _OutputSite(torch.autograd.Function):
    """Identity on the output ``[m, *]``; its backward first hands the output to the
    optimizer's callback (:func:`_fire`), then passes the gradient on unchanged. Part of
    the autograd graph, as the capture ops are: no hook."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, key: int, cell: list[Tensor]) -> Tensor:
        ctx.key, ctx.cell = key, cell
        return alias(t)  # as the capture ops return (in-place ops on the output stay allowed)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        _fire(ctx.key, ctx.cell, grad)
        return grad, None, None


@torch._dynamo.disable  # the output site runs eagerly (a graph break)
def attach(key: int, out: Any) -> Any:
    """Route ``out`` (a tensor, or a mapping's ``"logits"``) through the one-shot output
    site (module docstring); returns the output to hand on. A mapping's ``"loss"`` (a
    model that computes its loss itself, e.g. Hugging Face with ``labels=``) goes through
    a site too, sharing the one-shot cell: a backward from either fires it, handing over
    the logits."""
    t = _output_tensor(out)
    if t is None or not t.requires_grad:
        return out
    release(key)
    cell = [t]
    _PENDING[key] = cell
    if isinstance(out, Tensor):
        return _OutputSite.apply(t, key, cell)
    for name in ("logits", "loss"):  # one cell: the site the backward reaches first fires
        v = out.get(name)
        if isinstance(v, Tensor) and v.requires_grad:
            out[name] = _OutputSite.apply(v, key, cell)
    return out


@contextlib.contextmanager
def muted(key: int) -> Iterator[None]:
    """Within the block the output sites of ``key`` fire without calling the optimizer (forwards
    and backwards that are not training steps: a compile warm-up); the forwards attach as
    in training, so they run (and compile) the same code."""
    _MUTED.add(key)
    try:
        yield
    finally:
        _MUTED.discard(key)
        release(key)


@torch._dynamo.assume_constant_result  # evaluated while dynamo traces
def graph_breaks_allowed() -> bool:
    """Under ``torch.compile``: may the traced code break the graph (False with
    ``fullgraph=True``: :func:`attach`'s graph break would be an error, so a compiled
    ``fullgraph`` forward attaches nothing and ``mc_capture`` is called by hand)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return not (tx.one_graph or getattr(tx, "error_on_graph_break", False))
    except Exception:  # another torch: attach nothing rather than fail the compile
        return False


def wants_output(key: int) -> bool:
    """Should this forward of the model with capture ``key`` hand its output to :func:`attach`?"""
    return WANTED.get(key, False) and (not torch.compiler.is_compiling() or graph_breaks_allowed())


def maybe_attach(key: int, out: Any) -> Any:
    """:func:`attach` when an optimizer wants this model's output (read per forward)."""
    return attach(key, out) if wants_output(key) else out
