"""``--compile``: compile before the clock starts, and say how long it took.

A compiled forward is compiled at its first call for each kind of step it meets: a
capturing step (TENGraD's curvature steps, K-FAC's statistics steps), a plain one (reuse
steps: capture off), the last, smaller batch of an epoch. :func:`warm_up` runs one
forward and backward of each kind on a real batch before training, so that the
training time of the logs holds steps only; the model, its buffers (batch-norm running
statistics), its gradients, its records and the RNG are left as they were.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..capture import capturing, get_info
from ..capture.output_hook import muted

__all__ = ["warm_up"]


def _kinds(model: torch.nn.Module) -> list[Any]:
    """Capture on and off for a prepared model, the model as it is otherwise."""
    try:
        get_info(model)
    except ValueError:
        return [None]
    return [True, False]


def warm_up(forward: Callable[[torch.Tensor], torch.Tensor], model: torch.nn.Module, xb: torch.Tensor,
            yb: torch.Tensor, sizes: list[int]) -> float:
    """Seconds spent compiling: one forward/backward of ``forward`` per step kind and per
    batch size in ``sizes`` (rows of ``xb, yb``), with nothing of the model changed."""
    params = dict(model.named_parameters())
    buffers = {k: v.clone() for k, v in model.state_dict().items() if k not in params}
    grads = {p: p.grad for p in params.values()}
    rng = torch.get_rng_state()
    kinds = _kinds(model)
    store = get_info(model).store if kinds != [None] else None
    generation = store.generation if store is not None else 0
    t0 = time.perf_counter()
    mute = muted(store.key) if store is not None else contextlib.nullcontext()
    try:
        for p in grads:
            p.grad = None
        with mute:  # an optimizer's output site (MC Fisher) is attached, but runs nothing
            for on in kinds:
                for m in sizes:
                    with capturing(model, on) if on is not None else contextlib.nullcontext():
                        F.cross_entropy(forward(xb[:m]), yb[:m]).backward()
        if xb.is_cuda:
            torch.cuda.synchronize(xb.device)
    finally:
        model.load_state_dict(buffers, strict=False)
        for p, g in grads.items():
            p.grad = g
        torch.set_rng_state(rng)
        if store is not None:  # as if nothing had been captured
            store.clear()
            store.generation = generation
    return time.perf_counter() - t0
