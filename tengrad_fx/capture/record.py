"""One call's capture: :class:`Record`, the layer input ``I`` and output gradient ``G`` of
one call (``[m, *]`` each), or the materialized per-sample gradients ``P``/``Gsum``
(:mod:`.store` holds them per call site; :mod:`.union` joins micro-batches' records)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .amp import LOW_PRECISION

__all__ = ["Record", "times"]


@dataclass
class Record:
    """One call's capture: ``I``/``G`` as given, or the materialized ``P``/``Gsum``."""

    I: Optional[torch.Tensor]
    G: Optional[torch.Tensor]
    P: Optional[torch.Tensor] = None
    Gsum: Optional[torch.Tensor] = None
    in_shape: tuple[int, ...] = ()  # shape of the layer input (kept when I is not)
    batch: int = 0  # samples the loss was reduced over, when the record keeps only the first of them (0: m)
    # G of the optimizer's own loss (MC, Gauss-Newton): a mean over loss_batch samples (set by the store)
    own_loss: bool = field(default=False, init=False)
    micro: tuple[int, ...] = field(default=(), init=False)  # a union's: each joined micro-batch's samples

    def __post_init__(self) -> None:
        # detached: a record must not keep the autograd graph (or give results with grad);
        # a tensor without grad is kept as is (an output gradient in backward: no detach op).
        # Written out (no getattr/setattr loop): one record per layer call.
        if self.I is not None:
            if self.I.requires_grad:
                self.I = self.I.detach()
            if not self.in_shape:
                self.in_shape = tuple(self.I.shape)
        if self.G is not None and self.G.requires_grad:
            self.G = self.G.detach()
        if self.P is not None and self.P.requires_grad:
            self.P = self.P.detach()
        if self.Gsum is not None and self.Gsum.requires_grad:
            self.Gsum = self.Gsum.detach()

    def finalize(self, inv_scale: Optional[torch.Tensor]) -> None:
        """Low-precision floating tensors to float32; ``G``, ``P``, ``Gsum`` times
        ``inv_scale`` (``1 / loss scale``, a device scalar; None: unscaled). Integer ``I``
        (embedding indices) is left alone."""
        if self.I is not None and self.I.dtype in LOW_PRECISION:
            self.I = self.I.float()
        for name in ("G", "P", "Gsum"):
            t = getattr(self, name)
            if t is None:
                continue
            if t.dtype in LOW_PRECISION:
                t = t.float()
            if inv_scale is not None:
                t = t * inv_scale.to(t.dtype)
            setattr(self, name, t)

    def scale(self, c: torch.Tensor) -> None:
        """``G``, ``P``, ``Gsum`` times the device scalar ``c`` (low precision to float32)."""
        for name in ("G", "P", "Gsum"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, times(t, c))

    @property
    def m(self) -> int:
        """Samples (rows) the record holds."""
        t = self.I if self.I is not None else self.P
        assert t is not None
        return t.shape[0]

    @property
    def loss_batch(self) -> int:
        """Samples the loss was reduced over: :attr:`m`, or more for a record that keeps
        the first :attr:`m` of them (:meth:`first`)."""
        return self.batch or self.m

    def first(self, k: int) -> "Record":
        """The first ``k`` samples' rows, as copies (the full batch's tensors can be freed);
        :attr:`loss_batch` stays this record's."""
        def rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[:k].clone()
        return self._like(Record(rows(self.I), rows(self.G), rows(self.P), rows(self.Gsum), (k, *self.in_shape[1:]),
                                 self.loss_batch))

    def _like(self, rec: "Record") -> "Record":
        """``rec`` with this record's :attr:`own_loss`."""
        rec.own_loss = self.own_loss
        return rec


def times(t: torch.Tensor, c: float | torch.Tensor) -> torch.Tensor:
    """``t · c`` (low precision to float32 first; ``c = 1.0`` returns ``t`` itself)."""
    if isinstance(c, float) and c == 1.0:
        return t
    t = t.float() if t.dtype in LOW_PRECISION else t
    return t * (c.to(t.dtype) if isinstance(c, torch.Tensor) else c)
