"""Autocast (mixed precision) rules of the capture ops: the same casts as aten's.

``torch.autocast`` acts on aten ops through their ``Autocast<device>`` kernels, and a
``torch.library`` custom op has none, so each capture wrapper applies, before calling its
op, the cast autocast applies to the aten op it stands for:

* ``linear`` / convolutions: autocast's "lower precision" policy on CPU and CUDA — every
  floating-point tensor argument except float64 is cast to the autocast dtype
  (:func:`cast_lower`); the op then runs in that dtype, forward and backward, and the
  parameter gradients flow back through the differentiable cast to the fp32 parameters.
* ``layer_norm`` / ``group_norm``: aten registers an autocast kernel for them on some
  devices (CUDA: the "fp32" policy, inputs cast to float32) and none on others (CPU:
  the op runs in the input's dtype, with fp32 affine parameters).
  :func:`cast_like_aten` looks the registration up in the dispatcher, so the rule
  follows the installed torch instead of a copied list.
* ``batch_norm``, ``embedding``, added parameters: no autocast kernel on CPU or CUDA.

The backward ops run with autocast off (:func:`autocast_off`) whatever the caller's
state (the autograd engine runs a CPU backward under the autocast state of the thread
that called ``backward()``), and compute the per-sample quantities they record
(``P``, ``Gsum``, the norm sums) in float32 from low-precision ``x`` and ``G``
(:func:`acc`). The records ``I``/``G`` themselves stay in the dtype autograd delivered;
the optimizers convert them to float32 (and unscale them) at the step
(:meth:`~tengrad_fx.capture.store.CaptureStore.finalize`).
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch
from torch import Tensor

__all__ = ["LOW_PRECISION", "autocast_dtype", "cast_lower", "cast_like_aten", "autocast_off", "acc", "as_dtype"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"}


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)  # (absent: the per-device query)


def autocast_dtype(t: Tensor) -> Optional[torch.dtype]:
    """The autocast dtype active for ``t``'s device, or None when autocast is off there.
    Without autocast on any device one C call (outside ``torch.compile``, which traces the
    per-device query instead)."""
    if _ANY_AUTOCAST is not None and not torch.compiler.is_compiling() and not _ANY_AUTOCAST():
        return None
    dev = t.device.type
    if dev not in _KEYS or not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def _eligible(t: Optional[Tensor]) -> bool:
    """What autocast casts: floating-point tensors other than float64."""
    return t is not None and t.is_floating_point() and t.dtype != torch.float64


def _cast(dtype: torch.dtype, ts: tuple[Optional[Tensor], ...]) -> tuple[Optional[Tensor], ...]:
    return tuple(t.to(dtype) if _eligible(t) and t.dtype != dtype else t for t in ts)  # type: ignore[union-attr]


def cast_lower(x: Tensor, *ts: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    """``(x, *ts)`` cast as autocast casts the arguments of ``aten::linear`` /
    ``aten::conv*d`` (to the autocast dtype; unchanged with autocast off)."""
    dtype = autocast_dtype(x)
    return (x, *ts) if dtype is None else _cast(dtype, (x, *ts))


def cast_like_aten(op: str, x: Tensor, *ts: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    """``(x, *ts)`` cast to float32 when autocast is on for ``x``'s device and aten has an
    autocast kernel for ``op`` (e.g. ``"aten::layer_norm"``) there (the fp32 policy of
    norm ops), else unchanged."""
    if autocast_dtype(x) is None:
        return (x, *ts)
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op, _KEYS[x.device.type]):
        return (x, *ts)
    return _cast(torch.float32, (x, *ts))


_NO_CONTEXT = contextlib.nullcontext()


def autocast_off(t: Tensor) -> ContextManager[None]:
    """A context with autocast disabled on ``t``'s device (a no-op when it is off)."""
    if autocast_dtype(t) is None:
        return _NO_CONTEXT
    return torch.autocast(t.device.type, enabled=False)


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, without ``Tensor.to``'s argument parsing (about 1 µs per call on the
    host) where ``t`` has that dtype already: the gradients of every captured call."""
    return t if t.dtype == dtype else t.to(dtype)


def acc(t: Tensor) -> Tensor:
    """``t`` in the dtype per-sample sums are accumulated and kept in: float32 for
    float16/bfloat16, else unchanged."""
    return t.float() if t.dtype in LOW_PRECISION else t
