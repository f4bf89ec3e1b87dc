"""Gradient accumulation's records: several micro-batches' records as those of one batch
(:func:`union`, rows concatenated ``[Σ_j m_j, *]``), and how many of a global batch's first
``k`` samples a part holds (:func:`samples_held`, :func:`union_samples_held`; the global batch
of accumulated micro-batches is micro-batch major, part minor)."""
from __future__ import annotations

from typing import Optional

import torch

from .record import Record, times

__all__ = ["global_samples", "padded", "samples_held", "union", "union_samples_held"]


def samples_held(k: int, m: int, part: int = 0, parts: int = 1) -> int:
    """How many of the global batch's first ``k`` samples lie in part ``part`` of ``parts``
    equal parts of ``m`` samples each (rank order): ``min(m, max(0, k − part·m))``."""
    assert 0 <= part < parts
    return min(m, max(0, k - part * m))


def global_samples(micro: tuple[int, ...], part: int = 0, parts: int = 1) -> torch.Tensor:
    """``[Σ micro]`` int64: each sample of part ``part``'s union of micro-batches of ``micro =
    (m_0, m_1, ...)`` samples as a sample of the global batch. The global batch is the
    micro-batches in order, each the ``parts`` parts' (equal) ones in part order, so sample
    ``i`` of micro-batch ``j`` is ``parts·E_j + part·m_j + i`` (``E_j = Σ_{i<j} m_i``;
    ``part·m + i`` for one micro-batch), increasing along the union's rows."""
    starts = [parts * sum(micro[:j]) + part * m for j, m in enumerate(micro)]
    return torch.cat([torch.arange(m) + s for m, s in zip(micro, starts)])


def union_samples_held(k: int, micro: tuple[int, ...], part: int = 0, parts: int = 1) -> int:
    """How many of the global batch's first ``k`` samples lie in part ``part``'s union of
    micro-batches of ``micro`` samples each (:func:`global_samples`' order: the part's
    micro-batch ``j`` holds positions ``parts·E_j + part·m_j`` to ``+ m_j``, so the count is
    a prefix of the union's rows), on the host."""
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
            tensors = [times(t, c) if r.own_loss else t for t, r, c in zip(tensors, recs, scales)]
        fields[f] = torch.cat(padded(tensors, name), 0)
    in_shape = (rows, *(max(d) for d in zip(*(r.in_shape[1:] for r in recs))))
    rec = Record(fields["I"], fields["G"], fields["P"], fields["Gsum"], in_shape,
                 U if any(r.batch for r in recs) or rows != U else 0)
    rec.own_loss = all(r.own_loss for r in recs)
    rec.micro = sum((r.micro or (r.m,) for r in recs), ())
    return rec


def padded(ts: list[torch.Tensor], name: str) -> list[torch.Tensor]:
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
