"""TENGraD's curvature across ``state_dict`` / ``load_state_dict`` (bit-identical resume
for any ``curvature_every``).

With ``curvature_every = T > 1`` the steps between two curvature steps reuse the records
``(I, G)`` -- or the materialized per-sample gradients ``(P, Gsum)`` -- captured on the
last curvature step. ``state_dict()["curvature"]`` keeps exactly those records, plus the
schedule position and the damping they were factorized with, and only when the next step
is a reuse step (never for ``T = 1``). ``load_state_dict`` puts the records back into the
capture store and recomputes the Grams and Cholesky factors from them with the same code
and inputs as the original curvature step, so they are the same bits; the run then goes
on exactly as the uninterrupted one.

Size bound: one batch's records of the covered layers: for a layer kept as ``I, G``, its
input and output gradient of the curvature batch (together at most the activation memory
of that batch); for a materialized layer, ``P`` (``m × n``) and ``Gsum`` (``m × d_out``),
whose total is bounded by ``jacobian_budget_mb``. The ``m × m`` Grams and factors are not
stored. Views are saved as compact copies, never with a larger underlying storage.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ...capture.store import Record

__all__ = ["save_curvature", "restore_curvature"]

_FIELDS = ("I", "G", "P", "Gsum")


def _compact(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` without a larger storage behind it (torch.save writes whole storages)."""
    if t is None:
        return None
    if t.untyped_storage().nbytes() > t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def save_curvature(opt: Any) -> Optional[dict[str, Any]]:
    """The ``"curvature"`` entry of TENGraD ``opt``'s state dict, or None when the next
    step takes new curvature anyway."""
    if opt.curvature_every == 1 or opt._needs_capture(opt._sched):
        return None
    store = opt._info.store
    records: dict[str, list[list[dict[str, Any]]]] = {}
    for layer in opt._layers:
        per_site = [store.records.get(site, []) for site in layer.spec.sites]
        if not any(per_site):
            continue
        records[layer.name] = [[{**{k: _compact(getattr(r, k)) for k in _FIELDS}, "in_shape": list(r.in_shape)}
                                for r in recs] for recs in per_site]
    return {"sched": opt._curv_sched, "damping": opt._curv_damping, "records": records}


def restore_curvature(opt: Any, curv: dict[str, Any]) -> None:
    """Put saved records back into ``opt``'s capture store and rebuild the cached
    curvature from them (as the curvature step that captured them did)."""
    store = opt._info.store
    by_name = {layer.name: layer for layer in opt._layers}
    unknown = sorted(set(curv["records"]) - set(by_name))
    if unknown:
        raise ValueError(f"TENGraD.load_state_dict: curvature records of layers {unknown}, which are not "
                         "covered layers of this model")
    store.records = {}
    for name, per_site in curv["records"].items():
        layer = by_name[name]
        dev = layer.weight.device
        if len(per_site) != len(layer.spec.sites):
            raise ValueError(f"TENGraD.load_state_dict: layer '{name}' has {len(layer.spec.sites)} calls here, "
                             f"{len(per_site)} in the saved curvature")
        for site, recs in zip(layer.spec.sites, per_site):
            store.records[site] = [
                Record(**{k: (r[k].to(dev) if r[k] is not None else None) for k in _FIELDS},
                       in_shape=tuple(r["in_shape"])) for r in recs]
    store._complete = True  # the next capturing forward releases them, as after a backward
    store.mark_finalized()  # saved after the step's finalize: float32, unscaled
    opt._last_generation = store.generation
    opt._refresh(curv["damping"])
    opt._curv_sched = int(curv["sched"])
    opt._recapture = False
