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
:meth:`CaptureStore.keep_samples` cuts every record to the first ``k`` samples of the batch
(``TENGraD(curvature_samples=k)``); such a record keeps the loss's batch size in ``batch``,
since the per-sample scale of ``G`` (``m`` for a mean loss) is the loss's, not the record's.

Mixed precision: under ``torch.autocast`` the records arrive in the dtype autograd
delivers (``I``, ``G`` of Linear/conv in bfloat16/float16: half the memory of float32
between the backward and the step; ``P``, ``Gsum`` are computed in float32 by the capture
ops), and with a ``GradScaler`` every ``G``/``P``/``Gsum`` carries the loss scale. The
optimizer's step calls :meth:`CaptureStore.finalize` once per capture, which converts
them to float32 and divides by the loss scale; the curvature (Gram, solve, update) only
ever sees float32, unscaled records.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import kept
from .amp import LOW_PRECISION

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
    batch: int = 0  # samples the loss was reduced over, when the record keeps only the first of them (0: m)

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
        return Record(rows(self.I), rows(self.G), rows(self.P), rows(self.Gsum), (k, *self.in_shape[1:]),
                      self.loss_batch)


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
    transposed_sites: frozenset[int] = frozenset()  # linears with weight [d_in, d_out]: P in that layout
    onehot_sites: set[int] = field(default_factory=set)  # embedding lookups tied to a Linear: linear records
    records: dict[int, list[Record]] = field(default_factory=dict)
    _complete: bool = False  # a backward has recorded since the last begin()
    generation: int = 0  # how many captures have completed (for users caching results)
    _finalized: int = 0  # the generation finalize() last converted
    site_names: dict[int, str] = field(default_factory=dict)  # site -> layer name (for errors)
    _watched: list[kept.Watched] = field(default_factory=list)  # fingerprinted, not yet verified
    _verified: set[tuple] = field(default_factory=set)  # (site, shapes) checked

    def __post_init__(self) -> None:
        _STORES[self.key] = self

    def begin(self) -> None:
        """Called by the capturing forward: drop the previous step's records once."""
        if self._complete:
            self.records = {}
            self._complete = False
            self._watched = []  # never read: their sites are fingerprinted again next time

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
        kept.note(self, site, rec)

    def watch(self, site: int, rec: Record, always: bool) -> None:
        """Fingerprint ``rec`` (recorded by a custom op, :mod:`.kept`) unless a record of
        the same site and shapes was verified before (``always``: every time)."""
        sig = (site, *(None if t is None else tuple(t.shape) for t in (rec.I, rec.G, rec.P, rec.Gsum)))
        if always or sig not in self._verified:
            self._watched.extend(kept.watch(rec, site, sig))

    def verify_records(self) -> None:
        """Raise :class:`~.kept.RecordOverwritten` if a fingerprinted record changed since
        it was recorded (:mod:`.kept`); free when nothing is fingerprinted."""
        if self._watched:
            watched, self._watched = self._watched, []
            kept.verify(watched, self.site_names)
            self._verified.update(w.sig for w in watched)

    def needs_finalize(self) -> bool:
        """Are there records of a capture :meth:`finalize` has not converted yet?"""
        return self._finalized != self.generation and bool(self.records)

    def mark_finalized(self) -> None:
        """The records now held are float32 and unscaled already (restored from a checkpoint)."""
        self._finalized = self.generation

    def needs_conversion(self) -> bool:
        """Does any record hold a low-precision floating tensor (host check only)?"""
        return any(t is not None and t.dtype in LOW_PRECISION
                   for recs in self.records.values() for r in recs for t in (r.I, r.G, r.P, r.Gsum))

    def finalize(self, inv_scale: Optional[torch.Tensor] = None) -> None:
        """Once per capture (the optimizers call it at the step): every record in float32,
        its ``G``/``P``/``Gsum`` divided by the loss scale (``inv_scale = 1/scale``, a device
        scalar, None for none). Without autocast and without a scale nothing is touched
        (no op dispatched)."""
        self.verify_records()
        if not self.needs_finalize():
            return
        self._finalized = self.generation
        if inv_scale is None and not self.needs_conversion():
            return
        for recs in self.records.values():
            for r in recs:
                r.finalize(inv_scale)

    def keep_samples(self, k: int) -> bool:
        """Every record of more than ``k`` samples cut to its first ``k`` (:meth:`Record.first`;
        the full batch's tensors are released; a record cut already is kept). Returns whether
        the records now held are a subsample of the loss's batch (fewer rows than
        :attr:`Record.loss_batch`)."""
        for site, recs in self.records.items():
            if any(not r.batch and r.m > k for r in recs):
                self.records[site] = [r.first(k) if not r.batch and r.m > k else r for r in recs]
        return any(r.m < r.loss_batch for recs in self.records.values() for r in recs)

    def clear(self) -> None:
        """Release every captured tensor."""
        self.records = {}
        self._complete = False
        self._watched = []


def lookup(key: int) -> CaptureStore:
    """The live store registered under ``key``."""
    try:
        return _STORES[key]
    except KeyError:  # pragma: no cover - only if a model was freed mid-backward
        raise RuntimeError(f"tengrad_fx: capture store {key} no longer exists") from None
