"""Where captured layer inputs I and output gradients G live between steps.

One :class:`CaptureStore` belongs to one prepared model. Each rewritten call site of a
covered layer has an integer ``site``; the capture ops look the store up by an integer
``key`` (so that compiled graphs carry only ints, never Python objects) and append a
record ``(I, G)`` for that site during the backward pass.

Layout of a record:
  * ``I``: the layer input exactly as the layer received it, ``[m, *]``
    (Linear: ``[m, *, d_in]``; ConvNd: ``[m, c_in, *spatial]``).
  * ``G``: gradient of the loss w.r.t. the layer output, ``[m, *]``, as autograd
    delivered it (with a mean-reduced loss it carries a factor ``1/m``).

For sites in ``jacobian_sites`` (chosen by the optimizer's cost model) the backward op
instead stores the per-sample weight gradients ``P`` (``[m, weight.numel()]``, computed in
place of the weight gradient, which is then ``P.sum(0)``) and ``Gsum`` (``[m, d_out]``, the
per-sample bias gradients); ``I`` and ``G`` are then not retained.

A new capturing forward releases the previous step's records (see :meth:`begin`).
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["CaptureStore", "Record", "lookup"]

_KEYS = itertools.count(1)
_STORES: "weakref.WeakValueDictionary[int, CaptureStore]" = weakref.WeakValueDictionary()


@dataclass
class Record:
    """One call's capture: ``I``/``G`` as given, or the materialized ``P``/``Gsum``."""

    I: Optional[torch.Tensor]
    G: Optional[torch.Tensor]
    P: Optional[torch.Tensor] = None
    Gsum: Optional[torch.Tensor] = None
    in_shape: tuple[int, ...] = ()  # shape of the layer input (kept when I is not)

    def __post_init__(self) -> None:
        # detached: a record must not keep the autograd graph (or give results with grad)
        for name in ("I", "G", "P", "Gsum"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.detach())
        if self.I is not None and not self.in_shape:
            self.in_shape = tuple(self.I.shape)

    @property
    def m(self) -> int:
        t = self.I if self.I is not None else self.P
        assert t is not None
        return t.shape[0]


@dataclass
class CaptureStore:
    """Captured ``(I, G)`` records of one prepared model, by call site."""

    n_sites: int
    key: int = field(default_factory=lambda: next(_KEYS))
    enabled: bool = True  # capture on forwards with grad enabled
    recording: bool = True  # append records in backward
    grad_only: bool = False  # backward ops skip weight/bias grads (MC-Fisher pass: only G matters)
    jacobian_sites: set[int] = field(default_factory=set)  # backward materializes P there
    ignored_sites: set[int] = field(default_factory=set)  # fallback layers: never recorded
    records: dict[int, list[Record]] = field(default_factory=dict)
    _complete: bool = False  # a backward has recorded since the last begin()
    generation: int = 0  # how many captures have completed (for users caching results)

    def __post_init__(self) -> None:
        _STORES[self.key] = self

    def begin(self) -> None:
        """Called by the capturing forward: drop the previous step's records once."""
        if self._complete:
            self.records = {}
            self._complete = False

    def wants_jacobian(self, site: int) -> bool:
        """Should the backward op of ``site`` materialize per-sample gradients now?"""
        return self.recording and site in self.jacobian_sites

    def record(self, site: int, rec: Record) -> None:
        """Append a record for ``site`` (called from the capture ops' backward)."""
        if not self.recording or site in self.ignored_sites:
            return
        if not self._complete:
            self.generation += 1
            self._complete = True
        self.records.setdefault(site, []).append(rec)

    def clear(self) -> None:
        """Release every captured tensor."""
        self.records = {}
        self._complete = False


def lookup(key: int) -> CaptureStore:
    """The live store registered under ``key``."""
    try:
        return _STORES[key]
    except KeyError:  # pragma: no cover - only if a model was freed mid-backward
        raise RuntimeError(f"tengrad_fx: capture store {key} no longer exists") from None
