"""Moving the curvature records of distributed TENGraD to where each layer is solved.

A covered layer's records (per call site, per call: ``I``, ``G``, or ``P``/``Gsum`` for
kinds that always keep per-sample gradients) have ``m`` rows on every rank. The global
batch's records (``M = W·m`` rows, rank order) are the concatenation of the ranks'
records, with the fields linear in the loss gradient (``G``, ``P``, ``Gsum``) rescaled by
``m/M = 1/W``: with ``loss_reduction="mean"`` each rank's ``G`` is its local mean's
gradient, the global batch's is ``1/W`` of it.

The Gauss-Newton Fisher's records (:mod:`tengrad_fx.optim.tengrad.gauss_newton`) stack ``k``
rows per sample, ``m·k`` per rank, each ``G`` of the mean over them (``Record.loss_batch
= m·k``): the ``1/W`` rescale makes them the mean over the ``W·m·k`` gathered rows, which is
the gathered record's row count, its :attr:`~tengrad_fx.capture.store.Record.loss_batch`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..capture.store import CaptureStore, Record
from ..curvature.layer import KERNELS, CoveredLayer, choose_strategy
from .comm import Bucket, all_gather_meta, gather_buckets, pack, unpack
from .traffic import all_gather_sent, gather_sent

__all__ = ["FIELDS", "REPLICATED", "layer_meta", "check_records", "global_scored", "sends_per_sample",
           "per_sample_smaller", "per_sample_bytes", "record_bytes", "to_per_sample", "gather_records"]

FIELDS = ("I", "G", "P", "Gsum")
REPLICATED = -1  # the "owner" of a layer every rank solves
_SCALED = ("G", "P", "Gsum")  # linear in the loss gradient: rescaled by m/M


def layer_meta(layer: CoveredLayer) -> Optional[list[list[dict[str, Any]]]]:
    """Per call site, per record: ``{field: (shape, dtype)}`` and ``in_shape``; None when
    the layer captured nothing."""
    if not layer.captured:
        return None
    store = layer._info.store
    out = []
    for site in layer.spec.sites:
        recs = []
        for r in store.records.get(site, []):
            d: dict[str, Any] = {f: (tuple(getattr(r, f).shape), str(getattr(r, f).dtype))
                                 for f in FIELDS if getattr(r, f) is not None}
            d["in_shape"] = tuple(r.in_shape)
            d["batch"] = r.loss_batch
            recs.append(d)
        out.append(recs)
    return out


def _without_rows(meta: Optional[list[list[dict[str, Any]]]]) -> Any:
    """``meta`` with every shape's leading (row) dimension dropped."""
    if meta is None:
        return None
    return [[{f: (v[0][1:], v[1]) if f in FIELDS else v[1:] if f == "in_shape" else v for f, v in d.items()}
             for d in recs] for recs in meta]


def check_records(layers: list[CoveredLayer], rows_vary: bool = False) -> tuple[list[int], list[Any]]:
    """Indices of the ``layers`` that captured records, and every rank's :func:`layer_meta`
    of each layer (by rank), after checking (one host exchange of the shapes) that every
    rank captured the same layers with the same shapes (``rows_vary``: but for the number of
    rows, each rank holding its own part of the chosen rows) and local batch size; else
    ``ValueError`` on every rank, naming the layer and the ranks."""
    meta = [layer_meta(lay) for lay in layers]
    metas = all_gather_meta(meta, "exchange of the record shapes")
    same = _without_rows if rows_vary else (lambda mt: mt)
    for r, other in enumerate(metas):
        for lay, a, b in zip(layers, metas[0], other):
            if same(a) != same(b):
                raise ValueError(f"DistributedTENGraD: layer '{lay.name}' captured {b} on rank {r} but {a} on "
                                 "rank 0; every rank needs the same local batch size and the same layers called")
    return [i for i, mt in enumerate(meta) if mt is not None], metas


