"""Bad arguments raise ValueError naming the argument; the registry's tables."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx.optim.baselines.ekfac import EKFAC
from tengrad_fx.optim.baselines.kbfgs import KBFGS, damped_bfgs_update
from tengrad_fx.optim.baselines.kfac import KFAC
from tengrad_fx.optim.baselines.ngd import NGD
from tengrad_fx.optim.registry import OPTIMIZERS, PAPER_DEFAULTS, SGD, make_optimizer


@pytest.fixture(scope="module")
def model():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3))
    return tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 1, 4, 4),))


COMMON = [("lr", -1.0), ("damping", 0.0), ("damping", float("nan")), ("momentum", 1.0),
          ("momentum", -0.1), ("weight_decay", -1e-3), ("kl_clip", 0.0)]
BAD = {
    KFAC: COMMON + [("stat_decay", 1.0), ("curvature_every", 0), ("inverse_every", 2.5), ("fisher", "true"),
                    ("mc_loss", "nll"), ("solve_dtype", torch.int32)],
    EKFAC: COMMON + [("rescale_every", 0), ("stat_decay", -0.5), ("fisher", "exact"), ("curvature_every", 0),
                     ("solve_dtype", "float64")],
    KBFGS: COMMON + [("curvature_every", -1), ("inverse_every", 0), ("powell", 1.0), ("secant", "other"),
                     ("stat_decay", 2.0)],
    NGD: COMMON + [("curvature_every", 0), ("max_params", 0), ("fisher", "x"), ("solve_dtype", "float64")],
}


@pytest.mark.parametrize("cls,arg,value", [(c, a, v) for c, bad in BAD.items() for a, v in bad])
def test_bad_argument_names_it(model, cls, arg, value):
    kw = {"lr": 0.1, "damping": 0.1, arg: value}
    with pytest.raises(ValueError, match=arg):
        cls(model, **kw)


def test_unprepared_model_and_runtime_damping(model):
    with pytest.raises(ValueError, match="prepare"):
        KFAC(nn.Linear(2, 2))
    opt = KFAC(model, lr=0.1)
    opt.param_groups[0]["damping"] = -1.0
    with pytest.raises(ValueError, match="damping"):
        opt.step()


def test_damped_bfgs_bad_args():
    H, v = torch.eye(2), torch.ones(2)
    with pytest.raises(ValueError, match="powell"):
        damped_bfgs_update(H, v, v, powell=0.0)
    with pytest.raises(ValueError, match="lm"):
        damped_bfgs_update(H, v, v, lm=-1.0)


def test_registry(model):
    assert set(OPTIMIZERS) == {"tengrad", "kfac", "ekfac", "kbfgs", "ngd", "sgd"}
    for _method, rows in PAPER_DEFAULTS.items():  # values: tests/optim/test_paper_defaults.py
        assert set(rows) == {"fashion-mnist", "cifar10", "cifar100"}
    opt = make_optimizer("kbfgs", model, dataset="fashion-mnist")
    assert isinstance(opt, KBFGS) and opt.curvature_every == 20 and opt.inverse_every == 100
    g = opt.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["damping"], g["momentum"]) == (0.03, 0.01, 0.01, 0.9)
    opt = make_optimizer("ekfac", model, dataset="cifar10", lr=0.5)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.rescale_every == 20
    sgd = make_optimizer("sgd", model, dataset="fashion-mnist")
    assert isinstance(sgd, SGD) and sgd.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="name"):
        make_optimizer("adam", model)
    with pytest.raises(ValueError, match="dataset"):
        make_optimizer("kfac", model, dataset="imagenet")
    with pytest.raises(ValueError, match="dataset"):
        make_optimizer("ngd", model, dataset="cifar10")
    with pytest.raises(ValueError, match="lr"):
        SGD(model, lr=-1.0)
