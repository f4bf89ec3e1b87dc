"""One name per option across the optimizers: ``(model, lr, damping, *, ...)`` with the
rest keyword-only; the old names (``TCov``, ``TInv``, ``TScal``, ``factor_dtype``) still
work, warn ``DeprecationWarning`` naming the new one, and give the same optimizer."""
from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.baselines import EKFAC, KBFGS, KFAC, NGD
from tengrad_fx.optim.registry import OPTIMIZERS, PAPER_INTERVALS, make_optimizer
from tengrad_fx.optim.step.renamed import renamed_of

from ._helpers import batch, cnn

# per baseline: (options under the new names, the same options under the old names);
# every value differs from the default, so a dropped or misrouted option changes the run.
CASES: dict[type, tuple[dict[str, Any], dict[str, Any]]] = {
    KFAC: (dict(curvature_every=2, inverse_every=3, solve_dtype=torch.float32),
           dict(TCov=2, TInv=3, factor_dtype=torch.float32)),
    EKFAC: (dict(curvature_every=3, inverse_every=4, rescale_every=2, solve_dtype=torch.float32),
            dict(TCov=3, TInv=4, TScal=2, factor_dtype=torch.float32)),
    KBFGS: (dict(curvature_every=2, inverse_every=3), dict(TCov=2, TInv=3)),
}
RENAMED = {KFAC: {"TCov": "curvature_every", "TInv": "inverse_every", "factor_dtype": "solve_dtype"},
           EKFAC: {"TCov": "curvature_every", "TInv": "inverse_every", "factor_dtype": "solve_dtype",
                   "TScal": "rescale_every"},
           KBFGS: {"TCov": "curvature_every", "TInv": "inverse_every"},
           NGD: {}}


def _train(cls: type, steps: int = 6, **kw: Any) -> tuple[list[torch.Tensor], dict[str, Any], Any]:
    """Parameters and curvature after ``steps`` float64 steps of ``cls(model, lr, damping, **kw)``."""
    template = cnn()
    model = tengrad_fx.prepare(copy.deepcopy(template), example_inputs=(batch(2)[0],))
    opt = cls(model, 0.05, 0.1, momentum=0.5, **kw)
    for s in range(steps):
        x, y = batch(6, seed=s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()["curvature"], opt


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_renamed_maps_are_the_documented_ones():
    for cls, renamed in RENAMED.items():
        assert renamed_of(cls) == renamed, cls.__name__


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_old_names_warn_and_give_the_same_optimizer(cls):
    new_kw, old_kw = CASES[cls]
    params_new, curv_new, opt_new = _train(cls, **new_kw)
    with pytest.warns(DeprecationWarning) as record:
        params_old, curv_old, opt_old = _train(cls, **old_kw)
    messages = [str(w.message) for w in record if w.category is DeprecationWarning]
    for old, new in RENAMED[cls].items():  # one warning per old name, naming the new one
        assert sum(f"'{old}'" in m and f"'{new}'" in m for m in messages) == 1, (old, messages)
    assert all(w.filename == __file__ for w in record)  # points at the caller's line
    for name, value in new_kw.items():
        assert getattr(opt_new, name) == value and getattr(opt_old, name) == value, name
    assert len(params_new) == len(params_old)
    assert all(torch.equal(a, b) for a, b in zip(params_new, params_old))
    assert _same(curv_new, curv_old)
    # the options took effect: the default intervals give another run
    params_default, _, _ = _train(cls)
    assert not all(torch.equal(a, b) for a, b in zip(params_new, params_default))


def test_solve_dtype_reaches_the_factors():
    _, curv, _ = _train(KFAC, steps=1, solve_dtype=torch.float32)
    with pytest.warns(DeprecationWarning, match="solve_dtype"):
        _, curv_old, _ = _train(KFAC, steps=1, factor_dtype=torch.float32)
    for i, (A, G) in curv["factors"].items():  # the model is float64
        assert A.dtype == G.dtype == torch.float32
        assert torch.equal(A, curv_old["factors"][i][0])


@pytest.mark.parametrize("cls", [c for c, r in RENAMED.items() if r], ids=lambda c: c.__name__)
def test_old_and_new_name_together_is_an_error(cls):
    model = tengrad_fx.prepare(cnn(), example_inputs=(batch(2)[0],))
    for old, new in RENAMED[cls].items():
        value = torch.float32 if new == "solve_dtype" else 2
        with pytest.raises(TypeError, match=f"'{old}'.*'{new}'"):
            cls(model, 0.1, 0.1, **{old: value, new: value})


@pytest.mark.parametrize("cls", list(RENAMED), ids=lambda c: c.__name__)
def test_options_after_damping_are_keyword_only(cls):
    model = tengrad_fx.prepare(cnn(), example_inputs=(batch(2)[0],))
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params[:3]] == ["model", "lr", "damping"]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params[3:])
    with pytest.raises(TypeError, match="positional"):
        cls(model, 0.1, 0.1, 0.9)  # the old order's momentum
    opt = cls(model, 0.1, 0.2)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["damping"]) == (0.1, 0.2)


def test_ekfac_forwards_kfac_options():
    model = tengrad_fx.prepare(cnn(), example_inputs=(batch(2)[0],))
    opt = EKFAC(model, 0.1, 0.1, rescale_every=3, stat_decay=0.5, kl_clip=None, inverse_every=7)
    assert (opt.rescale_every, opt.stat_decay, opt.kl_clip, opt.inverse_every) == (3, 0.5, None, 7)
    with pytest.raises(TypeError, match="not_an_option"):
        EKFAC(model, 0.1, 0.1, not_an_option=1)


def test_old_attribute_names_read_and_write_the_new_ones():
    model = tengrad_fx.prepare(cnn(), example_inputs=(batch(2)[0],))
    opt = EKFAC(model, 0.1, 0.1, curvature_every=4, rescale_every=6)
    with pytest.warns(DeprecationWarning, match="'curvature_every'"):
        assert opt.TCov == 4
    with pytest.warns(DeprecationWarning, match="'rescale_every'"):
        opt.TScal = 9
    assert opt.rescale_every == 9


def test_registry_uses_the_new_names_and_translates_old_overrides():
    for name, intervals in PAPER_INTERVALS.items():
        assert not set(intervals) & set(renamed_of(OPTIMIZERS[name])), name
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the paper's settings use no old name
        opt = make_optimizer("ekfac", model, dataset="fashion-mnist")
    assert (opt.curvature_every, opt.inverse_every, opt.rescale_every) == (20, 100, 20)
    with pytest.warns(DeprecationWarning, match="'TCov'.*'curvature_every'") as record:
        opt = make_optimizer("ekfac", model, dataset="fashion-mnist", TCov=5)  # replaces the paper's 20
    assert record[0].filename == __file__
    assert (opt.curvature_every, opt.inverse_every) == (5, 100)
    with pytest.raises(TypeError, match="'TInv'.*'inverse_every'"):
        make_optimizer("kfac", model, dataset="fashion-mnist", TInv=5, inverse_every=5)
    with pytest.raises(TypeError):  # an optimizer without that old name refuses it
        make_optimizer("ngd", model, lr=0.1, damping=0.1, TCov=5)


def _model() -> torch.nn.Module:
    return tengrad_fx.prepare(cnn(), example_inputs=(batch(2)[0],))
