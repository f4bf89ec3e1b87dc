"""``torch.compile`` helpers shared by the capture and the optimizer."""
from __future__ import annotations

import types
from typing import Any, Callable

__all__ = ["own_code"]


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own (same body, globals, defaults and closure).

    Dynamo caches compiled frames per code object, up to its cache limit, and guards each
    entry on what the frame reads (a capture key, the shapes of one model's tensors). A
    function shared by several prepared models or optimizers would recompile for each
    and, past the limit, silently run eagerly; a copy per owner compiles once per owner.
    """
    new = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__doc__, new.__qualname__, new.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
    return new
