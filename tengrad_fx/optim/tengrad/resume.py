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

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ...capture.info import PrepareInfo
from ...capture.prepare import capturing
from ...capture.store import CaptureStore, Record
from ...curvature.layer import CoveredLayer
from ..step.state_check import check_materialization, materialization_meta

__all__ = ["CurvatureResume", "save_records", "restore_records"]

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


class CurvatureResume:
    """TENGraD's ``state_dict`` / ``load_state_dict`` with the curvature records (module docstring)."""

    NAME: str
    model: torch.nn.Module
    state: Any
    curvature_every: int
    strategy: str
    jacobian_budget_mb: Optional[float]
    _info: PrepareInfo
    _layers: list[CoveredLayer]
    _curv: list[Any]
    _curv_sched: int
    _curv_damping: Any
    _sched: int
    _last_generation: int
    _recapture: bool
    _graphs: Any
    _needs_capture: Callable[[int], bool]
    _subsampled: Callable[[], bool]
    _refresh: Callable[[Any], None]

    def state_dict(self) -> dict[str, Any]:
        """Counters, momentum buffers, which layers the backward materializes, and (with
        ``curvature_every > 1``, when the next step reuses curvature) the curvature records
        that step needs (:mod:`.resume`), so a resumed run continues bit for bit."""
        sd = super().state_dict()  # type: ignore[misc]
        sd["state"][self.NAME]["jacobian_sites"] = sorted(self._info.store.jacobian_sites)
        if self.curvature_every > 1 and not self._needs_capture(self._sched):  # the next step reuses it
            sd["curvature"] = {"sched": self._curv_sched, "damping": self._curv_damping,
                               "records": save_records(self._info.store, self._layers)}
        return sd

    def _restore_curvature(self, curv: dict[str, Any]) -> None:
        """Put saved records back into the capture store and rebuild the cached curvature
        from them (as the curvature step that captured them did)."""
        store = self._info.store
        restore_records(store, self._layers, curv["records"])
        self._last_generation = store.generation
        self._subsampled()
        self._refresh(curv["damping"])
        self._curv_sched = int(curv["sched"])
        self._recapture = False

    def _layout_meta(self) -> dict[str, Any]:
        return materialization_meta(self.strategy, self.jacobian_budget_mb, self._layers,
                                    self._info.store.jacobian_sites)

    def _check_layout_meta(self, meta: dict[str, Any]) -> None:
        check_materialization(meta, self.strategy, self.jacobian_budget_mb, self._layers)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load counters, momentum buffers and the saved curvature records (if any; else
        the next step takes curvature: capture is switched on). Refuses another
        optimizer's state, parameter layout or materialization (``ValueError``)."""
        sd = dict(state_dict)
        curv = sd.pop("curvature", None)
        super().load_state_dict(sd)  # type: ignore[misc]
        self._info.store.jacobian_sites = set(self.state[self.NAME].get("jacobian_sites", []))
        self._curv = []
        self._graphs.clear()
        if curv is not None:
            self._restore_curvature(curv)
        capturing(self.model, self._needs_capture(self._sched))
