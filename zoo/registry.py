"""Model registry: ``get_model(name, num_classes, in_chans, **kwargs)``.

Paper models (parameter counts at ``num_classes=10`` and the default ``in_chans``)::

    name          input          params
    3c1f          1 x 28 x 28    5,485,958
    wrn-28-4      3 x 32 x 32    5,849,050
    densenet-19   3 x 32 x 32    2,939,610
    mobilenetv2   3 x 32 x 32    2,296,922

Any timm or torchvision architecture is also reachable, always randomly initialised
(no weights are downloaded):

* ``timm:<name>`` -> ``timm.create_model(name, pretrained=False, num_classes=...,
  in_chans=..., **kwargs)`` (pass e.g. ``img_size=32`` for ViTs).
* ``torchvision:<name>`` -> ``torchvision.models.get_model(name, weights=None,
  num_classes=..., **kwargs)``; if ``in_chans != 3`` the first ``nn.Conv2d`` is
  replaced by a freshly initialised one with the same configuration and ``in_chans``
  inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..utils.optional import require
from .models import C3F1, DenseNetBC, MobileNetV2, WideResNet

__all__ = ["PAPER_MODELS", "PARAM_COUNTS", "get_model", "model_names"]

_Builder = Callable[..., nn.Module]

PAPER_MODELS: dict[str, tuple[_Builder, int]] = {
    # name: (builder(num_classes=, in_chans=, **kwargs), default in_chans)
    "3c1f": (C3F1, 1),
    "3c1f-bn": (lambda **kw: C3F1(batch_norm=True, **kw), 1),
    "wrn-28-4": (lambda **kw: WideResNet(depth=28, widen_factor=4, **kw), 3),
    "densenet-19": (lambda **kw: DenseNetBC(depth=19, growth_rate=100, reduction=0.5, **kw), 3),
    "mobilenetv2": (MobileNetV2, 3),
}

PARAM_COUNTS: dict[str, int] = {
    "3c1f": 5_485_958,
    "3c1f-bn": 5_486_726,
    "wrn-28-4": 5_849_050,
    "densenet-19": 2_939_610,
    "mobilenetv2": 2_296_922,
}
"""Trainable parameter count of each paper model at ``num_classes=10``, default ``in_chans``."""

_PREFIXES = ("timm:", "torchvision:")


def model_names() -> list[str]:
    """Valid names for :func:`get_model` (the prefixed families shown as patterns)."""
    return [*PAPER_MODELS, "timm:<name>", "torchvision:<name>"]


def _replace_first_conv(model: nn.Module, in_chans: int) -> None:
    """Swap the first ``nn.Conv2d`` (module order) for one taking ``in_chans`` inputs."""
    for qualname, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            if module.groups != 1:
                raise ValueError(f"cannot adapt grouped first convolution {qualname!r} to in_chans={in_chans}")
            new = nn.Conv2d(
                in_chans,
                module.out_channels,
                kernel_size=module.kernel_size,  # type: ignore[arg-type]
                stride=module.stride,  # type: ignore[arg-type]
                padding=module.padding,  # type: ignore[arg-type]
                dilation=module.dilation,  # type: ignore[arg-type]
                groups=1,
                bias=module.bias is not None,
                padding_mode=module.padding_mode,
            ).to(device=module.weight.device, dtype=module.weight.dtype)
            parent_name, _, attr = qualname.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, new)
            return
    raise ValueError("model has no nn.Conv2d to adapt to in_chans")


def get_model(name: str, num_classes: int = 10, in_chans: int | None = None, **kwargs: Any) -> nn.Module:
    """Build a randomly initialised model by name.

    Args:
        name: a paper model (``3c1f``, ``wrn-28-4``, ``densenet-19``, ``mobilenetv2``;
            case-insensitive), ``timm:<name>`` or ``torchvision:<name>``.
        num_classes: output size.
        in_chans: input channels; defaults to 1 for ``3c1f`` and 3 otherwise.
        **kwargs: forwarded to the constructor (e.g. ``dropout`` for WRN,
            ``img_size`` for timm ViTs).

    Returns:
        An ``nn.Module`` mapping N x in_chans x H x W to N x num_classes logits.

    Raises:
        ValueError: unknown name (the message lists the valid names), or an unknown
            timm / torchvision architecture.
    """
    key = name.strip()
    if key.startswith("timm:"):
        timm = require("timm", "zoo", f"model {key!r}")
        if not timm.is_model(key[5:]):
            raise ValueError(f"unknown timm model {key[5:]!r} (see timm.list_models())")
        chans = 3 if in_chans is None else in_chans
        return timm.create_model(key[5:], pretrained=False, num_classes=num_classes, in_chans=chans, **kwargs)
    if key.startswith("torchvision:"):
        torchvision = require("torchvision", "zoo", f"model {key!r}")
        if key[12:] not in torchvision.models.list_models():
            raise ValueError(f"unknown torchvision model {key[12:]!r} (see torchvision.models.list_models())")
        chans = 3 if in_chans is None else in_chans
        model = torchvision.models.get_model(key[12:], weights=None, num_classes=num_classes, **kwargs)
        if chans != 3:
            _replace_first_conv(model, chans)
        return model
    entry = PAPER_MODELS.get(key.lower())
    if entry is None:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(model_names())}")
    builder, default_chans = entry
    chans = default_chans if in_chans is None else in_chans
    return builder(num_classes=num_classes, in_chans=chans, **kwargs)
