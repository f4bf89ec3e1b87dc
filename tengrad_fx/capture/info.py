"""What :func:`tengrad_fx.prepare` did to a model, kept on the prepared module."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch.nn as nn

from .match import LayerSpec
from .store import CaptureStore

__all__ = ["PrepareInfo", "get_info", "ATTR"]

ATTR = "_tengrad_fx"


@dataclass
class PrepareInfo:
    """Facts about a prepared model.

    * ``layers``: covered layers, in graph order.
    * ``covered``: parameter name -> covering layer name.
    * ``fallback``: parameter name -> why it is updated by plain SGD-momentum.
    * ``method``: ``"fx"`` (one graph), ``"fx-dual"`` (separate train/eval graphs,
      because tracing in each mode gave different code), or ``"surgery"`` (tracing failed;
      covered modules' classes swapped for capturing ones), with ``trace_error``.
    * ``verified``: whether each layer's sample dimension was checked by probing at two
      batch sizes (needs ``example_inputs``); otherwise it is checked at run time.
    """

    layers: list[LayerSpec]
    covered: dict[str, str]
    fallback: dict[str, str]
    store: CaptureStore
    loss_reduction: Literal["mean", "sum"]
    method: Literal["fx", "fx-dual", "surgery"]
    verified: bool
    trace_error: str = ""
    notes: list[str] = field(default_factory=list)


def get_info(model: nn.Module) -> PrepareInfo:
    """The :class:`PrepareInfo` of a prepared model; a clear error for any other."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module prepared by tengrad_fx.prepare(), got {type(model).__name__}")
    mod = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    info = mod.__dict__.get(ATTR)
    if info is None:
        raise ValueError(
            f"{type(mod).__name__} was not prepared: call model = tengrad_fx.prepare(model) first"
        )
    return info
