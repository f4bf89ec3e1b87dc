"""Norm layers as capture sites: which classes, and how each is run with capture on.

A norm layer's output is ``y = γ ⊙ x̂ + β`` with ``x̂`` the normalized input
(BatchNorm 1d/2d/3d, LayerNorm, GroupNorm, RMSNorm and timm's variants; RMSNorm-shaped
modules such as Hugging Face's ``LlamaRMSNorm``/``T5LayerNorm``/``GemmaRMSNorm``, recognised
by structure and a probe, :mod:`.rms_probe`). The rewritten
call runs the module's own computation through a capture op of :mod:`.norm_ops` (aten's
fused kernel for BatchNorm/LayerNorm/GroupNorm, the module's composite ops split at the
affine for RMSNorm), whose backward records ``(x̂, G)`` or the per-sample gradients
``dγ_i = Σ_s G_i[s] ⊙ x̂_i[s]``, ``dβ_i = Σ_s G_i[s]`` (``[m, C]``).

Layout of the recorded ``x̂`` (``C`` = number of affine parameters):

* channel-first kinds (``batchnorm``, ``groupnorm``, ``rmsnorm2d``): ``x̂ [m, C, *spatial]``;
* trailing kinds (``layernorm``, ``rmsnorm``, and ``layernorm2d``, recorded channels-last
  as timm computes it): ``x̂ [m, *positions, *normalized_shape]``.

**BatchNorm in train mode** couples samples through the batch statistics. The
per-sample gradient reported for *every* layer is then sample ``i``'s term of the exact
batch gradient (their sum is the train-mode gradient, bit for bit the module's). For γ,
β of a BatchNorm that is ``Σ_s G_i[s] ⊙ x̂_i[s]`` and ``Σ_s G_i[s]`` with ``x̂`` normalized
by the batch statistics: the per-sample gradient with the batch statistics held fixed
(``BN_NOTE``, printed by the report). For every layer with no train-mode BatchNorm after
it, that equals ``∂ℓ_i/∂θ`` of the network whose BatchNorms use the batch statistics as
constants. In eval mode every per-sample gradient is exactly ``∂ℓ_i/∂θ``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import norm_ops, ops
from .amp import acc, as_dtype, cast_like_aten
from .rms_probe import probe_form, rms_shaped, run_form
from .folded_rows import FOLDS, fold_rows, unfold_rows

__all__ = ["NORM_KINDS", "CHANNEL_FIRST", "match_norm", "norm_entry", "is_norm_leaf", "norm", "BN_NOTE",
           "normalized_ndim"]

NORM_KINDS = ("batchnorm", "layernorm", "groupnorm", "rmsnorm", "layernorm2d", "rmsnorm2d")
CHANNEL_FIRST = frozenset({"batchnorm", "groupnorm", "rmsnorm2d"})
BN_NOTE = ("BN: batch statistics held fixed (in train mode each sample's per-sample gradient "
           "is its term of the batch gradient)")

Run = Callable[[nn.Module, Tensor, int, int], Tensor]


@dataclass(frozen=True)
class NormEntry:
    """How one norm class is captured: its kind, ``y = run(mod, x, key, site)`` (the
    module's forward through a capture op), and what the module does after the affine
    (timm's norm+act layers), ``post(mod, y)``."""

    cls: type[nn.Module]
    kind: str
    run: Run
    post: Optional[Callable[[nn.Module, Tensor], Tensor]] = None
    form: Optional[tuple[str, str]] = None  # an RMSNorm-shaped class: (probed form, eps attribute)

    def affine(self, mod: nn.Module, x: Tensor) -> Tensor:
        """The module's plain ``γ ⊙ x̂ + β`` (its own forward, or its norm base class's
        where ``post`` follows)."""
        base = self.cls if self.post is None else nn.modules.batchnorm._BatchNorm
        return base.forward(mod, x)


# --------------------------------------------------------------------------- forward per class
def _batch_norm(mod: Any, x: Tensor, key: int, site: int) -> Tensor:
    """``nn.modules.batchnorm._BatchNorm.forward`` through the capture op (same
    statistics, same running-buffer updates)."""
    if hasattr(mod, "_check_input_dim"):
        mod._check_input_dim(x)
    elif x.dim() != 4:
        raise ValueError(f"expected 4D input (got {x.dim()}D input)")
    # each buffer read once (a Module.__getattr__ per read, per call)
    momentum, training, rm, rv = mod.momentum, mod.training, mod.running_mean, mod.running_var
    eaf = 0.0 if momentum is None else momentum
    if training and mod.track_running_stats:
        tracked = mod.num_batches_tracked
        if tracked is not None:
            tracked.add_(1)
            eaf = 1.0 / float(tracked) if momentum is None else momentum
    bn_training = training or (rm is None and rv is None)
    use_buffers = not training or mod.track_running_stats
    return norm_ops.batch_norm(x, mod.weight, mod.bias, rm if use_buffers else None,
                               rv if use_buffers else None, bn_training, eaf, mod.eps, key, site)


def _layer_norm(mod: Any, x: Tensor, key: int, site: int) -> Tensor:
    return norm_ops.layer_norm(x, mod.normalized_shape, mod.weight, mod.bias, mod.eps, key, site)


def _layer_norm2d(mod: Any, x: Tensor, key: int, site: int) -> Tensor:
    y = norm_ops.layer_norm(x.permute(0, 2, 3, 1), mod.normalized_shape, mod.weight, mod.bias,
                            mod.eps, key, site)
    return y.permute(0, 3, 1, 2)


def _group_norm(mod: Any, x: Tensor, key: int, site: int) -> Tensor:
    return norm_ops.group_norm(x, mod.num_groups, mod.weight, mod.bias, mod.eps, key, site)


def _rms_norm(mod: Any, x: Tensor, key: int, site: int) -> Tensor:
    """``F.rms_norm`` computes ``x̂ ⊙ γ`` in float32 for a low-precision ``x`` and casts
    the product to ``x``'s dtype (after autocast's cast of ``aten::rms_norm``, :mod:`.amp`);
    the same here, so the output matches bit for bit."""
    x = cast(Tensor, cast_like_aten("aten::rms_norm", x)[0])  # x in, x (maybe float32) out
    xhat = F.rms_norm(acc(x), mod.normalized_shape, None, mod.eps)
    return as_dtype(norm_ops.affine(xhat, mod.weight, None, False, key, site), x.dtype)


def _timm_rms_norm(mod: Any, x: Tensor, key: int, site: int) -> Tensor:
    """The function timm's ``RmsNorm.forward`` calls: torch's ``F.rms_norm`` where torch
    has one, else timm's composite (``x̂ ⊙ γ`` by type promotion)."""
    from timm.layers import norm as timm_norm

    if timm_norm.rms_norm is F.rms_norm:
        return _rms_norm(mod, x, key, site)
    xhat = timm_norm.rms_norm(x, list(mod.normalized_shape), None, mod.eps)
    return norm_ops.affine(xhat, mod.weight, None, False, key, site)


def _timm_rms_norm2d(mod: Any, x: Tensor, key: int, site: int) -> Tensor:
    from timm.layers import norm as timm_norm

    xhat = timm_norm.rms_norm2d(x, list(mod.normalized_shape), None, mod.eps)
    return norm_ops.affine(xhat, mod.weight, None, True, key, site)


def _drop_act(mod: Any, y: Tensor) -> Tensor:
    return mod.act(mod.drop(y))


_TABLE: Optional[dict[type[nn.Module], NormEntry]] = None
_ENTRIES: dict[type, Optional[NormEntry]] = {}  # norm_entry by module class (read per layer call)
_PROBED: dict[type, NormEntry] = {}  # RMSNorm-shaped classes an instance of which passed the probe


def _table() -> dict[type, NormEntry]:
    """Classes whose forward is exactly ``post(γ ⊙ x̂ + β)`` as ``run`` computes it."""
    global _TABLE
    if _TABLE is None:
        rows: list[tuple[type[nn.Module], str, Run, Optional[Callable[[nn.Module, Tensor], Tensor]]]] = [
            (nn.BatchNorm1d, "batchnorm", _batch_norm, None),
            (nn.BatchNorm2d, "batchnorm", _batch_norm, None),
            (nn.BatchNorm3d, "batchnorm", _batch_norm, None),
            (nn.LayerNorm, "layernorm", _layer_norm, None),
            (nn.GroupNorm, "groupnorm", _group_norm, None),
            (nn.RMSNorm, "rmsnorm", _rms_norm, None),
        ]
        try:
            from timm.layers import norm as tn
            from timm.layers.norm_act import BatchNormAct2d

            rows += [
                (tn.LayerNorm, "layernorm", _layer_norm, None),
                (tn.LayerNorm2d, "layernorm2d", _layer_norm2d, None),
                (tn.GroupNorm, "groupnorm", _group_norm, None),
                (tn.GroupNorm1, "groupnorm", _group_norm, None),
                (tn.RmsNorm, "rmsnorm", _timm_rms_norm, None),
                (tn.RmsNorm2d, "rmsnorm2d", _timm_rms_norm2d, None),
                (BatchNormAct2d, "batchnorm", _batch_norm, _drop_act),
            ]
        except Exception:  # pragma: no cover - timm missing or reorganized
            pass
        _TABLE = {cls: NormEntry(cls, kind, f, post) for cls, kind, f, post in rows}
    return _TABLE


def norm_entry(mod: nn.Module) -> Optional[NormEntry]:
    """The entry of the nearest table class in ``type(mod)``'s MRO whose ``forward`` the
    module still uses (None: not a norm layer, or its forward is overridden); the MRO is
    walked once per class."""
    cls = type(mod)
    if cls not in _ENTRIES:
        _ENTRIES[cls] = _find_entry(cls)
    return _ENTRIES[cls]


def _find_entry(mod_cls: type[nn.Module]) -> Optional[NormEntry]:
    table = _table()
    for cls in mod_cls.__mro__:
        entry = table.get(cls) or _PROBED.get(cls)
        if entry is not None:  # entry.cls is cls
            return entry if mod_cls.forward is entry.cls.forward or _is_capturing(mod_cls) else None
    return None


def _is_capturing(cls: type) -> bool:
    return cls.__dict__.get("_tengrad_capturing", False)


def is_norm_leaf(mod: nn.Module) -> bool:
    """Keep a (known) norm module as one node of the traced graph."""
    return norm_entry(mod) is not None


def match_norm(mod: nn.Module) -> tuple[Optional[str], str]:
    """``(kind, "")`` for a covered norm layer, ``(None, reason)`` for a norm layer that
    is not, ``(None, "")`` for anything else (or a norm layer without affine parameters)."""
    entry = norm_entry(mod)
    if entry is None or entry.form is not None:
        kind, why = _match_rms_shaped(mod)
        if kind is not None or why or entry is not None:
            return kind, why
    if entry is None:
        base = next((c for c in type(mod).__mro__[1:] if c in _table()), None)
        if base is not None and getattr(mod, "weight", None) is not None:
            return None, f"{type(mod).__name__} overrides {base.__name__}.forward (not provably exact)"
        return None, ""
    w = getattr(mod, "weight", None)
    if w is None:
        return None, ""
    if not isinstance(w, nn.Parameter):
        return None, "weight is not a Parameter"
    if getattr(mod, "_fast_norm", False) or getattr(mod, "fast_norm", False):
        return None, "timm fast_norm (APEX) kernels have no capture path"
    return entry.kind, ""


def _match_rms_shaped(mod: nn.Module) -> tuple[Optional[str], str]:
    """``("rmsnorm", "")`` for an RMSNorm-shaped module whose forward passes the probe
    (:mod:`.rms_probe`; its class is then captured by the probed form), ``(None, reason)``
    for one that does not, ``(None, "")`` for a module of another shape."""
    eps_name = rms_shaped(mod)
    if eps_name is None:
        return None, ""
    cls = type(mod).__dict__.get("_tengrad_base", type(mod))
    form = probe_form(mod, eps_name)
    if form is None:
        return None, (f"{cls.__name__}: RMSNorm-shaped, but on a probe its forward is not x̂·γ or x̂·(1+γ) "
                      f"with x̂ = x·rsqrt(mean(x²) + {eps_name}) (not provably exact)")
    entry = _PROBED.get(cls)
    if entry is None:
        _PROBED[cls] = NormEntry(cls, "rmsnorm", run_form(form, eps_name), form=(form, eps_name))
        _ENTRIES.clear()  # classes cached without an entry are looked up again
    elif entry.form != (form, eps_name):
        first = entry.form[0] if entry.form is not None else entry.kind
        return None, f"{cls.__name__}: instances compute different RMSNorm forms on the probe ({first}, {form})"
    return "rmsnorm", ""


def normalized_ndim(mod: nn.Module) -> int:
    """Number of trailing dims a trailing-kind norm layer normalizes (its weight's dims
    for an RMSNorm-shaped module without ``normalized_shape``)."""
    shape = getattr(mod, "normalized_shape", None)
    return len(shape) if shape is not None else _weight(mod).dim()


def _weight(mod: nn.Module) -> Tensor:
    """A covered norm layer's ``γ`` (:func:`match_norm` checked it is a Parameter)."""
    return cast(Tensor, mod.weight)


def norm(x: Tensor, mod: nn.Module, key: int, site: int, batch: Optional[int] = None,
         name: str = "") -> Tensor:
    """The norm module ``mod`` applied to ``x``, recording ``(x̂, dL/dy)`` when capture is on.

    x: ``[m, ...]`` as the module takes it; returns the module's output. With capture
    off (or no grad) this is the module's own forward.
    """
    entry = norm_entry(mod)
    assert entry is not None, f"{type(mod).__name__} is not a captured norm layer"
    if ops.PROBE is not None:
        ops.probe(key, site, x)
    if not ops._active(key, x, _weight(mod)):
        bias = getattr(mod, "bias", None)  # RMSNorm has none
        if bias is None or not (bias.requires_grad and ops.ENABLED.get(key, False) and torch.is_grad_enabled()):
            return entry.cls.forward(mod, x)
        # a frozen γ and a trainable β: the plain affine output through the bias site
        channel_first = entry.kind in CHANNEL_FIRST or entry.kind == "layernorm2d"
        keep = 0 if channel_first else normalized_ndim(mod)
        y = ops.bias_only(entry.affine(mod, x), bias, channel_first, keep, key, site, batch, name)
        return entry.post(mod, y) if entry.post is not None else y
    fold = FOLDS.get((key, site)) if FOLDS else None
    if fold is not None:  # a folded batch (trailing kinds only, see fold.FOLDABLE)
        keep = normalized_ndim(mod)
        y = entry.run(mod, fold_rows(x, fold, keep, name, ops.SAMPLES.get(key)), key, site)
        y = unfold_rows(y, fold, x.shape[:x.dim() - keep])
    else:
        if batch is not None:
            ops._check_batch(x, batch, name)
        y = entry.run(mod, x, key, site)
    return entry.post(mod, y) if entry.post is not None else y
