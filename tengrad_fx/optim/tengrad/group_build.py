"""Which covered layers share a :class:`~tengrad_fx.optim.tengrad.layer_groups.LayerGroup`.

:func:`build_groups` puts every trainable covered layer with a record into a group:

1. **Equal shapes.** Layers of one form and one shape (and scale ``k``, dtypes, conv
   geometry) are stacked along a layer axis: ``"P"`` (materialized per-sample
   gradients, within ``jacobian_budget_mb``), ``"IG"`` (factored Linears with one position
   per sample, weight ``[d_out, d_in]``), ``"conv"`` (convolutions kept as ``I, G``), else ``"layer"`` (one each).
2. **Packing small ``"P"`` groups.** Each group is one set of batched ops per step (Gram,
   ``J g``, probe, ``Jᵀ c``, Woodbury: ~35 kernels on a curvature step), launched whatever
   its size, so many small groups (the norm layers' ``γ, β``: ``n = 2C``, the first
   convolution, a head) cost launches, not flops. The equal-shape ``"P"`` groups of one
   ``(k, dtypes)`` are therefore sorted by their layers' width ``n = n_w + n_b`` and merged
   greedily in that order into *packed* groups (``PackedGroup``, ``cols``; each layer's
   ``[P_w, P_b]`` side by side in ``[L, m, W]``, zero-padded to the widest ``W``; exact,
   see :mod:`.layer_groups`) while the packed stack stays

   * at most ``PACK_MAX_BYTES`` (16 MiB): only small layers are padded, so the zero
     columns cost at most that much memory (on top of ``jacobian_budget_mb``) and the
     packed group's probe can check every column, and
   * at most ``PACK_MAX_RATIO`` (4) times its layers' own bytes: the padding at most
     triples the Gram flops of the layers it packs (``2·m²·W`` per layer).

   A group left alone keeps the unpacked form (no copy for a single layer). Measured on
   tiny-bn / 3c1f-bn (``tools.bench --ops``): the four BatchNorms and the first
   convolution end up in one packed group with the other small ``"P"`` layers.

Stacking copies each group's ``P`` (or ``I``, ``G``) once; the store's records are then
pointed at views of the stack (:meth:`LayerGroup.point_records`) and the group's members
released before the next group is stacked, so no second copy stays alive and the
transient copy is one stack (at most :data:`STACK_BYTES`). The next curvature step copies
a new capture of the same layers and shapes into the same stacks (``reuse``,
:meth:`LayerGroup.refill`): no new stack, and the group keeps its views, its packed
gradient buffer and its record slices (no zeros, no views made per step).

Which materialized layers keep ``J`` is the cost model of :mod:`.jacobian_sites`
(:func:`~.jacobian_sites.keeps_jacobian`).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, cast

from torch import Tensor

from ...capture.store import Record
from ...curvature.layer import CoveredLayer, Strategy
from .group_forms import ConvStackGroup, FactoredLinearGroup, MaterializedGroup, PackedGroup, SingleLayerGroup
from .jacobian_sites import default_jacobian_cap, keeps_jacobian
from .layer_groups import LayerGroup, pack_views, stack

__all__ = ["build_groups", "previous_stacks", "PACK_MAX_BYTES", "PACK_MAX_RATIO", "STACK_BYTES"]

PACK_MAX_BYTES = 16 * 2**20
PACK_MAX_RATIO = 4.0
STACK_BYTES = 64 * 2**20
"""Bound on one stack of an equal-shape group, and so on the transient of making it (its
records and the stack are alive together while it is copied; the records are then
pointed at the stack and the members released before the next group is stacked). Layers
of one shape beyond it form several groups; a layer larger than it is a group of its own
and a view of its record (no copy): a few more ops per step only where each moves that
many bytes."""

_Member = tuple[CoveredLayer, Tensor, Optional[Tensor], float]  # (layer, X, Y, k)


def _materialized(layer: CoveredLayer, recs: list[Record], has_bias: bool,
                  k: float) -> tuple[Tensor, Optional[Tensor], float]:
    """``(Pw, Pb, k)`` with ``J = k·[Pw, Pb]``, without copying backward-made ``P``
    (``recs``: the layer's records, ``k``: its scale)."""
    P = recs[0].P
    if len(recs) == 1 and P is not None:
        return P, (recs[0].Gsum if has_bias else None), k
    dW, db = layer.per_sample_grads()  # already scaled
    return dW.flatten(1), (db.flatten(1) if db is not None else None), 1.0


def _itemsize(recs: list[Record], weight: Tensor) -> int:
    """Element size of a layer's captured (floating) records."""
    r = recs[0]
    return next((x for x in (r.P, r.G, r.I) if x is not None and x.is_floating_point()), weight).element_size()


def _runs(members: list[_Member]) -> list[list[_Member]]:
    """Equal-shape ``members`` in runs whose stack is at most :data:`STACK_BYTES` (one
    member at least): each run is one group."""
    X, Y = members[0][1], members[0][2]
    size = max(1, sum(t.numel() * t.element_size() for t in (X, Y) if t is not None))
    n = max(1, min(len(members), STACK_BYTES // size))
    return [members[i:i + n] for i in range(0, len(members), n)]


def _stackable_conv(layer: CoveredLayer, recs: list[Record]) -> bool:
    """A (non-transposed) ConvNd captured as one call's ``I, G`` (``recs``: its records): a
    ``"conv"`` group member."""
    return layer.kind in ("conv1d", "conv2d", "conv3d") and not layer.spec.transposed and len(recs) == 1 \
        and recs[0].I is not None and recs[0].G is not None and recs[0].P is None


def _width(unit: list[_Member]) -> int:
    """``n_w + n_b`` of an equal-shape ``"P"`` unit's layers."""
    _, Pw, Pb, _ = unit[0]
    return Pw.shape[1] + (Pb.shape[1] if Pb is not None else 0)


def _packable(units: list[list[_Member]]) -> bool:
    """Whether ``units`` may share one packed group (module docstring)."""
    m, es = units[0][0][1].shape[0], units[0][0][1].element_size()
    L = sum(len(u) for u in units)
    packed = L * m * max(_width(u) for u in units) * es
    real = sum(len(u) * m * _width(u) * es for u in units)
    return packed <= PACK_MAX_BYTES and packed <= PACK_MAX_RATIO * real


def pack_plan(units: list[list[_Member]]) -> list[list[int]]:
    """Indices of ``units`` (equal-shape ``"P"`` groups of one ``(k, dtypes)``) per group:
    sorted by width and merged greedily while :func:`_packable` holds."""
    plans: list[list[int]] = []
    for u in sorted(range(len(units)), key=lambda i: _width(units[i])):
        if plans and _packable([units[i] for i in plans[-1] + [u]]):
            plans[-1].append(u)
        else:
            plans.append([u])
    return plans


class _Plan(NamedTuple):
    """One group to make: ``key`` (form first; a packed group's is ``("P",)``) and members."""

    packed: bool
    key: tuple
    members: list[_Member]


def _group(plan: _Plan) -> LayerGroup:
    """The group of a plan: equal-shape members stacked, or several widths packed."""
    members, form = plan.members, plan.key[0]
    lays, k = [mb[0] for mb in members], members[0][3]
    if plan.packed:
        widths = _cols(members)
        X, views = pack_views([[Pw, Pb] for _, Pw, Pb, _ in members], max(a + b for a, b in widths), members[0][1])
        return PackedGroup(lays, X.shape[1], k, Pw=X, widths=widths, fill=views)
    dim = ConvStackGroup.layer_axis if form == "conv" else 0  # "conv": the layer axis after the sample axis
    X = stack([mb[1] for mb in members], dim)
    Ys = [Y for _, _, Y, _ in members if Y is not None]
    Y = stack(Ys, dim) if Ys else None
    m = X.shape[1 - dim]
    if form == "P":
        return MaterializedGroup(lays, m, k, Pw=X, Pb=Y)
    assert Y is not None, "a factored group stacks I and G"
    if form == "conv":
        return ConvStackGroup(lays, m, k, A=X, B=Y, strategy=plan.key[1])
    return FactoredLinearGroup(lays, m, k, A=X, B=Y)


def _cols(members: list[_Member]) -> list[tuple[int, int]]:
    """``(n_w, n_b)`` per member of a packed ``"P"`` group (``LayerGroup.cols``)."""
    return [(Pw.shape[1], Pb.shape[1] if Pb is not None else 0) for _, Pw, Pb, _ in members]


def previous_stacks(groups: list[LayerGroup]) -> dict[tuple, LayerGroup]:
    """The stacked groups of the last curvature step by :func:`_identity`, for
    :func:`build_groups` to copy a new capture of the same layers into (``"layer"``
    groups hold no stack)."""
    return {_identity(g.form, g.layers, g.cols): g for g in groups if g.form != "layer"}


def _identity(form: str, layers: list[CoveredLayer], cols: Optional[list[tuple[int, int]]]) -> tuple:
    return (form, tuple(id(lay) for lay in layers), tuple(cols or ()))


def _fits(S: Optional[Tensor], X: Optional[Tensor], L: int, dim: int) -> bool:
    """Whether a stack ``S`` is one of ``L`` tensors like ``X`` along ``dim`` (both None: True)."""
    if S is None or X is None:
        return S is None and X is None
    return S.dtype == X.dtype and tuple(S.shape) == (*X.shape[:dim], L, *X.shape[dim:])


def _match(plan: _Plan, reuse: dict[tuple, LayerGroup], static: bool) -> Optional[LayerGroup]:
    """The previous group ``plan``'s members are copied into (:meth:`LayerGroup.refill`):
    the same layers, form, scale, strategy and parameters, stacks of the same shapes and
    dtypes; popped from ``reuse``. A single unpacked layer's stack is a view of its record
    (no copy), so it is only refilled where the tensors must keep their addresses
    (``static``: a captured CUDA graph reads them)."""
    members = plan.members
    if not reuse or (not plan.packed and len(members) == 1 and not static):
        return None
    old = reuse.pop(_identity(plan.key[0], [mb[0] for mb in members], _cols(members) if plan.packed else None), None)
    if old is None or old.k != members[0][3] or (isinstance(old, ConvStackGroup) and old.strategy != plan.key[1]):
        return None
    if any(w is not lay.weight or b is not lay.bias for lay, (w, b) in zip(old.layers, old.param_pairs())):
        return None  # a parameter was replaced: its kept pairs and gradient buffer are out of date
    X, Y = members[0][1], members[0][2]
    S, T = old.stacks()
    if plan.packed:
        return old if S is not None and S.dtype == X.dtype and S.shape[1] == X.shape[0] else None
    L, dim = len(members), old.layer_axis
    return old if _fits(S, X, L, dim) and _fits(T, Y, L, dim) else None


def _place(layer: CoveredLayer, strategy: Strategy, budget: Optional[float], sites: set[int],
           keyed: dict[tuple, list[_Member]]) -> tuple[Optional[LayerGroup], Optional[float]]:
    """Put ``layer`` (trainable, captured) under its stacking key in ``keyed`` (a kept
    ``J``: its call sites added to ``sites``, its bytes taken from ``budget``), or make its
    ``"layer"`` group; returns that group (or None) and the budget left. Each layer's
    weight, bias and records are read once (host time per layer), and no record's tensor
    outlives the call in a local."""
    weight, bias = layer.weight, layer.bias  # bias: None when absent or frozen
    recs = layer.records()
    how = layer.choose(strategy, recs)
    m, k = recs[0].m, layer._scale(recs[0].loss_batch)
    I, G = recs[0].I, recs[0].G
    if how == "materialize":
        es = _itemsize(recs, weight)
        ig = 0.0 if budget is not None else default_jacobian_cap(layer, [r.in_shape for r in recs], es)
        n = weight.numel() + (bias.numel() if bias is not None else 0)
        if keeps_jacobian(m * n * es, ig, budget):  # (no P made for nothing)
            Pw, Pb, kP = _materialized(layer, recs, bias is not None, k)
            nbytes = (Pw.numel() + (Pb.numel() if Pb is not None else 0)) * Pw.element_size()
            if keeps_jacobian(nbytes, ig, budget):
                sites.update(layer.spec.sites)
                key: tuple = ("P", Pw.shape[1], Pb.shape[1] if Pb is not None else 0, kP, Pw.dtype, weight.dtype)
                keyed.setdefault(key, []).append((layer, Pw, Pb, kP))
                return None, (None if budget is None else budget - nbytes)
    elif layer.kind == "linear" and not layer.spec.transposed and len(recs) == 1 and I is not None \
            and I.dim() == 2 and G is not None:
        keyed.setdefault(("IG", I.shape[1], G.shape[1], bias is not None, k, I.dtype), []).append((layer, I, G, k))
        return None, budget
    if _stackable_conv(layer, recs) and I is not None and G is not None:  # factored, or beyond the budget
        spec = layer.spec
        key = ("conv", how, tuple(weight.shape), spec.stride, spec.padding, spec.dilation, spec.groups,
               tuple(I.shape), tuple(G.shape), bias is not None, k, I.dtype)
        keyed.setdefault(key, []).append((layer, I, G, k))
        return None, budget
    return SingleLayerGroup([layer], m, strategy=how), budget


def _plans(keyed: dict[tuple, list[_Member]], packed: bool) -> list[_Plan]:
    """The groups to make of the keyed members (consumed): ``"P"`` keys of one
    ``(k, dtypes)`` merged by :func:`pack_plan` (``packed``), each other key in runs of
    :func:`_runs`; a packed group goes where its first key was."""
    by_kind: dict[tuple, list[tuple]] = {}
    for key in keyed:
        if key[0] == "P":
            by_kind.setdefault(key[3:], []).append(key)
    merged: dict[tuple, list[tuple]] = {}
    for keys in by_kind.values():
        for idx in pack_plan([keyed[key] for key in keys]) if packed else [[i] for i in range(len(keys))]:
            for i in idx:
                merged[keys[i]] = [keys[j] for j in idx]
    plans: list[_Plan] = []
    for key in list(keyed):
        if key not in keyed:  # packed with an earlier key
            continue
        together = merged.get(key, [key])
        if len(together) == 1:
            plans.extend(_Plan(False, key, run) for run in _runs(keyed.pop(key)))
        else:
            plans.append(_Plan(True, ("P",), [mb for k2 in together for mb in keyed.pop(k2)]))
    return plans


def build_groups(layers: list[CoveredLayer], strategy: str, budget: Optional[float],
                 sites: Optional[set[int]] = None, packed: bool = True,
                 reuse: Optional[dict[tuple, LayerGroup]] = None,
                 static: bool = False) -> tuple[list[LayerGroup], set[int]]:
    """Groups of the trainable covered layers with a record in the store, and the call
    sites whose ``J`` is kept (materialized by later backwards, by :func:`keeps_jacobian`:
    within ``budget`` bytes, or with None within :func:`default_jacobian_cap`; added to
    ``sites``, e.g. the kept choice of layers not captured this time).
    ``packed=False``: equal shapes only (no zero columns, e.g. where ``J g`` / ``Jᵀ c``
    of a group travel between ranks).

    ``reuse`` (:func:`previous_stacks` of the last curvature's groups; consumed): a group
    of the same layers and shapes as one there is that group, its stacks refilled in place
    (:func:`_match`; no new stack, its views and kept buffers made once); the others are
    dropped before any new stack is made. ``static``: refill single layers too (their
    stacks then keep their addresses, for a captured CUDA graph)."""
    sites = set() if sites is None else set(sites)
    keyed: dict[tuple, list[_Member]] = {}
    single: list[LayerGroup] = []
    for layer in layers:
        if not layer.weight.requires_grad or not layer.captured:
            continue
        own, budget = _place(layer, cast(Strategy, strategy), budget, sites, keyed)
        if own is not None:
            single.append(own)
    plans = _plans(keyed, packed)
    olds = [_match(p, reuse, static) for p in plans] if reuse else [None] * len(plans)
    if reuse:
        reuse.clear()  # the groups not refilled are released before any new stack is made
    groups: list[LayerGroup] = []
    while plans:  # each plan's members are released once it is stacked
        plan, old = plans.pop(0), olds.pop(0)
        if old is not None:
            old.refill([(mb[1], mb[2]) for mb in plan.members])
            grp = old
        else:
            grp = _group(plan)
        grp.static = static
        grp.point_records()
        groups.append(grp)
        del grp, old, plan
    return groups + single, sites
