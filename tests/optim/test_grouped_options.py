"""``TENGraD``'s grouped options: ``schedule`` (an int or a ``CurvatureSchedule``) and
``execution`` (an ``Execution``) next to the flat keywords; options after ``damping`` are
keyword-only."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import CurvatureSchedule, Execution, TENGraD


def _model() -> nn.Module:
    torch.manual_seed(0)
    return tengrad_fx.prepare(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double())


def _run(**kw: object) -> tuple[list[torch.Tensor], list[bool]]:
    model = _model()
    opt = TENGraD(model, 0.1, 0.05, **kw)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    curv = []
    for _ in range(5):
        x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
        curv.append(opt._is_curvature_step())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], curv


def test_grouped_options_equal_the_flat_ones() -> None:
    flat, curv = _run(curvature_every=3, curvature_warmup=2, strategy="factor", solve_dtype=torch.float64)
    assert curv == [True, True, False, False, True]
    for kw in (dict(schedule=CurvatureSchedule(3, 2), execution=Execution(strategy="factor",
                                                                            solve_dtype=torch.float64)),
               dict(schedule=CurvatureSchedule(3, 2), strategy="factor", solve_dtype=torch.float64),
               dict(curvature_every=3, schedule=CurvatureSchedule(3, 2),
                    execution=Execution(strategy="factor"), solve_dtype=torch.float64)):
        got, got_curv = _run(**kw)
        assert got_curv == curv
        assert all(torch.equal(a, b) for a, b in zip(flat, got)), kw


def test_an_int_schedule_is_curvature_every() -> None:
    opt = TENGraD(_model(), 0.1, 0.05, schedule=7)
    assert opt.schedule == CurvatureSchedule(7) and opt.curvature_every == 7


@pytest.mark.parametrize("kw, name", [
    (dict(curvature_every=5, schedule=CurvatureSchedule(3)), "curvature_every"),
    (dict(curvature_warmup=2, schedule=CurvatureSchedule(3, 4)), "curvature_warmup"),
    (dict(strategy="factor", execution=Execution(strategy="materialize")), "strategy"),
    (dict(jacobian_budget_mb=8.0, execution=Execution(jacobian_budget_mb=16.0)), "jacobian_budget_mb"),
])
def test_a_field_given_twice_differently_is_a_value_error(kw: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        TENGraD(_model(), 0.1, 0.05, **kw)  # type: ignore[arg-type]


def test_bad_config_objects_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="schedule"):
        TENGraD(_model(), 0.1, 0.05, schedule="often")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="execution"):
        TENGraD(_model(), 0.1, 0.05, execution={"strategy": "factor"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        Execution(strategy="dense")  # type: ignore[arg-type]


def test_options_after_damping_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional"):
        TENGraD(_model(), 0.1, 0.05, 0.9)  # type: ignore[misc]
