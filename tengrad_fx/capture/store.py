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

Gradient accumulation: a capturing forward after a completed capture either starts a new
micro-batch, keeping the records captured so far (:attr:`CaptureStore.parts`), while the
covered parameters still hold gradients and no optimizer step has taken the records since
(the gradients accumulate, so does the curvature); or, after a step or a
``zero_grad()`` (``set_to_none=True``, torch's default), releases them (see :meth:`begin`;
a ``zero_grad()`` between that forward and its backward releases them at the backward's
first record).
:meth:`CaptureStore.merge` joins the micro-batches' records into one record per call of
``M = Σ_j m_j`` rows (:func:`union`); the optimizers take that union at their step
(:meth:`CaptureStore.consume`), and every curvature read merges first.
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

from . import record_guard
from .amp import LOW_PRECISION
from .record import Record
from .union import padded, samples_held, union, union_samples_held

__all__ = ["CaptureStore", "Record", "lookup", "samples_held", "union", "union_samples_held"]

_KEYS = itertools.count(1)
_STORES: "weakref.WeakValueDictionary[int, CaptureStore]" = weakref.WeakValueDictionary()


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
    parts: list[dict[int, list[Record]]] = field(default_factory=list)  # earlier micro-batches, not merged yet
    params: list[torch.Tensor] = field(default_factory=list)  # covered parameters: gradients held = accumulating
    consumed: bool = False  # an optimizer step took the records: the next capture starts afresh
    sampled: bool = False  # the optimizer's own backward (MC, Gauss-Newton) ran for this micro-batch
    scored: Optional[torch.Tensor] = None  # bool [m, L]: the positions this micro-batch's loss scores (.scored)
    scored_parts: list[Optional[torch.Tensor]] = field(default_factory=list)  # those of the earlier micro-batches
    _complete: bool = False  # a backward has recorded since the last begin()
    generation: int = 0  # how many captures have completed (for users caching results)
    _finalized: int = 0  # the generation finalize() last converted
    site_names: dict[int, str] = field(default_factory=dict)  # site -> layer name (for errors)
    _watched: list[record_guard.Watched] = field(default_factory=list)  # fingerprinted, not yet verified
    _verified: set[tuple] = field(default_factory=set)  # (site, shapes) checked

    def __post_init__(self) -> None:
        _STORES[self.key] = self

    def begin(self) -> None:
        """Called by the capturing forward: after a completed capture, start the next
        micro-batch once. Its records join the union (:attr:`parts`) while the covered
        parameters still hold gradients and no step consumed the records; else they are dropped."""
        if not (self._complete or self.sampled or self.consumed):
            return
        if self.consumed or not self._grads_held():
            self.parts, self.scored_parts = [], []
            self.records = {}
            self._watched = []  # never read: their sites are fingerprinted again next time
        elif self.records:
            self.parts.append(self.records)
            self.scored_parts.append(self.scored)
            self.records = {}
        self.scored = None
        self._complete = self.sampled = self.consumed = False
        self.recording = True

    def _grads_held(self) -> bool:
        """Does a covered parameter hold a gradient (host check)?"""
        return any(p.grad is not None for p in self.params)

    def end_sampled(self) -> None:
        """The optimizer's own backward of this micro-batch has run (:mod:`tengrad_fx.optim.step.mc`):
        the training backward records nothing; the next capturing forward starts a micro-batch."""
        self.recording = False
        self.sampled = True

    def scale_own(self, c: torch.Tensor) -> None:
        """The current micro-batch's records of the optimizer's own loss times ``c`` (a device
        scalar; :func:`tengrad_fx.optim.step.mc.mc_capture`'s normalization)."""
        for recs in self.records.values():
            for r in recs:
                if r.own_loss:
                    r.scale(c)

    def wants_jacobian(self, site: int) -> bool:
        """Should the backward op of ``site`` materialize per-sample gradients now?"""
        return self.recording and site in self.jacobian_sites

    def record(self, site: int, rec: Record) -> None:
        """Append a record for ``site`` (called from the capture ops' backward)."""
        if not self.recording or site in self.ignored_sites:
            return
        if not self._complete:
            if self.parts and not self._grads_held():  # zero_grad() since the forward: afresh
                self.parts, self.scored_parts = [], []
            self.generation += 1
            self._complete = True
        rec.own_loss = self.grad_only
        self.records.setdefault(site, []).append(rec)
        record_guard.note(self, site, rec)

    def watch(self, site: int, rec: Record, always: bool) -> None:
        """Fingerprint ``rec`` (recorded by a custom op, :mod:`.record_guard`) unless a record of
        the same site and shapes was verified before (``always``: every time)."""
        sig = (site, *(None if t is None else tuple(t.shape) for t in (rec.I, rec.G, rec.P, rec.Gsum)))
        if always or sig not in self._verified:
            self._watched.extend(record_guard.watch(rec, site, sig))

    def verify_records(self) -> None:
        """Raise :class:`~.record_guard.RecordOverwritten` if a fingerprinted record changed since
        it was recorded (:mod:`.record_guard`); free when nothing is fingerprinted."""
        if self._watched:
            watched, self._watched = self._watched, []
            record_guard.verify(watched, self.site_names)
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
        self.consumed = True
        if not self.needs_finalize():
            return
        self._finalized = self.generation
        if inv_scale is None and not self.needs_conversion():
            return
        for recs in self.records.values():
            for r in recs:
                r.finalize(inv_scale)

    def keep_samples(self, k: int, part: int = 0, parts: int = 1) -> bool:
        """Every record cut to the samples among the batch's first ``k`` (:meth:`Record.first`;
        the full batch's tensors are released; a record cut already is kept). With ``parts > 1``
        the ``m`` samples held here are part ``part`` of a batch of ``parts·m`` (rank order):
        a record keeps its first ``min(m, max(0, k − part·m))``; of accumulated micro-batches,
        its share of each (:func:`union_samples_held`). Returns whether the records of the whole
        batch are now a subsample of the loss's batch (fewer than ``parts·m`` rows)."""
        def held(r: Record) -> int:
            return union_samples_held(k, r.micro or (r.m,), part, parts)
        for site, recs in self.records.items():
            if any(not r.batch and held(r) < r.m for r in recs):
                self.records[site] = [r.first(held(r)) if not r.batch and held(r) < r.m else r for r in recs]
        return any(r.m < r.loss_batch or k < parts * r.loss_batch for recs in self.records.values() for r in recs)

    def merge(self, loss_reduction: str) -> None:
        """Join the micro-batches captured since the last step (:attr:`parts` and the
        current :attr:`records`) into :attr:`records`, one :func:`union` per call; free
        when there is one micro-batch."""
        if not self.parts:
            return
        self.verify_records()
        parts = [*self.parts, self.records] if self.records else self.parts
        masks = [*self.scored_parts, self.scored] if self.records else self.scored_parts
        self.parts, self.scored_parts = [], []
        scored = None if any(m is None for m in masks) else [m for m in masks if m is not None]
        self.records = union(parts, loss_reduction == "mean", self.site_names, scored)
        self.scored = None if scored is None else torch.cat(padded(scored, "the scored positions"), 0)

    def consume(self, loss_reduction: str) -> None:
        """An optimizer step takes the records: :meth:`merge`, and the next capturing
        forward starts afresh."""
        self.merge(loss_reduction)
        self.consumed = True

    def clear(self) -> None:
        """Release every captured tensor."""
        self.parts, self.scored_parts = [], []
        self.records = {}
        self.scored = None
        self._complete = False
        self._watched = []


def lookup(key: int) -> CaptureStore:
    """The live store registered under ``key``."""
    try:
        return _STORES[key]
    except KeyError:  # pragma: no cover - only if a model was freed mid-backward
        raise RuntimeError(f"tengrad_fx: capture store {key} no longer exists") from None
