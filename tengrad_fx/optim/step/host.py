"""What a step tells the host without waiting for the device: :class:`HostMirror`, and
:class:`SkipStep`, raised inside a step to skip it."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["SkipStep", "HostMirror"]


class SkipStep(RuntimeError):
    """Raised inside a step to skip it (parameters and curvature left unchanged)."""


class HostMirror:
    """A small device tensor copied to the host without waiting: :meth:`post` starts a
    non-blocking copy (pinned memory + an event on CUDA), :meth:`poll` returns the values
    once the copy has landed (else None), never blocking and dispatching no aten op."""

    def __init__(self, like: Tensor):
        self._cuda = like.is_cuda
        self._host = torch.zeros(like.shape, dtype=like.dtype, pin_memory=self._cuda)
        self._event = torch.cuda.Event() if self._cuda else None
        self._pending = False

    def post(self, t: Tensor) -> None:
        if self._pending and self._event is not None and not self._event.query():
            return  # the last copy is still in flight: keep it
        self._host.copy_(t, non_blocking=True)
        if self._event is not None:
            self._event.record()
        self._pending = True

    def reset(self) -> None:
        """Forget a copy in flight (its values are out of date)."""
        self._pending = False

    def poll(self) -> Optional[list[Any]]:
        if not self._pending or (self._event is not None and not self._event.query()):
            return None
        self._pending = False
        return self._host.numpy().tolist()  # host memory: no dispatch, no device wait
