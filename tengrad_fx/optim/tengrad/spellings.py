"""One spelling per option of :class:`~.tengrad.TENGraD`: its flat keyword.

Every option has exactly one spelling, the keyword of :data:`OPTIONS` in the constructor's
signature. The flat keywords are the canonical shape because they are what torch.optim's
param groups use: the options a param group may set (``"group"`` in :data:`OPTIONS`) live
under the same names in ``defaults`` (a group's ``"orthogonalize"`` is True or False: whether
its weights take the optimizer's polar factor), and presets, tools and ``make_optimizer``
pass flat keywords. Options that only mean something together are one keyword: ``orthogonalize``
carries the polar factor's method (``True``/``"eigh"``/``"newton-schulz"``), ``metric`` its
EMA factor and how often its roots are recomputed (``metric=Metric("factored", beta2=0.9,
root_every=10)``; the string alone: ``beta2 = 0.99``, ``root_every = None``).

The other spellings of :data:`DEPRECATED` still work, through :func:`respell_options` before
the constructor runs, with a ``DeprecationWarning`` naming the keywords to pass instead:

* ``schedule=CurvatureSchedule(every, warmup, growth)`` (or an int ``T``):
  ``curvature_every``, ``curvature_warmup``, ``curvature_growth``;
* ``execution=Execution(...)``: ``strategy``, ``jacobian_budget_mb``, ``compile``,
  ``cuda_graph``, ``gram_tf32``, ``solve_dtype``;
* ``metric_beta2=b`` next to ``metric="factored"``: ``metric=Metric("factored", beta2=b)``.

An object spells every one of its fields, so a deprecated spelling given together with any
keyword it stands for is a ``ValueError`` naming both, whatever their values ("given" means
passed by the caller; a keyword left out is not given). :class:`CurvatureSchedule` and
:class:`~.options.Execution` remain the optimizer's resolved views (``opt.schedule``,
``opt.execution``).
"""
from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any, Mapping

from .metric import Metric
from .options import Execution
from .schedule import CurvatureSchedule

__all__ = ["DEPRECATED", "OPTIONS", "SCHEDULE_FIELDS", "respell_options"]

OPTIONS: dict[str, str] = {
    # keyword -> "group": a param group may set it (a key of ``defaults``; ``orthogonalize``: a
    # group's True/False, the method is the optimizer's); "optimizer": one value
    "lr": "group", "damping": "group", "momentum": "group", "weight_decay": "group",
    "curvature_every": "optimizer", "curvature_warmup": "optimizer", "curvature_growth": "optimizer",
    "graft": "optimizer", "orthogonalize": "group", "orthogonalize_momentum": "optimizer",
    "metric": "optimizer", "relative_damping": "optimizer", "curvature_samples": "optimizer",
    "position_rows": "optimizer", "fisher": "optimizer", "mc_loss": "optimizer", "kl_clip": "optimizer",
    "update_form": "optimizer", "solve_dtype": "optimizer", "jacobian_budget_mb": "optimizer",
    "strategy": "optimizer", "compile": "optimizer", "cuda_graph": "optimizer", "gram_tf32": "optimizer",
    "grad_scaler": "optimizer", "params": "optimizer", "distribution": "optimizer",
}
"""Every keyword of ``TENGraD.__init__`` after ``model``, in signature order: the one spelling
of its option, and whether a param group may set it."""

SCHEDULE_FIELDS = {"every": "curvature_every", "warmup": "curvature_warmup", "growth": "curvature_growth"}
""":class:`CurvatureSchedule`'s fields -> the keywords that spell them."""

DEPRECATED: dict[str, tuple[str, ...]] = {
    "schedule": tuple(SCHEDULE_FIELDS.values()),
    "execution": tuple(f.name for f in fields(Execution)),
    "metric_beta2": ("metric",),
}
"""Each deprecated spelling -> the keywords of :data:`OPTIONS` it stands for."""


def _schedule(value: Any) -> dict[str, Any]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {"curvature_every": value}
    if not isinstance(value, CurvatureSchedule):
        raise TypeError(f"TENGraD: schedule must be an int (curvature_every) or a CurvatureSchedule, "
                        f"got {type(value).__name__}; pass curvature_every= (and curvature_warmup=, "
                        "curvature_growth=) instead")
    return {flat: getattr(value, attr) for attr, flat in SCHEDULE_FIELDS.items()}


def _execution(value: Any) -> dict[str, Any]:
    if not isinstance(value, Execution):
        raise TypeError(f"TENGraD: execution must be an Execution, got {type(value).__name__}; pass its "
                        f"fields as keywords instead ({', '.join(DEPRECATED['execution'])})")
    return {name: getattr(value, name) for name in DEPRECATED["execution"]}


def _metric_beta2(value: Any, metric: Any, owner: str) -> dict[str, Any]:
    if isinstance(metric, Metric):
        raise ValueError(f"{owner}: got both metric_beta2= and metric={metric!r}; metric_beta2 is the deprecated "
                         f"spelling of Metric.beta2: pass only metric={metric!r}")
    if metric is None:
        raise ValueError(f"{owner}: metric_beta2={value!r} is the EMA factor of metric's moments and does nothing "
                         "without metric=; pass metric=Metric('factored', beta2=...) (or 'kronecker')")
    return {"metric": Metric(metric, beta2=value)}


def respell_options(kwargs: Mapping[str, Any], owner: str, stacklevel: int) -> dict[str, Any]:
    """``kwargs`` with each deprecated spelling (:data:`DEPRECATED`) replaced by the keywords
    it stands for, each one warned (``DeprecationWarning`` naming those keywords and their
    values; ``stacklevel`` counted from here); one given together with a keyword it stands
    for is a ``ValueError`` naming both (module docstring)."""
    out = dict(kwargs)
    for name, spelled in DEPRECATED.items():
        if name not in out:
            continue
        value = out.pop(name)
        if name == "metric_beta2":
            flat = _metric_beta2(value, out.get("metric"), owner)
        else:
            both = [k for k in spelled if k in out]
            if both:
                raise ValueError(f"{owner}: got both {name}= and {', '.join(k + '=' for k in both)}; {name} is the "
                                 f"deprecated spelling of {', '.join(spelled)}: pass only those keywords")
            flat = _schedule(value) if name == "schedule" else _execution(value)
        warnings.warn(f"{owner}: {name}={value!r} is deprecated; pass "
                      f"{', '.join(f'{k}={v!r}' for k, v in flat.items())} instead", DeprecationWarning,
                      stacklevel=stacklevel)
        out.update(flat)
    return out
