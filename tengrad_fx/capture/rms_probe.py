"""RMSNorm-shaped modules recognised by structure and a probe, not by class name.

A module is *RMSNorm-shaped* when it has exactly one parameter, ``weight [D]``, no
buffers, no submodules, and a float ``eps`` / ``variance_epsilon`` / ``epsilon`` attribute
(Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``, ``Qwen2RMSNorm``, ``GemmaRMSNorm``, ...).
It is covered (kind ``"rmsnorm"``) when its own forward, run on a probe, equals one of the
:data:`FORMS` below: the probe is a float64 input ``[2, 3, D]`` whose rows have scales
``1``, ``√eps`` and ``10`` (so a wrong ``eps`` shows) and a random float64 weight put in place
of the module's for the call (the module's parameter is restored afterwards; nothing
else is touched). Each form writes ``y = γ' ⊙ x̂`` with ``γ' = γ`` or ``1 + γ`` and is
accepted when it equals the module's output to ``PROBE_RTOL`` (relative to the output's
largest entry); the float32 forms reproduce the module's rounding, so the HF classes match
to the last bit. A module that matches no form stays a fallback and the report says so.

With capture on, the same form runs with ``γ' ⊙ x̂`` as the capture op
(:func:`.norm_ops.affine`), so the forward is the module's own computation, dtype casts
included; the per-sample gradient of ``γ`` is ``Σ_s G ⊙ x̂`` for both ``γ' = γ`` and
``γ' = 1 + γ``. Low-precision inputs follow the matched form: Llama-style computes ``x̂``
in float32 and casts it to the input's dtype before ``γ ⊙ x̂``; T5 keeps ``x ⊙ rsqrt`` in
the promoted dtype (cast to a half-precision weight's dtype); Gemma computes ``x̂ ⊙ (1 + γ)``
in float32 and casts the result to the input's dtype; the native forms compute in the
input's dtype. A float64 model whose norm upcasts to float32 (Llama, T5, Gemma) thus keeps
that float32 rounding, as the module does.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Optional, cast

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["FORMS", "PROBE_RTOL", "EPS_NAMES", "rms_shaped", "probe_form", "run_form"]

EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
PROBE_RTOL = 1e-12

Mul = Callable[[Tensor, Tensor], Tensor]  # (x̂, γ') -> γ' ⊙ x̂


def _rsqrt_ms(x: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _llama(x: Tensor, w: Tensor, eps: float, mul: Mul) -> Tensor:
    """Llama / Qwen2 / Mistral: ``x̂`` in float32, cast to ``x``'s dtype, then ``γ ⊙ x̂``."""
    xf = x.to(torch.float32)
    return mul((xf * _rsqrt_ms(xf, eps)).to(x.dtype), w)


def _t5(x: Tensor, w: Tensor, eps: float, mul: Mul) -> Tensor:
    """T5: mean of squares in float32, ``x̂ = x ⊙ rsqrt`` promoted (cast to a half weight's dtype)."""
    xhat = x * _rsqrt_ms(x.to(torch.float32), eps)
    if w.dtype in (torch.float16, torch.bfloat16):
        xhat = xhat.to(w.dtype)
    return mul(xhat, w)


def _gemma(x: Tensor, w: Tensor, eps: float, mul: Mul) -> Tensor:
    """Gemma: ``x̂ ⊙ (1 + γ)`` in float32, cast to ``x``'s dtype."""
    xf = x.float()
    return mul(xf * _rsqrt_ms(xf, eps), 1.0 + w.float()).type_as(x)


def _native(x: Tensor, w: Tensor, eps: float, mul: Mul) -> Tensor:
    """In ``x``'s dtype: ``γ ⊙ x̂``."""
    return mul(x * _rsqrt_ms(x, eps), w)


def _native_offset(x: Tensor, w: Tensor, eps: float, mul: Mul) -> Tensor:
    """In ``x``'s dtype: ``(1 + γ) ⊙ x̂``."""
    return mul(x * _rsqrt_ms(x, eps), 1 + w)


Form = Callable[[Tensor, Tensor, float, Mul], Tensor]
FORMS: dict[str, Form] = {"llama": _llama, "t5": _t5, "gemma": _gemma, "native": _native,
                          "native_offset": _native_offset}
"""The forms a probed module may compute, by name (each: ``(x, γ, eps, mul) -> y``)."""


def promoted_mul(xhat: Tensor, w: Tensor) -> Tensor:
    """``γ' ⊙ x̂`` with both cast to their promoted dtype (as ``*`` computes it)."""
    dt = torch.promote_types(xhat.dtype, w.dtype)
    return xhat.to(dt) * w.to(dt)


def rms_shaped(mod: nn.Module) -> Optional[str]:
    """The name of ``mod``'s eps attribute if it is RMSNorm-shaped (module docstring), else None."""
    params = [(k, p) for k, p in mod._parameters.items() if p is not None]
    if len(params) != 1 or params[0][0] != "weight" or params[0][1].dim() != 1:
        return None
    if any(b is not None for b in mod._buffers.values()) or mod._modules:
        return None
    for name in EPS_NAMES:
        eps = getattr(mod, name, None)
        if isinstance(eps, (float, int)) and not isinstance(eps, bool) and eps >= 0:
            return name
    return None


_PROBED: "weakref.WeakKeyDictionary[nn.Module, Optional[str]]" = weakref.WeakKeyDictionary()


def probe_form(mod: nn.Module, eps_name: str) -> Optional[str]:
    """The name of the :data:`FORMS` entry ``mod``'s forward computes, or None (probed once
    per module; the module's own class forward, with its weight swapped for the call)."""
    if mod in _PROBED:
        return _PROBED[mod]
    cls = type(mod).__dict__.get("_tengrad_base", type(mod))  # a surgery-swapped class: its original
    saved = mod._parameters["weight"]
    assert saved is not None, "rms_shaped() admits modules with a weight Parameter only"
    D = saved.shape[0]
    eps = float(getattr(mod, eps_name))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, D, generator=gen, dtype=torch.float64)
    x = x * torch.tensor([1.0, math.sqrt(eps) if eps > 0 else 1e-3, 10.0], dtype=torch.float64)[:, None]
    w = nn.Parameter(torch.randn(D, generator=gen, dtype=torch.float64), requires_grad=False)
    mod._parameters["weight"] = w
    try:
        with torch.no_grad():
            y = cls.forward(mod, x)
    except Exception:
        y = None
    finally:
        mod._parameters["weight"] = saved
    found = None
    if isinstance(y, Tensor) and y.shape == x.shape and y.is_floating_point():
        for name, form in FORMS.items():
            want = form(x, w, eps, promoted_mul)
            if y.dtype == want.dtype and bool(((y - want).abs().max() <= PROBE_RTOL * want.abs().max()).item()):
                found = name
                break
    _PROBED[mod] = found
    return found


def run_form(form: str, eps_name: str) -> Callable[[nn.Module, Tensor, int, int], Tensor]:
    """``run(mod, x, key, site)``: ``form`` on ``mod``'s weight and eps with ``γ' ⊙ x̂`` as
    the capture op."""
    from . import norm_ops

    f = FORMS[form]

    def run(mod: nn.Module, x: Tensor, key: int, site: int) -> Tensor:
        def mul(xhat: Tensor, w: Tensor) -> Tensor:
            dt = torch.promote_types(xhat.dtype, w.dtype)
            return norm_ops.affine(xhat.to(dt), w.to(dt), None, False, key, site)

        weight = cast(Tensor, mod.weight)  # rms_shaped(): a 1-d weight Parameter
        return f(x, weight, float(getattr(mod, eps_name)), mul)

    return run
