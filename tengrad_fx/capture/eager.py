"""The eager fast path of the capture ops: one ``torch.autograd.Function`` per op kind.

Every capture op exists twice over the same implementation functions:

* as a ``torch.library`` custom op pair (``tengrad_fx::<kind>`` and
  ``tengrad_fx::<kind>_backward``, ``register_autograd``): opaque to ``torch.compile``,
  so a compiled model still records; the backward op's records never share memory with
  the op's arguments or results, which the compiled program may reuse (:mod:`.record_guard`),
  and both ops are tagged ``cudagraph_unsafe`` (their Python side effects must run at
  every call, not be replayed);
* as a plain ``torch.autograd.Function`` made by :func:`capture_op` from the same
  forward body, ``setup_context`` and autograd formula, whose backward calls the
  backward op's body directly.

Outside compilation the wrappers take the Function (:func:`use_custom_ops` is False):
no custom-op wrapper runs, no ``tengrad_fx::*`` op is dispatched, and the per-call cost is
that of ``Function.apply`` (the custom ops' Python-side argument handling, e.g.
``torch._library.utils.fill_defaults``, costs tens of µs per call and grows with the
square of the argument count). The records and gradients are the same bit for bit
(``tests/capture/test_eager_path.py``).

The custom ops are taken while ``torch.compile`` traces (``torch.compiler.is_compiling()``),
and everywhere when :data:`FORCE_CUSTOM_OPS` is set (tests, debugging). Neither form runs
under ``torch.func`` transforms (the custom ops' autograd is an ``autograd.Function``
without ``setup_context`` too): capture needs the ordinary autograd engine.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.library import infer_schema

from .record_guard import kept_apart

__all__ = ["FORCE_CUSTOM_OPS", "use_custom_ops", "capture_op", "alias"]

_unsafe_view = torch.ops.aten._unsafe_view.default


def alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an alias without a view relation (what ``matmul`` itself returns), or a copy
    of a non-contiguous ``t``: autograd forbids in-place ops on a view made inside a custom
    Function, so the capture ops and sites return this for their outputs."""
    return _unsafe_view(t, t.shape) if t.is_contiguous() else t.clone()

# True: run the custom ops in eager mode too (the path torch.compile takes)
FORCE_CUSTOM_OPS = False

# The ops run Python with side effects (records into the store): a CUDA graph replay would
# skip them, so inductor must not capture them into one.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

Setup = Callable[[Any, tuple[Any, ...], Any], None]
# the autograd formula: formula(backward, ctx, *grads) with backward(*args) the backward op
Formula = Callable[..., tuple[Any, ...]]


def use_custom_ops() -> bool:
    """Take the ``tengrad_fx::*`` custom ops (compiling, or forced), not the eager
    Functions. ``is_compiling()`` first: under ``torch.compile`` the global is not read
    (no guard on it)."""
    return torch.compiler.is_compiling() or FORCE_CUSTOM_OPS


def capture_op(name: str, forward: Callable[..., Any], backward: Callable[..., Any], setup: Setup,
               formula: Formula, eager_forward: Optional[Callable[..., Any]] = None,
               eager_backward: Optional[Callable[..., Any]] = None,
               ) -> tuple[Any, Any, type[torch.autograd.Function]]:
    """Both forms of one capture op kind from one implementation.

    Registers ``tengrad_fx::<name>`` (body ``forward``) and ``tengrad_fx::<name>_backward``
    (body ``backward``) with autograd ``formula(torch.ops.tengrad_fx.<name>_backward, ctx,
    *grads)`` after ``setup(ctx, inputs, output)``, and makes the eager
    ``autograd.Function`` whose forward is ``eager_forward`` (default ``forward``) and
    whose backward is ``formula(eager_backward or backward, ctx, *grads)``: the same bodies,
    called directly (an eager body may return an alias of its arguments, which a custom
    op may not).
    Returns ``(forward op, backward op, Function)``; the caller registers the fake kernels.
    """
    op = torch.library.custom_op(f"tengrad_fx::{name}", forward, mutates_args=(), tags=_TAGS)
    schema = infer_schema(backward, mutates_args=())
    op_backward = torch.library.custom_op(f"tengrad_fx::{name}_backward", kept_apart(backward),
                                          mutates_args=(), schema=schema, tags=_TAGS)
    dispatched = getattr(torch.ops.tengrad_fx, f"{name}_backward")
    op.register_autograd(lambda ctx, *grads: formula(dispatched, ctx, *grads), setup_context=setup)
    return op, op_backward, _function(name, eager_forward or forward, setup, eager_backward or backward, formula)


def _function(name: str, forward: Callable[..., Any], setup: Setup, backward: Callable[..., Any],
              formula: Formula) -> type[torch.autograd.Function]:
    """The ``autograd.Function`` of :func:`capture_op` (old-style ``forward(ctx, ...)``:
    ``apply`` binds no default arguments). Unused outputs' gradients arrive as None (the
    norm ops' statistics: not materialized as zeros)."""

    def fwd(ctx: Any, *inputs: Any) -> Any:
        ctx.set_materialize_grads(False)
        output = forward(*inputs)
        setup(ctx, inputs, output)
        return output

    def bwd(ctx: Any, *grads: Any) -> Any:
        return formula(backward, ctx, *grads)

    # named after the op: its grad_fn reads ``tengrad_fx_<name>Backward``
    return type(f"tengrad_fx_{name}", (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
