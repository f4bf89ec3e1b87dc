"""What a ``state_dict`` of TENGraD or a baseline records about the optimizer that saved
it, and the check ``load_state_dict`` runs before loading anything.

``state_dict()["tengrad_fx"]`` = ``{"optimizer": class name, "params": [[name, shape], ...]}``
plus the subclass's own entries (TENGraD: the materialization choices). Loading refuses,
with an error that names both sides and the fix, a state dict

* of another optimizer (``torch.optim.SGD``'s, K-FAC's into TENGraD, ...),
* of another parameter layout (number, order or shapes of the parameters: another model,
  or the same model with other parameters frozen),
* with other materialization choices (TENGraD: ``strategy``, ``jacobian_budget_mb``, or
  materialized layers this model does not have),

so nothing is half-loaded. State dicts written before this record existed (no
``"tengrad_fx"`` entry) are accepted when they carry this optimizer's counters.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from ...curvature.layer import CoveredLayer

__all__ = ["META", "named_params", "layout_meta", "check_loadable", "materialization_meta", "check_materialization"]

META = "tengrad_fx"

NamedParams = list[tuple[str, nn.Parameter]]


def named_params(model: nn.Module, params: Sequence[nn.Parameter]) -> NamedParams:
    """``(name in model, parameter)`` of an optimizer's ``params`` (``#i`` where unnamed)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names.get(id(p), f"#{i}"), p) for i, p in enumerate(params)]


def layout_meta(optimizer: str, params: NamedParams, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``"tengrad_fx"`` entry of a state dict: the ``optimizer`` class name, the
    parameter layout and the optimizer's ``extra`` entries."""
    return {"optimizer": optimizer, "params": [[n, list(p.shape)] for n, p in params], **extra}


def _kind_hint(sd: dict[str, Any]) -> str:
    keys = sorted(k for g in sd.get("param_groups", [])[:1] for k in g if k != "params")
    return f" (its param group has the options {keys})" if keys else ""


def check_loadable(cls: str, counters: str, params: NamedParams, n_groups: int,
                   sd: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Raise ``ValueError`` if ``sd`` was not saved by an optimizer of class ``cls`` (its
    counters under ``sd["state"][counters]``) over ``params`` in ``n_groups`` param groups
    (module docstring); else the saved ``"tengrad_fx"`` entry (None: written before it
    existed), whose optimizer-specific entries the caller checks."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError(f"{cls}.load_state_dict: expected an optimizer state_dict (a dict with 'state' and "
                         f"'param_groups'), got {type(sd).__name__}")
    meta = sd.get(META)
    if meta is None:
        if counters not in sd["state"]:
            raise ValueError(f"{cls}.load_state_dict: this state_dict was not saved by {cls} (it has no "
                             f"'{counters}' counters){_kind_hint(sd)}. Load it into the optimizer that saved "
                             f"it, or start {cls} without loading")
        return None  # written before the layout record existed
    if meta.get("optimizer") != cls:
        raise ValueError(f"{cls}.load_state_dict: this state_dict was saved by {meta.get('optimizer')}, not "
                         f"{cls}. Build a {meta.get('optimizer')} to load it, or start {cls} without loading")
    if len(sd["param_groups"]) != n_groups:
        raise ValueError(f"{cls}.load_state_dict: the state_dict has {len(sd['param_groups'])} param groups, "
                         f"this optimizer {n_groups}")
    saved = [(n, list(s)) for n, s in meta["params"]]
    mine = [(n, list(p.shape)) for n, p in params]
    if saved != mine:
        if len(saved) != len(mine):
            what = f"{len(saved)} parameters were saved, this optimizer has {len(mine)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(saved, mine)) if a != b)
            what = (f"parameter {i} is {saved[i][0]!r} {tuple(saved[i][1])} in the state_dict but "
                    f"{mine[i][0]!r} {tuple(mine[i][1])} here")
        raise ValueError(f"{cls}.load_state_dict: the parameter layout differs ({what}). Load it into an "
                         "optimizer over the same model with the same parameters trainable (requires_grad)")
    return meta


def materialization_meta(strategy: str, jacobian_budget_mb: Optional[float], layers: Sequence[CoveredLayer],
                         sites: set[int]) -> dict[str, Any]:
    """TENGraD's materialization choices (they decide how the backward computes gradients):
    its options and the covered ``layers`` with a call site in ``sites`` (materialized)."""
    return {"strategy": strategy, "jacobian_budget_mb": jacobian_budget_mb,
            "materialized": sorted(lay.name for lay in layers if set(lay.spec.sites) & sites)}


def check_materialization(meta: dict[str, Any], strategy: str, jacobian_budget_mb: Optional[float],
                          layers: Sequence[CoveredLayer]) -> None:
    """``ValueError`` if TENGraD with these options and covered ``layers`` cannot continue
    the saved materialization choices ``meta``."""
    mine = {"strategy": strategy, "jacobian_budget_mb": jacobian_budget_mb}
    diff = [f"{k}={meta.get(k)!r} in the state_dict, {v!r} here" for k, v in mine.items() if meta.get(k) != v]
    if diff:
        raise ValueError("TENGraD.load_state_dict: other materialization choices (" + "; ".join(diff) +
                         "). Build TENGraD with the same strategy and jacobian_budget_mb as the run that saved it")
    unknown = sorted(set(meta.get("materialized", [])) - {lay.name for lay in layers})
    if unknown:
        raise ValueError(f"TENGraD.load_state_dict: the state_dict materializes layers {unknown}, which are "
                         "not covered layers of this model (another model, or prepared differently)")
