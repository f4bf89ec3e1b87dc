"""``torch.compile`` helpers shared by the capture and the optimizer."""
from __future__ import annotations

import types
from typing import Any, Callable

import torch

__all__ = ["own_code", "keep_saved_tensors"]

_CACHE_TAG = "|tengrad_fx:no-donated-buffers"


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


def keep_saved_tensors() -> None:
    """Let a compiled backward run twice over one graph (``retain_graph=True``).

    The MC and Gauss-Newton captures backpropagate through a prepared model's graph before
    the training backward does. A ``torch.compile``-d backward whose saved tensors are
    *donated* (reused for its own temporaries) refuses a second pass or, where donation
    was decided without it being checked, overwrites what the second pass reads; so
    donation is turned off for the graphs compiled from now on
    (``torch._functorch.config.donated_buffer``: it saves memory, never time).
    Inductor's on-disk graph cache does not key on donation, so a backward compiled with
    it (by an earlier process) could be loaded again: these compiles get a cache key of
    their own (``torch.compiler.config.cache_key_tag``; where there is none, no graph cache).
    """
    from torch._functorch import config

    if getattr(config, "donated_buffer", False):
        config.donated_buffer = False
    cc = getattr(torch.compiler, "config", None)
    if cc is not None and hasattr(cc, "cache_key_tag"):
        if _CACHE_TAG not in cc.cache_key_tag:
            cc.cache_key_tag += _CACHE_TAG
    else:  # pragma: no cover - torch without cache_key_tag
        torch._inductor.config.fx_graph_cache = False
