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

__all__ = ["CaptureStore", "Record", "lookup", "samples_held", "union", "union_samples_held"]

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
                setattr(self, name, _times(t, c))

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
        self.scored = None if scored is None else torch.cat(_padded(scored, "the scored positions"), 0)

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


def samples_held(k: int, m: int, part: int = 0, parts: int = 1) -> int:
    """How many of the global batch's first ``k`` samples lie in part ``part`` of ``parts``
    equal parts of ``m`` samples each (rank order): ``min(m, max(0, k − part·m))``."""
    assert 0 <= part < parts
    return min(m, max(0, k - part * m))


def union_samples_held(k: int, micro: tuple[int, ...], part: int = 0, parts: int = 1) -> int:
    """How many of the global batch's first ``k`` samples lie in part ``part``'s union of
    micro-batches of ``micro = (m_0, m_1, ...)`` samples each. The global batch is the
    micro-batches in order, each the ``parts`` parts' (equal) ones in part order, so the
    part's micro-batch ``j`` holds positions ``parts·E_j + part·m_j`` to ``+ m_j``
    (``E_j = Σ_{i<j} m_i``): increasing along the union's rows, so the count is a prefix."""
    held, earlier = 0, 0
    for m in micro:
        held += samples_held(k - parts * earlier, m, part, parts)
        earlier += m
    return held


def union(parts: list[dict[int, list[Record]]], mean: bool, names: Optional[dict[int, str]] = None,
          scored: Optional[list[torch.Tensor]] = None) -> dict[int, list[Record]]:
    """The records of several micro-batches (``parts``, in order) as those of one batch:
    per call site and call, the rows concatenated (``[Σ_j m_j, *]``). Trailing dims that
    differ (sequences of other lengths) are zero-padded at the end: a padded position has
    zero ``I`` and ``G`` and adds nothing (for a convolution: with zero padding, not with
    ``padding_mode`` ``"circular"``/``"reflect"``, which read the far end). A call or site
    a micro-batch lacks (the layer was not called for its samples) gets zero rows: those
    samples' gradients are zero.

    The per-sample scale of the union (``loss_batch``) is ``U = Σ_j loss_batch_j``. Rows
    of the training loss keep their ``G`` as captured: with ``mean`` (``loss_reduction="mean"``)
    the accumulated loss reads as a mean over the ``U`` samples, so sample ``i``'s row is
    ``U`` times its term of the accumulated gradient (``∂ℓ_i/∂W`` when micro-batch ``j``'s
    loss is its mean times ``m_j/U``, or ``1/k`` of ``k`` equal ones). Rows of the
    optimizer's own loss (:attr:`Record.own_loss`, each micro-batch's mean) are rescaled
    by ``loss_batch_j/U``, which keeps every row ``∂ℓ_i/∂W``. ``names``: site → layer name (errors).

    ``scored`` (bool ``[m_j, L_j]`` per part: the positions each micro-batch's loss scores,
    :mod:`.scored`): the optimizer's own loss of micro-batch ``j`` is the mean over its
    ``N_j`` scored positions, and its rows are rescaled by ``N_j/N`` (``N = Σ_j N_j``, a
    device scalar) instead, so they are those of the mean over the whole batch's scored
    positions (equal to ``loss_batch_j/U`` for equal, unpadded sequences)."""
    order: dict[int, None] = {}
    for part in parts:
        order.update(dict.fromkeys(part))
    firsts = [next(iter(part.values()))[0] for part in parts]
    weights = _scored_weights(scored) if mean and scored is not None and len(scored) == len(parts) else None
    out: dict[int, list[Record]] = {}
    for site in order:
        calls = [part.get(site, []) for part in parts]
        n = max(len(c) for c in calls)
        template = [next(c[i] for c in calls if len(c) > i) for i in range(n)]
        out[site] = [_join([c[i] if len(c) > i else _zeros(template[i], first) for c, first in zip(calls, firsts)],
                           mean, (names or {}).get(site, f"site {site}"), weights) for i in range(n)]
    return out


def _scored_weights(scored: list[torch.Tensor]) -> list[torch.Tensor]:
    """``N_j / N`` per part (device scalars): each micro-batch's share of the scored positions."""
    counts = [m.sum(dtype=torch.float64) for m in scored]
    total = torch.stack(counts).sum().clamp(min=1)
    return [c / total for c in counts]


def _zeros(template: Record, first: Record) -> Record:
    """Zero rows for a micro-batch whose first record is ``first``, shaped as ``template``."""
    def z(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.new_zeros(first.m, *t.shape[1:])
    return template._like(Record(z(template.I), z(template.G), z(template.P), z(template.Gsum),
                                 (first.m, *template.in_shape[1:]), first.batch))


def _join(recs: list[Record], mean: bool, name: str, weights: Optional[list[torch.Tensor]] = None) -> Record:
    """One record of the rows of ``recs`` (:func:`union`; ``weights``: the own loss's per-part
    scale where the scored positions are known)."""
    U = sum(r.loss_batch for r in recs)
    rows = sum(r.m for r in recs)
    fields: dict[str, Optional[torch.Tensor]] = {}
    for f in ("I", "G", "P", "Gsum"):
        ts = [getattr(r, f) for r in recs]
        if all(t is None for t in ts):
            fields[f] = None
            continue
        if any(t is None for t in ts):
            raise RuntimeError(f"layer '{name}': the accumulated micro-batches captured different fields "
                               f"({f} in some, not in others); keep the model's capture settings fixed within "
                               "an optimizer step")
        tensors = [t for t in ts if t is not None]
        if f != "I" and mean:
            scales: list[float | torch.Tensor] = [r.loss_batch / U for r in recs] if weights is None else list(weights)
            tensors = [_times(t, c) if r.own_loss else t for t, r, c in zip(tensors, recs, scales)]
        fields[f] = torch.cat(_padded(tensors, name), 0)
    in_shape = (rows, *(max(d) for d in zip(*(r.in_shape[1:] for r in recs))))
    rec = Record(fields["I"], fields["G"], fields["P"], fields["Gsum"], in_shape,
                 U if any(r.batch for r in recs) or rows != U else 0)
    rec.own_loss = all(r.own_loss for r in recs)
    rec.micro = sum((r.micro or (r.m,) for r in recs), ())
    return rec


def _times(t: torch.Tensor, c: float | torch.Tensor) -> torch.Tensor:
    if isinstance(c, float) and c == 1.0:
        return t
    t = t.float() if t.dtype in LOW_PRECISION else t
    return t * (c.to(t.dtype) if isinstance(c, torch.Tensor) else c)


def _padded(ts: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """``ts`` zero-padded at the end of each non-leading dim to the largest size."""
    shapes = {tuple(t.shape[1:]) for t in ts}
    if len(shapes) == 1:
        return ts
    if len({len(sh) for sh in shapes}) > 1:
        raise RuntimeError(f"layer '{name}': the accumulated micro-batches captured tensors of different ranks "
                           f"{sorted(shapes)}")
    size = [max(d) for d in zip(*shapes)]
    out = []
    for t in ts:
        if list(t.shape[1:]) == size:
            out.append(t)
            continue
        p = t.new_zeros(t.shape[0], *size)
        p[tuple(slice(0, d) for d in t.shape)] = t
        out.append(p)
    return out


def lookup(key: int) -> CaptureStore:
    """The live store registered under ``key``."""
    try:
        return _STORES[key]
    except KeyError:  # pragma: no cover - only if a model was freed mid-backward
        raise RuntimeError(f"tengrad_fx: capture store {key} no longer exists") from None
