"""``capturing``: switch a prepared model's capture on or off at run time."""
from __future__ import annotations

import torch.nn as nn

from . import ops
from .info import get_info

__all__ = ["capturing"]


class capturing:
    """Switch capture on or off for a prepared model; restores on exit when used in ``with``.

    ``tengrad_fx.capturing(model, False)`` turns capture off until turned on again;
    ``with tengrad_fx.capturing(model, False): ...`` turns it off for the block only.
    While off (and under ``torch.no_grad()``), covered layers run plain aten ops and no
    tensor is retained.
    """

    def __init__(self, model: nn.Module, enabled: bool = True):
        key = get_info(model).store.key
        self._key, self._prev = key, ops.ENABLED.get(key, False)
        ops.ENABLED[key] = bool(enabled)

    def __enter__(self) -> "capturing":
        return self

    def __exit__(self, *exc: object) -> None:
        ops.ENABLED[self._key] = self._prev
