"""TENGraD's curvature across ``state_dict`` / ``load_state_dict`` (bit-identical resume
for any ``curvature_every``).

With ``curvature_every = T > 1`` the steps between two curvature steps reuse the records
``(I, G)`` -- or the materialized per-sample gradients ``(P, Gsum)`` -- captured on the
last curvature step. ``state_dict()["curvature"]`` keeps exactly those records, plus the
schedule position and the damping they were factorized with, and only when the next step
is a reuse step (never for ``T = 1``; :meth:`TENGraD.state_dict`). ``load_state_dict`` puts the records back into the
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

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ...capture.prepare import capturing
from ...capture.store import CaptureStore, Record
from ...curvature.layer import CoveredLayer
from ..step.state_check import META
from .subsample import choose_rows

__all__ = ["load_state", "save_records", "restore_records", "save_state"]

Records = dict[str, list[list[dict[str, Any]]]]
"""Layer name -> per call site -> per record ``{"I", "G", "P", "Gsum": tensor or None,
"in_shape": [...], "batch": the loss's batch size of a subsampled record, else 0}``."""

_FIELDS = ("I", "G", "P", "Gsum")


def _compact(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` without a larger storage behind it (torch.save writes whole storages)."""
    if t is None:
        return None
    if t.untyped_storage().nbytes() > t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def save_records(store: CaptureStore, layers: Sequence[CoveredLayer]) -> Records:
    """The records of ``layers`` in ``store`` (compact copies where a view would save a
    larger storage): ``state_dict()["curvature"]["records"]``."""
    records: Records = {}
    for layer in layers:
        per_site = [store.records.get(site, []) for site in layer.spec.sites]
        if not any(per_site):
            continue
        records[layer.name] = [[{**{k: _compact(getattr(r, k)) for k in _FIELDS}, "in_shape": list(r.in_shape),
                                 "batch": r.batch}
                                for r in recs] for recs in per_site]
    return records


def restore_records(store: CaptureStore, layers: Sequence[CoveredLayer], records: Records) -> None:
    """Put saved ``records`` of ``layers`` back into ``store`` (on each layer's device),
    as the backward of the curvature step that captured them left them; ``ValueError``
    for records of layers this model does not cover, or with another number of calls."""
    by_name = {layer.name: layer for layer in layers}
    unknown = sorted(set(records) - set(by_name))
    if unknown:
        raise ValueError(f"TENGraD.load_state_dict: curvature records of layers {unknown}, which are not "
                         "covered layers of this model")
    store.records = {}
    for name, per_site in records.items():
        layer = by_name[name]
        dev = layer.weight.device
        if len(per_site) != len(layer.spec.sites):
            raise ValueError(f"TENGraD.load_state_dict: layer '{name}' has {len(layer.spec.sites)} calls here, "
                             f"{len(per_site)} in the saved curvature")
        for site, recs in zip(layer.spec.sites, per_site):
            store.records[site] = [
                Record(**{k: (r[k].to(dev) if r[k] is not None else None) for k in _FIELDS},
                       in_shape=tuple(r["in_shape"]), batch=int(r.get("batch", 0))) for r in recs]
    store._complete = True  # the next capturing forward releases them, as after a backward
    store.mark_finalized()  # saved after the step's finalize: float32, unscaled


def save_state(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
    """:meth:`TENGraD.state_dict` from the skeleton's ``sd`` (``opt``: the TENGraD): the
    materialized sites, and under ``"curvature"`` the records the next step reuses (when it
    reuses curvature and the distribution keeps records) with the schedule position and the
    damping they were factorized with; marked a ``TENGraD`` state."""
    sd["state"][opt.NAME]["jacobian_sites"] = sorted(opt._info.store.jacobian_sites)
    if opt.distribution.saves_records and opt.curvature_every > 1 and not opt._needs_capture(opt._sched):
        sd["curvature"] = {"sched": opt.curvature.sched, "damping": opt.curvature.damping,
                           "records": save_records(opt._info.store, opt._layers)}
    sd[META] = {**sd[META], "optimizer": "TENGraD"}
    return sd


def load_state(opt: Any, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
    """:meth:`TENGraD.load_state_dict`: ``load`` (the skeleton's) of ``state_dict`` less its
    curvature, then the saved records put back into the capture store and the cached
    curvature rebuilt from them as the curvature step that captured them did (where the
    distribution keeps records; else capture is on and the next step takes curvature)."""
    sd = dict(state_dict)
    curv = sd.pop("curvature", None)
    if isinstance(sd.get(META), dict) and sd[META].get("optimizer") == "TENGraD":
        sd[META] = {**sd[META], "optimizer": type(opt).__name__}
    opt.distribution.reset(opt)
    load(sd)
    store = opt._info.store
    store.jacobian_sites = set(opt.state[opt.NAME].get("jacobian_sites", []))
    opt.curvature.groups, opt.curvature.fused = [], False  # the factors stay (refilled in place: static)
    opt.graph_runner.clear()
    if curv is not None and opt.distribution.saves_records:
        restore_records(store, opt._layers, curv["records"])
        opt._last_generation = store.generation
        choose_rows(opt)
        opt._refresh(curv["damping"])
        opt.curvature.sched, opt.curvature.recapture = int(curv["sched"]), False
    capturing(opt.model, opt._needs_capture(opt._sched))