def global_scored(store: CaptureStore) -> Optional[Tensor]:
    """The global batch's scored positions (bool ``[M, S]``, rank order): every rank's
    ``store.scored`` (a small host exchange); None where a rank has none."""
    masks = all_gather_meta(None if store.scored is None else store.scored.cpu(),
                            "exchange of the scored positions (position_rows)")
    if store.scored is None or any(mk is None for mk in masks):
        return None
    return torch.cat(masks, 0).to(store.scored.device)


def sends_per_sample(layer: CoveredLayer, M: int, strategy: str) -> bool:
    """Whether the ranks send ``layer``'s per-sample gradients ``P`` (``n`` values per
    sample) in place of its ``I``, ``G`` (``r`` values per sample): for a Linear or
    convolution called once, when ``n < r`` and the owner would build the global Gram by
    materializing (``strategy``, or the cost model at ``M`` samples under ``"auto"``):
    ``I`` and ``G``, or ``P`` where the cost model materializes and ``P`` is smaller."""
    if not (layer.kind == "linear" or layer.kind.startswith("conv")):
        return False
    recs = layer.records()
    if len(recs) != 1 or recs[0].P is not None or recs[0].I is None or recs[0].G is None:
        return False
    r = recs[0]
    n = sum(p.numel() for p in (layer.weight, layer.bias) if p is not None)
    return per_sample_smaller(n, r.m, r.I.numel() + r.G.numel(), M, layer.dims(), strategy)  # type: ignore[union-attr]


def per_sample_smaller(n: int, m: int, ig_numel: int, M: int, dims: tuple[int, int, int, int], strategy: str) -> bool:
    """The shapes' part of :func:`sends_per_sample`: ``m`` samples' per-sample gradients
    (``n·m`` values) are fewer than their ``I``, ``G`` (``ig_numel`` values) and the owner
    builds the Gram of ``M`` samples with ``dims = (g, S, f, o)`` by materializing
    (``strategy``, or the cost model under ``"auto"``)."""
    if strategy == "factor" or n * m >= ig_numel:
        return False
    return strategy == "materialize" or choose_strategy(M, *dims) == "materialize"


def per_sample_bytes(m: int, n_weight: int, dims: tuple[int, int, int, int], es: int) -> float:
    """Bytes of ``m`` samples' per-sample gradients as sent: ``P [m, n_weight]`` and the
    bias sums ``Gsum [m, g·o]``, ``es`` bytes a value; ``dims = (g, S, f, o)``."""
    g, _, _, o = dims
    return float(m * (n_weight + g * o) * es)


def record_bytes(layer: CoveredLayer, M: int, strategy: str) -> tuple[float, float]:
    """Bytes of this rank's records of ``layer`` as sent on a curvature step in gather
    mode (``P`` and its bias sums where :func:`sends_per_sample`, else ``I``, ``G``) and in
    gram-blocks mode (always ``I``, ``G``, or the ``P`` a kind always keeps)."""
    recs = layer.records()
    ig = float(sum(t.numel() * t.element_size() for r in recs for t in (r.I, r.G, r.P, r.Gsum) if t is not None))
    if not sends_per_sample(layer, M, strategy):
        return ig, ig
    r = recs[0]
    return per_sample_bytes(r.m, layer.weight.numel(), layer.dims(), r.G.element_size()), ig  # type: ignore[union-attr]


def to_per_sample(layer: CoveredLayer) -> None:
    """Replace ``layer``'s record ``(I, G)`` by ``(P, Gsum)``: its rows' per-sample weight
    gradients ``[m, n_w]`` and bias gradients ``[m, o]`` in ``G``'s scale (what a
    materializing backward stores), computed from this rank's own records."""
    store = layer._info.store
    site = layer.spec.sites[0] if len(layer.spec.sites) == 1 else next(
        s for s in layer.spec.sites if store.records.get(s))
    r = store.records[site][0]
    w, b = KERNELS[layer.kind].per_sample_grads(layer.spec, r.I, r.G)
    store.records[site] = [Record(I=None, G=None, P=w.reshape(r.m, -1), Gsum=b.reshape(r.m, -1),
                                  in_shape=tuple(r.in_shape))]


