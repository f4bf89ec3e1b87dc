"""Every option of ``TENGraD`` has one spelling: its flat keyword (:mod:`tengrad_fx.optim.tengrad.spellings`).

The constructor's signature is walked against :data:`OPTIONS` (a keyword added without being
classified there fails), the grouping objects' fields against :data:`DEPRECATED`; each
deprecated spelling warns ``DeprecationWarning`` naming the keywords to pass instead and
builds the same optimizer, and one given together with a keyword it stands for is a
``ValueError`` naming both."""
from __future__ import annotations

import inspect
import warnings
from dataclasses import fields
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import CurvatureSchedule, Execution, Metric, TENGraD, make_optimizer
from tengrad_fx.optim.registry import PRESETS
from tengrad_fx.optim.tengrad.spellings import DEPRECATED, OPTIONS, SCHEDULE_FIELDS

SIGNATURE = inspect.signature(TENGraD.__init__).parameters
# A value of each deprecated spelling, and the flat keywords it stands for.
DEPRECATED_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "schedule": (dict(schedule=CurvatureSchedule(3, 2)),
                 dict(curvature_every=3, curvature_warmup=2, curvature_growth=None)),
    "execution": (dict(execution=Execution(strategy="factor", solve_dtype=torch.float64)),
                  dict(strategy="factor", jacobian_budget_mb=None, compile=False, cuda_graph=None,
                       gram_tf32=False, solve_dtype=torch.float64)),
    "metric_beta2": (dict(metric="factored", metric_beta2=0.9), dict(metric=Metric("factored", beta2=0.9))),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return tengrad_fx.prepare(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double())


def _run(**kw: Any) -> tuple[list[torch.Tensor], list[bool]]:
    """Five steps of a small MLP: the parameters after them and which steps took curvature."""
    model = _model()
    opt = TENGraD(model, 0.1, 0.05, **kw)
    g = torch.Generator().manual_seed(1)
    curv = []
    for _ in range(5):
        x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
        curv.append(opt._is_curvature_step())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], curv


def test_every_keyword_has_one_classified_spelling() -> None:
    """The signature after ``model`` is :data:`OPTIONS`, in order; no deprecated spelling is
    in it; each stands for keywords of it, and the grouping objects' fields are exactly
    those keywords."""
    assert list(SIGNATURE)[:2] == ["self", "model"]
    assert list(SIGNATURE)[2:] == list(OPTIONS), "a TENGraD keyword is not classified in spellings.OPTIONS"
    assert set(OPTIONS.values()) == {"group", "optimizer"}
    assert not set(DEPRECATED) & set(SIGNATURE)
    assert set(DEPRECATED) == set(DEPRECATED_CASES)
    for name, spelled in DEPRECATED.items():
        assert spelled and set(spelled) <= set(OPTIONS), name
    assert [SCHEDULE_FIELDS[f.name] for f in fields(CurvatureSchedule)] == list(DEPRECATED["schedule"])
    assert [f.name for f in fields(Execution)] == list(DEPRECATED["execution"])
    # metric= (the kind), metric_beta2 (deprecated), root_every (only Metric spells it)
    assert [f.name for f in fields(Metric)] == ["kind", "beta2", "root_every"]


def test_group_options_live_in_defaults() -> None:
    """torch.optim's habit: what a param group may set is a key of ``defaults``, under its one spelling."""
    opt = TENGraD(_model(), 0.1, 0.05)
    assert set(opt.defaults) == {k for k, v in OPTIONS.items() if v == "group"}


@pytest.mark.parametrize("name", list(DEPRECATED_CASES))
def test_a_deprecated_spelling_warns_with_the_new_one(name: str) -> None:
    """The warning names every keyword the spelling stands for, with its value; the optimizer
    equals the one built with those keywords."""
    old, new = DEPRECATED_CASES[name]
    with pytest.warns(DeprecationWarning) as record:
        got = TENGraD(_model(), 0.1, 0.05, **old)
    messages = [str(w.message) for w in record if w.category is DeprecationWarning]
    assert len(messages) == 1 and f"{name}=" in messages[0], messages
    for key, value in new.items():
        assert f"{key}={value!r}" in messages[0], (key, messages[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ref = TENGraD(_model(), 0.1, 0.05, **new)
    assert (got.schedule, got.execution) == (ref.schedule, ref.execution)
    assert type(got.metric) is type(ref.metric) and getattr(got.metric, "beta2", None) == \
        getattr(ref.metric, "beta2", None)


@pytest.mark.parametrize("name, key", [(n, k) for n, keys in DEPRECATED.items() for k in keys])
def test_giving_both_spellings_is_a_value_error(name: str, key: str) -> None:
    """Both given, whatever the values (the flat one at its default included)."""
    old = {k: v for k, v in DEPRECATED_CASES[name][0].items() if k != key}
    flat = Metric("factored") if key == "metric" else SIGNATURE[key].default
    with pytest.raises(ValueError, match=f"both {name}=.*{key}="):
        TENGraD(_model(), 0.1, 0.05, **old, **{key: flat})


def test_deprecated_spellings_train_as_the_flat_keywords() -> None:
    flat, curv = _run(curvature_every=3, curvature_warmup=2, strategy="factor", solve_dtype=torch.float64)
    assert curv == [True, True, False, False, True]
    with pytest.warns(DeprecationWarning) as record:
        got, got_curv = _run(schedule=CurvatureSchedule(3, 2),
                             execution=Execution(strategy="factor", solve_dtype=torch.float64))
    messages = " ".join(str(w.message) for w in record)
    assert "pass curvature_every=3" in messages and "pass strategy='factor'" in messages
    assert got_curv == curv
    assert all(torch.equal(a, b) for a, b in zip(flat, got))


def test_an_int_schedule_is_curvature_every() -> None:
    with pytest.warns(DeprecationWarning, match="pass curvature_every=7 instead"):
        opt = TENGraD(_model(), 0.1, 0.05, schedule=7)
    assert opt.schedule == CurvatureSchedule(7) and opt.curvature_every == 7


def test_bad_values_of_the_spellings_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="schedule"):
        TENGraD(_model(), 0.1, 0.05, schedule="often")
    with pytest.raises(TypeError, match="execution"):
        TENGraD(_model(), 0.1, 0.05, execution={"strategy": "factor"})
    with pytest.raises(ValueError, match="strategy"):
        Execution(strategy="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        TENGraD(_model(), 0.1, 0.05, strategy="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="metric_beta2=0.9 .* without metric="):
        TENGraD(_model(), 0.1, 0.05, metric_beta2=0.9)
    with pytest.raises(ValueError, match="kron"):
        TENGraD(_model(), 0.1, 0.05, metric=Metric("kron"))  # type: ignore[arg-type]


def test_options_after_damping_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional"):
        TENGraD(_model(), 0.1, 0.05, 0.9)  # type: ignore[misc]


def test_make_optimizer_takes_a_deprecated_spelling_over_the_papers_value() -> None:
    """The paper's ``curvature_every=100`` is replaced by ``schedule=5``, not a conflict."""
    with pytest.warns(DeprecationWarning, match="curvature_every=5"):
        opt = make_optimizer("tengrad", _model(), paper=True, schedule=5)
    assert opt.curvature_every == 5
    with pytest.raises(ValueError, match="both schedule="):
        make_optimizer("tengrad", _model(), schedule=5, curvature_every=5)


@pytest.mark.parametrize("preset", list(PRESETS["tengrad"]))
def test_presets_use_the_one_spelling(preset: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        opt = make_optimizer("tengrad", _model(), preset=preset)
    assert isinstance(opt, TENGraD)