def gather_records(layers: list[CoveredLayer], live: list[int], owners: list[int], store: CaptureStore,
                   rank: int, world: int, keep: set[int], count: Callable[[str, int], None],
                   metas: Optional[list[Any]] = None) -> list[int]:
    """Give every layer ``layers[live[q]]`` solved on this rank (``owners[q]`` is this rank
    or :data:`REPLICATED`) the global batch's records in ``store``: one bucketed ``gather``
    per ``(owner, dtype)`` (an ``all_gather`` for replicated layers), all in flight at once.
    The records of a layer solved elsewhere are dropped, unless its index is in ``keep``
    (``gram-blocks`` layers: every rank keeps its own rows). Returns the indices of the
    layers solved here; ``count(name, bytes)`` gets the bytes this rank sends per layer.
    ``metas``: every rank's :func:`layer_meta` (:func:`check_records`) where the ranks hold
    different numbers of rows (a rank's part of ``curvature_samples`` or ``position_rows``):
    each rank's records travel whole, and the global records have the rows of all of them."""
    buckets: dict[tuple[int, torch.dtype], Bucket] = {}
    payload: dict[tuple[int, torch.dtype], list[Tensor]] = {}
    for i, owner in zip(live, owners):
        lay = layers[i]
        for s, site in enumerate(lay.spec.sites):
            for j, rec in enumerate(store.records.get(site, [])):
                for f in FIELDS:
                    t = getattr(rec, f)
                    if t is None:
                        continue
                    key = (owner, t.dtype)
                    if key not in buckets:
                        buckets[key] = Bucket(owner, t.dtype, t.device)
                        payload[key] = []
                    buckets[key].add((i, s, j, f), t.shape)
                    payload[key].append(t)
    blist = list(buckets.values())
    flats = {n: pack(payload[k], b) for n, (k, b) in enumerate(buckets.items())}
    shapes = None if metas is None else [[[torch.Size(metas[q][i][s][j][f][0]) for (i, s, j, f) in b.keys]
                                          for q in range(world)] for b in blist]  # by bucket, rank
    recv = gather_buckets(blist, flats, None if shapes is None else [[sum(x.numel() for x in sh) for sh in by_rank]
                                                                      for by_rank in shapes])
    for b in blist:
        sent = int(all_gather_sent(b.nbytes, world) if b.rank == REPLICATED else gather_sent(b.nbytes, b.rank == rank))
        for key, shape in zip(b.keys, b.shapes):
            count(layers[key[0]].name, sent * shape.numel() // max(b.numel, 1))
    parts: dict[tuple[int, int, int, str], list[Tensor]] = {}
    for n, b in enumerate(blist):
        got = recv[n]
        if got is None:
            continue
        per_rank = [unpack(flat, b, None if shapes is None else shapes[n][q]) for q, flat in enumerate(got)]
        for q, key in enumerate(b.keys):
            parts[key] = [views[q] for views in per_rank]
    mine = {i for i, r in zip(live, owners) if r in (REPLICATED, rank)}
    for i in live:
        lay = layers[i]
        for s, site in enumerate(lay.spec.sites):
            if i not in mine:
                if i not in keep:
                    store.records.pop(site, None)
                continue
            new = []
            for j, rec in enumerate(store.records.get(site, [])):
                fields: dict[str, Optional[Tensor]] = {}
                for f in FIELDS:
                    if getattr(rec, f) is None:
                        fields[f] = None
                        continue
                    t = torch.cat(parts[(i, s, j, f)], 0)
                    fields[f] = t * (1.0 / world) if f in _SCALED else t
                rows, batch = world * rec.in_shape[0], world * rec.batch
                if metas is not None:  # the ranks' parts of the rows; the loss's batch is the global one
                    rows, batch = sum(mt[i][s][j]["in_shape"][0] for mt in metas), world * rec.loss_batch
                new.append(Record(fields["I"], fields["G"], fields["P"], fields["Gsum"],
                                  in_shape=(rows, *rec.in_shape[1:]), batch=batch))
            store.records[site] = new
    return sorted(mine)
